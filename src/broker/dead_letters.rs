//! Dead letters (mig-nats.md section 6): a task that ends `failed` with no attempts left is
//! copied, with its last error, its attempts and its original body, to
//! `amp.<ns>.dlq.<job>` in `AMP_DLQ_<ns>` before its task message is terminated. AMP
//! `dead_letters` lists a job's letters and `redrive` submits one again as a new task.
//!
//! The letter is read from the task message itself (`STREAM.MSG.GET` by the sequence in
//! its ack subject), so no broker keeps task bodies while they run. The letter's
//! `Nats-Msg-Id` is the task id and its use (`TaskRecord::use_scoped`): a redelivery
//! after a crash between the letter and the terminate stores nothing twice, and a later
//! use of the id stores its own.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::envelope::EnvelopeView;
use super::task_store::{Eligible, TaskRecord, TaskState};
use crate::proto::headers::HeaderMap;

/// Letters in one `dead_letters` answer, at most.
pub const PAGE: usize = 20;
/// Stored letters one `dead_letters` request reads, visible to the caller or not; past it
/// the answer ends early with its `next` cursor.
pub const SCAN: usize = 200;
/// The letters of one answer stop growing past this many bytes (one letter always fits),
/// or past a quarter of what the asker may be sent at once if that is less.
pub const PAGE_BYTES: usize = 256 * 1024;

/// Whether a stored outcome is one that is dead-lettered: failed with every attempt spent.
/// A worker's `fail` with `retry: false` before the last attempt is its own verdict on the
/// task and is not.
pub fn is_dead(record: &TaskRecord) -> bool {
    record.state == TaskState::Failed && record.attempt >= record.max_attempts
}

/// A part of a letter that may be left out for it to fit in one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Body,
    Eligible,
    Headers,
    Error,
}

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Body => "body",
            Part::Eligible => "eligible",
            Part::Headers => "headers",
            Part::Error => "error",
        }
    }
}

/// The order [`Letter::fit`] leaves parts out in: the body first (the largest as a rule),
/// then what says least about why the task failed; the error last.
const OMITTABLE: [Part; 4] = [Part::Body, Part::Eligible, Part::Headers, Part::Error];

/// The parts [`Letter::fit_view`] leaves out, in [`OMITTABLE`] order: a view does not
/// show `eligible`, so leaving it out would only flag it.
const SHOWN: [Part; 3] = [Part::Body, Part::Headers, Part::Error];

/// One stored dead letter.
#[derive(Debug, Serialize, Deserialize)]
pub struct Letter {
    pub task: String,
    pub job: String,
    /// `ns/name` of the submitter.
    pub submitted_by: String,
    pub attempts: u32,
    pub max_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eligible: Option<Eligible>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub body: Box<RawValue>,
    /// The body did not fit in a stored letter (`body` is `null`): the letter keeps the
    /// failure, and the task cannot be redriven from it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_omitted: bool,
    /// As `body_omitted`, for the other parts [`Letter::fit`] may leave out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eligible_omitted: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub headers_omitted: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub error_omitted: bool,
    /// When the task failed (RFC 3339).
    pub failed_at: String,
}

