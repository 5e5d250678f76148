//! Task budgets: at most `tasks_per_window` `submit`s per participant per window of
//! `window_s` seconds, counted in JetStream so that every broker sharing one JetStream
//! enforces one budget.
//!
//! The count lives in the KV bucket `AMP_BUDGET` under `<ns>.<name>.<window index>` (the
//! index is Unix time divided by `window_s`, so brokers agree on windows by wall clock). Its
//! value is the number of tasks *reserved* so far in that window by all brokers together,
//! as decimal text. A broker reserves a chunk at a time (up to [`BudgetConfig::chunk`], and
//! about half of what remains near the end, so one broker does not sit on the last tasks
//! while another refuses) with a compare-and-set write (`Nats-Expected-Last-Subject-Sequence`
//! = the revision it read), then spends the chunk locally without any round trip. Each write
//! carries `Nats-TTL` of two windows, so old windows vanish by themselves.
//!
//! Because a task is reserved in JetStream before it is spent, brokers together never admit
//! more than `tasks_per_window` tasks in a window, crashes included. What a crash (or a write
//! whose reply is lost) costs is the other way round: the unused part of that broker's
//! current chunk stays counted, so the participant may be refused up to `chunk - 1` tasks
//! early in that window, per crashed broker. Near the end of a window, `budget_exhausted`
//! may also be answered while another live broker still holds part of a (halved) chunk.
//!
//! Sans-IO: [`Budgets::try_spend`] answers at once when the local chunk suffices; otherwise
//! it queues a KV operation ([`Budgets::poll_op`]) which the caller sends (see
//! [`KvOp::request`]) and whose reply it feeds back with [`Budgets::on_reply`].

use std::collections::HashMap;
use std::time::Duration;

use serde_json::Value;

use super::bounded_map::BoundedMap;
use crate::jetstream::api::Request;
use crate::jetstream::kv::Kv;
use crate::jetstream::publish::MsgTtl;
use crate::jetstream::{ApiPrefix, JsError};
use crate::proto::headers::HeaderMap;

pub const BUDGET_BUCKET: &str = "AMP_BUDGET";

/// A participant's budget (from its policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub tasks_per_window: u64,
    pub window_s: u64,
}

impl Budget {
    /// The task budget of participant `ns/name`, if its policy sets one.
    pub fn of(config: &super::config::Config, ns: &str, name: &str) -> Option<Budget> {
        config
            .participant(ns, name)
            .and_then(|p| p.policy.as_ref())
            .and_then(Budget::from_policy)
    }

    pub fn from_policy(policy: &super::config::Policy) -> Option<Budget> {
        match (policy.tasks_per_window, policy.window_s) {
            (Some(tasks_per_window), Some(window_s)) if window_s > 0 => Some(Budget {
                tasks_per_window,
                window_s,
            }),
            _ => None,
        }
    }

    pub fn window_index(&self, unix_ms: u64) -> u64 {
        unix_ms / 1000 / self.window_s.max(1)
    }
}

#[derive(Debug, Clone)]
pub struct BudgetConfig {
    /// Most tasks reserved by one write.
    pub chunk: u64,
    /// Compare-and-set conflicts tolerated per reservation before giving up (`unavailable`).
    pub max_conflicts: u32,
    /// Participants tracked at once.
    pub max_participants: usize,
}

impl Default for BudgetConfig {
    fn default() -> Self {
        BudgetConfig {
            chunk: 10,
            max_conflicts: 8,
            max_participants: 65_536,
        }
    }
}

/// The bucket's stream: one value per key, per-key TTLs allowed, direct gets.
pub fn budget_stream_config(replicas: u32) -> crate::jetstream::StreamConfig {
    let settings = super::binding::StreamSettings {
        replicas,
        duplicate_window_s: 120,
    };
    crate::jetstream::StreamConfig {
        allow_msg_ttl: Some(true),
        ..super::binding::kv_stream_config(BUDGET_BUCKET, 1, settings)
    }
}

/// The key of a participant's count in one window.
pub fn budget_key(participant: &str, window: u64) -> String {
    // `ns/name` becomes `ns.name`: both are single tokens, so the key is unambiguous.
    format!("{}.{window}", participant.replace('/', "."))
}

