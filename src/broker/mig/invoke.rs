//! INVOKE as an AMP task (mig-nats.md section 4): which job a request names, the task id
//! it gets, and how the task's outcome reads as a MIG answer.

use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::amp::Body;
use crate::amp::frame::{Headers, Submit};
use crate::broker::config::{Config, Participant};
use crate::broker::held_bytes::Hold;
use crate::broker::in_flight::Ticket;
use crate::broker::permissions::{self, Action};
use crate::broker::task_store::{self, TaskRecord, TaskState};

use super::cancel::CancelRequest;
use super::envelope::{Code, Echo, Header, MigError};

/// One INVOKE as it arrived.
pub struct Request<'a> {
    pub ns: &'a str,
    pub caller: &'a str,
    pub participant: &'a Participant,
    pub capability: &'a str,
    pub reply: &'a str,
    pub header: &'a Header,
    pub body: &'a Map<String, Value>,
}

/// How far an invocation got. Ordered: a later stage has done what the earlier did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// Reading the task record (a retry finds its first try's task).
    Looking,
    /// Waiting for the caller's task budget to be read or reserved.
    Budget,
    /// Counting the job's queue against `max_queued`.
    Counting,
    /// The submit is with the jobs engine.
    Submitting,
    /// The task exists; its record's changes are watched.
    Waiting,
}

pub struct Invocation {
    pub ns: String,
    pub caller: String,
    pub capability: String,
    pub job: String,
    pub task: String,
    pub reply: String,
    pub echo: Echo,
    pub received: Instant,
    pub deadline: Instant,
    pub stage: Stage,
    /// The task record's subject, whose messages only say that it may have changed.
    pub watch: Option<crate::nats::Sid>,
    /// Reads of the task record out.
    pub reads: u32,
    /// The record's subject had a message while a read was out: read it once more after.
    pub stale: bool,
    /// Later reads left for the last message on the record's subject that the store has
    /// not shown yet, and whether one is due.
    pub rechecks: u8,
    pub recheck_due: bool,
    /// A keyed invocation listens for cancels other brokers forward
    /// ([`super::subjects::forwarded_cancel_subject`]).
    pub cancel_watch: Option<crate::nats::Sid>,
    /// The payload's text from acceptance until the submit takes it, held against the
    /// bound on bytes waiting for JetStream (`held_bytes.rs`). It was kept parsed, and
    /// counted nowhere, until the invocation ended: up to `mig.max_deadline_ms`, 1,024
    /// invocations a caller.
    pub payload: Option<(Body, Hold)>,
    /// The payload's `body_sha256`, all a task record is checked against once the task
    /// exists.
    pub digest: String,
    pub headers: Headers,
    pub cancel_reason: Option<String>,
    /// A cancel that came while the submit was out.
    pub cancel_after_submit: Option<CancelRequest>,
    /// For `server_stream`: where frames go and how far they got.
    pub stream: Option<Stream>,
    /// Its place in its caller's requests in flight until its task exists (claim, record
    /// read, budget, queue count, submit): it then only waits.
    pub ticket: Option<Ticket>,
    /// Its message id is held for it in `AMP_MIG_SEEN` (a stream's, or a keyed invoke's
    /// its caller chose).
    pub claimed: bool,
}

/// The frames of one streaming invoke.
pub struct Stream {
    pub subject: String,
    /// `header.meta["amp.seq"]` of the last frame sent (the `started` reply is 1).
    pub seq: u64,
    /// `progress_n` of the task record when its last progress frame was sent.
    pub progress_n: u32,
}

/// What an accepted invoke is: the job, whether the caller asked for a stream, and the
/// payload as the submit sends it.
pub struct Accepted {
    pub job: String,
    pub streaming: bool,
    pub payload: Body,
}

