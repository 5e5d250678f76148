//! What must hold, checked as the run goes and at its end.
//!
//! - Inbox: every `send` answered `ok {seq}` reaches its recipient as a `message` with
//!   that seq at least once (checked at the end, after a fault-free drain in which every
//!   client is online and acks everything).
//! - Topics: within one session, a subscription's events have strictly increasing seqs
//!   (no duplicate, no reordering), and no event is skipped: between two consecutive
//!   events (and before the first one of a `from:"all"` or durable subscription) the
//!   topics stream holds no matching event, except, for a durable, events its
//!   participant acknowledged in an earlier session. So a resumed durable starts at the
//!   first unacknowledged event. (An ack sent but lost to a fault may bring an acked
//!   event back: that is allowed.) One relaxation, for durables only: a delivery lost
//!   in flight (bytes lost with a transport, a broker crash) is redelivered by JetStream
//!   only after the consumer's AckWait (30 s), so within that time after a loss a
//!   durable may skip events; such skips are counted (`Counts::tolerated_skips`), not
//!   failed. So may a durable while another broker still pulls it: its link is delayed
//!   (an event its pull got is handed back only when it arrives), or an old session of
//!   the same client there is not yet seen to end (a durable is taken over on one broker
//!   only). Plain subscriptions get no such leeway: the broker must notice the gap.
//! - Leases: a `claim` answered `ok` while another session still holds an unexpired
//!   lease of the same task (by its `lease_until`, extended by each heartbeat `ok`) that
//!   it has not given up (complete/fail sent, `lease_lost`, `revoked`, session closed)
//!   is two live leases. A claim `ok` whose `lease_until` has passed when it arrives
//!   (the task store's reply was delayed past it) is a violation too: the spec answers
//!   a claim after the lease ran out with `lease_lost`.
//! - Tasks (at the end, from the task store's KV history in the model): no revision has
//!   `attempt > max_attempts`; a terminal state never changes; after the drain every task
//!   is terminal; each terminal task has exactly one `task_result` message stored in its
//!   submitter's inbox; every task whose submit was answered `ok` is in the store.
//! - Budgets (at the end, from the task store): no participant with a task budget has
//!   more tasks in the store than its budget, however many brokers admitted them.
//! - Requests (each step): every request is answered at most once (an answer to an id
//!   not outstanding is a violation) and within 30 s, unless its session closed first.
//! - Memory (each step): each broker holds exactly the sessions the transport has open,
//!   no session has more unacknowledged inbox deliveries than the window or more
//!   outstanding requests than its client sent; in-flight round trips stay bounded. At
//!   the very end, after every client left and the world was quiet for a minute, the
//!   brokers hold no session, no presence and no held submit.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::broker::SessionId;
use crate::proto::subject::matches;

/// A durable's AckWait (30 s) with a second for the way back: how long after a loss a
/// durable may skip events.
pub const DURABLE_REDELIVERY_MS: u64 = 31_000;

/// A session as the checker names it: (node, session number). Session numbers of a
/// node are never reused, across crashes too.
pub type SessionKey = (usize, SessionId);

#[derive(Debug, Clone)]
struct Holder {
    session: SessionKey,
    who: String,
    until_ms: i64,
    since_ms: i64,
    ended: bool,
}

#[derive(Debug, Default)]
pub struct Checker {
    pub violations: Vec<String>,
    /// (recipient, seq) of every `send` answered ok.
    sent_ok: BTreeSet<(String, u64)>,
    /// (recipient, seq) of every message delivered.
    delivered: BTreeSet<(String, u64)>,
    /// (participant, durable sub) -> seqs acked.
    durable_acks: BTreeMap<(String, String), BTreeSet<u64>>,
    holders: BTreeMap<String, Vec<Holder>>,
    pub counts: Counts,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    pub sends_ok: u64,
    pub messages: u64,
    pub events: u64,
    pub claims_ok: u64,
    pub tasks: u64,
    pub tolerated_skips: u64,
    /// Submits answered `budget_exhausted`.
    pub budget_refusals: u64,
}

impl Checker {
    pub fn violation(&mut self, what: String) {
        if self.violations.len() < 16 {
            self.violations.push(what);
        }
    }

    pub fn send_ok(&mut self, to: &str, seq: u64) {
        self.counts.sends_ok += 1;
        self.sent_ok.insert((to.to_string(), seq));
    }

