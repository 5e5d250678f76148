//! Offering a delivered task: the record read, the choice of a serving session, the
//! offer frame and its watch, a claim or decline of it.

use super::*;

/// Where the record a delivered task is placed on comes from.
pub(super) enum RecordFrom {
    /// The message's own header (`record_in_message`): made with this very message.
    Message,
    /// The task store; with the message's `AMP-Task-Use` header.
    Store(Option<String>),
}

/// Who here may take a task ([`Jobs::admits`]).
enum Admits {
    Free,
    Busy,
    Nobody,
}

impl Jobs {
    pub(super) fn claim(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        let Some(key) = self.take_offer(caller, &re, task, Phase::Claiming) else {
            return;
        };
        let op = Op::Claim {
            session: caller.session,
            re,
        };
        self.write_local(conn, key, op, now);
    }

    pub(super) fn decline(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        // No longer claimable; the slot stays taken until the record says queued.
        let Some(key) = self.take_offer(caller, &re, task, Phase::Finishing) else {
            return;
        };
        let op = Op::Requeue {
            session: caller.session,
            re: Some(re),
        };
        self.write_local(conn, key, op, now);
    }

    /// The task's key when its offer is out to the caller's session, moving it to `next`;
    /// otherwise answers `lease_lost`.
    pub(super) fn take_offer(
        &mut self,
        caller: &Caller<'_>,
        re: &str,
        task: &str,
        next: Phase,
    ) -> Option<String> {
        let key = task_key(caller.ns, task);
        match self.tasks.get_mut(&key) {
            Some(t) if t.session == caller.session && t.phase == Phase::Offered => {
                t.phase = next;
                Some(key)
            }
            _ => {
                self.refuse(caller.session, re, lease_lost(task));
                None
            }
        }
    }

    /// Another broker asks (for a `status`) whether the offer of `key` is out here.
    pub(super) fn answer_offer_watch(&mut self, conn: &mut Connection, key: &str, msg: &Message) {
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        let answer = match self.unwritten_offer(key) {
            Some((by, at_ms)) => json!({"by": by, "at_ms": at_ms}),
            None => json!({}),
        };
        if let Err(e) = conn.publish(reply, None, None, answer.to_string().as_bytes()) {
            log::warn!(task:% = key; "offer watch answer not sent: {e}");
        }
    }