/// The job the request may invoke, or the MIG error that refuses it.
pub fn accept(config: &Config, r: &Request<'_>) -> Result<Accepted, MigError> {
    if let Some(named) = r.body.get("capability")
        && named.as_str() != Some(r.capability)
    {
        return Err(MigError::new(
            Code::InvalidRequest,
            "capability is not the capability of the subject",
        ));
    }
    let found = config
        .namespaces
        .get(r.ns)
        .into_iter()
        .flat_map(|n| n.jobs.iter())
        .find(|(_, j)| j.mig.as_ref().is_some_and(|c| c.id == r.capability));
    let Some((job, j)) = found else {
        return Err(MigError::new(
            Code::UnsupportedCapability,
            format!("tenant `{}` has no capability `{}`", r.ns, r.capability),
        ));
    };
    if !permissions::allows(&r.participant.permissions, Action::Submit, job) {
        return Err(MigError::new(
            Code::Forbidden,
            format!("invoking `{}` is not permitted", r.capability),
        )
        .detail("amp_code", json!("forbidden")));
    }
    let Some(payload @ Value::Object(_)) = r.body.get("payload") else {
        return Err(MigError::new(
            Code::InvalidRequest,
            "payload is required and must be a JSON object",
        ));
    };
    let streaming = match r.body.get("stream_preference") {
        None | Some(Value::Null) => false,
        Some(Value::String(mode)) if mode == "unary" => false,
        Some(Value::String(mode)) if mode == "server_stream" => true,
        Some(mode) => {
            return Err(MigError::new(
                Code::UnsupportedCapability,
                format!("stream_preference {mode} is not available on this broker"),
            ));
        }
    };
    if streaming {
        let declared = j
            .mig
            .as_ref()
            .is_some_and(|c| c.modes.iter().any(|m| m == "server_stream"));
        if !declared {
            return Err(MigError::new(
                Code::UnsupportedCapability,
                "server_stream is not a mode of this capability",
            ));
        }
        // The stream id is the message id, and it is a subject token.
        if !is_token(&r.header.message_id) {
            return Err(MigError::new(
                Code::InvalidRequest,
                "a streaming invoke's message_id must be one subject token (no `.`, `*`, `>` or spaces)",
            ));
        }
    }
    Ok(Accepted {
        job: job.clone(),
        streaming,
        payload: Body::from_value(payload),
    })
}

/// A single NATS subject token.
pub fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b > b' ' && b != b'.' && b != b'*' && b != b'>' && b != 0x7f)
}

/// The task id of an invocation: a digest of the caller and its `idempotency_key` (else
/// its `message_id`), so one caller's key always names one task, across brokers and
/// restarts, and no two callers (or a key and a message id) share one. Fields are length
/// prefixed, so the encoding before hashing is injective.
pub fn task_id(ns: &str, caller: &str, idempotency_key: Option<&str>, message_id: &str) -> String {
    let (kind, value) = match idempotency_key {
        Some(k) => ("key", k),
        None => ("msg", message_id),
    };
    let mut h = Sha256::new();
    for part in ["mig", ns, caller, kind, value] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    format!(
        "mig-{}",
        data_encoding::BASE32_NOPAD
            .encode(&digest)
            .to_ascii_lowercase()
    )
}

/// The answer of an invoke whose task was cancelled.
pub fn cancelled(reason: &str) -> MigError {
    let mut e = MigError::new(Code::Timeout, format!("cancelled: {reason}"));
    e.retryable = Some(false);
    e
}

/// The task headers of an invocation that describe the invocation itself (its ids,
/// capability and deadline), all but `traceparent`: a redrive of its dead letter is a
/// task no invocation waits for, and drops them (`jobs::letters`).
pub const INVOCATION_HEADERS: [&str; 7] = [
    "mig_version",
    "message_id",
    "tenant_id",
    "session_id",
    "mig_capability",
    "deadline_ms",
    "idempotency_key",
];