/// What [`Budgets::try_spend`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// One task admitted.
    Granted,
    /// The window's budget is spent: `budget_exhausted`.
    Exhausted,
    /// A reservation is under way: hold the request and call `try_spend` again when
    /// [`Budgets::on_reply`] reports this participant.
    Wait,
}

/// A KV operation for the caller to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvOp {
    pub id: u64,
    pub key: String,
    pub kind: KvOpKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOpKind {
    /// Read the key's latest value (direct get).
    Get,
    /// Write `count` only if the key's latest revision is `revision` (0: no value).
    Write {
        count: u64,
        revision: u64,
        ttl_s: u64,
    },
}

impl KvOp {
    /// The request to send for this operation on the budget bucket `kv` (its reply goes
    /// to [`KvReply::from_get`] or [`KvReply::from_pub_ack`] as the kind says).
    pub fn request(&self, kv: &Kv) -> Result<Request, JsError> {
        match &self.kind {
            KvOpKind::Get => kv.get_request(&self.key),
            KvOpKind::Write {
                count,
                revision,
                ttl_s,
            } => kv.update_ttl_request(
                &self.key,
                count.to_string().as_bytes(),
                *revision,
                MsgTtl::After(Duration::from_secs(*ttl_s)),
            ),
        }
    }
}

/// The budget bucket under `api` (a namespace's JetStream).
pub fn bucket(api: ApiPrefix) -> Result<Kv, JsError> {
    Kv::new(api, BUDGET_BUCKET)
}

/// A reply to a [`KvOp`], as the caller decoded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvReply {
    /// The key's latest revision and count (a missing or deleted key: count 0; revision 0
    /// when it has no message at all).
    Current { revision: u64, count: u64 },
    /// The write was stored at this revision.
    Written { revision: u64 },
    /// The key moved on since it was read.
    Conflict,
    /// Timeout, no responders, another JetStream error, or a value that is not a count.
    Failed,
}

impl KvReply {
    /// Decodes a direct-get reply: status 404 is a key without value; otherwise headers
    /// `Nats-Sequence` and the payload.
    pub fn from_get(status: Option<u16>, headers: Option<&HeaderMap>, payload: &[u8]) -> KvReply {
        match status {
            Some(404) => {
                return KvReply::Current {
                    revision: 0,
                    count: 0,
                };
            }
            Some(_) => return KvReply::Failed,
            None => {}
        }
        let Some(h) = headers else {
            return KvReply::Failed;
        };
        let Some(revision) = h.get("Nats-Sequence").and_then(|s| s.trim().parse().ok()) else {
            return KvReply::Failed;
        };
        if matches!(h.get("KV-Operation"), Some("DEL" | "PURGE")) {
            return KvReply::Current { revision, count: 0 };
        }
        match std::str::from_utf8(payload)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            Some(count) => KvReply::Current { revision, count },
            None => KvReply::Failed,
        }
    }

    /// Decodes a PubAck: `{"seq":N}`, or an error; `err_code` 10071 is a wrong last sequence.
    pub fn from_pub_ack(status: Option<u16>, payload: &[u8]) -> KvReply {
        if status.is_some() {
            // 503 no responders and the like.
            return KvReply::Failed;
        }
        let Ok(v) = serde_json::from_slice::<Value>(payload) else {
            return KvReply::Failed;
        };
        if let Some(err) = v.get("error") {
            return if err.get("err_code").and_then(Value::as_u64) == Some(10071) {
                KvReply::Conflict
            } else {
                KvReply::Failed
            };
        }
        match v.get("seq").and_then(Value::as_u64) {
            Some(revision) => KvReply::Written { revision },
            None => KvReply::Failed,
        }
    }
}

/// Reported by [`Budgets::on_reply`]: the reservation for `participant` ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Call `try_spend` again for the participant's held requests.
    Retry { participant: String },
    /// JetStream did not answer usefully: answer the held requests `unavailable`.
    Unavailable { participant: String },
}

