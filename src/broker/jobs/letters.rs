//! The jobs engine's dead letters (mig-nats.md section 6, [`crate::broker::dead_letters`]):
//! storing one before a failed task's message is terminated, and the AMP `dead_letters`
//! and `redrive` requests.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{
    Caller, Jobs, Outcome, Pending, RETRY_DELAY, SessionId, USE_HEADER, not_permitted, ns_of,
    task_key,
};
use crate::amp::frame::{self as amp_frame, DeadLetters};
use crate::amp::reply::FrameWriter;
use crate::amp::{AmpError, ErrorCode};
use crate::broker::binding;
use crate::broker::dead_letters::{self, Letter, PAGE, Part, SCAN};
use crate::broker::envelope::{self, Kind};
use crate::broker::mig::INVOCATION_HEADERS;
use crate::broker::permissions::{self, Action};
use crate::broker::task_store::TaskRecord;
use crate::jetstream::ack::{AckKind, AckMetadata};
use crate::jetstream::error::JsError;
use crate::jetstream::publish::parse_pub_ack;
use crate::jetstream::stream::{MsgSelector, StoredMessage, parse_msg_get};
use crate::nats::{Connection, Message, RequestError};
use crate::rfc3339;

/// A `dead_letters` page being read, one stored letter after another.
pub(super) struct LetterPage {
    session: SessionId,
    re: String,
    ns: String,
    job: String,
    /// `ns/name` of the asker, and whether it may serve the job (then it sees every letter).
    who: String,
    may_serve: bool,
    next: u64,
    scanned: usize,
    /// Each letter's entry as sent ([`Letter::view`]), and their bytes with a separator
    /// each.
    letters: Vec<String>,
    bytes: usize,
}

/// At most one warning about a letter too large to store whole per this long: any
/// submitter can cause one per task.
const TRIMMED_LOG_EVERY: Duration = Duration::from_secs(10);

/// Paces the warnings about letters too large to store whole; the next line says how many
/// went unlogged in between (`amp_jobs_dead_letters_trimmed_total` counts every letter
/// stored with parts left out).
#[derive(Debug, Default)]
pub(super) struct TrimmedLog {
    last: Option<Instant>,
    unlogged: u64,
}

impl TrimmedLog {
    /// Whether a line is due now and, if so, how many went unlogged before it.
    fn due(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < TRIMMED_LOG_EVERY)
        {
            self.unlogged += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }
}

/// The `(N more since the last)` of a paced line.
fn unlogged_note(unlogged: u64) -> String {
    match unlogged {
        0 => String::new(),
        n => format!(" ({n} more since the last such line)"),
    }
}

fn part_names(parts: &[Part]) -> String {
    let names: Vec<&str> = parts.iter().map(|p| p.name()).collect();
    names.join(", ")
}

/// A `redrive` waiting for its letter.
pub(super) struct RedriveRead {
    session: SessionId,
    re: String,
    ns: String,
    name: String,
    job: String,
    seq: u64,
    may_serve: bool,
}

impl Jobs {
    /// Announces a stored failure or completion; a failure with no attempts left is
    /// dead-lettered first, so its message is terminated only once the letter is stored.
    pub(super) fn outcome(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        by: &str,
        ack: Option<(String, AckKind)>,
        reply: Option<(SessionId, String, String)>,
        now: Instant,
    ) {
        let seq = ack
            .as_ref()
            .and_then(|(a, _)| AckMetadata::parse(a).ok())
            .map(|m| m.stream_sequence);
        let ns = record.submitted_by.split_once('/').map(|(ns, _)| ns);
        // A letter stored while the message stayed for its result is stored once.
        let letter_due = dead_letters::is_dead(record) && !record.lettered;
        let (true, Some(seq), Some(ns)) = (letter_due, seq, ns) else {
            return self.publish_result(conn, record, by, ack, reply, now);
        };
        let outcome = Box::new(Outcome {
            record: record.clone(),
            by: by.to_string(),
            ack,
            reply,
            lettered: false,
        });
        let which = MsgSelector::Sequence(seq);
        match self.msg_get(conn, ns, &binding::tasks_stream(ns), &which, now) {
            Ok(id) => self.await_reply(id, now, Pending::LetterRead(outcome)),
            Err(e) => self.letter_failed(conn, *outcome, &e, now),
        }
    }

