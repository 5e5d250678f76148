//! Sessions: the challenge, `hello` (authentication, the throttle of failed ones, the
//! scoped JWT), the dispatch of every later frame, and the end of a session.

use super::*;

impl Broker {
    /// A WebSocket session was upgraded: send the challenge and start the hello clock.
    pub(super) fn session_opened(&mut self, session: SessionId, peer: SocketAddr, now: Instant) {
        let nonce = self.nonces.next_nonce();
        self.sessions.insert(
            session,
            Box::new(Session {
                state: SessionState::AwaitingHello { nonce },
                peer,
                entry: None,
                last_to: None,
                outstanding: Outstanding::default(),
                charged: HashMap::new(),
                participant_outstanding: Rc::default(),
                inflight: IdMap::default(),
                moved: IdMap::default(),
                subs: HashMap::new(),
                deleting: 0,
            }),
        );
        let challenge = FrameWriter::new(amp_frame::server_op::CHALLENGE)
            .str("nonce", &base64_url(&nonce))
            .str("broker", &self.broker_id)
            .str("amp", "1")
            .finish();
        self.frame(session, challenge);
        let timeout = Duration::from_secs(self.config.limits.hello_timeout_s);
        self.set_timer(after(now, timeout), Timer::HelloTimeout(session));
    }

    /// One line for the end of a session: at `info` for one that logged in, with its
    /// participant; at `debug` for one that never did, as anyone can cause one of those
    /// per connection. A peer's close reason is its own text and is left out.
    pub(super) fn log_session_end(
        &self,
        session: SessionId,
        code: u16,
        reason: &str,
        by_peer: bool,
    ) {
        let id = format_args!("{}-{session}", self.broker_id);
        // A vanished peer sent no close: the reason is the transport's own.
        let by = if by_peer && code != close::ABNORMAL {
            "by the peer"
        } else {
            reason
        };
        match self.participant_of(session) {
            Some(p) => log::info!(session:% = id, participant:% = p; "session ended: {code} {by}"),
            None => log::debug!(session:% = id; "session ended: {code} {by}"),
        }
    }

    /// The participant a session logged in as, also while it closes.
    pub(super) fn participant_of(&self, session: SessionId) -> Option<String> {
        match &self.sessions.get(&session)?.state {
            SessionState::Active { ns, name }
            | SessionState::Closing {
                participant: Some((ns, name)),
            } => Some(participant_key(ns, name)),
            _ => None,
        }
    }

    /// The session is gone (closed by either side). Its unacknowledged inbox deliveries
    /// are handed back to JetStream at once, so the participant's next session gets them.
    pub(super) fn session_closed(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        now: Instant,
    ) {
        self.drop_subscriptions(conn, session, now);
        // Its lookups and creations are moot now; its deletes are still owed.
        for (req, pending, queued) in self.api.remove(session) {
            if pending.deleting_for().is_some() {
                self.api.push(Lane::Cleanup, (req, pending, queued));
            }
        }
        let Some(s) = self.sessions.remove(&session) else {
            return;
        };
        let all = &s.participant_outstanding;
        all.set(all.get().saturating_sub(s.outstanding.len()));
        let participant = match s.state {
            SessionState::Active { ns, name } => Some((ns, name)),
            SessionState::Closing { participant } => participant,
            SessionState::AwaitingHello { .. } => None,
        };
        if let Some((ns, _)) = &participant {
            self.unwatch(ns, session);
        }
        if let Some((ns, name)) = participant {
            self.metrics
                .registry
                .gauge_add(self.metrics.sessions, "", -1.0);
            let key = participant_key(&ns, &name);
            let last = match self.presence.get_mut(&key) {
                Some(p) => {
                    p.sessions.retain(|&x| x != session);
                    p.unwritten.remove(&session);
                    p.held.remove(&session);
                    p.sessions.is_empty()
                }
                None => false,
            };
            if !last {
                // The inbox may have waited for this session to write.
                self.check_pull_at(None, PullOwner::Inbox(key.clone()));
            }
            if last {
                if let Some(mut p) = self.presence.remove(&key) {
                    self.registry_kept
                        .left(&key, std::mem::take(&mut p.registry));
                    if let Some(sid) = p.inbox.detach(conn) {
                        self.routes.remove(&sid);
                    }
                    let rate = f64::from(self.config.limits.presence_listed_per_s);
                    if !p.listing.refilled(rate, now) {
                        *self
                            .listing_debts
                            .get_or_insert_with(key.clone(), || p.listing) = p.listing;
                    }
                }
                // One a reload asked to keep is still wanted.
                if !self.kept_inboxes.contains(&key) {
                    self.inbox_creates.withdraw(&key);
                }
                self.registry_sync(conn, &ns, &name, now);
            }
        }
        // Handed back after the last session's inbox pull is unsubscribed: JetStream
        // gives a naked message to a waiting pull whose reply subject still has
        // interest, so naked first it could go straight back to that pull, which
        // nobody reads any more.
        for ack_subject in s.inflight.values() {
            let _ = conn.publish(
                ack_subject,
                None,
                None,
                &AckKind::Nak { delay: None }.payload(),
            );
        }
        self.jobs.session_closed(conn, session, now);
        self.drain_jobs(conn, now);
    }