#[derive(Debug, Default)]
struct State {
    window: u64,
    /// Reserved here and not yet spent.
    left: u64,
    /// The window's count has reached the limit (as of the last read).
    exhausted: bool,
    /// The last revision and count this broker read or wrote, to try a write without a read.
    known: Option<(u64, u64)>,
    in_flight: Option<InFlight>,
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    op: u64,
    window: u64,
    limit: u64,
    ttl_s: u64,
    /// For a write: the count it writes and what it grants.
    write: Option<(u64, u64)>,
    conflicts: u32,
}

#[derive(Debug)]
pub struct Budgets {
    config: BudgetConfig,
    states: BoundedMap<String, State>,
    ops: HashMap<u64, String>,
    queue: Vec<KvOp>,
    next_op: u64,
}

impl Budgets {
    pub fn new(config: BudgetConfig) -> Budgets {
        Budgets {
            states: BoundedMap::new(config.max_participants),
            config,
            ops: HashMap::new(),
            queue: Vec::new(),
            next_op: 0,
        }
    }

    pub fn config(&self) -> &BudgetConfig {
        &self.config
    }

    /// Admits one task of `participant` (`ns/name`) under `budget` at wall-clock time
    /// `unix_ms`.
    pub fn try_spend(&mut self, participant: &str, budget: Budget, unix_ms: u64) -> Spend {
        if budget.tasks_per_window == 0 {
            return Spend::Exhausted;
        }
        let window = budget.window_index(unix_ms);
        let state = self
            .states
            .get_or_insert_with(participant.to_string(), State::default);
        if state.window != window {
            // A new window: what was left of the old one is gone with it.
            state.window = window;
            state.left = 0;
            state.exhausted = false;
            state.known = None;
        }
        if state.left > 0 {
            state.left -= 1;
            return Spend::Granted;
        }
        if let Some(f) = &state.in_flight {
            if f.window == window {
                return Spend::Wait;
            }
            // A reservation for a past window is still out; its reply will be ignored.
            self.ops.remove(&f.op);
            state.in_flight = None;
        }
        if state.exhausted {
            return Spend::Exhausted;
        }
        let ttl_s = budget.window_s.saturating_mul(2).max(1);
        self.next_op += 1;
        let op = self.next_op;
        let key = budget_key(participant, window);
        let mut flight = InFlight {
            op,
            window,
            limit: budget.tasks_per_window,
            ttl_s,
            write: None,
            conflicts: 0,
        };
        let kind = match state.known {
            // Try the write on what we last saw: no read when no other broker wrote since.
            Some((revision, count)) => {
                match plan(count, budget.tasks_per_window, self.config.chunk) {
                    Some(grant) => {
                        flight.write = Some((count + grant, grant));
                        KvOpKind::Write {
                            count: count + grant,
                            revision,
                            ttl_s,
                        }
                    }
                    None => KvOpKind::Get,
                }
            }
            None => KvOpKind::Get,
        };
        state.in_flight = Some(flight);
        self.ops.insert(op, participant.to_string());
        self.queue.push(KvOp { id: op, key, kind });
        Spend::Wait
    }

    /// The next KV operation to send.
    pub fn poll_op(&mut self) -> Option<KvOp> {
        if self.queue.is_empty() {
            None
        } else {
            Some(self.queue.remove(0))
        }
    }