    pub fn message(&mut self, recipient: &str, frame: &Value) {
        self.counts.messages += 1;
        let Some(seq) = frame["seq"].as_u64() else {
            return self.violation(format!("message without seq: {frame}"));
        };
        if frame["to"].as_str() != Some(recipient) {
            self.violation(format!(
                "{recipient} got a message for someone else: {frame}"
            ));
        }
        self.delivered.insert((recipient.to_string(), seq));
    }

    pub fn durable_acked(&mut self, who: &str, sub: &str, seq: u64) {
        self.durable_acks
            .entry((who.to_string(), sub.to_string()))
            .or_default()
            .insert(seq);
    }

    /// An event of subscription `view` (its state before this event) on `session`;
    /// `stream` is the topics stream as the model holds it now.
    pub fn event(
        &mut self,
        who: &str,
        session: SessionKey,
        view: &super::clients::SubView,
        seq: u64,
        stream: &[(u64, &str, &[u8])],
        after_loss: bool,
    ) {
        self.counts.events += 1;
        let subject = format!("amp.dev.topic.{}", view.pattern);
        let matching = |s: &str| matches(subject.as_bytes(), s.as_bytes());
        if let Some(last) = view.last
            && seq <= last
        {
            return self.violation(format!(
                "{who} session {session:?} sub {}: event {seq} after {last} (duplicate or out of order)",
                view.sub
            ));
        }
        let Some(&(_, got_subject, _)) = stream.iter().find(|m| m.0 == seq) else {
            return self.violation(format!(
                "{who} sub {}: event {seq} is not in the topics stream",
                view.sub
            ));
        };
        if !matching(got_subject) {
            return self.violation(format!(
                "{who} sub {} ({}): event {seq} on {got_subject} does not match",
                view.sub, view.pattern
            ));
        }
        let lower = match view.last {
            Some(last) => last,
            None if view.from_all || view.durable => 0,
            None => return,
        };
        let empty = BTreeSet::new();
        let acked = if view.durable {
            self.durable_acks
                .get(&(who.to_string(), view.sub.clone()))
                .unwrap_or(&empty)
        } else {
            &empty
        };
        let skipped: Vec<u64> = stream
            .iter()
            .filter(|m| m.0 > lower && m.0 < seq && matching(m.1) && !acked.contains(&m.0))
            .map(|m| m.0)
            .collect();
        if !skipped.is_empty() && view.durable && after_loss {
            self.counts.tolerated_skips += 1;
        } else if !skipped.is_empty() {
            let what = if view.last.is_none() && view.durable {
                "a (resumed) durable started past unacknowledged events"
            } else {
                "events skipped"
            };
            self.violation(format!(
                "{who} session {session:?} sub {} ({}, durable {}): {what}: got {seq} after {:?}, missing {skipped:?}",
                view.sub, view.pattern, view.durable, view.last
            ));
        }
    }

    pub fn claim_ok(
        &mut self,
        task: &str,
        session: SessionKey,
        who: &str,
        until_ms: i64,
        now_ms: i64,
    ) {
        self.counts.claims_ok += 1;
        let holders = self.holders.entry(task.to_string()).or_default();
        if until_ms <= now_ms {
            // Its reply was delayed past `lease_until`: the session holds nothing, and
            // the spec answers a claim after the lease ran out with `lease_lost`.
            return self.violation(format!(
                "{who} {session:?}: claim of task {task} answered ok at {now_ms} for a lease that ended at {until_ms}"
            ));
        }
        for h in holders.iter() {
            if !h.ended && h.session != session && now_ms < h.until_ms {
                let msg = format!(
                    "two live leases of task {task}: {who} {session:?} claimed at {now_ms} while {} {:?} holds it (since {}) until {}",
                    h.who, h.session, h.since_ms, h.until_ms
                );
                self.violations.push(msg);
            }
        }
        holders.retain(|h| !h.ended);
        holders.push(Holder {
            session,
            who: who.to_string(),
            until_ms,
            since_ms: now_ms,
            ended: false,
        });
    }

    pub fn heartbeat_ok(&mut self, task: &str, session: SessionKey, until_ms: i64) {
        for h in self.holders.entry(task.to_string()).or_default() {
            if h.session == session && !h.ended {
                h.until_ms = h.until_ms.max(until_ms);
            }
        }
    }