    /// The failed task's message, read back: its letter is stored.
    pub(super) fn letter_read(
        &mut self,
        conn: &mut Connection,
        outcome: Box<Outcome>,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let stored = match reply.map(|m| parse_msg_get(&m.payload)) {
            Ok(Ok(m)) => m,
            Ok(Err(JsError::MessageNotFound(_))) => {
                // Gone already (terminated by an earlier delivery of this outcome): the
                // letter was stored before that, or the stream's limits removed it.
                return self.announce(conn, *outcome, now);
            }
            Ok(Err(e)) => return self.letter_failed(conn, *outcome, &e.to_string(), now),
            Err(e) => return self.letter_failed(conn, *outcome, &e.to_string(), now),
        };
        let failed_at = rfc3339::format_millis(self.clock.ms(now));
        let use_id = stored.header(USE_HEADER);
        let mut letter = match Letter::new(&outcome.record, &stored.payload, use_id, failed_at) {
            Ok(l) => l,
            Err(e) => {
                // Not a task envelope: nothing to redrive; the outcome stands.
                let key = task_key(ns_of(&outcome.record), &outcome.record.id);
                log::warn!(task:% = key; "no dead letter: {e}");
                return self.announce(conn, *outcome, now);
            }
        };
        let subject = binding::dlq_subject(ns_of(&outcome.record), &letter.job);
        let msg_id = outcome.record.use_scoped(&letter.task);
        let headers = letter.headers(&self.broker_id, &msg_id);
        // A letter too large to store would be too large on every retry: what does not fit
        // is left out rather than retried for ever (each retry announcing the outcome again).
        let max = conn.max_payload();
        let Some(json) = letter.fit(max.saturating_sub(headers.encoded_len())) else {
            // Only a server `max_payload` of a few hundred bytes leaves no room for the ids.
            if let Some(unlogged) = self.trimmed_log.due(now) {
                let key = task_key(ns_of(&outcome.record), &outcome.record.id);
                log::warn!(task:% = key, job:% = letter.job;
                    "no dead letter: too large for the server's max_payload of {max} bytes \
                     even without its body, eligible, headers and error{}",
                    unlogged_note(unlogged));
            }
            return self.announce(conn, *outcome, now);
        };
        match self.request(conn, &subject, Some(&headers), &json, now) {
            Ok(id) => self.await_reply(
                id,
                now,
                Pending::LetterStore {
                    outcome,
                    letter: Box::new(letter),
                },
            ),
            Err(e) => self.letter_failed(conn, *outcome, &e.to_string(), now),
        }
    }

