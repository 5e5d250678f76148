//! The task record kept in the task store (KV bucket `AMP_TASK_STATE`, key `<ns>.<task>`)
//! and its state machine. Every change is a pure function from one record to the next;
//! the broker writes the result with a compare-and-set on the revision it read, so two
//! changes based on the same revision can never both succeed. Lease ownership, attempts
//! and terminal outcomes live here, not in JetStream's delivery counts.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::amp::reply::{push_json_str, push_json_str_map};
use crate::proto::encode::push_decimal;
use crate::rfc3339;

/// History entries kept per task. The first (the submission) is always kept; past the
/// bound the oldest of the others are dropped, so a task declined forever cannot grow its
/// record without limit.
pub const MAX_HISTORY: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Queued,
    Offered,
    Leased,
    Completed,
    Failed,
    Cancelled,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Queued => "queued",
            TaskState::Offered => "offered",
            TaskState::Leased => "leased",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Cancelled => "cancelled",
        }
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Cancelled
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub state: TaskState,
    pub at: String,
    pub by: String,
}

/// The `eligible` restriction of a submit: names (bare, within the namespace) and labels
/// that must all match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Eligible {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub names: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

impl Eligible {
    /// Whether participant `name` with `labels` may be offered the task.
    pub fn admits(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        let name_ok = self
            .names
            .as_ref()
            .is_none_or(|names| names.iter().any(|n| n == name));
        let labels_ok = self
            .labels
            .as_ref()
            .is_none_or(|want| want.iter().all(|(k, v)| labels.get(k) == Some(v)));
        name_ok && labels_ok
    }
}

/// One task as the task store holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    pub job: String,
    pub state: TaskState,
    /// Claims so far (0 before the first).
    pub attempt: u32,
    pub max_attempts: u32,
    /// `ns/name` of the lease holder while leased (and of the offer's recipient while
    /// offered); after completion, who completed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// The session (`<broker>/<incarnation>/<session>`) holding the offer or the lease: one participant
    /// may have several sessions, each with its own in-flight state. After `completed` or
    /// `failed` by the holder it names the session that reported the outcome, so that the
    /// retry of an outcome answered `unavailable` (whose write landed after all) is known
    /// as that session's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_session: Option<String>,
    /// Milliseconds since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until_ms: Option<i64>,
    pub submitted_by: String,
    /// SHA-256 of the canonical JSON of the body, to tell a resubmit from a conflict.
    pub body_sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eligible: Option<Eligible>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    #[serde(default)]
    pub history: Vec<HistoryEntry>,
    /// The last `progress` a heartbeat reported, and how many heartbeats reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Value>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub progress_n: u32,
    /// Submitted by a MIG invoke (task header `mig_capability`): the caller hears the
    /// outcome as its reply, from the record, so no `task_result` goes to its AMP inbox.
    #[serde(default, skip_serializing_if = "is_false")]
    pub via_mig: bool,
    /// The stream sequence of the task message whose deliveries act on this record: the
    /// first delivery whose change is written binds it (or a resubmit that had to store
    /// the message again, see `jobs::submit`). A copy of the message stored later (a
    /// republish past the stream's duplicate window) is none of the task's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub msg_seq: Option<u64>,
    /// The `task_result` of this completed or failed task is stored in the submitter's
    /// inbox while its message stays for a redelivery (its dead letter not stored yet):
    /// that redelivery must not publish it again, as past the inbox's duplicate window
    /// its message id no longer makes a repeat a duplicate. Of a cancelled task: a
    /// repeat of its cancel stored it, so the retry of a cancel whose own publishes were
    /// all refused, which republishes past that window, must not.
    #[serde(default, skip_serializing_if = "is_false")]
    pub result_sent: bool,
    /// The dead letter of this failed task is stored while its message stays for a
    /// redelivery (its `task_result` not stored yet, the inbox full): that redelivery
    /// must not store it again, as past the letters' duplicate window its message id no
    /// longer makes a repeat a duplicate.
    #[serde(default, skip_serializing_if = "is_false")]
    pub lettered: bool,
    /// Of a cancelled task: every publish of its `task_result` was refused for want of
    /// room (JetStream stored nothing), as the broker that last had one refused knew of
    /// its own. A retry of the cancel through any broker publishes it again, also past
    /// the repeat window, where only the broker that had them refused did: a retry
    /// through another one answered `conflict` and the result was never stored. Cleared
    /// when it is stored, or by a broker whose publish of it may have landed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub result_refused: bool,
    /// The use of the task id this record is: drawn at random by the submit that made
    /// it, and carried by its task message (header `AMP-Task-Use`; a resubmit's copy
    /// carries the record's). A task id is free again once its record expired, and a
    /// message of an earlier use may outlive that record: only a message carrying this
    /// one is the record's, even one of the same submitter, job and body. `None` in a
    /// record an earlier release made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_id: Option<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A participant acting through one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Actor<'a> {
    /// `ns/name`.
    pub participant: &'a str,
    /// `<broker>/<session>`.
    pub session: &'a str,
}

/// A change to a task record.
#[derive(Debug, Clone, PartialEq)]
pub enum Change<'a> {
    /// Offer the task to a session (a delivery that `on_delivery` said to offer).
    Offer {
        to: Actor<'a>,
    },
    /// The offer was declined or not claimed in time. `offered_at_ms` is when the offer
    /// went out: an offer that was never written (the record still says what it said at
    /// the delivery) is recorded in the history with it.
    Requeue {
        by: Actor<'a>,
        offered_at_ms: i64,
    },
    /// The offered session takes the lease. The offer itself is recorded here when it was
    /// not written before (see `Requeue`).
    Claim {
        by: Actor<'a>,
        lease_ms: i64,
        offered_at_ms: i64,
    },
    Heartbeat {
        by: Actor<'a>,
        lease_ms: i64,
        progress: Option<&'a Value>,
    },
    Complete {
        by: Actor<'a>,
        result: Option<Value>,
    },
    Fail {
        by: Actor<'a>,
        error: Value,
        retry: bool,
    },
    /// The last attempt's lease ran out: the task fails. `by` names the broker.
    Exhaust {
        by: &'a str,
    },
    Cancel {
        by: &'a str,
    },
    /// The `task_result` of a finished task is stored (see [`TaskRecord::result_sent`]).
    ResultSent,
    /// The dead letter of a failed task is stored (see [`TaskRecord::lettered`]).
    Lettered,
    /// The `task_result` of a finished task was refused for want of room (a full inbox),
    /// or a publish of it may have landed unconfirmed: the record is written again, so
    /// that its expiry (`keep_finished_s`) starts over, saying of a cancelled task what
    /// [`Refused`] says ([`TaskRecord::result_refused`]). What publishes the result
    /// again (a redelivery of its message, a retry of its cancel) needs the record;
    /// counted from the outcome, it expired while the inbox stayed full, and the result
    /// was never stored.
    ResultRefused(Refused),
}