impl Invocation {
    /// `hold` holds the bytes of `accepted.payload`.
    pub fn new(
        r: &Request<'_>,
        accepted: Accepted,
        hold: Hold,
        deadline_ms: u64,
        now: Instant,
    ) -> Invocation {
        let h = r.header;
        let task = task_id(r.ns, r.caller, h.idempotency_key.as_deref(), &h.message_id);
        let mut headers = Headers::new();
        headers.insert("mig_version".into(), super::envelope::MIG_VERSION.into());
        headers.insert("message_id".into(), h.message_id.clone());
        headers.insert("tenant_id".into(), h.tenant_id.clone());
        headers.insert("mig_capability".into(), r.capability.to_string());
        headers.insert("deadline_ms".into(), deadline_ms.to_string());
        for (k, v) in [
            ("session_id", &h.session_id),
            ("traceparent", &h.traceparent),
            ("idempotency_key", &h.idempotency_key),
        ] {
            if let Some(v) = v {
                headers.insert(k.into(), v.clone());
            }
        }
        Invocation {
            ns: r.ns.to_string(),
            caller: r.caller.to_string(),
            capability: r.capability.to_string(),
            job: accepted.job,
            stream: accepted.streaming.then(|| Stream {
                subject: format!("{}.{}.stream.{}", super::subjects::ROOT, r.ns, h.message_id),
                seq: 0,
                progress_n: 0,
            }),
            task,
            reply: r.reply.to_string(),
            echo: Echo::of(h),
            received: now,
            deadline: crate::deadline::after(now, Duration::from_millis(deadline_ms)),
            stage: Stage::Looking,
            watch: None,
            reads: 0,
            stale: false,
            rechecks: 0,
            recheck_due: false,
            // `Body::from_value` writes serde_json's compact form, which the store hashes.
            digest: task_store::canonical_digest(accepted.payload.get()),
            payload: Some((accepted.payload, hold)),
            headers,
            cancel_reason: None,
            cancel_watch: None,
            cancel_after_submit: None,
            ticket: None,
            claimed: false,
        }
    }

    /// Its task exists: it waits for the task's outcome, reading the task's record only
    /// when the record changes.
    pub fn waits(&mut self) {
        self.stage = Stage::Waiting;
        self.ticket = None;
        // A retry that found its first try's task never submits it.
        self.payload = None;
    }

    pub fn submit_frame(&self, body: Body) -> Submit {
        Submit {
            id: "submit".to_string(),
            job: self.job.clone(),
            body,
            task: Some(self.task.clone()),
            max_attempts: None,
            eligible: None,
            headers: self.headers.clone(),
        }
    }

    /// A finished task's record as the invoke's answer.
    pub fn outcome(&self, record: &TaskRecord) -> Result<Value, MigError> {
        match record.state {
            TaskState::Completed => Ok(json!({
                "capability": self.capability,
                "payload": record.result.clone().unwrap_or(Value::Null),
            })),
            TaskState::Cancelled => Err(cancelled(
                self.cancel_reason
                    .as_deref()
                    .unwrap_or("the task was cancelled"),
            )),
            _ => Err(failure(record)),
        }
    }
}

/// A failed task: a worker's MIG code passes through, anything else is `MIG_INTERNAL`.
fn failure(record: &TaskRecord) -> MigError {
    let error = record.error.clone().unwrap_or(Value::Null);
    let code = error.get("code").and_then(Value::as_str).unwrap_or("");
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("the task failed");
    let mig = Code::parse(code).unwrap_or(Code::Internal);
    MigError::new(mig, message)
        .detail("task", json!(record.id))
        .detail("attempts", json!(record.attempt))
        .detail("worker_error", error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_ids_are_per_caller_and_key() {
        let a = task_id("acme", "bob", Some("k1"), "m1");
        assert_eq!(a, task_id("acme", "bob", Some("k1"), "m2"));
        assert_ne!(a, task_id("acme", "ann", Some("k1"), "m1"));
        assert_ne!(a, task_id("acme", "bob", None, "k1"));
        assert_ne!(task_id("a", "bc", None, "x"), task_id("ab", "c", None, "x"));
        assert!(a.len() <= 128 && a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    }
}