    /// Feeds the reply to operation `op`. Replies to unknown or superseded operations are
    /// ignored (`None`).
    pub fn on_reply(&mut self, op: u64, reply: KvReply) -> Option<Settled> {
        let participant = self.ops.remove(&op)?;
        let chunk = self.config.chunk;
        let max_conflicts = self.config.max_conflicts;
        let Some(state) = self.states.get_mut(&participant) else {
            return Some(Settled::Retry { participant });
        };
        let mut flight = state.in_flight.filter(|f| f.op == op)?;
        state.in_flight = None;
        if flight.window != state.window {
            return Some(Settled::Retry { participant });
        }
        let key = budget_key(&participant, flight.window);
        let next = match (reply, flight.write) {
            (KvReply::Current { revision, count }, None) => {
                state.known = Some((revision, count));
                match plan(count, flight.limit, chunk) {
                    None => {
                        state.exhausted = true;
                        return Some(Settled::Retry { participant });
                    }
                    Some(grant) => {
                        flight.write = Some((count + grant, grant));
                        KvOpKind::Write {
                            count: count + grant,
                            revision,
                            ttl_s: flight.ttl_s,
                        }
                    }
                }
            }
            (KvReply::Written { revision }, Some((count, grant))) => {
                state.known = Some((revision, count));
                state.left += grant;
                return Some(Settled::Retry { participant });
            }
            (KvReply::Conflict, Some(_)) if flight.conflicts < max_conflicts => {
                flight.conflicts += 1;
                flight.write = None;
                state.known = None;
                KvOpKind::Get
            }
            _ => {
                state.known = None;
                return Some(Settled::Unavailable { participant });
            }
        };
        self.next_op += 1;
        flight.op = self.next_op;
        state.in_flight = Some(flight);
        self.ops.insert(flight.op, participant);
        self.queue.push(KvOp {
            id: flight.op,
            key,
            kind: next,
        });
        None
    }

    /// Gives back a task admitted by [`try_spend`](Self::try_spend) whose `submit` then
    /// failed for another reason (so it changes nothing); ignored once the window turned.
    pub fn refund(&mut self, participant: &str, budget: Budget, unix_ms: u64) {
        let window = budget.window_index(unix_ms);
        if let Some(state) = self.states.get_mut(&participant.to_string())
            && state.window == window
        {
            state.left += 1;
        }
    }

    /// Tasks reserved here for `participant` and not yet spent (for metrics and tests).
    pub fn reserved_left(&self, participant: &str) -> u64 {
        self.states
            .get(&participant.to_string())
            .map_or(0, |s| s.left)
    }

    /// Operations sent and not yet answered.
    pub fn in_flight(&self) -> usize {
        self.ops.len()
    }
}

