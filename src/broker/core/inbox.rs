//! The inbox: `send` stored in the recipient's inbox stream, its pull consumer, the
//! deliveries to the participant's sessions and their acks.

use super::*;

/// Largest stored-envelope buffer kept between sends.
const STORE_SCRATCH_KEEP: usize = 16 << 10;

impl Broker {
    pub(super) fn send(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        send: amp_frame::Send,
        now: Instant,
    ) {
        let to = send.to.as_str();
        let (entry, known) = self.sessions.get(&session).map_or((None, false), |s| {
            (s.entry.clone(), s.last_to.as_deref() == Some(to))
        });
        let sender = entry.as_deref();
        let allowed = sender.is_some_and(|p| permissions::allows(&p.permissions, Action::Send, to));
        let limits = sender
            .and_then(|p| p.policy.as_ref())
            .and_then(rate_limit::Limits::from_policy);
        if !allowed {
            let e = AmpError::new(
                ErrorCode::Forbidden,
                format!("sending to `{to}` is not permitted"),
            )
            .with_path("/to");
            return self.fail(session, &send.id, e);
        }
        if !known {
            if self.config.participant(ns, to).is_none() {
                let e = AmpError::new(
                    ErrorCode::NotFound,
                    format!("`{to}` is not a participant of `{ns}`"),
                )
                .with_path("/to");
                return self.fail(session, &send.id, e);
            }
            if let Some(s) = self.sessions.get_mut(&session) {
                s.last_to = Some(to.into());
            }
        }
        let body = send.body.into_text();
        let charged = match self.take_rate_with(ns, name, limits, body.len(), now) {
            Ok(charged) => charged,
            Err(e) => return self.fail(session, &send.id, e),
        };
        // Written into the last send's strings: five allocations a message fewer. Boxed,
        // so taking it out and putting it back moves a pointer, not the envelope.
        let (env, mut subject) = std::mem::take(&mut self.send_scratch);
        let mut env = env.unwrap_or_else(|| {
            Box::new(Envelope {
                id: String::new(),
                kind: Kind::Message,
                from: String::new(),
                to: None,
                topic: None,
                job: None,
                ts: String::new(),
                headers: Default::default(),
                body: Default::default(),
            })
        });
        let key = |out: &mut String, name: &str| {
            out.clear();
            out.push_str(ns);
            out.push('/');
            out.push_str(name);
        };
        key(&mut env.from, name);
        key(env.to.get_or_insert_with(String::new), to);
        match &send.idem {
            Some(idem) => env.id = envelope::idempotent_id(Kind::Message, &env.from, to, idem),
            None => {
                env.id.clear();
                self.ids.push_id(&mut env.id);
            }
        }
        env.ts.clear();
        self.stamps.push(&mut env.ts, self.clock.ms(now));
        env.headers = send.headers;
        env.body = body;
        subject.clear();
        binding::push_inbox_subject(&mut subject, ns, to);
        self.store(conn, session, send.id, &subject, &env, charged, now);
        env.headers.clear();
        env.body = Default::default();
        self.send_scratch = (Some(env), subject);
    }

