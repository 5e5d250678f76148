//! A consumer's delivery state: where it is in the stream, what waits for an ack, what
//! is due for redelivery, the pull requests waiting for messages and push delivery with
//! flow control and idle heartbeats.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::clock::{format_nanos, parse_nanos};
use super::errors::{self, ApiErr};
use super::stream::{StoredMsg, Stream};
use crate::jetstream::{AckPolicy, ConsumerConfig, DeliverPolicy};
use crate::proto::subject::matches;

/// Push consumers stop after this many bytes until the flow-control request is answered.
const FLOW_CONTROL_BYTES: u64 = 256 * 1024;

/// A message the model publishes: routed on `to`, shown with `subject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbound {
    pub to: String,
    pub subject: String,
    pub reply: Option<String>,
    pub headers: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

impl Outbound {
    /// What the server counts of a delivery against a pull's `max_bytes`.
    fn pulled_size(&self) -> u64 {
        (self.subject.len()
            + self.reply.as_ref().map_or(0, String::len)
            + self.headers.as_ref().map_or(0, Vec::len)
            + self.payload.len()) as u64
    }

    pub fn status(to: &str, code: u16, text: &str, fields: &[(&str, String)]) -> Outbound {
        let mut h = if text.is_empty() {
            format!("NATS/1.0 {code}\r\n")
        } else {
            format!("NATS/1.0 {code} {text}\r\n")
        };
        for (k, v) in fields {
            h.push_str(&format!("{k}: {v}\r\n"));
        }
        h.push_str("\r\n");
        Outbound {
            to: to.to_string(),
            subject: to.to_string(),
            reply: None,
            headers: Some(h.into_bytes()),
            payload: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct PullWait {
    reply: String,
    left: u64,
    bytes_left: Option<u64>,
    expires: Option<Instant>,
    heartbeat: Option<Duration>,
    next_heartbeat: Option<Instant>,
    no_wait: bool,
    delivered: u64,
}

#[derive(Debug, Clone)]
struct Pending {
    cseq: u64,
    deliveries: u64,
    /// Ack wait (or NAK delay) deadline; `None` once due for redelivery.
    deadline: Option<Instant>,
}

/// A `CONSUMER.MSG.NEXT` body.
#[derive(Debug, Clone, Default)]
pub struct NextRequest {
    pub batch: u64,
    pub expires: Option<Duration>,
    pub no_wait: bool,
    pub max_bytes: Option<u64>,
    pub idle_heartbeat: Option<Duration>,
}

impl NextRequest {
    /// The JSON body, or a bare batch number, or nothing (one message).
    pub fn parse(payload: &[u8]) -> Result<NextRequest, ApiErr> {
        let text = std::str::from_utf8(payload).map_err(|_| errors::bad_request("not UTF-8"))?;
        let text = text.trim();
        if text.is_empty() {
            return Ok(NextRequest {
                batch: 1,
                ..NextRequest::default()
            });
        }
        if let Ok(n) = text.parse::<u64>() {
            return Ok(NextRequest {
                batch: n.max(1),
                ..NextRequest::default()
            });
        }
        let v: Value =
            serde_json::from_str(text).map_err(|_| errors::bad_request("invalid JSON"))?;
        let num = |k: &str| v.get(k).and_then(Value::as_u64);
        let dur = |k: &str| num(k).filter(|n| *n > 0).map(Duration::from_nanos);
        Ok(NextRequest {
            batch: num("batch").unwrap_or(1).max(1),
            expires: dur("expires"),
            no_wait: v.get("no_wait").and_then(Value::as_bool).unwrap_or(false),
            max_bytes: num("max_bytes").filter(|n| *n > 0),
            idle_heartbeat: dur("idle_heartbeat"),
        })
    }
}

/// What an ack message asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckOp {
    Ack,
    Nak(Option<Duration>),
    Progress,
    Term,
}

impl AckOp {
    pub fn parse(payload: &[u8]) -> Option<AckOp> {
        let text = std::str::from_utf8(payload).ok()?.trim();
        if text.is_empty() || text.starts_with("+ACK") || text.starts_with("+NXT") {
            return Some(AckOp::Ack);
        }
        if let Some(rest) = text.strip_prefix("-NAK") {
            let delay = serde_json::from_str::<Value>(rest.trim())
                .ok()
                .and_then(|v| v.get("delay").and_then(Value::as_u64))
                .filter(|d| *d > 0)
                .map(Duration::from_nanos);
            return Some(AckOp::Nak(delay));
        }
        if text.starts_with("+WPI") {
            return Some(AckOp::Progress);
        }
        if text.starts_with("+TERM") {
            return Some(AckOp::Term);
        }
        None
    }
}

#[derive(Debug)]
pub struct Consumer {
    pub name: String,
    pub stream: String,
    pub config: Value,
    pub cfg: ConsumerConfig,
    pub created: String,
    filters: Vec<String>,
    /// The next stream sequence a first delivery may come from.
    next_seq: u64,
    /// Nothing from `next_seq` up to here is for this consumer: scans start here.
    scan_from: u64,
    /// `last_per_subject`: up to this sequence only these sequences are delivered.
    last_per_subject: Option<(u64, BTreeSet<u64>)>,
    cseq: u64,
    last_sseq: u64,
    pending: BTreeMap<u64, Pending>,
    /// Acked (or terminated) stream sequence below which everything is done.
    floor: (u64, u64),
    waiting: VecDeque<PullWait>,
    // Push delivery.
    flow_control_id: u64,
    flow_stalled: Option<String>,
    bytes_since_flow: u64,
    next_heartbeat: Option<Instant>,
    /// Since when nobody pulls (pull) or listens (push); for `inactive_threshold`.
    idle_since: Option<Instant>,
}

/// Fills in what nats-server fills in for a consumer's configuration.
pub fn normalize_config(
    name: &str,
    body: &Value,
    durable: bool,
) -> Result<(Value, ConsumerConfig), ApiErr> {
    let mut v = match body {
        Value::Object(m) => m.clone(),
        _ => return Err(errors::bad_request("invalid consumer config")),
    };
    v.retain(|_, x| !x.is_null());
    v.insert("name".into(), json!(name));
    let push = v
        .get("deliver_subject")
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty());
    let ack_none = v.get("ack_policy").and_then(Value::as_str) == Some("none");
    let mut defaults = vec![
        ("deliver_policy", json!("all")),
        ("ack_policy", json!("explicit")),
        ("ack_wait", json!(30_000_000_000u64)),
        ("max_deliver", json!(-1)),
        ("replay_policy", json!("instant")),
        ("num_replicas", json!(0)),
    ];
    if !ack_none {
        defaults.push(("max_ack_pending", json!(1000)));
    }
    if !push {
        defaults.push(("max_waiting", json!(512)));
    }
    if !durable {
        defaults.push(("inactive_threshold", json!(5_000_000_000u64)));
    }
    for (k, d) in defaults {
        v.entry(k.to_string()).or_insert(d);
    }
    let value = Value::Object(v);
    let cfg: ConsumerConfig = serde_json::from_value(value.clone())
        .map_err(|e| errors::invalid_consumer_config(&e.to_string()))?;
    let filters = filters_of(&cfg);
    if filters
        .iter()
        .any(|f| crate::proto::subject::validate_pattern(f.as_bytes()).is_err())
    {
        return Err(errors::invalid_consumer_config("invalid filter subject"));
    }
    Ok((value, cfg))
}

/// Why nats-server refuses to update consumer config `old` to `new`, in its words
/// (`checkNewConsumerConfig`, in its order): the fields it never changes.
pub fn fixed_field_change(old: &Value, new: &Value) -> Option<&'static str> {
    const FIXED: [(&str, &str); 9] = [
        ("deliver_policy", "deliver policy can not be updated"),
        ("mem_storage", "storage type can not be updated"),
        ("opt_start_seq", "start sequence can not be updated"),
        ("opt_start_time", "start time can not be updated"),
        ("ack_policy", "ack policy can not be updated"),
        ("replay_policy", "replay policy can not be updated"),
        ("idle_heartbeat", "heart beats can not be updated"),
        ("flow_control", "flow control can not be updated"),
        ("max_waiting", "max waiting can not be updated"),
    ];
    // Absent, false, 0 and "" are one value to the server's Go structs.
    let get = |c: &Value, k: &str| match c.get(k) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Value::Null,
        Some(Value::Number(n)) if n.as_f64() == Some(0.0) => Value::Null,
        Some(Value::String(s)) if s.is_empty() => Value::Null,
        Some(v) => v.clone(),
    };
    let changed = |k: &str| get(old, k) != get(new, k);
    let (before, after) = FIXED.split_at(8);
    if let Some((_, why)) = before.iter().find(|(k, _)| changed(k)) {
        return Some(why);
    }
    if changed("deliver_subject") {
        if get(old, "deliver_subject").is_null() {
            return Some("can not update pull consumer to push based");
        }
        if get(new, "deliver_subject").is_null() {
            return Some("can not update push consumer to pull based");
        }
    }
    after.iter().find(|(k, _)| changed(k)).map(|(_, why)| *why)
}