/// How many to reserve when `count` of `limit` are taken: up to `chunk`, and about half of
/// what remains near the end; `None` when nothing remains.
fn plan(count: u64, limit: u64, chunk: u64) -> Option<u64> {
    let remaining = limit.saturating_sub(count);
    if remaining == 0 {
        return None;
    }
    Some(chunk.max(1).min(remaining.div_ceil(2)).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Budget = Budget {
        tasks_per_window: 25,
        window_s: 60,
    };

    /// A KV bucket in memory with JetStream's compare-and-set rule, standing in for the
    /// server in these unit tests (the integration tests use a real one).
    #[derive(Default)]
    struct Bucket {
        seq: u64,
        keys: HashMap<String, (u64, u64)>,
    }

    impl Bucket {
        fn apply(&mut self, op: &KvOp) -> KvReply {
            match op.kind {
                KvOpKind::Get => match self.keys.get(&op.key) {
                    Some(&(revision, count)) => KvReply::Current { revision, count },
                    None => KvReply::Current {
                        revision: 0,
                        count: 0,
                    },
                },
                KvOpKind::Write {
                    count, revision, ..
                } => {
                    let last = self.keys.get(&op.key).map_or(0, |k| k.0);
                    if last != revision {
                        return KvReply::Conflict;
                    }
                    self.seq += 1;
                    self.keys.insert(op.key.clone(), (self.seq, count));
                    KvReply::Written { revision: self.seq }
                }
            }
        }
    }

    /// Spends one task, running KV round trips against `bucket` until decided.
    fn spend(b: &mut Budgets, bucket: &mut Bucket, who: &str, unix_ms: u64) -> (Spend, u32) {
        let mut trips = 0;
        loop {
            match b.try_spend(who, B, unix_ms) {
                Spend::Wait => {}
                decided => return (decided, trips),
            }
            loop {
                let op = b.poll_op().expect("an operation to send");
                trips += 1;
                let reply = bucket.apply(&op);
                if b.on_reply(op.id, reply).is_some() {
                    break;
                }
            }
        }
    }

    #[test]
    fn spends_from_a_chunk_without_round_trips_then_stops_at_the_limit() {
        let mut b = Budgets::new(BudgetConfig::default());
        let mut bucket = Bucket::default();
        let mut trips = 0;
        let mut granted = 0;
        for _ in 0..40 {
            let (s, t) = spend(&mut b, &mut bucket, "acme/a", 0);
            trips += t;
            if s == Spend::Granted {
                granted += 1;
            } else {
                assert_eq!(s, Spend::Exhausted);
            }
        }
        assert_eq!(granted, 25);
        // A read and a write for the first chunk of 10, then writes on the known revision
        // for 8, 4, 2 and 1, and one read that finds the window spent.
        assert_eq!(trips, 2 + 4 + 1);
        assert_eq!(bucket.keys.get("acme.a.0").map(|k| k.1), Some(25));
    }

    #[test]
    fn two_brokers_share_one_budget_and_never_exceed_it() {
        let mut one = Budgets::new(BudgetConfig::default());
        let mut two = Budgets::new(BudgetConfig::default());
        let mut bucket = Bucket::default();
        let mut granted = 0;
        for i in 0..100 {
            let b = if i % 3 == 0 { &mut one } else { &mut two };
            if spend(b, &mut bucket, "acme/a", 5_000).0 == Spend::Granted {
                granted += 1;
            }
        }
        let stranded = one.reserved_left("acme/a") + two.reserved_left("acme/a");
        assert_eq!(granted + stranded, 25);
        assert!(granted >= 25 - 2, "near the end chunks shrink: {granted}");
    }

    #[test]
    fn interleaved_reservations_conflict_and_retry_with_a_fresh_read() {
        let mut one = Budgets::new(BudgetConfig::default());
        let mut two = Budgets::new(BudgetConfig::default());
        let mut bucket = Bucket::default();
        assert_eq!(one.try_spend("acme/a", B, 0), Spend::Wait);
        assert_eq!(two.try_spend("acme/a", B, 0), Spend::Wait);
        let get1 = one.poll_op().expect("get");
        let get2 = two.poll_op().expect("get");
        assert_eq!(one.on_reply(get1.id, bucket.apply(&get1)), None);
        assert_eq!(two.on_reply(get2.id, bucket.apply(&get2)), None);
        let w1 = one.poll_op().expect("write");
        let w2 = two.poll_op().expect("write");
        assert!(matches!(
            one.on_reply(w1.id, bucket.apply(&w1)),
            Some(Settled::Retry { .. })
        ));
        // The second write was based on the same revision: refused, then read again.
        assert_eq!(bucket.apply(&w2), KvReply::Conflict);
        assert_eq!(two.on_reply(w2.id, KvReply::Conflict), None);
        let reread = two.poll_op().expect("get again");
        assert_eq!(reread.kind, KvOpKind::Get);
        assert_eq!(two.on_reply(reread.id, bucket.apply(&reread)), None);
        let w2 = two.poll_op().expect("write again");
        assert!(matches!(
            two.on_reply(w2.id, bucket.apply(&w2)),
            Some(Settled::Retry { .. })
        ));
        assert_eq!(
            one.reserved_left("acme/a") + two.reserved_left("acme/a"),
            10 + 8
        );
        assert_eq!(bucket.keys.get("acme.a.0").map(|k| k.1), Some(18));
    }

    #[test]
    fn a_new_window_starts_a_new_count_under_a_new_key() {
        let mut b = Budgets::new(BudgetConfig::default());
        let mut bucket = Bucket::default();
        for _ in 0..25 {
            assert_eq!(
                spend(&mut b, &mut bucket, "acme/a", 59_999).0,
                Spend::Granted
            );
        }
        assert_eq!(
            spend(&mut b, &mut bucket, "acme/a", 59_999).0,
            Spend::Exhausted
        );
        assert_eq!(
            spend(&mut b, &mut bucket, "acme/a", 60_000).0,
            Spend::Granted
        );
        assert!(bucket.keys.contains_key("acme.a.1"));
    }

    #[test]
    fn a_refunded_task_is_admitted_again_without_a_round_trip() {
        let mut b = Budgets::new(BudgetConfig::default());
        let mut bucket = Bucket::default();
        for _ in 0..25 {
            assert_eq!(spend(&mut b, &mut bucket, "acme/a", 0).0, Spend::Granted);
        }
        assert_eq!(spend(&mut b, &mut bucket, "acme/a", 0).0, Spend::Exhausted);
        b.refund("acme/a", B, 0);
        assert_eq!(spend(&mut b, &mut bucket, "acme/a", 0), (Spend::Granted, 0));
        b.refund("acme/a", B, 60_000);
        assert_eq!(
            b.reserved_left("acme/a"),
            0,
            "a refund for another window is ignored"
        );
    }

    #[test]
    fn failures_report_unavailable_and_stale_replies_are_ignored() {
        let mut b = Budgets::new(BudgetConfig::default());
        assert_eq!(b.try_spend("acme/a", B, 0), Spend::Wait);
        assert_eq!(
            b.try_spend("acme/a", B, 0),
            Spend::Wait,
            "one reservation at a time"
        );
        let get = b.poll_op().expect("get");
        assert_eq!(b.poll_op(), None);
        assert_eq!(
            b.on_reply(get.id, KvReply::Failed),
            Some(Settled::Unavailable {
                participant: "acme/a".into()
            })
        );
        assert_eq!(b.on_reply(get.id, KvReply::Failed), None, "answered once");
        assert_eq!(b.on_reply(999, KvReply::Written { revision: 1 }), None);
        // A reservation still out when the window turns is dropped.
        assert_eq!(b.try_spend("acme/a", B, 0), Spend::Wait);
        let old = b.poll_op().expect("get");
        assert_eq!(b.try_spend("acme/a", B, 60_000), Spend::Wait);
        assert_eq!(
            b.on_reply(
                old.id,
                KvReply::Current {
                    revision: 0,
                    count: 0
                }
            ),
            None
        );
        assert_eq!(b.in_flight(), 1);
    }

    #[test]
    fn replies_decode_from_jetstream_forms() {
        assert_eq!(
            KvReply::from_pub_ack(None, br#"{"stream":"KV_AMP_BUDGET","seq":7}"#),
            KvReply::Written { revision: 7 }
        );
        assert_eq!(
            KvReply::from_pub_ack(
                None,
                br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 6"}}"#
            ),
            KvReply::Conflict
        );
        assert_eq!(KvReply::from_pub_ack(Some(503), b""), KvReply::Failed);
        assert_eq!(KvReply::from_pub_ack(None, b"nonsense"), KvReply::Failed);
        assert_eq!(
            KvReply::from_get(Some(404), None, b""),
            KvReply::Current {
                revision: 0,
                count: 0
            }
        );
        let mut h = HeaderMap::new();
        h.insert("Nats-Sequence", "12").expect("header");
        assert_eq!(
            KvReply::from_get(None, Some(&h), b"17"),
            KvReply::Current {
                revision: 12,
                count: 17
            }
        );
        assert_eq!(KvReply::from_get(None, Some(&h), b"x"), KvReply::Failed);
        assert_eq!(KvReply::from_get(Some(408), None, b""), KvReply::Failed);
    }

    #[test]
    fn requests_carry_the_compare_and_set_and_ttl_headers() {
        let op = KvOp {
            id: 1,
            key: budget_key("acme/a", 3),
            kind: KvOpKind::Write {
                count: 20,
                revision: 9,
                ttl_s: 120,
            },
        };
        let local = bucket(ApiPrefix::default()).expect("bucket");
        let hub = bucket(ApiPrefix::domain("hub").expect("domain")).expect("bucket");
        let r = op.request(&local).expect("request");
        assert_eq!(r.subject, "$KV.AMP_BUDGET.acme.a.3");
        assert_eq!(
            op.request(&hub).expect("request").subject,
            "$JS.hub.API.$KV.AMP_BUDGET.acme.a.3"
        );
        let h = r.headers.expect("headers");
        assert_eq!(h.get("Nats-Expected-Last-Subject-Sequence"), Some("9"));
        assert_eq!(h.get("Nats-TTL"), Some("120s"));
        assert_eq!(r.payload, b"20");
        let get = KvOp {
            kind: KvOpKind::Get,
            ..op
        };
        assert_eq!(
            get.request(&local).expect("request").subject,
            "$JS.API.DIRECT.GET.KV_AMP_BUDGET.$KV.AMP_BUDGET.acme.a.3"
        );
    }
}