/// What a [`Change::ResultRefused`] makes of [`TaskRecord::result_refused`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every publish of the result the broker made for a cancel it answered
    /// `unavailable` was refused, or a repeat no cancel waits on was refused 80 s or more
    /// after the cancel, when JetStream would have answered it a duplicate of any copy
    /// stored: set, for a cancelled task.
    Every,
    /// A publish of it may have landed unconfirmed: cleared.
    Maybe,
    /// A repeat for a cancel answered `conflict` was refused earlier: left as it is
    /// (the broker publishes it again until one of its repeats tells). The cancel's own
    /// publish, through another broker, may land after it and writes nothing once
    /// stored, so `Every` set the flag on a stored result, and a retry past the inbox's
    /// duplicate window stored it a second time (review finding 3).
    Keep,
}

impl Refused {
    /// `record`'s `result_refused` once this is written to it.
    pub fn flag(self, record: &TaskRecord) -> bool {
        match self {
            Refused::Every => record.state == TaskState::Cancelled,
            Refused::Maybe => false,
            Refused::Keep => record.result_refused,
        }
    }
}

/// Why a change does not apply to the record as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The actor does not hold the offer or the lease, or the lease ran out.
    LeaseLost,
    /// Only the submitter may cancel.
    NotSubmitter,
    /// The task already reached this terminal state.
    Finished(TaskState),
    /// Someone holds an unexpired lease (until this time, ms).
    LeaseHeld { until_ms: i64 },
}

/// What to do with a delivery of the task's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDelivery {
    /// Offer it (queued, an offer that was never answered, or an expired lease with
    /// attempts left).
    Offer,
    /// Finished already: acknowledge the message away.
    Finished,
    /// The last attempt's lease ran out: terminate the message and store `failed`.
    Exhaust,
    /// A lease is still running (a redelivery raced a heartbeat): release it until then.
    Held { until_ms: i64 },
}

/// SHA-256 hex of a body's canonical JSON (object keys sorted, no whitespace).
pub fn body_digest(body: &Value) -> String {
    // `Value` keeps objects in sorted maps, so its serialisation is canonical.
    canonical_digest(&serde_json::to_string(body).unwrap_or_default())
}

/// [`body_digest`] of the value whose serde_json serialisation is `text`.
pub fn canonical_digest(text: &str) -> String {
    crate::broker::envelope::hex(&Sha256::digest(text.as_bytes()))
}

impl TaskRecord {
    /// A freshly submitted task.
    pub fn submitted(
        id: &str,
        job: &str,
        submitted_by: &str,
        body: &Value,
        max_attempts: u32,
        eligible: Option<Eligible>,
        now_ms: i64,
    ) -> TaskRecord {
        TaskRecord {
            id: id.to_string(),
            job: job.to_string(),
            state: TaskState::Queued,
            attempt: 0,
            max_attempts,
            holder: None,
            holder_session: None,
            lease_until_ms: None,
            submitted_by: submitted_by.to_string(),
            body_sha256: body_digest(body),
            eligible,
            result: None,
            error: None,
            history: vec![HistoryEntry {
                state: TaskState::Queued,
                at: rfc3339::format_millis(now_ms),
                by: submitted_by.to_string(),
            }],
            progress: None,
            progress_n: 0,
            via_mig: false,
            msg_seq: None,
            result_sent: false,
            lettered: false,
            result_refused: false,
            use_id: None,
        }
    }