fn filters_of(cfg: &ConsumerConfig) -> Vec<String> {
    let mut f: Vec<String> = cfg.filter_subjects.clone().unwrap_or_default();
    if let Some(s) = cfg.filter_subject.as_ref().filter(|s| !s.is_empty()) {
        f.push(s.clone());
    }
    f
}

impl Consumer {
    pub fn new(
        name: &str,
        stream: &Stream,
        config: Value,
        cfg: ConsumerConfig,
        created: String,
        now: Instant,
    ) -> Consumer {
        let mut c = Consumer {
            name: name.to_string(),
            stream: stream.name.clone(),
            filters: filters_of(&cfg),
            config,
            cfg,
            created,
            next_seq: 1,
            scan_from: 1,
            last_per_subject: None,
            cseq: 0,
            last_sseq: 0,
            pending: BTreeMap::new(),
            floor: (0, 0),
            waiting: VecDeque::new(),
            flow_control_id: 0,
            flow_stalled: None,
            bytes_since_flow: 0,
            next_heartbeat: None,
            idle_since: Some(now),
        };
        c.start_position(stream);
        c.scan_from = c.next_seq;
        c.floor = (c.next_seq.saturating_sub(1), 0);
        c
    }

    fn start_position(&mut self, stream: &Stream) {
        let policy = self
            .cfg
            .deliver_policy
            .clone()
            .unwrap_or(DeliverPolicy::All);
        self.next_seq = match policy {
            DeliverPolicy::All | DeliverPolicy::Other(_) => stream.first_seq(),
            DeliverPolicy::New => stream.last_seq + 1,
            DeliverPolicy::Last => stream
                .msgs
                .iter()
                .rev()
                .find(|(_, m)| self.wants(&m.subject))
                .map_or(stream.last_seq + 1, |(s, _)| *s),
            // As nats-server does: a start outside the stream is moved into it (and the
            // consumer's info says where it starts).
            DeliverPolicy::ByStartSequence => {
                let start = self.cfg.opt_start_seq.unwrap_or(1).max(1);
                if stream.last_seq == 0 {
                    1
                } else if start < stream.first_seq() {
                    stream.first_seq()
                } else {
                    start.min(stream.last_seq + 1)
                }
            }
            DeliverPolicy::ByStartTime => {
                let t = self
                    .cfg
                    .opt_start_time
                    .as_deref()
                    .and_then(parse_nanos)
                    .unwrap_or(0);
                stream
                    .msgs
                    .iter()
                    .find(|(_, m)| m.ts >= t)
                    .map_or(stream.last_seq + 1, |(s, _)| *s)
            }
            DeliverPolicy::LastPerSubject => {
                let mut last: BTreeMap<&str, u64> = BTreeMap::new();
                for (s, m) in &stream.msgs {
                    if self.wants(&m.subject) {
                        last.insert(&m.subject, *s);
                    }
                }
                let set: BTreeSet<u64> = last.values().copied().collect();
                let first = set.iter().next().copied().unwrap_or(stream.last_seq + 1);
                self.last_per_subject = Some((stream.last_seq, set));
                first
            }
        };
    }