impl Letter {
    /// The letter of failed task `record`, whose stored task message is `task_message`
    /// (its `AMP-Task-Use` header `use_id`).
    pub fn new(
        record: &TaskRecord,
        task_message: &[u8],
        use_id: Option<&str>,
        failed_at: String,
    ) -> Result<Letter, String> {
        let env = EnvelopeView::parse(task_message)
            .map_err(|e| format!("the task message is not an envelope: {e}"))?;
        if env.id.as_str() != record.id {
            return Err(format!(
                "the message holds task `{}`, not `{}`",
                env.id.as_str(),
                record.id
            ));
        }
        // A message of an earlier use of the id would be redriven as this task's.
        let job = env.job.as_ref().map_or("", |j| j.as_str());
        if !record.submitted_as(use_id, env.from.as_str(), job, env.body.get()) {
            return Err(format!(
                "the message of task `{}` is of another submission",
                record.id
            ));
        }
        Ok(Letter {
            task: record.id.clone(),
            job: record.job.clone(),
            submitted_by: record.submitted_by.clone(),
            attempts: record.attempt,
            max_attempts: record.max_attempts,
            error: record.error.clone(),
            eligible: record.eligible.clone(),
            headers: env
                .headers
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), v.as_str().to_string()))
                .collect(),
            body: env.body.to_raw(),
            body_omitted: false,
            eligible_omitted: false,
            headers_omitted: false,
            error_omitted: false,
            failed_at,
        })
    }

    /// The letter as stored, in at most `max` bytes: parts are left out in [`OMITTABLE`]
    /// order until it fits. The task fitted in a message, but its letter adds its record's
    /// `eligible` and error to its body and headers, each of which may be near the limit.
    /// `None`: it does not fit even without them.
    pub fn fit(&mut self, max: usize) -> Option<Vec<u8>> {
        let (json, fits) = self.fit_with(&OMITTABLE, max, Letter::to_json);
        fits.then_some(json)
    }

    /// Its [`view`](Self::view) as entry `seq` of a page, in at most `max` bytes: parts
    /// left out as [`fit`](Self::fit) does (but `eligible`, which a view does not show).
    /// Should even its ids alone be more, as small as it gets.
    pub fn fit_view(&mut self, seq: u64, max: usize) -> String {
        self.fit_with(&SHOWN, max, |l| l.view(seq)).0
    }

    /// `show(self)` with `parts` left out in order until it takes at most `max` bytes:
    /// the text as small as it got, and whether it fits.
    fn fit_with<T: AsRef<[u8]>>(
        &mut self,
        parts: &[Part],
        max: usize,
        show: impl Fn(&Letter) -> T,
    ) -> (T, bool) {
        let mut text = show(self);
        for &part in parts {
            if text.as_ref().len() <= max {
                return (text, true);
            }
            if self.omit(part) {
                text = show(self);
            }
        }
        let fits = text.as_ref().len() <= max;
        (text, fits)
    }

    /// Leaves `part` out; `false` if there was nothing to leave out.
    fn omit(&mut self, part: Part) -> bool {
        match part {
            Part::Body => match RawValue::from_string("null".to_string()) {
                // A `null` body is the whole task's: nothing is left out.
                Ok(null) if self.body.get() != "null" => {
                    self.body = null;
                    self.body_omitted = true;
                }
                _ => return false,
            },
            Part::Eligible => {
                if self.eligible.take().is_none() {
                    return false;
                }
                self.eligible_omitted = true;
            }
            Part::Headers => {
                if self.headers.is_empty() {
                    return false;
                }
                self.headers.clear();
                self.headers_omitted = true;
            }
            Part::Error => {
                if self.error.take().is_none() {
                    return false;
                }
                self.error_omitted = true;
            }
        }
        true
    }

    /// The parts left out of it.
    pub fn omitted(&self) -> Vec<Part> {
        OMITTABLE
            .into_iter()
            .filter(|part| match part {
                Part::Body => self.body_omitted,
                Part::Eligible => self.eligible_omitted,
                Part::Headers => self.headers_omitted,
                Part::Error => self.error_omitted,
            })
            .collect()
    }

    /// Whether a redrive can submit its task as it was: a task without its body, headers
    /// or `eligible` (which may keep it from workers it must not reach) is another task.
    pub fn redrivable(&self) -> bool {
        self.omitted().iter().all(|p| *p == Part::Error)
    }

    pub fn parse(stored: &[u8]) -> Result<Letter, serde_json::Error> {
        serde_json::from_slice(stored)
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Strings, maps and already-valid JSON always serialise.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The headers it is stored with, under message id `msg_id`.
    pub fn headers(&self, broker: &str, msg_id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let from = format!("broker/{broker}");
        for (k, v) in [
            ("Nats-Msg-Id", msg_id),
            ("AMP-From", from.as_str()),
            ("AMP-Kind", "dead_letter"),
        ] {
            // Task ids and broker ids are header-safe tokens.
            let _ = h.insert(k, v);
        }
        h
    }

    /// Whether participant `who` (`ns/name`) may read it: its submitter, or anyone who may
    /// serve the job (workers see task bodies in offers anyway). Another submitter's task
    /// body is not for everyone who may submit.
    pub fn visible_to(&self, who: &str, may_serve: bool) -> bool {
        may_serve || self.submitted_by == who
    }

    /// The entry of a `dead_letters` answer (JSON text). The body is the text stored, as
    /// a message's is sent: parsed and written again its numbers would be spelt another
    /// way (`9E15` as `9000000000000000.0`), and a page sized by what is stored would be
    /// sent larger.
    pub fn view(&self, seq: u64) -> String {
        let view = View {
            seq,
            task: &self.task,
            job: &self.job,
            submitted_by: &self.submitted_by,
            attempts: self.attempts,
            max_attempts: self.max_attempts,
            failed_at: &self.failed_at,
            headers: &self.headers,
            body: &self.body,
            error: self.error.as_ref(),
            body_omitted: self.body_omitted,
            eligible_omitted: self.eligible_omitted,
            headers_omitted: self.headers_omitted,
            error_omitted: self.error_omitted,
        };
        // Strings, maps and already-valid JSON always serialise; `null` keeps a page
        // valid JSON all the same.
        serde_json::to_string(&view).unwrap_or_else(|_| "null".to_string())
    }

    /// The id of the task `redriver`'s redrive of letter `seq` submits. Derived, so a
    /// retried redrive (its answer lost) is answered `dup` with the same task instead of
    /// making a second; the original task id is part of it, so a recreated stream's
    /// sequences never name an older letter's redrive; the redriver too, so one who sees
    /// the letter (a worker) cannot take the id from another (its submitter).
    pub fn redrive_task(&self, seq: u64, redriver: &str) -> String {
        let mut h = Sha256::new();
        for part in ["redrive", self.task.as_str(), &seq.to_string(), redriver] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        let digest = h.finalize();
        let hex: String = digest[..12].iter().map(|b| format!("{b:02x}")).collect();
        format!("redrive-{hex}")
    }

    /// The MIG message published on `mig.v0_1.<ns>.dlq.<capability>` (JSON text). Its
    /// `payload` is the body as stored, as [`view`](Self::view) shows it.
    pub fn mig_message(&self, ns: &str, capability: &str, seq: u64, message_id: &str) -> String {
        let notice = Notice {
            header: NoticeHeader {
                mig_version: super::mig::envelope::MIG_VERSION,
                tenant_id: ns,
                message_id,
                timestamp: &self.failed_at,
            },
            capability,
            sequence: seq,
            task_id: &self.task,
            attempts: self.attempts,
            error: self.error.as_ref(),
            payload: &self.body,
        };
        // As in `view`: strings, maps and already-valid JSON always serialise.
        serde_json::to_string(&notice).unwrap_or_else(|_| "null".to_string())
    }
}