    pub(super) fn delivery(
        &mut self,
        conn: &mut Connection,
        qk: &str,
        msg: &Message,
        now: Instant,
    ) {
        // JetStream started the message's AckWait when it sent it, a moment before `now`;
        // `keep_message`'s margin covers the moment.
        let ack_basis = Some(now);
        let Some(ack) = msg.reply.clone() else {
            return;
        };
        let meta = AckMetadata::parse(&ack).ok();
        let delivered = meta.as_ref().map_or(1, |m| m.delivered);
        let stored_nanos = meta.as_ref().map(|m| m.timestamp_nanos);
        let Some(q) = self.queues.get_mut(qk) else {
            return;
        };
        let ns = q.ns.clone();
        let consumer_seq = meta.as_ref().map(|m| m.consumer_sequence);
        if consumer_seq.is_some_and(|seq| seq <= q.last_consumer_seq) {
            // The consumer's count went back: it was deleted and created again by someone
            // else (its earlier self may have delivered any waiting message). Trust no
            // record carried until this broker has seen it created again.
            log::warn!(queue:% = qk; "job consumer was created anew; creating it again");
            q.last_consumer_seq = 0;
            self.create_consumer(conn, qk, now);
        } else if let Some(seq) = consumer_seq {
            q.last_consumer_seq = seq;
        }
        let env = match Envelope::from_json(&msg.payload) {
            Ok(env) if env.kind == Kind::Task => env,
            _ => {
                log::warn!(
                    queue:% = qk, subject:% = msg.subject;
                    "terminating a malformed task message"
                );
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("malformed task envelope".into()),
                    },
                );
                return self.pull_more(conn, qk, now);
            }
        };
        let key = task_key(&ns, &env.id);
        if self.tasks.contains_key(&key) {
            if !self.another_copy(conn, &key, &ack)
                && let Some(t) = self.tasks.get_mut(&key)
            {
                // A redelivery of a task this broker already handles (its in-progress acks
                // were lost): keep the newest ack subject and carry on.
                t.ack_subject = ack;
                t.ack_basis = ack_basis;
            }
            return self.pull_more(conn, qk, now);
        }
        if let Some(read) = self.record_in_message(qk, delivered, stored_nanos, msg, &env) {
            if let Some(q) = self.queues.get_mut(qk) {
                q.unplaced += 1;
            }
            self.stats.record_reads_spared += 1;
            let watch = self.watch(conn, &key);
            let env = Box::new(env);
            self.placed(
                conn,
                qk,
                key.clone(),
                ack,
                delivered,
                env,
                (Ok(read), RecordFrom::Message),
                ack_basis,
                watch,
                now,
            );
            return self.drop_untaken_watch(conn, &key, watch);
        }
        match self.kv.get_request(&key) {
            Ok(req) => match self.request(conn, &req.subject, None, &req.payload, now) {
                Ok(id) => {
                    if let Some(q) = self.queues.get_mut(qk) {
                        q.unplaced += 1;
                    }
                    // The offer watch is made before the record's answer comes back on this
                    // connection, so the server has it before the offer can reach anybody:
                    // a `status` asked through another broker after the offer finds it.
                    let watch = self.watch(conn, &key);
                    let use_id = msg
                        .headers
                        .as_ref()
                        .and_then(|h| h.get(USE_HEADER))
                        .map(str::to_string);
                    self.await_reply(
                        id,
                        now,
                        Pending::DeliveryRead {
                            queue: qk.to_string(),
                            key,
                            ack,
                            delivered,
                            env: Box::new(env),
                            use_id,
                            ack_basis,
                            watch,
                        },
                    );
                }
                Err(e) => {
                    log::warn!(task:% = key; "task record read failed: {e}");
                    self.nak(conn, &ack, Some(RETRY_DELAY));
                }
            },
            Err(e) => {
                log::warn!(task:% = key; "task id not a key: {e}");
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("task id is not a valid key".into()),
                    },
                );
            }
        }
    }

    /// Whether `ack` delivers another message of task `key` than the one its local task
    /// here is on (a copy stored past the duplicate window, see `TaskRecord::msg_seq`):
    /// taken for a redelivery, it took over the local task's ack subject, and the
    /// task's own message, redelivered later, published its result a second time. The
    /// copy goes for good once the local task's record is bound to its own message, and
    /// comes back a little later until then (the offer here may be declined).
    pub(super) fn another_copy(&mut self, conn: &mut Connection, key: &str, ack: &str) -> bool {
        let Some(t) = self.tasks.get(key) else {
            return false;
        };
        let (Some(mine), Some(this)) = (message_seq(&t.ack_subject), message_seq(ack)) else {
            return false;
        };
        if mine == this {
            return false;
        }
        if t.record.msg_seq == Some(mine) {
            self.term_copy(conn, ack);
        } else {
            self.nak(conn, ack, Some(NO_TAKER_DELAY));
        }
        true
    }

    /// The record a task message carries (`AMP-Task-Record`, written at submit with the
    /// revision of the record's creation), when it may stand in for reading the task
    /// store: on the message's first delivery by a consumer whose state this broker saw
    /// after its last (re)connection, for a message stored after that (see
    /// `JobQueue::trust_after_nanos`). A record that changed since (a cancel while it
    /// waited) makes the claim's compare-and-set fail, which reads the record and
    /// answers `lease_lost` as for any offer that lost its task.
    fn record_in_message(
        &self,
        qk: &str,
        delivered: u64,
        stored_nanos: Option<u64>,
        msg: &Message,
        env: &Envelope,
    ) -> Option<(TaskRecord, u64)> {
        let q = self.queues.get(qk)?;
        if delivered != 1 || stored_nanos? <= q.trust_after_nanos? {
            return None;
        }
        let (revision, json) = msg.headers.as_ref()?.get(RECORD_HEADER)?.split_once(' ')?;
        let revision = revision.parse().ok()?;
        let record = TaskRecord::from_json(json.as_bytes()).ok()?;
        // Only the broker writes task messages (no participant's NATS permissions reach
        // the task stream); a record that does not describe this very message is read
        // from the store all the same.
        let fresh = record.id == env.id
            && record.submitted_by == env.from
            && record.job == q.job
            && record.state == TaskState::Queued
            && record.attempt == 0;
        fresh.then_some((record, revision))
    }

    /// Whether the task message `env` with `AMP-Task-Use` header `use_id`, delivered by
    /// job queue `qk`, is the submission `record` was made for
    /// ([`TaskRecord::submitted_as`]).
    fn submission_of(
        &self,
        qk: &str,
        record: &TaskRecord,
        use_id: Option<&str>,
        env: &Envelope,
    ) -> bool {
        self.queues
            .get(qk)
            .is_some_and(|q| record.submitted_as(use_id, &env.from, &q.job, &env.body))
    }

    /// A delivered task that is finished: make sure the submitter heard (the result's
    /// message id dedupes a repeat), then ack the message away.
    pub(super) fn finished_delivery(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        ack: String,
        now: Instant,
    ) {
        if matches!(record.state, TaskState::Completed | TaskState::Failed) {
            // Who finished it: the holder, or the broker whose exhaust failed it.
            let by = record
                .holder
                .as_deref()
                .or_else(|| record.history.last().map(|h| h.by.as_str()))
                .unwrap_or_default()
                .to_string();
            self.outcome(conn, record, &by, Some((ack, AckKind::Ack)), None, now);
        } else {
            self.ack(conn, &ack, AckKind::Ack);
        }
    }

    /// The record of a delivered task arrived: offer it, finish it, or release it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn placed(
        &mut self,
        conn: &mut Connection,
        qk: &str,
        key: String,
        ack: String,
        delivered: u64,
        env: Box<Envelope>,
        (read, from): (Result<(TaskRecord, u64), JsError>, RecordFrom),
        ack_basis: Option<Instant>,
        premade_watch: Option<Sid>,
        now: Instant,
    ) {
        if let Some(q) = self.queues.get_mut(qk) {
            q.unplaced = q.unplaced.saturating_sub(1);
        }
        if self.tasks.contains_key(&key) {
            if !self.another_copy(conn, &key, &ack)
                && let Some(t) = self.tasks.get_mut(&key)
            {
                // Delivered twice while the first delivery's record was being read (its
                // AckWait ran out meanwhile): one local task, on the newer delivery's ack
                // subject.
                let seq = |a: &str| AckMetadata::parse(a).map_or(0, |m| m.consumer_sequence);
                if seq(&ack) > seq(&t.ack_subject) {
                    t.ack_subject = ack;
                    t.ack_basis = ack_basis;
                }
            }
            return self.pull_more(conn, qk, now);
        }
        let (record, revision) = match read {
            Ok(r) => r,
            Err(JsError::KeyNotFound) if delivered >= MAX_ORPHAN_DELIVERIES => {
                log::warn!(task:% = key; "terminating a task without a record");
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("no task record".into()),
                    },
                );
                return self.pull_more(conn, qk, now);
            }
            Err(e) => {
                log::warn!(task:% = key; "task record unreadable: {e}");
                self.nak(conn, &ack, Some(RETRY_DELAY));
                return self.pull_more(conn, qk, now);
            }
        };
        if record
            .msg_seq
            .zip(message_seq(&ack))
            .is_some_and(|(bound, seq)| bound != seq)
        {
            // Neither offered nor finished again: the task's own message does both.
            self.term_copy(conn, &ack);
            return self.pull_more(conn, qk, now);
        }
        if let RecordFrom::Store(use_id) = &from
            && record.msg_seq.is_none()
            && !self.submission_of(qk, &record, use_id.as_deref(), &env)
        {
            // A message of an earlier use of the task id, whose record expired: offered
            // under this one it ran a cancelled task, or another submitter's body for
            // this record's submitter, whose own message was then terminated as a copy;
            // the same submitter's same body ran with the cancelled submit's headers.
            log::info!(task:% = key; "a message of an earlier use of the task id is terminated");
            let reason = Some("a message of an earlier use of the task id".into());
            self.ack(conn, &ack, AckKind::Term { reason });
            return self.pull_more(conn, qk, now);
        }
        let now_ms = self.clock.ms(now);
        match record.on_delivery(now_ms) {
            // A crash or a lost ack between the outcome and the ack.
            OnDelivery::Finished => self.finished_delivery(conn, &record, ack, now),
            OnDelivery::Held { until_ms } => {
                let wait = u64::try_from(until_ms - now_ms).unwrap_or(0) + 50;
                self.nak(conn, &ack, Some(Duration::from_millis(wait)));
            }
            OnDelivery::Exhaust => {
                let write = Write {
                    key,
                    op: Op::Exhaust,
                    ack: Some(ack),
                    tries: 0,
                };
                self.cas(conn, write, &record, revision, now);
            }
            OnDelivery::Offer => {
                let Some(session) = self.choose(qk, &key, record.eligible.as_ref(), now) else {
                    // A session here with a free slot declined it lately: soon again. Every
                    // session here that may take it is busy: later and later, a little.
                    // None may take it at all: later still (it may be nobody's anywhere).
                    let delay = match self.admits(qk, record.eligible.as_ref()) {
                        Admits::Free => NO_TAKER_DELAY,
                        Admits::Busy => no_taker_delay(delivered, BUSY_TAKER_DELAY_MAX),
                        Admits::Nobody => no_taker_delay(delivered, NO_TAKER_DELAY_MAX),
                    };
                    self.nak(conn, &ack, Some(delay));
                    return self.pull_more(conn, qk, now);
                };
                let Some((ns, job)) = self.queues.get(qk).map(|q| (q.ns.clone(), q.job.clone()))
                else {
                    return;
                };
                let participant = self
                    .workers
                    .get(&session)
                    .map(|w| format!("{}/{}", w.ns, w.name))
                    .unwrap_or_default();
                self.slot_taken(session, &job);
                self.next_generation += 1;
                // An offer made on a record that already names another offer would have to
                // replace it, so it is written; so is one past the watches this broker keeps.
                let watch = premade_watch.filter(|_| record.state != TaskState::Offered);
                let record = Rc::new(record);
                self.tasks.insert(
                    key.clone(),
                    LocalTask {
                        ns,
                        job,
                        session,
                        participant,
                        ack_subject: ack.clone(),
                        phase: Phase::Offering,
                        record: Rc::clone(&record),
                        revision,
                        leased: false,
                        generation: self.next_generation,
                        extending: 0,
                        waiting: Default::default(),
                        heartbeat_sent: None,
                        next_heartbeat: None,
                        pacing: false,
                        offer_until: None,
                        offered_at_ms: self.clock.ms(now),
                        watch,
                        ack_basis,
                        progress_at: None,
                        lease_timer_at: None,
                    },
                );
                match watch {
                    Some(_) => self.send_offer(&key, session, &env, &record, now),
                    None => {
                        let write = Write {
                            key,
                            op: Op::Offer { session, env },
                            ack: Some(ack),
                            tries: 0,
                        };
                        self.cas(conn, write, &record, revision, now);
                    }
                }
            }
        }
        self.pull_more(conn, qk, now);
    }

    pub(super) fn choose(
        &mut self,
        qk: &str,
        key: &str,
        eligible: Option<&Eligible>,
        now: Instant,
    ) -> Option<SessionId> {
        if let Some(list) = self.declines.get_mut(key) {
            list.retain(|(_, at)| now.saturating_duration_since(*at) < DECLINE_MEMORY);
            if list.is_empty() {
                self.declines.remove(key);
            }
        }
        let declined = self.declines.get(key);
        let q = self.queues.get(qk)?;
        let candidates = self.workers.iter().filter_map(|(id, w)| {
            if declined.is_some_and(|d| d.iter().any(|(s, _)| s == id)) {
                return None;
            }
            let s = w.serving.get(&q.job).filter(|_| w.ns == q.ns)?;
            Some(Candidate {
                session: *id,
                name: &w.name,
                labels: &w.labels,
                slots: s.slots,
                in_flight: s.in_flight,
                idle_since: s.idle_since,
            })
        });
        worker_choice::choose(candidates, eligible)
    }

    /// Whether any session here serving the job may take a task restricted to
    /// `eligible`, busy, declining or not.
    /// Whether a session here may take a task of `qk` with `eligible`, and has a slot.
    fn admits(&self, qk: &str, eligible: Option<&Eligible>) -> Admits {
        let Some(q) = self.queues.get(qk) else {
            return Admits::Nobody;
        };
        let mut found = Admits::Nobody;
        for w in self.workers.values() {
            let serving = w.serving.get(&q.job);
            let Some(s) = serving.filter(|_| w.ns == q.ns) else {
                continue;
            };
            if !eligible.is_none_or(|e| e.admits(&w.name, &w.labels)) {
                continue;
            }
            if s.in_flight < s.slots {
                return Admits::Free;
            }
            found = Admits::Busy;
        }
        found
    }

    pub(super) fn remember_decline(&mut self, key: &str, session: SessionId, now: Instant) {
        if self.declines.len() >= MAX_DECLINES {
            self.declines.retain(|_, list| {
                list.retain(|(_, at)| now.saturating_duration_since(*at) < DECLINE_MEMORY);
                !list.is_empty()
            });
            if self.declines.len() >= MAX_DECLINES {
                self.declines.clear();
            }
        }
        self.declines
            .entry(key.to_string())
            .or_default()
            .push((session, now));
    }

    pub(super) fn slot_taken(&mut self, session: SessionId, job: &str) {
        if let Some(s) = self
            .workers
            .get_mut(&session)
            .and_then(|w| w.serving.get_mut(job))
        {
            s.in_flight += 1;
        }
    }

    /// The offer of local task `key` goes to `session`, lapsing after the job's `offer_ms`.
    pub(super) fn send_offer(
        &mut self,
        key: &str,
        session: SessionId,
        env: &Envelope,
        record: &TaskRecord,
        now: Instant,
    ) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        t.phase = Phase::Offered;
        let (ns, job, generation) = (t.ns.clone(), t.job.clone(), t.generation);
        let cfg = self.job_config(&ns, &job);
        let offer_until = after(now, Duration::from_millis(cfg.offer_ms));
        if let Some(t) = self.tasks.get_mut(key) {
            t.offer_until = Some(offer_until);
        }
        self.stats.offers += 1;
        let text = FrameWriter::new(amp_frame::server_op::OFFER)
            .str("task", &record.id)
            .str("job", &job)
            .str("from", &env.from)
            .raw("body", &env.body)
            .str_map("headers", &env.headers)
            .uint("attempt", u64::from(record.attempt) + 1)
            .uint("max_attempts", u64::from(record.max_attempts))
            .uint("lease_s", cfg.lease_s)
            .uint("offer_ms", cfg.offer_ms)
            .finish();
        self.out.push_back(JobsOutput::Frame { session, text });
        let key = key.to_string();
        self.later
            .push(offer_until, Alarm(Timer::OfferExpiry { key, generation }));
    }

    /// A subscription that will answer `status` for an offer of `key` made here; none
    /// past the watches this broker keeps (such an offer is written instead).
    pub(super) fn watch(&mut self, conn: &mut Connection, key: &str) -> Option<Sid> {
        if self.watches.len() >= MAX_OFFER_WATCHES {
            return None;
        }
        match conn.subscribe(&offer_subject(key), None) {
            Ok(sid) => {
                self.watches.insert(sid, key.to_string());
                Some(sid)
            }
            Err(e) => {
                log::warn!(task:% = key; "offer watch not made: {e}");
                None
            }
        }
    }

    /// The subscription answering `status` for the offer of `key` ends.
    pub(super) fn unwatch(&mut self, conn: &mut Connection, key: &str) {
        if let Some(sid) = self.tasks.get_mut(key).and_then(|t| t.watch.take()) {
            self.drop_watch(conn, sid);
        }
    }

    pub(super) fn drop_watch(&mut self, conn: &mut Connection, sid: Sid) {
        self.watches.remove(&sid);
        if let Err(e) = conn.unsubscribe(sid, None) {
            log::warn!("offer watch not ended: {e}");
        }
    }
}