    /// One text frame from a session.
    pub(super) fn session_frame(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        text: &str,
        now: Instant,
    ) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        match &s.state {
            SessionState::Closing { .. } => {}
            SessionState::AwaitingHello { nonce } => {
                let (nonce, peer) = (*nonce, s.peer);
                let decoded = self.validator.decode(text);
                self.count_in(&decoded);
                match decoded {
                    Ok(ClientFrame::Hello(hello)) => {
                        self.hello(conn, session, peer, &hello, &nonce, now)
                    }
                    Ok(other) => self.refuse(session, other.id()),
                    Err(r) if r.error.code == ErrorCode::BadFrame => {
                        self.error(session, r.re.as_deref(), &r.error);
                        self.close(session, close::POLICY, "bad frame before hello");
                    }
                    Err(r) => self.refuse(session, r.re.as_deref()),
                }
            }
            SessionState::Active { ns, name } => {
                let (ns, name) = (ns.clone(), name.clone());
                let decoded = self.validator.decode(text);
                self.count_in(&decoded);
                match decoded {
                    Ok(frame) => self.dispatch(conn, session, &ns, &name, frame, now),
                    Err(r) => self.error(session, r.re.as_deref(), &r.error),
                }
            }
        }
        self.drain_jobs(conn, now);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn hello(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        peer: SocketAddr,
        hello: &Hello,
        nonce: &[u8; 32],
        now: Instant,
    ) {
        let (ns, name) = (hello.ns.as_str(), hello.name.as_str());
        let key = participant_key(ns, name);
        let throttled = match self.throttle.check(peer.ip(), &key, now) {
            Verdict::Delay(wait) => Some(wait),
            _ => None,
        };
        let credential = match &hello.auth {
            Auth::Token { token } => Credential::Token(token),
            Auth::Nkey { nkey, sig } => Credential::NKey { nkey, sig },
        };
        let participant = self.config.participant(ns, name);
        // Too many failures from here or for this name: a token is not even checked, so
        // guessing stays slow. An NKey signature of this session's nonce is no guess, so
        // it is checked and a good one passes: failures in someone's name, from anywhere,
        // cannot lock an NKey participant out.
        let nkey = matches!(hello.auth, Auth::Nkey { .. });
        let verified =
            (throttled.is_none() || nkey) && auth::verify(participant, credential, nonce);
        if let Some(wait) = throttled.filter(|_| !verified) {
            // The answer says when to try again and nothing else.
            let e = AmpError::rate_limited(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX));
            self.error(session, Some(&hello.id), &e);
            return self.close(session, close::POLICY, "too many failed hellos");
        }
        // Checked whether or not the participant exists: the same work either way.
        if !verified {
            log::info!(session:% = format_args!("{}-{session}", self.broker_id), participant:% = key, peer:% = peer; "hello refused"
            );
            self.throttle.record_failure(peer.ip(), &key, now);
            return self.refuse(session, Some(&hello.id));
        }
        self.throttle.record_success(peer.ip(), &key, now);
        let max = self.config.limits.max_sessions_per_participant;
        if self
            .presence
            .get(&key)
            .is_some_and(|p| p.sessions.len() >= max)
        {
            // Its share of the broker's sessions is taken: however many addresses it
            // comes from, one participant cannot hold all of `max_sessions`.
            let mut e = AmpError::rate_limited(SESSIONS_FULL_RETRY_MS);
            e.message = format!("a participant holds at most {max} sessions on this broker").into();
            self.error(session, Some(&hello.id), &e);
            return self.close(
                session,
                close::POLICY,
                "too many sessions of this participant",
            );
        }
        self.metrics
            .registry
            .gauge_add(self.metrics.sessions, "", 1.0);
        let id = Some(hello.id.clone());
        let (ns, name) = (ns.to_string(), name.to_string());
        self.out.push_back(Output::LoggedIn { session }.into());
        if let Some(s) = self.sessions.get_mut(&session) {
            s.state = SessionState::Active {
                ns: Rc::from(ns.as_str()),
                name: Rc::from(name.as_str()),
            };
            s.entry = self.config.entry(&ns, &name).cloned();
        }
        let first = !self.presence.contains_key(&key);
        let written = if first {
            self.registry_kept.arrived(&key)
        } else {
            registry::Written::default()
        };
        let window = self
            .config
            .namespaces
            .get(&ns)
            .map_or(64, |n| n.inbox.inbox_window);
        let presence = self.presence.entry(key.clone()).or_insert_with(|| {
            Box::new(Presence {
                sessions: Vec::new(),
                labels: labels(&hello.labels, participant),
                declared: hello.labels.clone(),
                since: self.clock.timestamp(now),
                // Its window of unacknowledged messages bounds their number, not their
                // size: each pull brings at most a quarter of a session's outbound
                // bound, the next once a session of the participant has written it.
                inbox: PullLoop::new(
                    binding::inbox_stream(&ns),
                    binding::inbox_consumer(&name),
                    window,
                )
                .paced((self.config.limits.max_outbound_bytes / 4) as u64)
                .in_domain(self.config.js_api(&ns)),
                unwritten: IdSet::default(),
                held: IdSet::default(),
                inbox_refused: None,
                registry_due: false,
                listing: self
                    .listing_debts
                    .remove(&key)
                    .unwrap_or_else(|| rate_limit::DebtBucket::new(now)),
                registry: written,
            })
        });
        presence.sessions.push(session);
        if let Some(s) = self.sessions.get_mut(&session) {
            s.participant_outstanding = self.in_flight.count(&key);
        }
        let refused = presence
            .inbox_refused
            .as_ref()
            .map(|(_, why)| super::inbox::inbox_refused_error(why));
        let limits = &self.config.limits;
        let mut reply = FrameWriter::ok(id.as_deref())
            .str("session", &format!("{}-{session}", self.broker_id))
            .str("participant", &key)
            .value("heartbeat_s", &limits.heartbeat_s)
            .value("max_frame", &limits.max_frame);
        if let (Some(issuer), Some(p)) = (&self.issuer, self.config.participant(&ns, &name)) {
            let mig = readable_dead_letters(&self.config, &ns, p);
            let (now_s, ttl) = (self.clock.unix_seconds(now), self.config.callout.jwt_ttl_s);
            let subs = scoped_jwt::subscription_cap(&self.config, &ns);
            match scoped_jwt::hello_jwt(issuer, &ns, &name, p, subs, now_s, ttl, mig.as_deref()) {
                Ok(jwt) => reply = reply.str("jwt", &jwt),
                Err(e) => log::warn!(participant:% = key; "no JWT for the participant: {e}"),
            }
        }
        self.frame(session, reply.finish());
        if let Some(e) = refused {
            self.error(session, None, &e);
        }
        log::info!(session:% = format_args!("{}-{session}", self.broker_id), participant:% = key; "hello");
        if !hello.serve.is_empty()
            && let (Some(participant), Some(p)) =
                (self.config.participant(&ns, &name), self.presence.get(&key))
        {
            let caller = Caller {
                session,
                ns: &ns,
                name: &name,
                participant,
                labels: &p.labels,
            };
            self.jobs.serve_from_hello(conn, &caller, &hello.serve, now);
        }
        if first {
            self.registry_put(conn, &ns, &name, now);
            self.ensure_inbox_consumer(conn, &ns, &name, now);
        } else {
            // An inbox waiting for its grant may get it from this session too.
            self.check_pull_at(None, PullOwner::Inbox(key));
        }
    }

    /// The one answer to any failed `hello`: it never says which part was wrong.
    pub(super) fn refuse(&mut self, session: SessionId, id: Option<&str>) {
        let e = AmpError::new(ErrorCode::Unauthenticated, "authentication failed");
        self.error(session, id, &e);
        self.close(session, close::POLICY, "unauthenticated");
    }

    pub(super) fn dispatch(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        frame: ClientFrame,
        now: Instant,
    ) {
        if let Some(id) = frame.id() {
            let limits = &self.config.limits;
            let (own, all) = (
                limits.max_requests_in_flight,
                limits.max_participant_requests_in_flight,
            );
            let Some(s) = self.sessions.get_mut(&session) else {
                return;
            };
            let full = if s.outstanding.len() >= own {
                Some(format!("a session has at most {own} requests in flight"))
            } else if s.participant_outstanding.get() >= all {
                Some(format!(
                    "a participant has at most {all} requests in flight over its sessions"
                ))
            } else {
                None
            };
            if let Some(why) = full
                && !s.outstanding.contains(id)
            {
                // Each may hold one of the broker's NATS request slots, which all
                // sessions share: a session waits for answers rather than taking more.
                let mut e = AmpError::rate_limited(in_flight::FULL_RETRY_MS);
                e.message = format!("{why}; wait for their answers").into();
                return self.error(session, Some(id), &e);
            }
            if !s.outstanding.insert(id) {
                let e = AmpError::new(
                    ErrorCode::Schema,
                    "id is already used by an outstanding request",
                )
                .with_path("/id");
                return self.error(session, Some(id), &e);
            }
            let all = &s.participant_outstanding;
            all.set(all.get() + 1);
        }
        match frame {
            ClientFrame::Ping { id } => self.ok(session, &id, FrameWriter::ok(Some(&id))),
            ClientFrame::Bye { id } => {
                self.ok(session, &id, FrameWriter::ok(Some(&id)));
                self.close(session, close::NORMAL, "bye");
            }
            ClientFrame::Send(send) => self.send(conn, session, ns, name, send, now),
            ClientFrame::Ack(ack) => match ack.sub {
                Some(sub) => self.event_ack(conn, session, ack.id, &sub, ack.seq, now),
                None => self.inbox_ack(conn, session, ack.id, ack.seq, AckKind::Ack, now),
            },
            ClientFrame::Publish(p) => self.publish(conn, session, ns, name, p, now),
            ClientFrame::Subscribe(f) => self.subscribe(conn, session, ns, name, f, now),
            ClientFrame::Unsubscribe { id, sub } => self.unsubscribe(conn, session, id, sub, now),
            ClientFrame::Nak(nak) => {
                let kind = AckKind::Nak {
                    delay: nak.delay_ms.map(Duration::from_millis),
                };
                self.inbox_ack(conn, session, nak.id, nak.seq, kind, now)
            }
            ClientFrame::Who { id, job } => self.who(session, ns, &id, job.as_deref(), now),
            ClientFrame::Watch { id } => self.watch(session, ns, &id, now),
            ClientFrame::Hello(hello) => {
                let e = AmpError::new(ErrorCode::Conflict, "this session has already said hello");
                self.fail(session, &hello.id, e);
            }
            frame if Jobs::handles(&frame) => {
                if let ClientFrame::DeadLetters(d) = &frame {
                    // Each page reads up to `dead_letters::SCAN` stored letters, one after
                    // another: paced as listings are.
                    if !self.charge_listing(session, &d.id, dead_letters::SCAN, now) {
                        return;
                    }
                }
                // A redrive is a submit whose body is already stored.
                let submitting = match &frame {
                    ClientFrame::Submit(s) => Some((&s.id, s.body.get().len())),
                    ClientFrame::Redrive { id, .. } => Some((id, 0)),
                    _ => None,
                };
                if let Some((id, bytes)) = submitting {
                    if let Some(e) = self.refusal(session, ns, name, &frame) {
                        return self.fail(session, id, e);
                    }
                    // Its body alone will not fit in a stored message: refused before it
                    // is charged (one within the bound whose envelope does not fit is
                    // refused by the engine, which gives its budget back).
                    let max = conn.max_payload();
                    if bytes > max {
                        let e = AmpError::new(
                            ErrorCode::TooLarge,
                            format!(
                                "the body is {bytes} bytes; the server allows {max} for the stored task"
                            ),
                        );
                        return self.fail(session, id, e);
                    }
                    // Refused for want of room later, it would have spent its budget: the
                    // client's retry with its task id would find the budget spent and
                    // no task.
                    if !self.jobs.held_bytes().has_room(bytes) {
                        return self.fail(session, id, crate::broker::held_bytes::full());
                    }
                    match self.take_rate(ns, name, bytes, now) {
                        Err(e) => return self.fail(session, id, e),
                        Ok(Some(rate)) => {
                            if let Some(s) = self.sessions.get_mut(&session) {
                                s.charged.entry(id.to_string()).or_default().rate = Some(rate);
                            }
                        }
                        Ok(None) => {}
                    }
                    if !self.spend_budget(conn, session, ns, name, &frame, now) {
                        return;
                    }
                }
                self.hand_to_jobs(conn, session, ns, name, frame, now);
            }
            other => {
                let op = other.op();
                let e = AmpError::new(
                    ErrorCode::Internal,
                    format!("`{}` is not available on this broker yet", op.as_str()),
                );
                if let Some(id) = other.id() {
                    self.fail(session, id, e);
                }
            }
        }
    }
}