    /// The record as the task store keeps it: the members serde writes, in its order,
    /// with the same ones left out. Written by hand because every compare-and-set
    /// writes one, and serde's string escaping went byte by byte (about a tenth of
    /// the broker's instructions per task); `serde_json::to_vec` is the oracle of the
    /// unit test.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = String::with_capacity(512);
        // Member names are this file's constants, plain JSON.
        let member = |out: &mut String, name: &str| {
            if out.len() > 1 {
                out.push(',');
            }
            out.push('"');
            out.push_str(name);
            out.push_str("\":");
        };
        let number = |out: &mut String, n: i64| {
            if n < 0 {
                out.push('-');
            }
            push_decimal(out, n.unsigned_abs());
        };
        let value = |out: &mut String, v: &Value| {
            // A `Value` with string keys serialises without fail.
            out.push_str(&serde_json::to_string(v).unwrap_or_default());
        };
        out.push('{');
        member(&mut out, "id");
        push_json_str(&mut out, &self.id);
        member(&mut out, "job");
        push_json_str(&mut out, &self.job);
        member(&mut out, "state");
        push_json_str(&mut out, self.state.as_str());
        member(&mut out, "attempt");
        push_decimal(&mut out, self.attempt.into());
        member(&mut out, "max_attempts");
        push_decimal(&mut out, self.max_attempts.into());
        if let Some(holder) = &self.holder {
            member(&mut out, "holder");
            push_json_str(&mut out, holder);
        }
        if let Some(session) = &self.holder_session {
            member(&mut out, "holder_session");
            push_json_str(&mut out, session);
        }
        if let Some(until) = self.lease_until_ms {
            member(&mut out, "lease_until_ms");
            number(&mut out, until);
        }
        member(&mut out, "submitted_by");
        push_json_str(&mut out, &self.submitted_by);
        member(&mut out, "body_sha256");
        push_json_str(&mut out, &self.body_sha256);
        if let Some(eligible) = &self.eligible {
            member(&mut out, "eligible");
            out.push('{');
            if let Some(names) = &eligible.names {
                push_json_str(&mut out, "names");
                out.push_str(":[");
                for (i, name) in names.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    push_json_str(&mut out, name);
                }
                out.push(']');
            }
            if let Some(labels) = &eligible.labels {
                if eligible.names.is_some() {
                    out.push(',');
                }
                push_json_str(&mut out, "labels");
                out.push(':');
                push_json_str_map(&mut out, labels);
            }
            out.push('}');
        }
        for (name, v) in [("result", &self.result), ("error", &self.error)] {
            if let Some(v) = v {
                member(&mut out, name);
                value(&mut out, v);
            }
        }
        member(&mut out, "history");
        out.push('[');
        for (i, entry) in self.history.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str("{\"state\":");
            push_json_str(&mut out, entry.state.as_str());
            out.push_str(",\"at\":");
            push_json_str(&mut out, &entry.at);
            out.push_str(",\"by\":");
            push_json_str(&mut out, &entry.by);
            out.push('}');
        }
        out.push(']');
        if let Some(progress) = &self.progress {
            member(&mut out, "progress");
            value(&mut out, progress);
        }
        if self.progress_n != 0 {
            member(&mut out, "progress_n");
            push_decimal(&mut out, self.progress_n.into());
        }
        if self.via_mig {
            member(&mut out, "via_mig");
            out.push_str("true");
        }
        if let Some(seq) = self.msg_seq {
            member(&mut out, "msg_seq");
            push_decimal(&mut out, seq);
        }
        if self.result_sent {
            member(&mut out, "result_sent");
            out.push_str("true");
        }
        if self.result_refused {
            member(&mut out, "result_refused");
            out.push_str("true");
        }
        if self.lettered {
            member(&mut out, "lettered");
            out.push_str("true");
        }
        if let Some(use_id) = &self.use_id {
            member(&mut out, "use_id");
            push_json_str(&mut out, use_id);
        }
        out.push('}');
        out.into_bytes()
    }

    pub fn from_json(bytes: &[u8]) -> Result<TaskRecord, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Whether a resubmit of `job` with `body` is the same task.
    pub fn same_submission(&self, job: &str, body_sha256: &str) -> bool {
        self.job == job && self.body_sha256 == body_sha256
    }

    /// Whether a task message with `AMP-Task-Use` header `use_id`, from `from`
    /// (`ns/name`), of `job` with `body` (its JSON text) is this record's submission. A
    /// task id is free again once its record expired, and a message of its earlier use
    /// may outlive that record (a cancel that could not remove it, a copy of racing
    /// submits): it is not the new record's ([`TaskRecord::use_id`]). The use id tells
    /// uses apart but is no credential (whoever reads the record or its message has it),
    /// so the submitter, job and body must be the record's too; where the record or the
    /// message is an earlier release's and has no use id, they alone decide, which the
    /// same submitter sending the same job and body again passes.
    pub fn submitted_as(&self, use_id: Option<&str>, from: &str, job: &str, body: &str) -> bool {
        if let (Some(mine), Some(theirs)) = (self.use_id.as_deref(), use_id)
            && mine != theirs
        {
            return false;
        }
        self.submitted_by == from && self.job == job && self.body_is(body)
    }

    /// Whether `body` (JSON text) is the body this record was submitted with. Text in the
    /// form the digest is taken of (serde_json's compact form, keys sorted) is only
    /// hashed; any other is parsed: for a message not yet bound to the record (`msg_seq`)
    /// read from the store, and a dead letter, only.
    fn body_is(&self, body: &str) -> bool {
        canonical_digest(body) == self.body_sha256
            || serde_json::from_str::<Value>(body)
                .is_ok_and(|b| body_digest(&b) == self.body_sha256)
    }

    /// `id`, the message id of something this task's outcome stores (its `task_result`,
    /// its dead letter), made this use's own. The id was the task's alone: a later use of
    /// it (this record expired) was a duplicate of the earlier use's while that was still
    /// inside a stream's duplicate window, which an operator may lengthen past the
    /// record's lifetime, and its result or letter was never stored. A record of an
    /// earlier release, without a use id, keeps the id it published under.
    pub fn use_scoped(&self, id: &str) -> String {
        match &self.use_id {
            Some(u) => [id, ".", u].concat(),
            None => id.to_string(),
        }
    }

    /// Whether `other` is a record of the same use of the task id as this one, not one
    /// the id got when used again after this one expired: the same submission with the
    /// same `use_id`, or, for a record of an earlier release, made at the same moment.
    pub fn same_use(&self, other: &TaskRecord) -> bool {
        let submission = self.id == other.id
            && self.submitted_by == other.submitted_by
            && self.same_submission(&other.job, &other.body_sha256);
        match (&self.use_id, &other.use_id) {
            (Some(mine), Some(theirs)) => submission && mine == theirs,
            _ => submission && self.history.first() == other.history.first(),
        }
    }

    /// Whether participant `who` (`ns/name`) may read this record with `status` (spec 2.7):
    /// the submitter always, the lease holder while it holds the lease.
    pub fn may_see_status(&self, who: &str) -> bool {
        self.submitted_by == who
            || (self.state == TaskState::Leased && self.holder.as_deref() == Some(who))
    }

    /// Whether `session` holds a lease that has not run out at `now_ms`.
    pub fn leased_to(&self, session: &str, now_ms: i64) -> bool {
        self.state == TaskState::Leased
            && self.holder_session.as_deref() == Some(session)
            && self.lease_until_ms.is_some_and(|until| until > now_ms)
    }

    /// Whether `session` reported this record's outcome (`completed`, or `failed` by the
    /// holder).
    pub fn finished_by(&self, session: &str) -> bool {
        matches!(self.state, TaskState::Completed | TaskState::Failed)
            && self.holder_session.as_deref() == Some(session)
    }

    pub fn offered_to(&self, session: &str) -> bool {
        self.state == TaskState::Offered && self.holder_session.as_deref() == Some(session)
    }

    pub fn on_delivery(&self, now_ms: i64) -> OnDelivery {
        if self.state.is_terminal() {
            return OnDelivery::Finished;
        }
        if self.state == TaskState::Leased
            && let Some(until_ms) = self.lease_until_ms
            && until_ms > now_ms
        {
            return OnDelivery::Held { until_ms };
        }
        if self.attempt >= self.max_attempts {
            return OnDelivery::Exhaust;
        }
        OnDelivery::Offer
    }

    /// The record after `change` at `now_ms`, or why it does not apply.
    pub fn apply(&self, change: &Change<'_>, now_ms: i64) -> Result<TaskRecord, Refusal> {
        // Before the state: a stranger's cancel must not learn whether the task finished.
        if let Change::Cancel { by } = change
            && self.submitted_by != *by
        {
            return Err(Refusal::NotSubmitter);
        }
        let about_outcome = matches!(
            change,
            Change::ResultSent | Change::Lettered | Change::ResultRefused(_)
        );
        if self.state.is_terminal() && !about_outcome {
            return Err(Refusal::Finished(self.state));
        }
        let mut next = self.clone();
        match change {
            Change::Offer { to } => {
                match self.on_delivery(now_ms) {
                    OnDelivery::Offer => {}
                    OnDelivery::Held { until_ms } => return Err(Refusal::LeaseHeld { until_ms }),
                    OnDelivery::Finished => return Err(Refusal::Finished(self.state)),
                    OnDelivery::Exhaust => return Err(Refusal::LeaseLost),
                }
                if self.state == TaskState::Leased {
                    // The previous lease ran out unnoticed: record when it ended, so the
                    // history shows every lease as a closed interval.
                    let until = self.lease_until_ms.unwrap_or(now_ms);
                    let by = self.holder.clone().unwrap_or_default();
                    next.push_history(TaskState::Queued, until, &by);
                }
                next.state = TaskState::Offered;
                next.holder = Some(to.participant.to_string());
                next.holder_session = Some(to.session.to_string());
                next.lease_until_ms = None;
                next.push_history(TaskState::Offered, now_ms, to.participant);
            }
            Change::Requeue { by, offered_at_ms } => {
                next = self.with_offer(*by, *offered_at_ms)?;
                next.release();
                next.push_history(TaskState::Queued, now_ms, by.participant);
            }
            Change::Claim {
                by,
                lease_ms,
                offered_at_ms,
            } => {
                next = self.with_offer(*by, *offered_at_ms)?;
                if next.attempt >= next.max_attempts {
                    return Err(Refusal::LeaseLost);
                }
                next.state = TaskState::Leased;
                next.attempt += 1;
                next.holder = Some(by.participant.to_string());
                next.lease_until_ms = Some(now_ms + lease_ms);
                next.push_history(TaskState::Leased, now_ms, by.participant);
            }
            Change::Heartbeat {
                by,
                lease_ms,
                progress,
            } => {
                if !self.leased_to(by.session, now_ms) {
                    return Err(Refusal::LeaseLost);
                }
                next.lease_until_ms = Some(now_ms + lease_ms);
                if let Some(p) = progress {
                    next.progress = Some((*p).clone());
                    next.progress_n = next.progress_n.saturating_add(1);
                }
            }
            Change::Complete { by, result } => {
                if !self.leased_to(by.session, now_ms) {
                    return Err(Refusal::LeaseLost);
                }
                next.state = TaskState::Completed;
                next.lease_until_ms = None;
                next.result = result.clone();
                next.push_history(TaskState::Completed, now_ms, by.participant);
            }
            Change::Fail { by, error, retry } => {
                if !self.leased_to(by.session, now_ms) {
                    return Err(Refusal::LeaseLost);
                }
                next.error = Some(error.clone());
                if *retry && self.attempt < self.max_attempts {
                    next.release();
                    next.push_history(TaskState::Queued, now_ms, by.participant);
                } else {
                    next.state = TaskState::Failed;
                    next.lease_until_ms = None;
                    next.push_history(TaskState::Failed, now_ms, by.participant);
                }
            }
            Change::Exhaust { by } => {
                if self.on_delivery(now_ms) != OnDelivery::Exhaust {
                    return Err(Refusal::LeaseLost);
                }
                if self.state == TaskState::Leased {
                    let until = self.lease_until_ms.unwrap_or(now_ms);
                    let holder = self.holder.clone().unwrap_or_default();
                    next.push_history(TaskState::Queued, until, &holder);
                }
                next.state = TaskState::Failed;
                next.holder = None;
                next.holder_session = None;
                next.lease_until_ms = None;
                if next.error.is_none() {
                    next.error = Some(json!({
                        "code": "attempts_exhausted",
                        "message": format!("no attempt of {} completed the task", self.max_attempts),
                    }));
                }
                next.push_history(TaskState::Failed, now_ms, by);
            }
            Change::ResultSent => {
                // Said already, or nothing to say yet.
                if self.result_sent || !self.state.is_terminal() {
                    return Err(Refusal::Finished(self.state));
                }
                next.result_sent = true;
                next.result_refused = false;
            }
            Change::Lettered => {
                if self.lettered || self.state != TaskState::Failed {
                    return Err(Refusal::Finished(self.state));
                }
                next.lettered = true;
            }
            // Stored meanwhile (a repeat through another broker), or nothing to tell yet.
            Change::ResultRefused(_) if self.result_sent || !self.state.is_terminal() => {
                return Err(Refusal::Finished(self.state));
            }
            Change::ResultRefused(refused) => next.result_refused = refused.flag(self),
            Change::Cancel { by } => {
                if self.submitted_by != *by {
                    return Err(Refusal::NotSubmitter);
                }
                next.state = TaskState::Cancelled;
                next.holder = None;
                next.holder_session = None;
                next.lease_until_ms = None;
                next.push_history(TaskState::Cancelled, now_ms, by);
            }
        }
        Ok(next)
    }

    /// The record with the offer to `to` made at `at_ms`: as it is when the offer was
    /// written (to `to` and no one else), else as the offer would have written it.
    /// Refused when no offer could be made on it (someone else's running lease, an
    /// outcome, no attempts left).
    fn with_offer(&self, to: Actor<'_>, at_ms: i64) -> Result<TaskRecord, Refusal> {
        if self.state == TaskState::Offered {
            return if self.offered_to(to.session) {
                Ok(self.clone())
            } else {
                Err(Refusal::LeaseLost)
            };
        }
        self.apply(&Change::Offer { to }, at_ms)
            .map_err(|r| match r {
                Refusal::Finished(state) => Refusal::Finished(state),
                _ => Refusal::LeaseLost,
            })
    }

    fn release(&mut self) {
        self.state = TaskState::Queued;
        self.holder = None;
        self.holder_session = None;
        self.lease_until_ms = None;
    }

    fn push_history(&mut self, state: TaskState, at_ms: i64, by: &str) {
        if self.history.len() >= MAX_HISTORY {
            self.history.remove(1);
        }
        self.history.push(HistoryEntry {
            state,
            at: rfc3339::format_millis(at_ms),
            by: by.to_string(),
        });
    }

    /// The record as `status` shows it while an offer to `to` (`ns/name`) made at `at_ms`
    /// is out without having been written.
    pub fn with_unwritten_offer(&self, to: &str, at_ms: i64) -> TaskRecord {
        let mut r = self.clone();
        r.state = TaskState::Offered;
        r.holder = Some(to.to_string());
        r.push_history(TaskState::Offered, at_ms, to);
        r
    }

    /// The `task` member of a `status` answer.
    pub fn status_view(&self) -> Value {
        let mut v = json!({
            "id": self.id,
            "job": self.job,
            "state": self.state.as_str(),
            "attempt": self.attempt,
            "max_attempts": self.max_attempts,
            "submitted_by": self.submitted_by,
            "history": self.history,
        });
        if self.state != TaskState::Offered
            && let Some(h) = &self.holder
        {
            v["holder"] = json!(h);
        }
        if let Some(ms) = self.lease_until_ms {
            v["lease_until"] = json!(rfc3339::format_millis(ms));
        }
        if let Some(r) = &self.result {
            v["result"] = r.clone();
        }
        if let Some(e) = &self.error {
            v["error"] = e.clone();
        }
        v
    }

    /// The body of the `task_result` message sent to the submitter's inbox.
    pub fn result_body(&self) -> Value {
        let mut v = json!({
            "task": self.id,
            "state": self.state.as_str(),
            "attempts": self.attempt,
        });
        if self.state == TaskState::Completed {
            v["result"] = self.result.clone().unwrap_or(Value::Null);
        }
        if self.state == TaskState::Failed
            && let Some(e) = &self.error
        {
            v["error"] = e.clone();
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_800_000_000_000;
    const LEASE: i64 = 30_000;
    const W1: Actor = Actor {
        participant: "acme/w1",
        session: "b1/1",
    };
    const W2: Actor = Actor {
        participant: "acme/w2",
        session: "b2/7",
    };

    fn task(max_attempts: u32) -> TaskRecord {
        TaskRecord::submitted(
            "T",
            "render",
            "acme/app",
            &json!({"frame": 1}),
            max_attempts,
            None,
            T0,
        )
    }

    #[test]
    fn a_record_is_written_as_serde_would_write_it_and_read_back_the_same() {
        let plain = task(3);
        let mut full = task(1);
        full.id = "t\"q\\u\u{1}\u{7f}é\n".into();
        full.state = TaskState::Leased;
        full.attempt = 7;
        full.holder = Some("acme/w\"1".into());
        full.holder_session = Some("b1/1".into());
        full.lease_until_ms = Some(-5);
        full.eligible = Some(Eligible {
            names: Some(vec!["w1".into(), "w\t2".into()]),
            labels: Some(BTreeMap::from([("gpu".into(), "a\"100".into())])),
        });
        full.result = Some(json!({"a": [1, "x\u{2028}"], "b": null}));
        full.error = Some(json!({"code": "e", "message": "m"}));
        full.progress = Some(json!(0.5));
        full.progress_n = 3;
        full.via_mig = true;
        full.msg_seq = Some(u64::MAX);
        full.result_sent = true;
        full.lettered = true;
        full.result_refused = true;
        full.use_id = Some("u\"1".into());
        full.history.push(HistoryEntry {
            state: TaskState::Offered,
            at: "2027-01-15T08:00:00.000Z".into(),
            by: "acme/w\u{0}".into(),
        });
        let mut labels_only = task(2);
        labels_only.eligible = Some(Eligible {
            names: None,
            labels: Some(BTreeMap::new()),
        });
        labels_only.history.clear();
        let mut names_only = task(2);
        names_only.eligible = Some(Eligible {
            names: Some(vec![]),
            labels: None,
        });
        for r in [plain, full, labels_only, names_only] {
            let ours: Value = serde_json::from_slice(&r.to_json()).expect("valid JSON");
            let serde: Value = serde_json::to_value(&r).expect("serde");
            assert_eq!(ours, serde);
            assert_eq!(TaskRecord::from_json(&r.to_json()).expect("read back"), r);
        }
    }

    fn states(r: &TaskRecord) -> Vec<&'static str> {
        r.history.iter().map(|h| h.state.as_str()).collect()
    }

    #[test]
    fn a_task_goes_queued_offered_leased_completed() {
        let r = task(3);
        assert_eq!(r.on_delivery(T0), OnDelivery::Offer);
        let r = r.apply(&Change::Offer { to: W1 }, T0 + 1).expect("offer");
        assert_eq!(r.state, TaskState::Offered);
        assert_eq!(
            r.status_view().get("holder"),
            None,
            "an offer is not a lease"
        );
        let r = r
            .apply(
                &Change::Claim {
                    by: W1,
                    lease_ms: LEASE,
                    offered_at_ms: T0,
                },
                T0 + 2,
            )
            .expect("claim");
        assert_eq!(
            (r.state, r.attempt, r.lease_until_ms),
            (TaskState::Leased, 1, Some(T0 + 2 + LEASE))
        );
        assert_eq!(r.status_view()["holder"], "acme/w1");
        let r = r
            .apply(
                &Change::Heartbeat {
                    by: W1,
                    lease_ms: LEASE,
                    progress: None,
                },
                T0 + 10,
            )
            .expect("heartbeat");
        assert_eq!(r.lease_until_ms, Some(T0 + 10 + LEASE));
        let r = r
            .apply(
                &Change::Complete {
                    by: W1,
                    result: Some(json!({"ok": true})),
                },
                T0 + 20,
            )
            .expect("complete");
        assert_eq!(r.state, TaskState::Completed);
        assert_eq!(states(&r), ["queued", "offered", "leased", "completed"]);
        assert_eq!(
            r.result_body(),
            json!({"task":"T","state":"completed","attempts":1,"result":{"ok":true}})
        );
        assert_eq!(r.on_delivery(T0 + 30), OnDelivery::Finished);
        let back = TaskRecord::from_json(&r.to_json()).expect("round trip");
        assert_eq!(back, r);
    }

    #[test]
    fn an_offer_never_written_is_recorded_by_the_claim_or_the_decline() {
        let claim = |r: &TaskRecord, by, at| {
            r.apply(
                &Change::Claim {
                    by,
                    lease_ms: LEASE,
                    offered_at_ms: at - 4,
                },
                at,
            )
        };
        let r = claim(&task(3), W1, T0 + 5).expect("claim of a queued task");
        assert_eq!((r.state, r.attempt), (TaskState::Leased, 1));
        assert_eq!(states(&r), ["queued", "offered", "leased"]);
        assert_eq!(r.history[1].at, rfc3339::format_millis(T0 + 1));
        assert_eq!(r.history[1].by, "acme/w1");
        assert_eq!(r.lease_until_ms, Some(T0 + 5 + LEASE));
        assert_eq!(
            claim(&r, W2, T0 + 6),
            Err(Refusal::LeaseLost),
            "a running lease is nobody else's to claim"
        );
        let again = claim(&r, W2, T0 + 9 + LEASE).expect("claim after the lease ran out");
        assert_eq!(again.attempt, 2);
        assert_eq!(
            states(&again),
            ["queued", "offered", "leased", "queued", "offered", "leased"]
        );
        let declined = task(3)
            .apply(
                &Change::Requeue {
                    by: W1,
                    offered_at_ms: T0 + 1,
                },
                T0 + 2,
            )
            .expect("decline");
        assert_eq!((declined.state, declined.attempt), (TaskState::Queued, 0));
        assert_eq!(states(&declined), ["queued", "offered", "queued"]);
        let written = task(3).apply(&Change::Offer { to: W1 }, T0).expect("offer");
        assert_eq!(
            claim(&written, W2, T0 + 5),
            Err(Refusal::LeaseLost),
            "a written offer binds the claim to its session"
        );
        let cancelled = task(3)
            .apply(&Change::Cancel { by: "acme/app" }, T0)
            .expect("cancel");
        assert_eq!(
            claim(&cancelled, W1, T0 + 5),
            Err(Refusal::Finished(TaskState::Cancelled))
        );
    }

    #[test]
    fn only_a_finished_task_records_its_result_once() {
        let leased = task(3)
            .apply(
                &Change::Claim {
                    by: W1,
                    lease_ms: LEASE,
                    offered_at_ms: T0,
                },
                T0,
            )
            .expect("leased");
        assert_eq!(
            leased.apply(&Change::ResultSent, T0),
            Err(Refusal::Finished(TaskState::Leased))
        );
        let failed = leased
            .apply(
                &Change::Fail {
                    by: W1,
                    error: json!({"code":"x"}),
                    retry: false,
                },
                T0 + 1,
            )
            .expect("fail");
        let sent = failed.apply(&Change::ResultSent, T0 + 2).expect("sent");
        assert!(sent.result_sent && !failed.result_sent);
        assert_eq!(sent.history, failed.history, "no history entry");
        assert_eq!(
            sent.apply(&Change::ResultSent, T0 + 3),
            Err(Refusal::Finished(TaskState::Failed)),
            "once"
        );
        let cancelled = task(3)
            .apply(&Change::Cancel { by: "acme/app" }, T0)
            .expect("cancel");
        // A cancelled task's, when a repeat of its cancel stored it.
        let told = cancelled.apply(&Change::ResultSent, T0 + 1).expect("sent");
        assert!(told.result_sent && told.history == cancelled.history);
        assert!(told.apply(&Change::ResultSent, T0 + 2).is_err(), "once");
        // A refused result rewrites a finished record as it is, until one is stored.
        let every = Change::ResultRefused(Refused::Every);
        assert!(leased.apply(&every, T0).is_err());
        assert_eq!(failed.apply(&every, T0 + 2).as_ref(), Ok(&failed));
        assert!(sent.apply(&every, T0 + 3).is_err());
        // A cancelled task's says so, for a retry through any broker, until it is stored
        // or a publish may have landed.
        let refused = cancelled.apply(&every, T0 + 1).expect("refused");
        assert!(refused.result_refused && refused.history == cancelled.history);
        let maybe = Change::ResultRefused(Refused::Maybe);
        assert_eq!(refused.apply(&maybe, T0 + 2).as_ref(), Ok(&cancelled));
        // A refused repeat for a cancel answered `conflict` leaves it as it is.
        let keep = Change::ResultRefused(Refused::Keep);
        assert_eq!(refused.apply(&keep, T0 + 2).as_ref(), Ok(&refused));
        assert_eq!(cancelled.apply(&keep, T0 + 2).as_ref(), Ok(&cancelled));
        let stored = refused.apply(&Change::ResultSent, T0 + 2).expect("sent");
        assert!(stored.result_sent && !stored.result_refused);
        // Only a failed task has a dead letter, marked once, with no history entry.
        assert!(leased.apply(&Change::Lettered, T0).is_err());
        assert!(cancelled.apply(&Change::Lettered, T0).is_err());
        let lettered = failed.apply(&Change::Lettered, T0 + 2).expect("lettered");
        assert!(lettered.lettered && !lettered.result_sent && !failed.lettered);
        assert_eq!(lettered.history, failed.history, "no history entry");
        assert_eq!(
            lettered.apply(&Change::Lettered, T0 + 3),
            Err(Refusal::Finished(TaskState::Failed)),
            "once"
        );
    }

    #[test]
    fn an_outcome_names_the_session_that_reported_it() {
        let leased = task(3)
            .apply(&Change::Offer { to: W1 }, T0)
            .and_then(|r| {
                r.apply(
                    &Change::Claim {
                        by: W1,
                        lease_ms: LEASE,
                        offered_at_ms: T0,
                    },
                    T0,
                )
            })
            .expect("leased");
        assert!(!leased.finished_by(W1.session));
        let done = leased
            .apply(
                &Change::Complete {
                    by: W1,
                    result: None,
                },
                T0 + 1,
            )
            .expect("complete");
        assert!(done.finished_by(W1.session));
        assert!(!done.finished_by("b1/2"), "another session of w1");
        assert!(
            !done.leased_to(W1.session, T0 + 1),
            "no lease after the outcome"
        );
        let failed = leased
            .apply(
                &Change::Fail {
                    by: W1,
                    error: json!({"code":"x"}),
                    retry: false,
                },
                T0 + 1,
            )
            .expect("fail");
        assert!(failed.finished_by(W1.session));
        let requeued = leased
            .apply(
                &Change::Fail {
                    by: W1,
                    error: json!({"code":"x"}),
                    retry: true,
                },
                T0 + 1,
            )
            .expect("fail with retry");
        assert!(!requeued.finished_by(W1.session), "queued again: nobody's");
        let cancelled = leased
            .apply(&Change::Cancel { by: "acme/app" }, T0 + 1)
            .expect("cancel");
        assert!(!cancelled.finished_by(W1.session));
    }

    #[test]
    fn only_the_session_offered_the_task_can_claim_it() {
        let r = task(3).apply(&Change::Offer { to: W1 }, T0).expect("offer");
        let same_participant_other_session = Actor {
            participant: "acme/w1",
            session: "b1/2",
        };
        for by in [W2, same_participant_other_session] {
            assert_eq!(
                r.apply(
                    &Change::Claim {
                        by,
                        lease_ms: LEASE,
                        offered_at_ms: T0
                    },
                    T0
                ),
                Err(Refusal::LeaseLost)
            );
        }
    }

    #[test]
    fn a_stale_holder_loses_every_lease_operation_after_expiry() {
        let r = task(3)
            .apply(&Change::Offer { to: W1 }, T0)
            .and_then(|r| {
                r.apply(
                    &Change::Claim {
                        by: W1,
                        lease_ms: LEASE,
                        offered_at_ms: T0,
                    },
                    T0,
                )
            })
            .expect("leased");
        let late = T0 + LEASE;
        assert_eq!(
            r.apply(
                &Change::Heartbeat {
                    by: W1,
                    lease_ms: LEASE,
                    progress: None,
                },
                late
            ),
            Err(Refusal::LeaseLost)
        );
        assert_eq!(
            r.apply(
                &Change::Complete {
                    by: W1,
                    result: None
                },
                late
            ),
            Err(Refusal::LeaseLost)
        );
        assert_eq!(
            r.apply(
                &Change::Fail {
                    by: W1,
                    error: json!({}),
                    retry: true
                },
                late
            ),
            Err(Refusal::LeaseLost)
        );
        assert_eq!(
            r.apply(
                &Change::Complete {
                    by: W2,
                    result: None
                },
                T0 + 1
            ),
            Err(Refusal::LeaseLost),
            "not the holder"
        );
    }

    #[test]
    fn an_expired_lease_is_reoffered_and_the_history_closes_it() {
        let r = task(3)
            .apply(&Change::Offer { to: W1 }, T0)
            .and_then(|r| {
                r.apply(
                    &Change::Claim {
                        by: W1,
                        lease_ms: LEASE,
                        offered_at_ms: T0,
                    },
                    T0,
                )
            })
            .expect("leased");
        assert_eq!(
            r.on_delivery(T0 + 5),
            OnDelivery::Held {
                until_ms: T0 + LEASE
            }
        );
        assert_eq!(
            r.apply(&Change::Offer { to: W2 }, T0 + 5),
            Err(Refusal::LeaseHeld {
                until_ms: T0 + LEASE
            })
        );
        let r = r
            .apply(&Change::Offer { to: W2 }, T0 + LEASE + 100)
            .expect("re-offer");
        assert_eq!(
            states(&r),
            ["queued", "offered", "leased", "queued", "offered"]
        );
        assert_eq!(r.history[3].at, rfc3339::format_millis(T0 + LEASE));
        assert_eq!(r.history[3].by, "acme/w1");
        assert_eq!(r.attempt, 1, "expiry spends the attempt that was claimed");
    }

    #[test]
    fn the_last_expired_attempt_exhausts_the_task() {
        let r = task(1)
            .apply(&Change::Offer { to: W1 }, T0)
            .and_then(|r| {
                r.apply(
                    &Change::Claim {
                        by: W1,
                        lease_ms: LEASE,
                        offered_at_ms: T0,
                    },
                    T0,
                )
            })
            .expect("leased");
        let later = T0 + LEASE + 1;
        assert_eq!(r.on_delivery(later), OnDelivery::Exhaust);
        assert_eq!(
            r.apply(&Change::Offer { to: W2 }, later),
            Err(Refusal::LeaseLost)
        );
        let r = r
            .apply(&Change::Exhaust { by: "broker/b2" }, later)
            .expect("exhaust");
        assert_eq!(r.state, TaskState::Failed);
        assert_eq!(r.result_body()["error"]["code"], "attempts_exhausted");
        assert_eq!(r.result_body()["attempts"], 1);
    }

    #[test]
    fn fail_with_retry_requeues_until_attempts_run_out() {
        let lease = |r: TaskRecord, at| {
            r.apply(&Change::Offer { to: W1 }, at)
                .and_then(|r| {
                    r.apply(
                        &Change::Claim {
                            by: W1,
                            lease_ms: LEASE,
                            offered_at_ms: T0,
                        },
                        at,
                    )
                })
                .expect("leased")
        };
        let fail = |r: &TaskRecord, retry| {
            r.apply(
                &Change::Fail {
                    by: W1,
                    error: json!({"code":"oom"}),
                    retry,
                },
                T0 + 1,
            )
            .expect("fail")
        };
        let r = fail(&lease(task(2), T0), true);
        assert_eq!((r.state, r.attempt), (TaskState::Queued, 1));
        assert_eq!(r.holder, None);
        let r = fail(&lease(r, T0), true);
        assert_eq!((r.state, r.attempt), (TaskState::Failed, 2));
        assert_eq!(r.result_body()["error"]["code"], "oom");
        let r = fail(&lease(task(3), T0), false);
        assert_eq!(r.state, TaskState::Failed, "no retry asked");
    }

    #[test]
    fn a_decline_requeues_without_spending_an_attempt() {
        let r = task(3).apply(&Change::Offer { to: W1 }, T0).expect("offer");
        assert_eq!(
            r.apply(
                &Change::Requeue {
                    by: W2,
                    offered_at_ms: T0
                },
                T0
            ),
            Err(Refusal::LeaseLost)
        );
        let r = r
            .apply(
                &Change::Requeue {
                    by: W1,
                    offered_at_ms: T0,
                },
                T0,
            )
            .expect("decline");
        assert_eq!((r.state, r.attempt), (TaskState::Queued, 0));
        assert_eq!(r.on_delivery(T0), OnDelivery::Offer);
    }

    #[test]
    fn only_the_submitter_cancels_and_finished_tasks_stay_finished() {
        let r = task(3);
        assert_eq!(
            r.apply(&Change::Cancel { by: "acme/w1" }, T0),
            Err(Refusal::NotSubmitter)
        );
        let r = r
            .apply(&Change::Cancel { by: "acme/app" }, T0)
            .expect("cancel");
        assert_eq!(r.state, TaskState::Cancelled);
        assert_eq!(
            r.apply(&Change::Cancel { by: "acme/app" }, T0),
            Err(Refusal::Finished(TaskState::Cancelled))
        );
        assert_eq!(
            r.apply(&Change::Cancel { by: "acme/w1" }, T0),
            Err(Refusal::NotSubmitter),
            "a stranger does not learn that it finished"
        );
        assert_eq!(
            r.apply(&Change::Offer { to: W1 }, T0),
            Err(Refusal::Finished(TaskState::Cancelled))
        );
        assert_eq!(
            r.result_body(),
            json!({"task":"T","state":"cancelled","attempts":0})
        );
    }

    #[test]
    fn status_is_for_the_submitter_and_the_lease_holder_only() {
        let queued = task(3);
        assert!(queued.may_see_status("acme/app"));
        assert!(!queued.may_see_status("acme/w1"));
        let offered = queued.apply(&Change::Offer { to: W1 }, T0).expect("offer");
        assert!(!offered.may_see_status("acme/w1"), "an offer is no lease");
        let leased = offered
            .apply(
                &Change::Claim {
                    by: W1,
                    lease_ms: LEASE,
                    offered_at_ms: T0,
                },
                T0,
            )
            .expect("claim");
        assert!(leased.may_see_status("acme/w1"));
        assert!(!leased.may_see_status("acme/w2"));
        assert!(leased.may_see_status("acme/app"));
        let done = leased
            .apply(
                &Change::Complete {
                    by: W1,
                    result: None,
                },
                T0,
            )
            .expect("complete");
        assert!(!done.may_see_status("acme/w1"));
        assert!(done.may_see_status("acme/app"));
    }

    #[test]
    fn resubmits_are_recognised_by_job_and_canonical_body() {
        let r = task(3);
        assert!(r.same_submission("render", &body_digest(&json!({"frame": 1}))));
        assert!(!r.same_submission("render", &body_digest(&json!({"frame": 2}))));
        assert!(!r.same_submission("encode", &body_digest(&json!({"frame": 1}))));
        let a: Value = serde_json::from_str(r#"{"a":1,"b":[true,null]}"#).expect("json");
        let b: Value = serde_json::from_str(r#"{ "b": [true, null], "a": 1 }"#).expect("json");
        assert_eq!(body_digest(&a), body_digest(&b));
    }

    #[test]
    fn a_use_of_a_task_id_is_told_by_its_use_id_not_by_its_submission() {
        // Two uses by one submitter of one job and body, made in the same millisecond
        // (two brokers' clocks apart by the time between them).
        let mut first = task(3);
        first.use_id = Some("one".into());
        let mut again = task(3);
        again.use_id = Some("two".into());
        assert!(!first.same_use(&again));
        assert!(first.same_use(&first.clone()));
        let body = r#"{"frame":1}"#;
        assert!(first.submitted_as(Some("one"), "acme/app", "render", body));
        assert!(!again.submitted_as(Some("one"), "acme/app", "render", body));
        // A record or a message of an earlier release has none: the submission decides.
        let old = task(3);
        assert!(old.same_use(&first) && first.same_use(&old));
        assert!(old.submitted_as(Some("one"), "acme/app", "render", body));
        assert!(first.submitted_as(None, "acme/app", "render", body));
        assert!(!first.submitted_as(None, "acme/app", "render", r#"{"frame":2}"#));
        assert!(!first.submitted_as(None, "acme/bob", "render", body));
        // The use id is no credential: with it, another submitter, job or body is not
        // this record's either; the same body spelt otherwise is.
        assert!(!first.submitted_as(Some("one"), "acme/bob", "render", body));
        assert!(!first.submitted_as(Some("one"), "acme/app", "encode", body));
        assert!(!first.submitted_as(Some("one"), "acme/app", "render", r#"{"frame":2}"#));
        assert!(first.submitted_as(Some("one"), "acme/app", "render", r#"{ "frame": 1 }"#));
        let mut other = first.clone();
        other.submitted_by = "acme/bob".into();
        assert!(!first.same_use(&other));
    }

    #[test]
    fn eligibility_matches_names_and_every_label() {
        let labels = BTreeMap::from([("gpu".to_string(), "a100".to_string())]);
        assert!(Eligible::default().admits("w1", &BTreeMap::new()));
        let by_name = Eligible {
            names: Some(vec!["w1".into(), "w2".into()]),
            labels: None,
        };
        assert!(by_name.admits("w2", &labels));
        assert!(!by_name.admits("w3", &labels));
        let by_label = Eligible {
            names: None,
            labels: Some(labels.clone()),
        };
        assert!(by_label.admits("w3", &labels));
        assert!(!by_label.admits("w3", &BTreeMap::new()));
        let other = BTreeMap::from([("gpu".to_string(), "h100".to_string())]);
        assert!(!by_label.admits("w3", &other));
    }

    #[test]
    fn history_is_bounded_and_keeps_the_submission() {
        let mut r = task(3);
        for i in 0..(MAX_HISTORY as i64 * 2) {
            r = r
                .apply(&Change::Offer { to: W1 }, T0 + i)
                .and_then(|r| {
                    r.apply(
                        &Change::Requeue {
                            by: W1,
                            offered_at_ms: T0,
                        },
                        T0 + i,
                    )
                })
                .expect("offer and decline");
        }
        assert_eq!(r.history.len(), MAX_HISTORY);
        assert_eq!(r.history[0].by, "acme/app");
        assert_eq!(r.history[0].state, TaskState::Queued);
    }
}