    /// Publishes an envelope to its stream and answers the request when JetStream acks.
    /// `charged` (the sender's rate, see [`take_rate`](Broker::take_rate)) is given back
    /// when nothing was stored: refused here, or by JetStream.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn store(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        re: String,
        subject: &str,
        env: &Envelope,
        charged: Option<u64>,
        now: Instant,
    ) {
        let (mut payload, mut headers) = std::mem::take(&mut self.store_scratch);
        payload.clear();
        headers.clear();
        env.write_json(&mut payload);
        let stamped = [
            ("Nats-Msg-Id", env.id.as_str()),
            ("AMP-From", env.from.as_str()),
            ("AMP-Kind", env.kind.as_str()),
        ];
        // Distinct names, so appended without looking for an earlier value; the broker
        // made each value (an id, a configured or checked name, a constant).
        for (k, value) in stamped {
            headers.append_trusted(k, value);
        }
        // Spec 2.7 copies it to the stored header: one no NATS header carries (a control
        // character, which the schema lets through) is refused, not stored without it.
        if let Some(tp) = env.headers.get("traceparent")
            && let Err(e) = headers.append("traceparent", tp)
        {
            let e = AmpError::new(
                ErrorCode::Schema,
                format!("`traceparent` cannot be stored as a NATS header: {e}"),
            )
            .with_path("/headers/traceparent");
            self.refund_rate(session, charged);
            self.fail(session, &re, e);
            return;
        }
        // The connection's limit: an INFO without `max_payload` (0) does not change it.
        let max = conn.max_payload();
        if payload.len() + headers.encoded_len() > max {
            let e = AmpError::new(
                ErrorCode::TooLarge,
                format!("the stored message would exceed the server's max_payload of {max} bytes"),
            )
            .with_path("");
            self.refund_rate(session, charged);
            self.fail(session, &re, e);
            return;
        }
        // A send on a silent link would only wait out its timeout: `unavailable` now.
        let sent = conn.check_heard(now).and_then(|()| {
            conn.request(subject, Some(&headers), payload.as_bytes(), JS_TIMEOUT, now)
        });
        match sent {
            Ok(req) => {
                let topic = env.topic.is_some();
                let pending = Pending::Send {
                    session,
                    re,
                    charged,
                    topic,
                };
                self.await_reply(req, now, pending);
            }
            Err(e) => {
                self.refund_rate(session, charged);
                self.fail(session, &re, unavailable(e));
            }
        }
        // Kept for the next unless a large body grew it.
        if payload.capacity() <= STORE_SCRATCH_KEEP {
            self.store_scratch = (payload, headers);
        }
    }

    pub(super) fn inbox_ack(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        id: Option<String>,
        seq: u64,
        kind: AckKind,
        now: Instant,
    ) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let held = s.inflight.remove(&seq);
        let was_moved = held.is_none();
        let moved = was_moved.then(|| s.moved.remove(&seq)).flatten();
        if moved.is_some() && matches!(kind, AckKind::Nak { .. }) {
            // Out again already, with a sibling: nothing to hand back.
            if let Some(re) = id {
                self.ok(session, &re, FrameWriter::ok(Some(&re)));
            }
            return;
        }
        let Some(ack_subject) = held.or(moved) else {
            if let Some(re) = id {
                let e = AmpError::new(
                    ErrorCode::NotFound,
                    format!("no unacknowledged message {seq} in this session"),
                )
                .with_path("/seq");
                self.fail(session, &re, e);
            }
            return;
        };
        // Unconfirmed, the client hears `unavailable` ("safe to retry"): the delivery
        // is kept for the retry.
        let keep = id.is_some().then(|| Kept {
            seq,
            ack_subject: ack_subject.clone(),
            moved: was_moved,
        });
        self.ack_keeping(conn, session, id, &ack_subject, kind, keep, now);
    }

    /// Acks a delivery; with a request id, answers once JetStream confirmed it.
    pub(super) fn ack(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        id: Option<String>,
        ack_subject: &str,
        kind: AckKind,
        now: Instant,
    ) {
        self.ack_keeping(conn, session, id, ack_subject, kind, None, now);
    }

    /// [`ack`](Self::ack), an inbox delivery (`seq`, ack subject) given back to the
    /// session if the confirmed ack fails. `ack_subject` is always the reply of a message
    /// the connection handed on (a session's or durable's held delivery), so it is sent
    /// to unchecked (`publish_to_reply`): the connection checked it when it came in.
    #[allow(clippy::too_many_arguments)]
    fn ack_keeping(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        id: Option<String>,
        ack_subject: &str,
        kind: AckKind,
        keep: Option<Kept>,
        now: Instant,
    ) {
        match id {
            Some(re) => match conn
                .check_heard(now)
                .and_then(|()| conn.request_to_reply(ack_subject, &kind.payload(), JS_TIMEOUT, now))
            {
                Ok(req) => {
                    self.await_reply(req, now, Pending::AckSync { session, re, keep });
                }
                Err(e) => {
                    self.keep_delivery(session, keep);
                    self.fail(session, &re, unavailable(e))
                }
            },
            None => {
                let _ = conn.publish_to_reply(ack_subject, &kind.payload());
            }
        }
    }

    /// An inbox delivery whose confirmed ack failed is the session's again, where it
    /// was, unless it was delivered to it anew meanwhile (that ack subject counts).
    pub(super) fn keep_delivery(&mut self, session: SessionId, keep: Option<Kept>) {
        let Some(kept) = keep else {
            return;
        };
        let participant = self
            .sessions
            .get(&session)
            .and_then(|s| s.state.participant())
            .map(|(ns, name)| (ns.to_string(), participant_key(ns, name)));
        let window = participant
            .as_ref()
            .map_or(64, |(ns, _)| self.inbox_window(ns));
        // Redelivered to a sibling while the ack was out: the sibling's now, as any
        // delivery that moved (a nak or the end of this session must not take it back).
        let sibling_has_it = participant
            .and_then(|(_, key)| self.presence.get(&key))
            .is_some_and(|p| {
                p.sessions.iter().any(|&id| {
                    id != session
                        && self
                            .sessions
                            .get(&id)
                            .is_some_and(|o| o.inflight.contains_key(&kept.seq))
                })
            });
        if let Some(s) = self.sessions.get_mut(&session)
            && !s.inflight.contains_key(&kept.seq)
        {
            let held = if kept.moved || sibling_has_it {
                &mut s.moved
            } else {
                &mut s.inflight
            };
            hold(held, kept.seq, kept.ack_subject, window);
        }
    }

    /// The inbox window of a namespace's participants (the default for one a reload
    /// removed).
    fn inbox_window(&self, ns: &str) -> usize {
        self.config
            .namespaces
            .get(ns)
            .map_or(64, |n| n.inbox.inbox_window as usize)
    }

    /// Queues the creation (or update) of the participant's inbox consumer; see
    /// [`send_inbox_creates`](Broker::send_inbox_creates).
    pub(super) fn ensure_inbox_consumer(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        name: &str,
        now: Instant,
    ) {
        self.inbox_creates.push(&participant_key(ns, name));
        self.send_inbox_creates(conn, now);
    }

    /// Sends queued inbox consumer creations while fewer than `INBOX_CREATES_IN_FLIGHT`
    /// are out, skipping participants that left or were attached meanwhile.
    pub(super) fn send_inbox_creates(&mut self, conn: &mut Connection, now: Instant) {
        while let Some(key) = self.inbox_creates.admit() {
            let wanted = self.kept_inboxes.remove(&key)
                || self
                    .presence
                    .get(&key)
                    .is_some_and(|p| p.inbox.sid().is_none());
            let inbox = key
                .split_once('/')
                .filter(|_| wanted)
                .and_then(|(ns, name)| Some((ns, name, self.config.namespaces.get(ns)?)));
            let Some((ns, name, namespace)) = inbox else {
                self.inbox_creates.done();
                continue;
            };
            // From the start, after a loss too: acks do not remove messages from the
            // inbox (limits retention), but only the start keeps every one not yet
            // acknowledged, wherever it was out (another broker's sessions, a NAK's
            // delay, a closed session's hand-back). The price of a lost consumer is
            // the inbox's kept messages once more.
            let config = binding::inbox_consumer_config(
                ns,
                name,
                namespace.inbox.ack_wait_s,
                namespace.inbox.inbox_window,
            );
            let req = self.config.js_api(ns).consumer_create(
                &binding::inbox_stream(ns),
                &config,
                ConsumerAction::CreateOrUpdate,
            );
            match js_request(conn, req, now) {
                Ok(req) => self.await_reply(req, now, Pending::InboxConsumer { participant: key }),
                Err(e) => {
                    self.inbox_creates.done();
                    log::warn!(participant:% = key; "inbox consumer request failed: {e}");
                    self.retry_inbox_consumer(key, now);
                }
            }
        }
    }

    pub(super) fn retry_inbox_consumer(&mut self, participant: String, now: Instant) {
        let at = crate::deadline::after(now, INBOX_CONSUMER_RETRY);
        self.retry_inbox_at(participant, at);
    }

    /// One retry chain per participant: a participant logging in and out while its
    /// consumer is refused started one more each time, all asking again for good. An
    /// earlier retry (a new presence's first) replaces a later one.
    fn retry_inbox_at(&mut self, participant: String, at: Instant) {
        if self
            .inbox_retrying
            .get(&participant)
            .is_some_and(|&armed| armed <= at)
        {
            return;
        }
        self.inbox_retrying.insert(participant.clone(), at);
        self.set_timer(at, Timer::InboxConsumerRetry(participant));
    }

    /// JetStream answered the inbox consumer's creation with an error (its consumer
    /// limit, most likely): the participant's messages are kept, but none reach it. Its
    /// sessions are told once (and any session that joins while it lasts, at its
    /// `hello`), and the broker asks again after 1, 2, 4 ... at most 60 s.
    pub(super) fn inbox_consumer_refused(
        &mut self,
        participant: String,
        e: &JsError,
        now: Instant,
    ) {
        // A name the namespace does not list finds the room of those it does taken.
        let unlisted = participant.split_once('/').is_some_and(|(ns, name)| {
            self.config
                .namespaces
                .get(ns)
                .is_some_and(|n| n.open.is_some() && !n.participants.contains_key(name))
        });
        let Some(p) = self.presence.get_mut(&participant) else {
            return;
        };
        let refusals = p.inbox_refused.as_ref().map_or(0, |(n, _)| *n);
        let mut why = e.to_string();
        if unlisted {
            why.push_str("; the namespace keeps inboxes for the participants it lists, and names not listed have the rest");
        }
        let error = (refusals == 0).then(|| inbox_refused_error(&why));
        p.inbox_refused = Some((refusals.saturating_add(1), why.into()));
        if let Some(error) = error {
            log::warn!(participant:% = participant; "inbox consumer refused: {e}; asking again");
            let sessions = p.sessions.clone();
            self.error_to_each(sessions, &error);
        } else {
            log::debug!(participant:% = participant; "inbox consumer refused again ({}): {e}", refusals + 1);
        }
        let backoff = INBOX_CONSUMER_RETRY
            .saturating_mul(1 << refusals.min(6))
            .min(INBOX_REFUSED_RETRY_MAX);
        self.retry_inbox_at(participant, crate::deadline::after(now, backoff));
    }

    pub(super) fn start_inbox(&mut self, conn: &mut Connection, participant: &str, now: Instant) {
        let Some(p) = self
            .presence
            .get_mut(participant)
            .filter(|p| p.inbox.sid().is_none())
        else {
            return;
        };
        if let Some((refusals, _)) = p.inbox_refused.take() {
            log::info!(participant:% = participant; "inbox consumer created after {refusals} refusals");
        }
        match p.inbox.attach_status_only(conn) {
            Ok(sid) => {
                let check = p.inbox.pull(conn, now);
                self.routes.insert(
                    sid,
                    Route::Inbox {
                        participant: Rc::from(participant),
                    },
                );
                self.check_pull_at(check, PullOwner::Inbox(participant.to_string()));
            }
            // No room for the SUB (the server not reading) or no subscription left: the
            // inbox would stay silent for good unless asked again.
            Err(e) => {
                log::warn!(participant:% = participant; "inbox subscription failed: {e}; asking again");
                let at = crate::deadline::after(now, INBOX_CONSUMER_RETRY);
                self.retry_inbox_at(participant.to_string(), at);
            }
        }
    }

    /// Files the pull's next check, and for a paced pull that waits for credit asks to
    /// hear when its session's output is written (`Input::Drained`, then `grant_pulls`).
    pub(super) fn check_pull_at(&mut self, check: Option<Check>, owner: PullOwner) {
        match &owner {
            PullOwner::Sub(session, sub) => {
                if self
                    .sessions
                    .get(session)
                    .and_then(|s| s.subs.get(sub))
                    .is_some_and(|t| t.pull.wants_credit())
                {
                    self.out
                        .push_back(Output::WhenDrained { session: *session }.into());
                }
            }
            // Granted once any of the participant's open sessions here has written its
            // output: one the broker closed takes no more (see `grant_inbox`).
            PullOwner::Inbox(participant) => {
                if let Some(p) = self.presence.get(participant)
                    && p.inbox.wants_credit()
                {
                    for &session in &p.sessions {
                        if self
                            .sessions
                            .get(&session)
                            .is_some_and(|s| s.state.is_active())
                        {
                            self.out.push_back(Output::WhenDrained { session }.into());
                        }
                    }
                }
            }
        }
        if let Some(c) = check {
            self.set_timer(c.at, Timer::PullCheck(owner, c.generation));
        }
    }

    /// The session wrote its output: its participant's inbox pulls again if it waits
    /// for credit (see `Presence::unwritten`). Not for a session the broker closed: it
    /// writes nothing more, and its pull would bring deliveries nobody here can take.
    pub(super) fn grant_inbox(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some((ns, name)) = self
            .sessions
            .get(&session)
            .filter(|s| s.state.is_active())
            .and_then(|s| s.state.participant())
        else {
            return;
        };
        let key = participant_key(ns, name);
        let Some(p) = self.presence.get_mut(&key) else {
            return;
        };
        p.unwritten.remove(&session);
        p.held.remove(&session);
        if !p.inbox.wants_credit() {
            return;
        }
        // This session can take more; those still writing get none of the next pull.
        p.held.extend(&p.unwritten);
        let check = p.inbox.grant(conn, now);
        self.check_pull_at(check, PullOwner::Inbox(key));
    }

    pub(super) fn inbox_delivery(
        &mut self,
        conn: &mut Connection,
        participant: &str,
        mut msg: Message,
        now: Instant,
    ) {
        let parts = split_key(participant);
        let window = parts.map_or(64, |(ns, _)| self.inbox_window(ns));
        let Some(p) = self.presence.get_mut(participant) else {
            if let Some(reply) = msg.reply.as_deref().filter(|_| msg.status().is_none()) {
                let _ = conn.publish(reply, None, None, &AckKind::Nak { delay: None }.payload());
            }
            return;
        };
        let meta = msg
            .reply
            .as_deref()
            .and_then(|r| AckMetadata::parse(r).ok());
        let (pulled, check) = p.inbox.on_delivery(conn, &msg, meta.as_ref(), now);
        // A message the pull counts names this consumer in a well-formed ack subject.
        let numbers = meta.map(|m| (m.stream_sequence, m.delivered));
        if pulled == Pulled::Lost {
            // Deleted (an operator, a replica set that lost it, its stream made anew):
            // made again, then pulled.
            let sid = p.inbox.detach(conn);
            if let Some(sid) = sid {
                self.routes.remove(&sid);
            }
            // After a moment: nats-server can give a consumer made again right after
            // its delete the deleted one's older saved state.
            log::warn!(participant:% = participant; "inbox consumer gone; making it again");
            self.retry_inbox_consumer(participant.to_string(), now);
            return;
        }
        // The session it goes to, chosen while the presence is at hand (one lookup).
        let chosen = 'choose: {
            let (Pulled::Message, Some((seq, delivered)), Some(reply)) =
                (pulled, numbers, msg.reply.take())
            else {
                break 'choose None;
            };
            // A consumer of that name JetStream would not update is used as it is: one
            // somebody else made may deliver another participant's messages.
            if !parts.is_some_and(|(ns, name)| binding::is_inbox_subject(&msg.subject, ns, name)) {
                log::warn!(participant:% = participant, subject:% = msg.subject; "terminating an inbox delivery of another subject: consumer {} is not the broker's (an operator removes it)", p.inbox.consumer());
                let term = AckKind::Term {
                    reason: Some("not this participant's inbox".into()),
                };
                let _ = conn.publish(&reply, None, None, &term.payload());
                break 'choose None;
            }
            // A redelivery supersedes the delivery another session of the participant
            // here still holds (JetStream gave up waiting for its ack): that session
            // may still acknowledge it, but no longer hands it back.
            for id in &p.sessions {
                if let Some(s) = self.sessions.get_mut(id)
                    && let Some(ack_subject) = s.inflight.remove(&seq)
                {
                    hold(&mut s.moved, seq, ack_subject, window);
                }
            }
            // Those the broker closed stay until their end is reported; a delivery
            // given to one would come back only then, one delivery more.
            let open = |id: &SessionId| {
                self.sessions
                    .get(id)
                    .filter(|s| matches!(s.state, SessionState::Active { .. }))
                    .map(|s| (*id, s.inflight.len()))
            };
            let least = |(_, inflight): &(SessionId, usize)| *inflight;
            let free = p.sessions.iter().filter(|id| !p.held.contains(id));
            let target = free
                .filter_map(open)
                .min_by_key(least)
                .or_else(|| p.sessions.iter().filter_map(open).min_by_key(least))
                .map(|(id, _)| id);
            // Before the pull's check below, which asks what it waits for.
            if let Some(t) = target {
                p.unwritten.insert(t);
            }
            let closing = p.sessions.first().copied();
            Some((reply, seq, delivered, target.ok_or(closing)))
        };
        if check.is_some() {
            self.check_pull_at(check, PullOwner::Inbox(participant.to_string()));
        }
        let Some((reply, seq, delivered, target)) = chosen else {
            return;
        };
        let target = match target {
            Ok(target) => target,
            // Every session here is closing: the delivery stays with one of them, unread,
            // and goes back at its end, after the pull if that was the last (see
            // `session_closed`). A NAK now would bring it straight back to this pull,
            // again and again until then.
            Err(closing) => {
                match closing.and_then(|id| self.sessions.get_mut(&id)) {
                    Some(s) => {
                        s.moved.remove(&seq);
                        hold(&mut s.inflight, seq, reply, window);
                    }
                    None => {
                        let nak = AckKind::Nak { delay: None }.payload();
                        let _ = conn.publish(&reply, None, None, &nak);
                    }
                }
                return;
            }
        };
        let env = match EnvelopeView::parse(&msg.payload) {
            Ok(env) => env,
            Err(e) => {
                // Not an AMP envelope: nobody can use it; terminate it so it is not redelivered forever.
                log::warn!(seq:% = seq, participant:% = participant; "terminating malformed inbox message: {e}"
                );
                let _ = conn.publish(
                    &reply,
                    None,
                    None,
                    &AckKind::Term {
                        reason: Some("malformed envelope".into()),
                    }
                    .payload(),
                );
                return;
            }
        };
        let buffer = self.frame_buffer(msg.payload.len() + 64);
        let text = FrameWriter::in_buffer(amp_frame::server_op::MESSAGE, buffer)
            .uint("seq", seq)
            .str("from", env.from.as_str())
            .str("to", env.to.as_ref().map_or(participant, |t| t.as_str()))
            .str("ts", env.ts.as_str())
            .uint("delivery", delivered)
            .raw("body", env.body.get())
            .str_map("headers", &env.headers)
            .literal(
                "kind",
                if env.kind == Kind::TaskResult {
                    "task_result"
                } else {
                    "message"
                },
            )
            .finish();
        if let Some(s) = self.sessions.get_mut(&target) {
            s.moved.remove(&seq);
            hold(&mut s.inflight, seq, reply, window);
        }
        self.frame(target, text);
    }
}