    pub fn lease_ended(&mut self, task: &str, session: SessionKey) {
        for h in self.holders.entry(task.to_string()).or_default() {
            if h.session == session {
                h.ended = true;
            }
        }
    }

    pub fn session_closed(&mut self, session: SessionKey) {
        for hs in self.holders.values_mut() {
            for h in hs.iter_mut().filter(|h| h.session == session) {
                h.ended = true;
            }
        }
    }

    /// The end-of-run checks of inbox delivery.
    pub fn check_inbox(&mut self) {
        let missing: Vec<&(String, u64)> = self.sent_ok.difference(&self.delivered).collect();
        if !missing.is_empty() {
            let shown: Vec<_> = missing.iter().take(8).collect();
            let msg = format!(
                "{} sends answered ok were never delivered, e.g. {shown:?}",
                missing.len()
            );
            self.violations.push(msg);
        }
    }

    /// The end-of-run checks of tasks, from the task store's history and the inboxes.
    pub fn check_tasks(
        &mut self,
        store: &[(u64, &str, &[u8])],
        inbox: &[(u64, &str, &[u8])],
        submitted: &[(String, String)],
        budgets: &[(String, u64)],
    ) {
        let prefix = "$KV.AMP_TASK_STATE.dev.";
        let mut revisions: BTreeMap<&str, Vec<Value>> = BTreeMap::new();
        for (_, subject, payload) in store {
            let Some(task) = subject.strip_prefix(prefix) else {
                continue;
            };
            if let Ok(v) = serde_json::from_slice::<Value>(payload) {
                revisions.entry(task).or_default().push(v);
            }
        }
        let mut results: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
        for (seq, _, payload) in inbox {
            let Ok(env) = serde_json::from_slice::<Value>(payload) else {
                continue;
            };
            if env["kind"] == "task_result"
                && let Some(task) = env["body"]["task"].as_str()
            {
                let to = env["to"].as_str().unwrap_or_default().to_string();
                results
                    .entry(task.to_string())
                    .or_default()
                    .push((*seq, to));
            }
        }
        self.counts.tasks = revisions.len() as u64;
        for (task, revs) in &revisions {
            let mut terminal: Option<&str> = None;
            for r in revs {
                let state = r["state"].as_str().unwrap_or_default();
                let (attempt, max) = (r["attempt"].as_u64(), r["max_attempts"].as_u64());
                if let (Some(a), Some(m)) = (attempt, max)
                    && a > m
                {
                    self.violation(format!("task {task}: attempt {a} of {m} in the store: {r}"));
                }
                if let Some(t) = terminal
                    && t != state
                {
                    self.violation(format!("task {task}: terminal {t} became {state}: {r}"));
                }
                if matches!(state, "completed" | "failed" | "cancelled") {
                    terminal = Some(state);
                }
            }
            let last = revs.last().cloned().unwrap_or(Value::Null);
            if last["via_mig"] == true {
                continue;
            }
            let Some(state) = terminal else {
                self.violation(format!(
                    "task {task} is not terminal after the drain: {last}"
                ));
                continue;
            };
            let submitter = last["submitted_by"].as_str().unwrap_or_default();
            let got = results.get(*task).map(Vec::as_slice).unwrap_or_default();
            if got.len() != 1 || got.iter().any(|(_, to)| to != submitter) {
                self.violation(format!(
                    "task {task} ({state}): {} task_result messages stored for {submitter}: {got:?}",
                    got.len()
                ));
            }
        }
        let mut per_submitter: BTreeMap<&str, u64> = BTreeMap::new();
        for revs in revisions.values() {
            if let Some(by) = revs.first().and_then(|r| r["submitted_by"].as_str()) {
                *per_submitter.entry(by).or_default() += 1;
            }
        }
        for (who, budget) in budgets {
            let n = per_submitter.get(who.as_str()).copied().unwrap_or(0);
            if n > *budget {
                self.violation(format!(
                    "{who} has {n} tasks in the store, its budget across all brokers is {budget}"
                ));
            }
        }
        for (who, task) in submitted {
            if !revisions.contains_key(task.as_str()) {
                self.violation(format!(
                    "{who}'s task {task} was answered ok but is not in the store"
                ));
            }
        }
    }
}