/// Labels a session declares, with the configuration's on top: an operator's label
/// cannot be overridden by the participant.
pub(super) fn labels(
    declared: &BTreeMap<String, String>,
    participant: Option<&Participant>,
) -> BTreeMap<String, String> {
    let mut labels = declared.clone();
    labels.extend(participant.map(|p| p.labels.clone()).unwrap_or_default());
    labels
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! Sessions driven in process: the core on the NATS/JetStream model, one virtual clock.

    use std::time::Duration;

    use serde_json::json;

    use crate::testing::harness::Harness;

    #[test]
    fn a_wrong_token_and_a_first_frame_that_is_not_hello_are_unauthenticated() {
        let mut h = Harness::development(1);
        for first in [
            json!({"op":"hello","ns":"dev","name":"eve","auth":{"type":"token","token":"guess"}}),
            json!({"op":"send","to":"bob","body":1}),
        ] {
            let s = h.open(0);
            h.wait_for(s, |f| f["op"] == "challenge");
            let answer = h.request(s, first);
            assert_eq!(answer["code"], "unauthenticated", "{answer}");
            assert_eq!(h.closed(s).map(|c| c.0), Some(1008));
        }
    }

    #[test]
    fn failed_hellos_in_a_participants_name_do_not_lock_its_nkey_out() {
        // The throttle slows guessing; an NKey signature of this session's nonce is no
        // guess. An attacker failing hellos in ann's name (from ann's address, or emptying
        // her bucket from many) held ann's own, correctly signed hellos back for as long as
        // it kept failing.
        use crate::nkeys::{KeyKind, KeyPair};
        use base64::Engine;
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let ann = KeyPair::generate(KeyKind::User).expect("key");
        let mut config = crate::testing::harness::development_config();
        if let Some(dev) = config.namespaces.get_mut("dev") {
            let Some(mut p) = dev.open.as_deref().cloned() else {
                panic!("the development namespace is open");
            };
            p.token_sha256 = None;
            p.nkey = Some(ann.public_key());
            dev.participants.insert("ann".into(), p.into());
        }
        let mut h = Harness::new(config, 1, 7);
        for _ in 0..40 {
            let s = h.open(0);
            h.wait_for(s, |f| f["op"] == "challenge");
            h.request(
                s,
                json!({"op":"hello","ns":"dev","name":"ann","auth":{"type":"token","token":"guess"}}),
            );
        }
        let hello = |h: &mut Harness, key: &KeyPair| {
            let s = h.open(0);
            let challenge = h.wait_for(s, |f| f["op"] == "challenge");
            let nonce = URL_SAFE_NO_PAD
                .decode(challenge["nonce"].as_str().unwrap_or_default())
                .expect("nonce");
            let sig = URL_SAFE_NO_PAD.encode(key.sign(&nonce));
            h.request(
                s,
                json!({"op":"hello","ns":"dev","name":"ann",
                       "auth":{"type":"nkey","nkey":ann.public_key(),"sig":sig}}),
            )
        };
        let other = KeyPair::generate(KeyKind::User).expect("key");
        let forged = hello(&mut h, &other);
        assert_eq!(
            forged["code"], "rate_limited",
            "a wrong signature waits: {forged}"
        );
        let ok = hello(&mut h, &ann);
        assert_eq!(ok["op"], "ok", "ann's own key: {ok}");
    }

    #[test]
    fn a_silent_client_is_closed_after_the_hello_timeout() {
        let mut h = Harness::development(1);
        let s = h.open(0);
        h.advance(Duration::from_secs(4));
        assert_eq!(h.closed(s), None);
        h.advance(Duration::from_secs(2));
        assert_eq!(h.closed(s).map(|c| c.0), Some(1008));
    }

    #[test]
    fn ping_answers_and_bye_closes_normally() {
        let mut h = Harness::development(1);
        let s = h.join(0, "alice", json!({}));
        assert_eq!(h.request(s, json!({"op":"ping"}))["op"], "ok");
        assert_eq!(h.request(s, json!({"op":"bye"}))["op"], "ok");
        h.advance(Duration::from_millis(100));
        assert_eq!(h.closed(s).map(|c| c.0), Some(1000));
        assert_eq!(h.broker(0).footprint().sessions, 0);
    }
}