/// Files a delivery (stream sequence -> ack subject) in a session's held or moved ones.
/// JetStream has at most a window of a participant's messages unacknowledged, so a
/// session holding a full window holds some its consumer already redelivered elsewhere
/// (to a session on another broker, after their ack wait): the oldest delivery (lowest
/// consumer sequence) goes. Were it still pending, its ack would answer `not_found` and
/// the message would come again after its ack wait: at least once still holds.
fn hold(held: &mut IdMap<u64, String>, seq: u64, ack_subject: String, window: usize) {
    if held.len() >= window && !held.contains_key(&seq) {
        let oldest = held
            .iter()
            .min_by_key(|(_, ack)| AckMetadata::parse(ack).map_or(0, |m| m.consumer_sequence))
            .map(|(&seq, _)| seq);
        if let Some(seq) = oldest {
            held.remove(&seq);
        }
    }
    held.insert(seq, ack_subject);
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! The inbox driven in process: the core on the NATS/JetStream model, ack waits
    //! running out on a virtual clock.

    use std::time::Duration;

    use serde_json::{Value, json};

    use crate::broker::config::Policy;
    use crate::testing::harness::{self, Harness, Session};

    fn bench(ack_wait_s: u64, window: u32, brokers: usize) -> Harness {
        let mut config = harness::development_config();
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.inbox.ack_wait_s = ack_wait_s;
            ns.inbox.inbox_window = window;
        }
        Harness::new(config, brokers, 3)
    }

    fn send(h: &mut Harness, from: Session, to: &str, n: u64) -> u64 {
        let ok = h.request(from, json!({"op":"send","to":to,"body":{"n":n}}));
        assert_eq!(ok["op"], "ok", "{ok}");
        ok["seq"].as_u64().expect("seq")
    }

    fn message(h: &mut Harness, s: Session) -> Value {
        h.wait_for(s, |f| f["op"] == "message")
    }

    /// A session holds its participant's entry from `hello` on, not its name's lookup:
    /// a reload must put the new one in, so a withdrawn or granted permission and a new
    /// policy apply from the next `send`, for listed and `open` participants alike.
    #[test]
    fn a_reload_applies_to_an_open_sessions_next_send() {
        let config = harness::development_config();
        let mut h = Harness::new(config.clone(), 1, 3);
        let ann = h.join(0, "ann", json!({}));
        send(&mut h, ann, "bob", 1);
        let with = |send: &[&str], policy: Option<Policy>| {
            let mut c = config.clone();
            if let Some(open) = c.namespaces.get_mut("dev").and_then(|n| n.open.as_mut()) {
                let open = std::sync::Arc::make_mut(open);
                open.permissions.send = send.iter().map(|s| s.to_string()).collect();
                open.policy = policy;
            }
            c
        };
        let code = |h: &mut Harness, n: u64| {
            let e = h.request(ann, json!({"op":"send","to":"bob","body":{"n":n}}));
            e["code"].as_str().map(str::to_string)
        };
        h.reload(with(&["carol"], None));
        assert_eq!(code(&mut h, 2).as_deref(), Some("forbidden"));
        h.reload(with(&["bob"], None));
        send(&mut h, ann, "bob", 3);
        let one = Policy {
            msgs_per_s: Some(0.001),
            burst: Some(1),
            bytes_per_s: None,
            tasks_per_window: None,
            window_s: None,
        };
        h.reload(with(&["bob"], Some(one)));
        send(&mut h, ann, "bob", 4);
        assert_eq!(code(&mut h, 5).as_deref(), Some("rate_limited"));
        h.reload(config);
        send(&mut h, ann, "bob", 6);
    }

    /// A session remembers the recipient its last `send` found, not looked up again for
    /// the next `send` to it: a reload that takes the recipient away is heard all the same.
    #[test]
    fn a_recipient_a_reload_takes_away_is_not_found_by_the_next_send() {
        let config = harness::development_config();
        let mut h = Harness::new(config.clone(), 1, 3);
        let ann = h.join(0, "ann", json!({}));
        send(&mut h, ann, "bob", 1);
        send(&mut h, ann, "bob", 2);
        // Ann listed by name, with what `open` gave her, and nobody else; then anyone
        // again (a listed name stays listed).
        let mut only_ann = config.clone();
        let mut again = config;
        if let Some(ns) = only_ann.namespaces.get_mut("dev")
            && let Some(open) = ns.open.take()
        {
            ns.participants.insert("ann".into(), open.clone());
            if let Some(ns) = again.namespaces.get_mut("dev") {
                ns.participants.insert("ann".into(), open);
            }
        }
        h.reload(only_ann);
        let e = h.request(ann, json!({"op":"send","to":"bob","body":{"n":3}}));
        assert_eq!(e["code"], "not_found", "{e}");
        h.reload(again);
        send(&mut h, ann, "bob", 4);
    }

    #[test]
    fn a_message_sent_while_its_recipient_is_away_waits_and_an_unacked_one_comes_again() {
        let mut h = bench(5, 8, 2);
        let alice = h.join(0, "alice", json!({}));
        let seq = send(&mut h, alice, "bob", 1);
        // Bob connects to the other broker, later.
        h.advance(Duration::from_secs(2));
        let bob = h.join(1, "bob", json!({}));
        let m = message(&mut h, bob);
        assert_eq!(
            (
                m["seq"].as_u64(),
                m["delivery"].as_u64(),
                m["from"].as_str()
            ),
            (Some(seq), Some(1), Some("dev/alice"))
        );
        assert_eq!(m["to"], "dev/bob");
        // Not acknowledged: it comes again after the ack wait, one delivery more.
        let again = message(&mut h, bob);
        assert_eq!(
            (again["seq"].as_u64(), again["delivery"].as_u64()),
            (Some(seq), Some(2))
        );
        let ok = h.request(bob, json!({"op":"ack","seq":seq}));
        assert_eq!(ok["op"], "ok", "{ok}");
        h.advance(Duration::from_secs(12));
        assert!(h.take(bob).is_empty(), "an acknowledged message came again");
    }

    #[test]
    fn at_most_the_window_of_messages_is_unacknowledged_at_once() {
        let mut h = bench(30, 3, 1);
        let alice = h.join(0, "alice", json!({}));
        let sent: Vec<u64> = (1..=5).map(|n| send(&mut h, alice, "bob", n)).collect();
        let bob = h.join(0, "bob", json!({}));
        let first: Vec<u64> = (0..3)
            .map(|_| message(&mut h, bob)["seq"].as_u64().unwrap_or(0))
            .collect();
        assert_eq!(first, sent[..3]);
        h.advance(Duration::from_secs(5));
        assert!(h.take(bob).is_empty(), "more than the window in flight");
        h.send(bob, json!({"op":"ack","seq":sent[0]}));
        assert_eq!(message(&mut h, bob)["seq"].as_u64(), Some(sent[3]));
        // A nak'd message comes again at once, in its own place in the window.
        h.send(bob, json!({"op":"nak","seq":sent[1]}));
        let m = message(&mut h, bob);
        assert_eq!(
            (m["seq"].as_u64(), m["delivery"].as_u64()),
            (Some(sent[1]), Some(2))
        );
        h.send(bob, json!({"op":"ack","seq":sent[2]}));
        let m = message(&mut h, bob);
        assert_eq!(
            (m["seq"].as_u64(), m["delivery"].as_u64()),
            (Some(sent[4]), Some(1))
        );
    }

    /// Real time per NAK-driven redelivery to the first of `bob`'s 1,024 sessions, the
    /// others holding nothing unacknowledged: with `held`, none of them has written
    /// its last delivery (each is `held`), else all have.
    fn nak_redelivery_time(held: bool) -> Duration {
        const SESSIONS: usize = 1024;
        let mut h = bench(3600, 4 * SESSIONS as u32, 1);
        let alice = h.join(0, "alice", json!({}));
        let bob: Vec<Session> = (0..SESSIONS).map(|_| h.join(0, "bob", json!({}))).collect();
        h.hold_drains = held;
        // One message each (the reader's kept, the others acknowledged).
        for n in 0..SESSIONS as u64 {
            send(&mut h, alice, "bob", n);
        }
        let reader = bob[0];
        let mut seq = message(&mut h, reader)["seq"].as_u64().unwrap_or(0);
        for &s in &bob[1..] {
            let m = message(&mut h, s);
            h.send(s, json!({"op":"ack","seq":m["seq"]}));
        }
        // The pull runs out; the reader's write grants the next, the others held.
        h.advance(Duration::from_secs(25));
        assert_eq!(
            h.release_drain(reader),
            held,
            "the reader's drain was asked for"
        );
        let started = std::time::Instant::now();
        for _ in 0..200 {
            h.send(reader, json!({"op":"nak","seq":seq}));
            h.release_drain(reader);
            seq = message(&mut h, reader)["seq"].as_u64().unwrap_or(0);
        }
        started.elapsed()
    }

    #[test]
    fn a_redelivery_costs_the_same_however_many_sessions_are_held() {
        // Choosing the session scanned the held list for each session: a participant
        // with a thousand sessions that read nothing and one that NAKs every message
        // cost the event loop about half a million comparisons per redelivery.
        let best = |held| {
            (0..3)
                .map(|_| nak_redelivery_time(held))
                .min()
                .unwrap_or_default()
        };
        let (none, all) = (best(false), best(true));
        let ratio = all.as_secs_f64() / none.as_secs_f64().max(1e-9);
        assert!(
            ratio < 3.0,
            "200 redeliveries took {all:?} with 1,023 sessions held, {none:?} with none ({ratio:.1}x)"
        );
    }

    #[test]
    fn a_closing_session_is_not_chosen_for_a_delivery() {
        // Closed by the broker, a session stays among its participant's until the
        // transport reports its end: a message chosen for it meanwhile went back only
        // then, to come to a sibling as a redelivery.
        let mut h = bench(30, 8, 1);
        let alice = h.join(0, "alice", json!({}));
        let leaving = h.join(0, "bob", json!({}));
        let staying = h.join(0, "bob", json!({}));
        h.hold_closes = true;
        assert_eq!(h.request(leaving, json!({"op":"bye"}))["op"], "ok");
        let seq = send(&mut h, alice, "bob", 1);
        let got = h.take(staying);
        h.release_closes();
        let m = got.iter().find(|f| f["op"] == "message");
        assert_eq!(
            m.map(|m| (m["seq"].as_u64(), m["delivery"].as_u64())),
            Some((Some(seq), Some(1))),
            "before the leaving session's end: {got:?}"
        );
    }

    #[test]
    fn a_participant_whose_only_session_here_is_closing_leaves_its_messages_waiting() {
        // With every session of bob's here closing, a delivery was NAKed at once, came
        // straight back to the same pull, and each closing session, written at once,
        // granted the pull a new batch: deliveries without end until the transport
        // reported the session's end (up to the 5 s close timeout), each one counted
        // against the message.
        let mut h = bench(30, 8, 1);
        let alice = h.join(0, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        h.hold_closes = true;
        assert_eq!(h.request(bob, json!({"op":"bye"}))["op"], "ok");
        let seq = send(&mut h, alice, "bob", 1);
        h.advance(Duration::from_secs(1));
        let info = h.nats_request("$JS.API.CONSUMER.INFO.AMP_INBOX_dev.inbox_bob", &[], b"");
        let delivered = info["delivered"]["consumer_seq"].as_u64();
        assert!(
            delivered.is_some_and(|n| n <= 2) && info["num_redelivered"].as_u64() <= Some(1),
            "while bob's only session here was closing: {info}"
        );
        h.release_closes();
        let next = h.join(0, "bob", json!({}));
        let m = message(&mut h, next);
        assert_eq!(m["seq"].as_u64(), Some(seq), "{m}");
        assert!(m["delivery"].as_u64().is_some_and(|d| d <= 2), "{m}");
    }

    #[test]
    fn a_confirmed_ack_that_failed_after_its_message_went_to_a_sibling_leaves_it_there() {
        // A confirmed ack takes the delivery from its session; its message, redelivered
        // meanwhile, went to a sibling. The ack failing put it back as the first
        // session's own, whose nak (or end) then took it from the sibling: delivered
        // once more while the sibling worked on it. The ack wait, 3 s, runs out before
        // the ack's 4 s timeout, and the sibling's own before the test is done.
        let mut h = bench(3, 8, 1);
        let alice = h.join(0, "alice", json!({}));
        let first = h.join(0, "bob", json!({}));
        let sibling = h.join(0, "bob", json!({}));
        let one = send(&mut h, alice, "bob", 1);
        assert_eq!(message(&mut h, first)["seq"].as_u64(), Some(one));
        let two = send(&mut h, alice, "bob", 2);
        assert_eq!(message(&mut h, sibling)["seq"].as_u64(), Some(two));
        let three = send(&mut h, alice, "bob", 3);
        assert_eq!(message(&mut h, first)["seq"].as_u64(), Some(three));
        let acked = h.request(sibling, json!({"op":"ack","seq":two}));
        assert_eq!(acked["op"], "ok", "{acked}");
        h.mute(0, true);
        let failed = h.request(first, json!({"op":"ack","seq":one}));
        assert_eq!(failed["code"], "unavailable", "{failed}");
        let again = h.wait_for(sibling, |f| f["op"] == "message" && f["seq"] == one);
        assert_eq!(again["delivery"].as_u64(), Some(2), "{again}");
        h.mute(0, false);
        let nak = h.request(first, json!({"op":"nak","seq":one}));
        assert_eq!(nak["op"], "ok", "{nak}");
        h.advance(Duration::from_millis(500));
        let taken: Vec<Value> = h
            .take(sibling)
            .into_iter()
            .chain(h.take(first))
            .filter(|f| f["op"] == "message" && f["seq"] == one)
            .collect();
        assert!(taken.is_empty(), "taken from the sibling: {taken:?}");
    }

    #[test]
    fn an_inbox_refusal_is_queued_once_for_all_of_its_participants_sessions() {
        // Each of a participant's sessions is told; the frames were made at once, up to
        // 1,024 of them (its share of the broker's sessions) in the core's queue before
        // any budget saw one, each carrying JetStream's text of the refusal: a server or
        // a responder that misbehaves sets that text's length, up to max_payload.
        const SESSIONS: usize = 1024;
        let mut config = harness::development_config();
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.inbox.max_consumers = 2;
        }
        let mut h = Harness::new(config, 1, 3);
        let _alice = h.join(0, "alice", json!({}));
        let bob: Vec<Session> = (0..SESSIONS).map(|_| h.join(0, "bob", json!({}))).collect();
        // Bob's consumer deleted (an operator, or anyone with the account's JetStream
        // API); carol takes its room before it is asked for again.
        let deleted = h.nats_request("$JS.API.CONSUMER.DELETE.AMP_INBOX_dev.inbox_bob", &[], b"");
        assert_eq!(deleted["success"], true, "{deleted}");
        let _carol = h.join(0, "carol", json!({}));
        h.hold_output = true;
        h.advance(Duration::from_secs(2));
        let queued = h.broker(0).footprint().queued_outputs;
        h.hold_output = false;
        h.advance(Duration::from_millis(1));
        for &s in &bob {
            let told = h.take(s);
            let refusals = told
                .iter()
                .filter(|f| {
                    f["code"] == "unavailable"
                        && f["message"]
                            .as_str()
                            .is_some_and(|m| m.starts_with("your inbox is not delivered"))
                })
                .count();
            assert_eq!(refusals, 1, "{s:?} was told {told:?}");
        }
        assert!(
            queued < 16,
            "one refusal told to {SESSIONS} sessions left {queued} outputs in the core at once"
        );
    }

    /// Bob's inbox consumer refused (an `error` queued once for his three sessions), a
    /// reply queued for bob[0] behind it, and bob[0] closed before either is taken: what
    /// `counted` reads before and after.
    fn counted_with_a_session_closed_before_it_takes_them<T>(
        counted: impl Fn(&Harness) -> T,
    ) -> (T, T) {
        let mut config = harness::development_config();
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.inbox.max_consumers = 2;
        }
        let mut h = Harness::new(config, 1, 3);
        let _alice = h.join(0, "alice", json!({}));
        let bob: Vec<Session> = (0..3).map(|_| h.join(0, "bob", json!({}))).collect();
        let before = counted(&h);
        // As in the test above: bob's consumer is refused, and each session is told.
        let deleted = h.nats_request("$JS.API.CONSUMER.DELETE.AMP_INBOX_dev.inbox_bob", &[], b"");
        assert_eq!(deleted["success"], true, "{deleted}");
        let _carol = h.join(0, "carol", json!({}));
        h.hold_output = true;
        h.advance(Duration::from_secs(2));
        h.send(bob[0], json!({"op":"who","id":"w","ns":"nowhere"}));
        h.close(bob[0]);
        h.hold_output = false;
        h.advance(Duration::from_millis(1));
        for &s in &bob[1..] {
            let told = h.take(s);
            assert!(told.iter().any(|f| f["op"] == "error"), "{s:?}: {told:?}");
        }
        (before, counted(&h))
    }

    #[test]
    fn frames_are_counted_as_sent_only_when_their_session_takes_them() {
        // `amp_frames_out_total` counted a frame when the core queued it: one of a
        // refusal told to each of a participant's sessions, or a reply, for a session
        // closed before it was taken (gone, or shed by the transport for a full queue)
        // was counted and never sent.
        let (before, after) = counted_with_a_session_closed_before_it_takes_them(|h| {
            let registry = &h.broker(0).metrics.registry;
            registry
                .value("amp_frames_out_total", "error")
                .unwrap_or(0.0)
        });
        assert_eq!(after - before, 2.0, "frames for the closed session counted");
    }

    #[test]
    fn errors_are_counted_by_code_only_when_their_session_takes_them() {
        // `amp_errors_total` counted an error reply when the core made it, so one for a
        // session closed before it took it counted too, as `amp_frames_out_total` did.
        let (before, after) = counted_with_a_session_closed_before_it_takes_them(|h| {
            let mut text = String::new();
            h.broker(0).metrics.registry.render(&mut text);
            text.lines()
                .filter_map(|l| l.strip_prefix("amp_errors_total{code=\""))
                .filter_map(|l| {
                    let (code, n) = l.split_once("\"} ")?;
                    Some((code.to_string(), n.parse::<f64>().ok()?))
                })
                .collect::<std::collections::BTreeMap<String, f64>>()
        });
        let counted: Vec<(String, f64)> = after
            .iter()
            .map(|(code, n)| (code.clone(), n - before.get(code).unwrap_or(&0.0)))
            .filter(|(_, n)| *n != 0.0)
            .collect();
        assert_eq!(
            counted,
            [("unavailable".to_string(), 2.0)],
            "errors for the closed session counted"
        );
    }

    #[test]
    fn an_errors_code_is_counted_whatever_its_id_says() {
        // The code is read from the frame's text, behind the `re` the client chose.
        let mut h = bench(30, 8, 1);
        let alice = h.join(0, "alice", json!({}));
        let forged = r#"","code":"forged"#;
        let frame = json!({"op":"who","id":forged,"ns":"nowhere"});
        let e = h.request_text(alice, forged, &frame.to_string());
        assert_eq!((&e["re"], &e["code"]), (&json!(forged), &json!("schema")));
        let registry = &h.broker(0).metrics.registry;
        assert_eq!(registry.value("amp_errors_total", "schema"), Some(1.0));
        assert_eq!(registry.value("amp_errors_total", "forged"), None);
    }

    #[test]
    fn a_refusal_tells_sessions_a_bounded_clean_excerpt_of_the_answers_text() {
        // Whoever answers the account's `$JS.API` first (a server that misbehaves, a
        // client of the account subscribed there) chooses the refusal's description:
        // up to max_payload, control characters and all, it went whole into the frame
        // of each of the participant's sessions, and was kept for each that joins while
        // the refusal lasts.
        let mut h = bench(30, 8, 1);
        let bob: Vec<Session> = (0..3).map(|_| h.join(0, "bob", json!({}))).collect();
        let now = h.now;
        let responder = h.server.accept(now);
        h.server.receive(
            responder,
            b"CONNECT {\"headers\":true,\"verbose\":false}\r\n\
              SUB $JS.API.CONSUMER.CREATE.AMP_INBOX_dev.> 1\r\n",
            now,
        );
        let deleted = h.nats_request("$JS.API.CONSUMER.DELETE.AMP_INBOX_dev.inbox_bob", &[], b"");
        assert_eq!(deleted["success"], true, "{deleted}");
        // JetStream's own answer to the consumer's creation is lost on the way: the
        // responder's is the first the broker hears.
        h.deafen(0, true);
        let mut reply = None;
        for _ in 0..50 {
            h.advance(Duration::from_millis(100));
            let heard = String::from_utf8_lossy(&h.server.take_output(responder)).into_owned();
            reply = heard
                .split("\r\n")
                .find(|l| l.starts_with("MSG $JS.API.CONSUMER.CREATE.AMP_INBOX_dev.inbox_bob"))
                .and_then(|l| l.split(' ').nth(3).map(str::to_string));
            if reply.is_some() {
                break;
            }
        }
        let reply = reply.expect("the broker asks for bob's consumer again");
        h.deafen(0, false);
        let description = format!(
            "no\nINFO  participant=dev/alice forged line\u{1b}[2J\u{202e}{}",
            "x".repeat(512 * 1024)
        );
        let body =
            json!({"error":{"code":400,"err_code":10012,"description":description}}).to_string();
        let now = h.now;
        h.server.receive(
            responder,
            format!("PUB {reply} {}\r\n{body}\r\n", body.len()).as_bytes(),
            now,
        );
        h.advance(Duration::ZERO);
        for &s in &bob {
            let told = h.take(s);
            let refusal = told
                .iter()
                .filter_map(|f| f["message"].as_str())
                .find(|m| m.starts_with("your inbox is not delivered"))
                .unwrap_or_else(|| panic!("{s:?} was not told of the refusal: {told:?}"));
            let hidden = refusal
                .chars()
                .filter(|&c| c.is_control() || c == '\u{202e}')
                .count();
            assert!(
                refusal.len() < 1024 && hidden == 0,
                "{s:?} was told a refusal of {} bytes, {hidden} control characters: {:?}...",
                refusal.len(),
                refusal.chars().take(140).collect::<String>()
            );
        }
    }

    #[test]
    fn a_sender_cannot_name_itself_someone_else() {
        let mut h = bench(5, 8, 1);
        let alice = h.join(0, "alice", json!({}));
        let forged = h.request(
            alice,
            json!({"op":"send","to":"bob","from":"dev/carol","body":1}),
        );
        assert_eq!(forged["code"], "schema", "{forged}");
    }
}

/// What a participant's sessions are told while JetStream refuses its inbox consumer.
pub(super) fn inbox_refused_error(why: &str) -> AmpError {
    AmpError::new(
        ErrorCode::Unavailable,
        format!(
            "your inbox is not delivered: JetStream refused its consumer ({why}); \
             messages sent to you are kept, and the broker keeps asking"
        ),
    )
}