    pub fn is_push(&self) -> bool {
        self.deliver_subject().is_some()
    }

    fn deliver_subject(&self) -> Option<&str> {
        self.cfg
            .deliver_subject
            .as_deref()
            .filter(|s| !s.is_empty())
    }

    fn ack_policy(&self) -> AckPolicy {
        self.cfg.ack_policy.clone().unwrap_or(AckPolicy::Explicit)
    }

    fn ack_wait(&self) -> Duration {
        self.cfg
            .ack_wait
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(30))
    }

    fn wants(&self, subject: &str) -> bool {
        self.filters.is_empty()
            || self
                .filters
                .iter()
                .any(|f| matches(f.as_bytes(), subject.as_bytes()))
    }

    fn eligible_new(&self, seq: u64, m: &StoredMsg) -> bool {
        if !self.wants(&m.subject) {
            return false;
        }
        match &self.last_per_subject {
            Some((until, set)) if seq <= *until => set.contains(&seq),
            _ => true,
        }
    }

    pub fn num_pending(&self, stream: &Stream) -> u64 {
        self.pending_from(stream, self.next_seq)
    }

    fn pending_from(&self, stream: &Stream, next_seq: u64) -> u64 {
        stream
            .msgs
            .range(self.scan_from.max(next_seq)..)
            .filter(|(s, m)| self.eligible_new(**s, m))
            .count() as u64
    }

    pub fn update_config(&mut self, config: Value, cfg: ConsumerConfig) {
        self.filters = filters_of(&cfg);
        self.scan_from = self.next_seq;
        self.config = config;
        self.cfg = cfg;
    }

    /// Forgets pending acks of messages the stream no longer has.
    pub fn sync(&mut self, stream: &Stream) {
        self.pending.retain(|s, _| stream.msgs.contains_key(s));
    }

    fn next_message(&mut self, stream: &Stream) -> Option<(u64, bool)> {
        if let Some((s, _)) = self.pending.iter().find(|(_, p)| p.deadline.is_none()) {
            return Some((*s, true));
        }
        let max_pending = self
            .cfg
            .max_ack_pending
            .filter(|n| *n > 0)
            .map(|n| n as usize);
        if self.ack_policy() != AckPolicy::None
            && max_pending.is_some_and(|m| self.pending.len() >= m)
        {
            return None;
        }
        let from = self.scan_from.max(self.next_seq);
        let found = stream
            .msgs
            .range(from..)
            .find(|(s, m)| self.eligible_new(**s, m))
            .map(|(s, _)| *s);
        // Filters and the start set do not change under a scan: what it passed over
        // stays passed over.
        self.scan_from = found.unwrap_or(stream.last_seq + 1);
        found.map(|s| (s, false))
    }

    /// What handing out message `seq` next would deliver to `to`, the consumer as yet
    /// unchanged: the server checks its size (with the ack reply) against a pull's
    /// `max_bytes` before it delivers.
    fn delivery(
        &self,
        stream: &Stream,
        seq: u64,
        redelivery: bool,
        to: &str,
    ) -> Option<(Outbound, u64)> {
        let m = stream.msgs.get(&seq)?;
        let deliveries = if redelivery {
            self.pending.get(&seq).map_or(1, |p| p.deliveries + 1)
        } else {
            1
        };
        let next_seq = if redelivery { self.next_seq } else { seq + 1 };
        let pending_after = self.pending_from(stream, next_seq);
        let reply = format!(
            "$JS.ACK.{}.{}.{}.{}.{}.{}.{}",
            self.stream,
            self.name,
            deliveries,
            seq,
            self.cseq + 1,
            m.ts,
            pending_after
        );
        let out = Outbound {
            to: to.to_string(),
            subject: m.subject.clone(),
            reply: Some(reply),
            headers: m.headers.clone(),
            payload: m.payload.clone(),
        };
        Some((out, deliveries))
    }

    /// Hands out message `seq` as the next delivery.
    fn deliver(
        &mut self,
        stream: &Stream,
        seq: u64,
        redelivery: bool,
        to: &str,
        now: Instant,
    ) -> Option<Outbound> {
        let (out, deliveries) = self.delivery(stream, seq, redelivery, to)?;
        self.record(seq, redelivery, deliveries, now);
        Some(out)
    }

    fn record(&mut self, seq: u64, redelivery: bool, deliveries: u64, now: Instant) {
        self.cseq += 1;
        self.last_sseq = seq;
        if !redelivery {
            self.next_seq = seq + 1;
        }
        if self.ack_policy() == AckPolicy::None {
            self.floor = (seq, self.cseq);
        } else {
            let deadline = now.checked_add(self.ack_wait());
            self.pending.insert(
                seq,
                Pending {
                    cseq: self.cseq,
                    deliveries,
                    deadline: deadline.or(Some(now)),
                },
            );
        }
    }

    /// A pull request; `out` gets statuses that answer it at once.
    pub fn add_pull(
        &mut self,
        reply: &str,
        req: NextRequest,
        now: Instant,
        out: &mut Vec<Outbound>,
    ) {
        self.idle_since = None;
        if self.is_push() {
            out.push(Outbound::status(reply, 409, "Consumer is push based", &[]));
            return;
        }
        let max_waiting = self.cfg.max_waiting.filter(|n| *n > 0).unwrap_or(512) as usize;
        if self.waiting.len() >= max_waiting {
            out.push(Outbound::status(reply, 409, "Exceeded MaxWaiting", &[]));
            return;
        }
        let heartbeat = req.idle_heartbeat.filter(|_| !req.no_wait);
        self.waiting.push_back(PullWait {
            reply: reply.to_string(),
            left: req.batch,
            bytes_left: req.max_bytes,
            expires: req.expires.and_then(|d| now.checked_add(d)),
            heartbeat,
            next_heartbeat: heartbeat.and_then(|d| now.checked_add(d)),
            no_wait: req.no_wait,
            delivered: 0,
        });
    }

    /// Delivers what it can; `interest` says whether a subject has a subscriber.
    pub fn pump(
        &mut self,
        stream: &Stream,
        now: Instant,
        interest: &dyn Fn(&str) -> bool,
        out: &mut Vec<Outbound>,
    ) {
        self.sync(stream);
        if let Some(subject) = self.deliver_subject().map(str::to_string) {
            self.pump_push(stream, &subject, now, interest, out);
            return;
        }
        if self.waiting.is_empty() {
            return;
        }
        while let Some(front) = self.waiting.front() {
            if !interest(&front.reply) {
                self.waiting.pop_front();
                continue;
            }
            let (reply, bytes_left) = (front.reply.clone(), front.bytes_left);
            let Some((seq, redelivery)) = self.next_message(stream) else {
                break;
            };
            let Some((msg, deliveries)) = self.delivery(stream, seq, redelivery, &reply) else {
                break;
            };
            let size = msg.pulled_size();
            if bytes_left.is_some_and(|b| size > b) {
                if let Some(w) = self.waiting.pop_front() {
                    out.push(Outbound::status(
                        &reply,
                        409,
                        "Message Size Exceeds MaxBytes",
                        &pending_fields(&w),
                    ));
                }
                continue;
            }
            self.record(seq, redelivery, deliveries, now);
            out.push(msg);
            if let Some(w) = self.waiting.front_mut() {
                w.left = w.left.saturating_sub(1);
                w.delivered += 1;
                w.bytes_left = w.bytes_left.map(|b| b.saturating_sub(size));
                w.next_heartbeat = w.heartbeat.and_then(|d| now.checked_add(d));
                if w.left == 0 && w.bytes_left.is_some_and(|b| b > 0) {
                    // A pull carrying `max_bytes` whose count ran out first says so.
                    out.push(Outbound::status(
                        &reply,
                        409,
                        "Batch Completed",
                        &pending_fields(w),
                    ));
                }
                if w.left == 0 || w.bytes_left == Some(0) {
                    self.waiting.pop_front();
                }
            }
        }
        // A no_wait request ends with what there was.
        let mut kept = VecDeque::new();
        for w in self.waiting.drain(..) {
            if !w.no_wait {
                kept.push_back(w);
            } else if w.delivered == 0 {
                out.push(Outbound::status(&w.reply, 404, "No Messages", &[]));
            } else {
                out.push(Outbound::status(
                    &w.reply,
                    408,
                    "Request Timeout",
                    &pending_fields(&w),
                ));
            }
        }
        self.waiting = kept;
        if self.waiting.is_empty() && self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
    }

    fn pump_push(
        &mut self,
        stream: &Stream,
        subject: &str,
        now: Instant,
        interest: &dyn Fn(&str) -> bool,
        out: &mut Vec<Outbound>,
    ) {
        if !interest(subject) {
            self.idle_since.get_or_insert(now);
            self.next_heartbeat = None;
            return;
        }
        self.idle_since = None;
        let heartbeat = self.cfg.idle_heartbeat.filter(|d| !d.is_zero());
        if self.next_heartbeat.is_none() {
            self.next_heartbeat = heartbeat.and_then(|d| now.checked_add(d));
        }
        while self.flow_stalled.is_none() {
            let Some((seq, redelivery)) = self.next_message(stream) else {
                break;
            };
            let size = stream.msgs.get(&seq).map_or(0, StoredMsg::size);
            if let Some(msg) = self.deliver(stream, seq, redelivery, subject, now) {
                out.push(msg);
            }
            self.next_heartbeat = heartbeat.and_then(|d| now.checked_add(d));
            self.bytes_since_flow += size;
            if self.cfg.flow_control == Some(true) && self.bytes_since_flow >= FLOW_CONTROL_BYTES {
                self.flow_control_id += 1;
                let reply = format!(
                    "$JS.FC.{}.{}.{}",
                    self.stream, self.name, self.flow_control_id
                );
                let mut fc = Outbound::status(subject, 100, "FlowControl Request", &[]);
                fc.reply = Some(reply.clone());
                out.push(fc);
                self.flow_stalled = Some(reply);
                self.bytes_since_flow = 0;
            }
        }
    }

    /// After a server restart: no connection is left to answer or to deliver to.
    pub fn restart(&mut self, now: Instant) {
        self.waiting.clear();
        self.flow_stalled = None;
        self.bytes_since_flow = 0;
        self.next_heartbeat = None;
        self.idle_since = Some(now);
        for p in self.pending.values_mut() {
            p.deadline = Some(p.deadline.map_or(now, |d| d.max(now)));
        }
    }

    /// A reply to a flow-control request.
    pub fn flow_answered(&mut self, reply: &str) {
        if self.flow_stalled.as_deref() == Some(reply) {
            self.flow_stalled = None;
        }
    }

    /// An ack; returns the stream sequences it completed (for work-queue removal).
    pub fn ack(&mut self, seq: u64, op: AckOp, now: Instant) -> Vec<u64> {
        self.idle_since = self.idle_since.map(|_| now);
        let done: Vec<u64> = match op {
            AckOp::Ack if self.ack_policy() == AckPolicy::All => {
                self.pending.range(..=seq).map(|(s, _)| *s).collect()
            }
            AckOp::Ack | AckOp::Term => self
                .pending
                .contains_key(&seq)
                .then_some(seq)
                .into_iter()
                .collect(),
            AckOp::Nak(delay) => {
                if let Some(p) = self.pending.get_mut(&seq) {
                    p.deadline = delay.and_then(|d| now.checked_add(d));
                }
                Vec::new()
            }
            AckOp::Progress => {
                let wait = self.ack_wait();
                if let Some(p) = self.pending.get_mut(&seq) {
                    p.deadline = now.checked_add(wait).or(Some(now));
                }
                Vec::new()
            }
        };
        for s in &done {
            self.pending.remove(s);
        }
        self.advance_floor();
        done
    }

    fn advance_floor(&mut self) {
        self.floor = match self.pending.iter().next() {
            None => (self.next_seq.saturating_sub(1).max(self.floor.0), self.cseq),
            Some((s, p)) => (
                s.saturating_sub(1).max(self.floor.0),
                p.cseq.saturating_sub(1),
            ),
        };
    }

    /// Removes everything waiting, answering each pull with `409 Consumer Deleted`.
    pub fn close(&mut self, out: &mut Vec<Outbound>) {
        for w in self.waiting.drain(..) {
            out.push(Outbound::status(&w.reply, 409, "Consumer Deleted", &[]));
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut keep = |t: Option<Instant>| {
            if let Some(t) = t {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        };
        for p in self.pending.values() {
            keep(p.deadline);
        }
        for w in &self.waiting {
            keep(w.expires);
            keep(w.next_heartbeat);
        }
        keep(self.next_heartbeat);
        keep(self.inactive_deadline());
        next
    }

    fn inactive_deadline(&self) -> Option<Instant> {
        let threshold = self.cfg.inactive_threshold.filter(|d| !d.is_zero())?;
        self.idle_since?.checked_add(threshold)
    }

    /// Runs the clock forward; returns true when the consumer has been idle too long.
    pub fn handle_timeout(&mut self, now: Instant, out: &mut Vec<Outbound>) -> bool {
        let max_deliver = self.cfg.max_deliver.filter(|n| *n > 0).map(|n| n as u64);
        let mut exhausted = Vec::new();
        for (s, p) in self.pending.iter_mut() {
            if p.deadline.is_some_and(|d| d <= now) {
                if max_deliver.is_some_and(|m| p.deliveries >= m) {
                    exhausted.push(*s);
                } else {
                    p.deadline = None;
                }
            }
        }
        for s in exhausted {
            self.pending.remove(&s);
        }
        self.advance_floor();
        let mut kept = VecDeque::new();
        for mut w in self.waiting.drain(..) {
            if w.expires.is_some_and(|t| t <= now) {
                out.push(Outbound::status(
                    &w.reply,
                    408,
                    "Request Timeout",
                    &pending_fields(&w),
                ));
                continue;
            }
            if let (Some(t), Some(hb)) = (w.next_heartbeat, w.heartbeat)
                && t <= now
            {
                out.push(Outbound::status(&w.reply, 100, "Idle Heartbeat", &[]));
                w.next_heartbeat = now.checked_add(hb);
            }
            kept.push_back(w);
        }
        self.waiting = kept;
        if !self.is_push() && self.waiting.is_empty() && self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
        if let (Some(t), Some(subject)) = (self.next_heartbeat, self.deliver_subject())
            && t <= now
        {
            let mut fields = vec![
                ("Nats-Last-Consumer", self.cseq.to_string()),
                ("Nats-Last-Stream", self.last_sseq.to_string()),
            ];
            if let Some(stalled) = &self.flow_stalled {
                fields.push(("Nats-Consumer-Stalled", stalled.clone()));
            }
            out.push(Outbound::status(subject, 100, "Idle Heartbeat", &fields));
            self.next_heartbeat = self
                .cfg
                .idle_heartbeat
                .filter(|d| !d.is_zero())
                .and_then(|d| now.checked_add(d));
        }
        self.inactive_deadline().is_some_and(|t| t <= now)
    }

    pub fn info(&self, stream: &Stream, now_nanos: u64) -> Value {
        let redelivered = self.pending.values().filter(|p| p.deliveries > 1).count();
        let last_active = format_nanos(now_nanos);
        json!({
            "type": "io.nats.jetstream.api.v1.consumer_info_response",
            "stream_name": self.stream,
            "name": self.name,
            "created": self.created,
            "config": self.config,
            "delivered": {"consumer_seq": self.cseq, "stream_seq": self.next_seq.saturating_sub(1).max(self.last_sseq), "last_active": last_active},
            "ack_floor": {"consumer_seq": self.floor.1, "stream_seq": self.floor.0},
            "num_ack_pending": self.pending.len(),
            "num_redelivered": redelivered,
            "num_waiting": self.waiting.len(),
            "num_pending": self.num_pending(stream),
            "ts": format_nanos(now_nanos),
        })
    }
}

fn pending_fields(w: &PullWait) -> Vec<(&'static str, String)> {
    vec![
        ("Nats-Pending-Messages", w.left.to_string()),
        ("Nats-Pending-Bytes", w.bytes_left.unwrap_or(0).to_string()),
    ]
}