/// [`Letter::mig_message`].
#[derive(Serialize)]
struct Notice<'a> {
    header: NoticeHeader<'a>,
    capability: &'a str,
    sequence: u64,
    task_id: &'a str,
    attempts: u32,
    error: Option<&'a Value>,
    payload: &'a RawValue,
}

#[derive(Serialize)]
struct NoticeHeader<'a> {
    mig_version: &'a str,
    tenant_id: &'a str,
    message_id: &'a str,
    timestamp: &'a str,
}

/// [`Letter::view`]: the letter without `eligible`, with its sequence.
#[derive(Serialize)]
struct View<'a> {
    seq: u64,
    task: &'a str,
    job: &'a str,
    submitted_by: &'a str,
    attempts: u32,
    max_attempts: u32,
    failed_at: &'a str,
    headers: &'a BTreeMap<String, String>,
    body: &'a RawValue,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a Value>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    body_omitted: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    eligible_omitted: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    headers_omitted: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    error_omitted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(state: TaskState, attempt: u32, max: u32) -> TaskRecord {
        let mut r = TaskRecord::submitted("T1", "infer", "acme/alice", &json!(1), max, None, 0);
        r.state = state;
        r.attempt = attempt;
        r.error = Some(json!({"code": "boom"}));
        r
    }

    /// `l`'s entry of a page, parsed.
    fn shown(l: &Letter, seq: u64) -> Value {
        serde_json::from_str(&l.view(seq)).expect("a view is JSON")
    }

    /// `r` as submitted with `body`.
    fn with_body(mut r: TaskRecord, body: &Value) -> TaskRecord {
        r.body_sha256 = super::super::task_store::body_digest(body);
        r
    }

    #[test]
    fn only_failures_with_no_attempt_left_are_dead() {
        assert!(is_dead(&record(TaskState::Failed, 3, 3)));
        assert!(!is_dead(&record(TaskState::Failed, 1, 3)), "retry: false");
        assert!(!is_dead(&record(TaskState::Completed, 3, 3)));
        assert!(!is_dead(&record(TaskState::Cancelled, 3, 3)));
    }

    #[test]
    fn a_letter_keeps_the_body_headers_and_last_error_of_its_own_task() {
        let r = with_body(record(TaskState::Failed, 2, 2), &json!({"n":[1,2]}));
        let msg = br#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","headers":{"traceparent":"00-x"},"body":{"n":[1,2]}}"#;
        let l = Letter::new(&r, msg, None, "2026-12-03T00:00:00.000Z".into()).expect("letter");
        let back = Letter::parse(&l.to_json()).expect("parse");
        assert_eq!(back.body.get(), r#"{"n":[1,2]}"#);
        assert_eq!(back.headers["traceparent"], "00-x");
        assert_eq!(shown(&back, 7)["error"]["code"], "boom");
        assert_eq!(shown(&back, 7)["seq"], 7);
        let other = br#"{"id":"T2","kind":"task","from":"acme/alice","ts":"t","body":1}"#;
        assert!(Letter::new(&r, other, None, String::new()).is_err());
        assert!(Letter::new(&r, b"not json", None, String::new()).is_err());
    }

    #[test]
    fn a_letter_is_made_of_its_own_submission_only() {
        // A task id is free again once its record expired; a message of its earlier
        // use, still queued, is not this task's, and redriven it would run that body.
        let r = record(TaskState::Failed, 1, 1);
        let own =
            br#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","body":1}"#;
        assert!(Letter::new(&r, own, None, String::new()).is_ok());
        for earlier in [
            r#"{"id":"T1","kind":"task","from":"acme/mallory","job":"infer","ts":"t","body":1}"#,
            r#"{"id":"T1","kind":"task","from":"acme/alice","job":"render","ts":"t","body":1}"#,
            r#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","body":2}"#,
        ] {
            let e = Letter::new(&r, earlier.as_bytes(), None, String::new());
            assert!(e.is_err(), "{earlier}");
        }
        // Its use told by the message's header: even the same submission of another
        // use is not this task's.
        let mut r = r;
        r.use_id = Some("u2".into());
        assert!(Letter::new(&r, own, Some("u2"), String::new()).is_ok());
        assert!(Letter::new(&r, own, Some("u1"), String::new()).is_err());
    }

    #[test]
    fn a_letter_leaves_out_only_what_it_must_body_first_and_says_so() {
        let big = "x".repeat(3000);
        let mut r = with_body(record(TaskState::Failed, 2, 2), &json!({ "big": big }));
        r.eligible = Some(Eligible {
            names: Some(vec!["w".repeat(64); 40]),
            labels: None,
        });
        let msg = format!(
            r#"{{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","headers":{{"h":"{}"}},"body":{{"big":"{big}"}}}}"#,
            "h".repeat(2000),
        );
        let whole = Letter::new(&r, msg.as_bytes(), None, String::new()).expect("letter");
        let size = whole.to_json().len();
        assert!(!String::from_utf8_lossy(&whole.to_json()).contains("_omitted"));
        assert!(whole.redrivable());

        // Room for all of it: nothing left out.
        let mut l = Letter::parse(&whole.to_json()).expect("parse");
        assert_eq!(l.fit(size).map(|j| j.len()), Some(size));
        assert!(l.omitted().is_empty());

        // Room for all but the body.
        let mut l = Letter::parse(&whole.to_json()).expect("parse");
        let json = l.fit(size - 100).expect("fits without the body");
        assert_eq!(l.omitted(), [Part::Body]);
        let back = Letter::parse(&json).expect("parse");
        assert!(back.body_omitted && !back.redrivable());
        assert_eq!(back.body.get(), "null");
        assert_eq!(back.headers["h"].len(), 2000);
        assert_eq!(shown(&back, 1)["body_omitted"], true);
        assert_eq!(shown(&back, 1)["error"]["code"], "boom");
        assert!(shown(&back, 1).get("headers_omitted").is_none());

        // Room for neither the eligible names (2,600 bytes) nor the headers (2,000): both
        // go, the error stays.
        let mut l = Letter::parse(&whole.to_json()).expect("parse");
        let json = l.fit(size - 3000 - 2600 - 100).expect("fits");
        assert_eq!(l.omitted(), [Part::Body, Part::Eligible, Part::Headers]);
        let back = Letter::parse(&json).expect("parse");
        let view = shown(&back, 1);
        assert_eq!(view["headers"], json!({}));
        assert_eq!(
            (&view["eligible_omitted"], &view["headers_omitted"]),
            (&json!(true), &json!(true))
        );
        assert_eq!(view["error"]["code"], "boom");
        assert!(back.eligible.is_none());

        // Room for the ids alone: the error goes too; less than that, no letter.
        let mut bare = Letter::parse(&whole.to_json()).expect("parse");
        assert!(bare.fit(0).is_none());
        let least = bare.to_json().len();
        let mut l = Letter::parse(&whole.to_json()).expect("parse");
        let json = l.fit(least).expect("fits");
        assert_eq!(Letter::parse(&json).expect("parse").omitted().len(), 4);
        let mut l = Letter::parse(&whole.to_json()).expect("parse");
        assert!(l.fit(least - 1).is_none());
    }

    #[test]
    fn a_view_shows_the_body_as_stored_and_fits_leaving_out_only_what_it_shows() {
        // Parsed and written again, `9E15` was shown as `9000000000000000.0`: a page
        // sized by its stored letters came out larger than counted.
        let body = format!("[9E15, 1E-5,{}]", vec![r#""x""#; 1000].join(","));
        let mut r = with_body(
            record(TaskState::Failed, 1, 1),
            &serde_json::from_str(&body).expect("json"),
        );
        r.error = Some(json!({"code": "boom", "message": "e".repeat(1000)}));
        r.eligible = Some(Eligible {
            names: Some(vec!["w".repeat(64); 40]),
            labels: None,
        });
        let msg = format!(
            r#"{{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","headers":{{"h":"{}"}},"body":{body}}}"#,
            "h".repeat(2000),
        );
        let l = Letter::new(&r, msg.as_bytes(), None, String::new()).expect("letter");
        let stored = l.to_json();
        let whole = Letter::parse(&stored).expect("parse").view(3);
        assert!(whole.contains(&format!(r#""body":{body}"#)), "{whole}");
        assert!(whole.len() < stored.len(), "without its eligible names");

        // Room for all of it: as it is.
        let mut back = Letter::parse(&stored).expect("parse");
        assert_eq!(back.fit_view(3, whole.len()), whole);
        // Room for all but the body: only it goes (`eligible` is not shown anyway).
        let mut back = Letter::parse(&stored).expect("parse");
        let view = back.fit_view(3, whole.len() - 100);
        assert!(view.len() <= whole.len() - 100);
        assert_eq!(back.omitted(), [Part::Body]);
        let parsed: Value = serde_json::from_str(&view).expect("json");
        assert_eq!(
            (&parsed["body"], &parsed["body_omitted"]),
            (&Value::Null, &json!(true))
        );
        assert_eq!(parsed["error"]["code"], "boom");
        // Room for the ids alone: the headers and the error go too; less than that, as
        // small as it gets all the same.
        let mut back = Letter::parse(&stored).expect("parse");
        let least = back.fit_view(3, 0);
        assert_eq!(back.omitted(), [Part::Body, Part::Headers, Part::Error]);
        let parsed: Value = serde_json::from_str(&least).expect("json");
        assert_eq!((&parsed["seq"], &parsed["task"]), (&json!(3), &json!("T1")));
        assert!(parsed.get("eligible_omitted").is_none(), "{least}");
        let mut back = Letter::parse(&stored).expect("parse");
        assert_eq!(back.fit_view(3, least.len()), least);
    }

    #[test]
    fn a_null_body_or_no_headers_is_not_left_out() {
        let r = with_body(record(TaskState::Failed, 1, 1), &Value::Null);
        let msg =
            br#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","body":null}"#;
        let mut l = Letter::new(&r, msg, None, String::new()).expect("letter");
        let size = l.to_json().len();
        // Only the error can make room: the letter says nothing of a body or headers.
        let json = l.fit(size - 1).expect("fits without the error");
        let back = Letter::parse(&json).expect("parse");
        assert_eq!(back.omitted(), [Part::Error]);
        assert!(back.redrivable(), "the task is whole");
    }

    #[test]
    fn letters_are_read_by_their_submitter_and_the_job_s_workers_only() {
        let r = record(TaskState::Failed, 1, 1);
        let msg =
            br#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","body":1}"#;
        let l = Letter::new(&r, msg, None, String::new()).expect("letter");
        assert!(l.visible_to("acme/alice", false));
        assert!(!l.visible_to("acme/bob", false));
        assert!(l.visible_to("acme/bob", true));
    }

    #[test]
    fn a_redrive_names_one_task_per_letter_and_redriver() {
        let r = record(TaskState::Failed, 1, 1);
        let msg =
            br#"{"id":"T1","kind":"task","from":"acme/alice","job":"infer","ts":"t","body":1}"#;
        let l = Letter::new(&r, msg, None, String::new()).expect("letter");
        let alice = "acme/alice";
        assert_eq!(l.redrive_task(4, alice), l.redrive_task(4, alice));
        assert_ne!(l.redrive_task(4, alice), l.redrive_task(5, alice));
        assert_ne!(l.redrive_task(4, alice), l.redrive_task(4, "acme/w1"));
        let id = l.redrive_task(4, alice);
        assert!(id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    }
}