    /// The letter is stored: MIG hears of it (once: not for a duplicate), and the outcome
    /// is announced.
    pub(super) fn letter_stored(
        &mut self,
        conn: &mut Connection,
        outcome: Box<Outcome>,
        letter: &Letter,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let ack = match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
            Ok(Ok(ack)) => ack,
            Ok(Err(e)) => return self.letter_failed(conn, *outcome, &e.to_string(), now),
            Err(e) => {
                // No stream holds the subject: it was deleted, and its redelivery would
                // find it so for ever.
                if e == RequestError::NoResponders {
                    let ns = ns_of(&outcome.record);
                    self.stream_gone(ns, binding::dlq_stream(ns));
                }
                return self.letter_failed(conn, *outcome, &e.to_string(), now);
            }
        };
        self.stats.dead_letters += 1;
        let ns = ns_of(&outcome.record);
        let omitted = letter.omitted();
        if !ack.duplicate && !omitted.is_empty() {
            self.stats.dead_letters_trimmed += 1;
            if let Some(unlogged) = self.trimmed_log.due(now) {
                let key = task_key(ns, &letter.task);
                log::warn!(task:% = key, job:% = letter.job;
                    "dead letter {} stored with its {} left out: too large for the server's \
                     max_payload of {} bytes{}",
                    ack.seq, part_names(&omitted), conn.max_payload(), unlogged_note(unlogged));
            }
        }
        let capability = self
            .jobs
            .get(ns)
            .and_then(|j| j.get(&letter.job))
            .and_then(|j| j.mig.as_ref())
            .map(|m| m.id.clone());
        if let (false, true, Some(cap)) = (ack.duplicate, self.mig_enabled, capability.as_deref()) {
            // This use's own, as the letter's `Nats-Msg-Id` is: a later use of the task id
            // is not a repeat of the earlier one's notice.
            let task = outcome.record.use_scoped(&letter.task);
            let message_id = envelope::idempotent_id(Kind::Task, "dlq", ns, &task);
            let body = letter.mig_message(ns, cap, ack.seq, &message_id);
            let subject = crate::broker::mig::subjects::dlq_subject(ns, cap);
            // mig-nats.md section 3: NATS subscribers may route on these without parsing
            // the body, as on every other message the broker publishes for MIG.
            let headers = crate::broker::mig::envelope::Echo {
                tenant_id: ns.to_string(),
                message_id: Some(message_id),
                ..Default::default()
            }
            .nats_headers();
            if let Err(e) = conn.publish(&subject, None, Some(&headers), body.as_bytes()) {
                log::warn!("dead letter not published on {subject}: {e}");
            }
        }
        let outcome = Outcome {
            lettered: true,
            ..*outcome
        };
        self.announce(conn, outcome, now);
    }

    /// The letter could not be stored: the outcome stands and is announced, but the task
    /// message stays (a NAK with delay, not a terminate) so its redelivery tries again.
    fn letter_failed(&mut self, conn: &mut Connection, mut o: Outcome, e: &str, now: Instant) {
        let key = task_key(ns_of(&o.record), &o.record.id);
        log::warn!(task:% = key; "dead letter not stored yet: {e}");
        if let Some((_, kind)) = &mut o.ack {
            *kind = AckKind::Nak {
                delay: Some(RETRY_DELAY),
            };
        }
        self.announce(conn, o, now);
    }

    /// Sends `STREAM.MSG.GET` for `which` of `stream` in namespace `ns`'s domain.
    fn msg_get(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        stream: &str,
        which: &MsgSelector,
        now: Instant,
    ) -> Result<crate::nats::RequestId, String> {
        let req = self
            .api
            .of(ns)
            .msg_get(stream, which)
            .map_err(|e| e.to_string())?;
        self.request(conn, &req.subject, None, &req.payload, now)
            .map_err(|e| e.to_string())
    }

    // ---- dead_letters and redrive ------------------------------------------------------

    /// Who may read a job's letters at all: those who may submit to it or serve it.
    fn letter_access(caller: &Caller<'_>, job: &str) -> Result<bool, AmpError> {
        let p = &caller.participant.permissions;
        let may_serve = permissions::allows(p, Action::Serve, job);
        if may_serve || permissions::allows(p, Action::Submit, job) {
            Ok(may_serve)
        } else {
            Err(not_permitted("reading the dead letters of", job))
        }
    }

    pub(super) fn dead_letters(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        req: DeadLetters,
        now: Instant,
    ) {
        let may_serve = match Self::letter_access(caller, &req.job) {
            Ok(s) => s,
            Err(e) => return self.refuse(caller.session, &req.id, e),
        };
        let page = LetterPage {
            session: caller.session,
            re: req.id,
            ns: caller.ns.to_string(),
            job: req.job,
            who: format!("{}/{}", caller.ns, caller.name),
            may_serve,
            next: req.from.map_or(1, |f| f.seq.max(1)),
            scanned: 0,
            letters: Vec::new(),
            bytes: 0,
        };
        self.read_letter(conn, page, now);
    }

    fn read_letter(&mut self, conn: &mut Connection, page: LetterPage, now: Instant) {
        let which = MsgSelector::NextBySubject {
            subject: binding::dlq_subject(&page.ns, &page.job),
            from: page.next,
        };
        let stream = binding::dlq_stream(&page.ns);
        match self.msg_get(conn, &page.ns, &stream, &which, now) {
            Ok(id) => self.await_reply(id, now, Pending::LetterPage(Box::new(page))),
            Err(e) => {
                let e = unreadable(e);
                self.refuse(page.session, &page.re, e)
            }
        }
    }

    pub(super) fn letter_page(
        &mut self,
        conn: &mut Connection,
        mut page: LetterPage,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let stored = match read_stored(reply) {
            Ok(Some(m)) => m,
            // The end of the job's letters.
            Ok(None) => return self.answer_page(page, false),
            Err(e) => {
                let e = self.unreadable(&page.ns, e);
                return self.refuse(page.session, &page.re, e);
            }
        };
        match Letter::parse(&stored.payload) {
            Ok(mut l) if l.visible_to(&page.who, page.may_serve) => {
                // Sized as sent, not as stored: a page past what the asker may be sent
                // at once is refused whole, `next` and all, hiding every later letter.
                let mut view = l.view(stored.sequence);
                if !page.letters.is_empty()
                    && page.bytes.saturating_add(view.len() + 1) > self.page_bytes
                {
                    // It starts the next page.
                    return self.answer_page(page, true);
                }
                if view.len() > self.letter_bytes {
                    // Alone it may still be: its body, headers and error are left out
                    // until it fits (the view says which). Only a room too small for a
                    // letter's ids alone (some hundreds of bytes) is past even that.
                    view = l.fit_view(stored.sequence, self.letter_bytes);
                }
                page.bytes += view.len() + 1;
                page.letters.push(view);
            }
            Ok(_) => {}
            Err(e) => log::warn!("dead letter {} unreadable: {e}", stored.sequence),
        }
        page.next = stored.sequence + 1;
        page.scanned += 1;
        if page.letters.len() >= PAGE || page.bytes >= self.page_bytes || page.scanned >= SCAN {
            return self.answer_page(page, true);
        }
        self.read_letter(conn, page, now);
    }

    /// `more`: the page ended at a bound, not at the last letter; `next` says where the
    /// following page starts.
    fn answer_page(&mut self, page: LetterPage, more: bool) {
        let letters = format!("[{}]", page.letters.join(","));
        let mut w = FrameWriter::ok(Some(&page.re)).raw("letters", &letters);
        if more {
            w = w.value("next", &json!({"seq": page.next}));
        }
        self.reply(page.session, &page.re, w);
    }

    pub(super) fn redrive(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        (id, job, seq): (String, String, u64),
        now: Instant,
    ) {
        let p = &caller.participant.permissions;
        if let Some(e) = redrive_refusal(p, &job) {
            return self.refuse_unmade(caller.session, &id, e);
        }
        let may_serve = permissions::allows(p, Action::Serve, &job);
        let stream = binding::dlq_stream(caller.ns);
        let sent = self.msg_get(conn, caller.ns, &stream, &MsgSelector::Sequence(seq), now);
        let read = RedriveRead {
            session: caller.session,
            re: id,
            ns: caller.ns.to_string(),
            name: caller.name.to_string(),
            job,
            seq,
            may_serve,
        };
        match sent {
            Ok(rid) => self.await_reply(rid, now, Pending::Redrive(Box::new(read))),
            Err(e) => {
                let e = unreadable(e);
                self.refuse_unmade(read.session, &read.re, e)
            }
        }
    }

    pub(super) fn redrive_read(
        &mut self,
        conn: &mut Connection,
        r: RedriveRead,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let who = format!("{}/{}", r.ns, r.name);
        let letter = match read_stored(reply) {
            // Another job's letter, or one the asker may not read, is as good as absent.
            Ok(Some(m)) if m.subject == binding::dlq_subject(&r.ns, &r.job) => {
                Letter::parse(&m.payload)
                    .ok()
                    .filter(|l| l.visible_to(&who, r.may_serve))
            }
            Ok(_) => None,
            Err(e) => {
                let e = self.unreadable(&r.ns, e);
                return self.refuse_unmade(r.session, &r.re, e);
            }
        };
        let Some(letter) = letter else {
            let e = AmpError::new(
                ErrorCode::NotFound,
                format!("job `{}` has no dead letter {}", r.job, r.seq),
            )
            .with_path("/seq");
            return self.refuse_unmade(r.session, &r.re, e);
        };
        if !letter.redrivable() {
            let e = AmpError::new(
                ErrorCode::Conflict,
                format!(
                    "dead letter {} holds no {} (too large to keep): submit the task again",
                    r.seq,
                    part_names(&letter.omitted())
                ),
            )
            .with_path("/seq");
            return self.refuse_unmade(r.session, &r.re, e);
        }
        let body = crate::amp::Body::parse(letter.body.get()).unwrap_or_default();
        // The redriver is part of it: a worker, who sees every letter of its job,
        // redriving one first must not take the id from the letter's submitter.
        let task = letter.redrive_task(r.seq, &format!("{}/{}", r.ns, r.name));
        let mut headers = letter.headers;
        if headers.contains_key("mig_capability") {
            // A MIG invoke's task: the invocation is over (its caller was answered), so
            // its ids and deadline would only mislead the worker (a deadline long past,
            // an idempotency key whose outcome is the failure).
            headers.retain(|k, _| !INVOCATION_HEADERS.contains(&k.as_str()));
        }
        let submit = amp_frame::Submit {
            id: r.re,
            job: r.job,
            body,
            task: Some(task),
            max_attempts: None,
            eligible: letter.eligible.map(|e| amp_frame::Eligible {
                names: e.names,
                labels: e.labels,
            }),
            headers,
        };
        self.submit_as(conn, r.session, (&r.ns, &r.name), submit, false, now);
    }
}

fn unreadable(e: String) -> AmpError {
    AmpError::new(
        ErrorCode::Unavailable,
        format!("dead letters unreadable: {e}"),
    )
}

/// Why a dead letter could not be read.
enum Unread {
    /// Start-up made the stream, so it was deleted since: made again, its letters lost.
    StreamGone,
    Failed(String),
}

impl Jobs {
    fn unreadable(&mut self, ns: &str, e: Unread) -> AmpError {
        match e {
            Unread::StreamGone => self.stream_gone(ns, binding::dlq_stream(ns)),
            Unread::Failed(e) => unreadable(e),
        }
    }
}

/// A `STREAM.MSG.GET` answer: the message, `None` when there is none, or what went wrong.
fn read_stored(reply: Result<Message, RequestError>) -> Result<Option<StoredMessage>, Unread> {
    match reply.map(|m| parse_msg_get(&m.payload)) {
        Ok(Ok(m)) => Ok(Some(m)),
        Ok(Err(JsError::MessageNotFound(_))) => Ok(None),
        Ok(Err(JsError::StreamNotFound(_))) => Err(Unread::StreamGone),
        Ok(Err(e)) => Err(Unread::Failed(e.to_string())),
        Err(e) => Err(Unread::Failed(e.to_string())),
    }
}

/// A redrive submits the letter's task again: the asker must be allowed to submit it.
pub(super) fn redrive_refusal(
    permissions: &crate::broker::config::Permissions,
    job: &str,
) -> Option<AmpError> {
    (!permissions::allows(permissions, Action::Submit, job))
        .then(|| not_permitted("redriving the dead letters of", job))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_about_trimmed_letters_are_paced_and_count_the_unlogged() {
        let t0 = Instant::now();
        let mut log = TrimmedLog::default();
        assert_eq!(log.due(t0), Some(0));
        assert_eq!(log.due(t0 + Duration::from_secs(1)), None);
        assert_eq!(log.due(t0 + Duration::from_secs(9)), None);
        assert_eq!(log.due(t0 + TRIMMED_LOG_EVERY), Some(2));
        assert_eq!(log.due(t0 + TRIMMED_LOG_EVERY * 3), Some(0));
        assert_eq!(unlogged_note(0), "");
        assert_eq!(unlogged_note(2), " (2 more since the last such line)");
    }
}
