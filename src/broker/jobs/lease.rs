//! Leases: claims, heartbeats and in-progress acks, expiry and revocation.

use super::*;

/// Heartbeats of one lease that may wait for the one being written (or paced); more are
/// answered `rate_limited`.
const MAX_WAITING_CHANGES: usize = 64;

/// How long past `lease_until` the last keep of a lease holds its message (a delivery's
/// broker finding the lease still running waits as long past it).
const PAST_LEASE: Duration = Duration::from_millis(50);

/// A message JetStream would hold longer than this past a lease's end is released then.
const HELD_SLACK: Duration = Duration::from_millis(250);

impl Jobs {
    /// `heartbeat`, `complete` and `fail`: changes only the lease holder may make.
    pub(super) fn lease_op(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        task: &str,
        op: Op,
        now: Instant,
    ) {
        let key = task_key(caller.ns, task);
        let now_ms = self.clock.ms(now);
        let session = self.session_name(caller.session);
        let holds = self.tasks.get(&key).is_some_and(|t| {
            t.session == caller.session
                && t.phase == Phase::Leased
                && t.record.leased_to(&session, now_ms)
        });
        if !holds {
            if let Some((s, re)) = op.answer_to() {
                let re = re.to_string();
                self.refuse(s, &re, lease_lost(task));
            }
            return;
        }
        let Some(t) = self.tasks.get_mut(&key) else {
            return;
        };
        let heartbeat = matches!(op, Op::Heartbeat { .. });
        let paced = heartbeat && t.next_heartbeat.is_some_and(|at| at > now);
        if t.extending == 0 && t.waiting.is_empty() && !paced {
            return self.start_change(conn, key, op, now);
        }
        // Behind the heartbeat being written (or paced), in the order the worker sent them.
        // Only heartbeats are capped: a `complete` or `fail` always gets its turn.
        if heartbeat && t.waiting.len() >= MAX_WAITING_CHANGES {
            if let Some((s, re)) = op.answer_to() {
                let re = re.to_string();
                let e = AmpError::new(
                    ErrorCode::RateLimited,
                    format!("{MAX_WAITING_CHANGES} heartbeats of task `{task}` wait already"),
                );
                self.refuse(s, &re, e);
            }
            return;
        }
        t.waiting.push_back(op);
        self.next_waiting(conn, &key, now);
    }

    /// Writes a holder's change now that no heartbeat of its lease is being written.
    fn start_change(&mut self, conn: &mut Connection, key: String, op: Op, now: Instant) {
        if let Some(t) = self.tasks.get_mut(&key) {
            match op {
                Op::Complete { .. } | Op::Fail { .. } => t.phase = Phase::Finishing,
                Op::Heartbeat { .. } => {
                    t.extending += 1;
                    t.heartbeat_sent = Some(now);
                }
                _ => {}
            }
        }
        self.write_local(conn, key, op, now);
    }

    /// The next change waiting behind a heartbeat goes, once nothing of the lease is being
    /// written, the lease is still the holder's to change and (for a heartbeat) the gap
    /// after the last has passed; the rest wait on (a `complete` that is refused hands the
    /// lease back, and they go then).
    pub(super) fn next_waiting(&mut self, conn: &mut Connection, key: &str, now: Instant) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        if t.extending > 0 || t.phase != Phase::Leased {
            return;
        }
        let heartbeat = matches!(t.waiting.front(), Some(Op::Heartbeat { .. }));
        if let Some(at) = t.next_heartbeat.filter(|at| heartbeat && *at > now) {
            if !t.pacing {
                t.pacing = true;
                let timer = Timer::NextChange {
                    key: key.to_string(),
                    generation: t.generation,
                };
                self.later.push(at, Alarm(timer));
            }
            return;
        }
        if let Some(op) = t.waiting.pop_front() {
            self.start_change(conn, key.to_string(), op, now);
        }
    }

    /// The lease of local task `key` is over (it ran out, or its write was answered after
    /// the `lease_until` it wrote): its slot frees, and a message JetStream would still
    /// hold well past now is released for its next delivery at once. That is one kept by
    /// an in-progress ack sent while a heartbeat or an outcome was being written that then
    /// failed, or one whose redelivery here restarted its AckWait; no other holder can have
    /// it, since JetStream has not delivered it since.
    pub(super) fn lease_over(&mut self, conn: &mut Connection, key: &str, now: Instant) {
        let held = self.tasks.get(key).and_then(|t| {
            let until = after(t.ack_basis?, self.ack_wait(t));
            (until > after(now, HELD_SLACK) && !t.ack_subject.is_empty())
                .then(|| t.ack_subject.clone())
        });
        if let Some(subject) = held {
            self.nak(conn, &subject, None);
        }
        self.release_local(conn, key, now);
    }

    /// The local task `key` ends here (finished, lost, released): its slot frees.
    pub(super) fn release_local(&mut self, conn: &mut Connection, key: &str, now: Instant) {
        if let Some(qk) = self.free_slot(conn, key, now) {
            self.pull_more(conn, &qk, now);
        }
    }

    /// As [`Jobs::release_local`], leaving the pull for the freed slot to the caller;
    /// returns the task's queue.
    pub(super) fn free_slot(
        &mut self,
        conn: &mut Connection,
        key: &str,
        now: Instant,
    ) -> Option<String> {
        self.unwatch(conn, key);
        let t = self.tasks.remove(key)?;
        for op in &t.waiting {
            if let Some((s, re)) = op.answer_to() {
                self.refuse(s, re, lease_lost(&t.record.id));
            }
        }
        let was_leased = t.leased;
        if let Some(s) = self
            .workers
            .get_mut(&t.session)
            .and_then(|w| w.serving.get_mut(&t.job))
        {
            s.in_flight = s.in_flight.saturating_sub(1);
            if was_leased {
                s.leases = s.leases.saturating_sub(1);
                s.idle_since = now;
            }
        }
        Some(queue_key(&t.ns, &t.job))
    }

    /// The record shows this broker's session holding a lease the local state did not
    /// know of (a claim answered `unavailable` that landed later, then the offer lapsed or
    /// was declined): the session holds it until `lease_until`, with the slot, the lease
    /// count and the expiry timer that go with it.
    pub(super) fn adopt_lease(
        &mut self,
        key: &str,
        record: &TaskRecord,
        revision: u64,
        now: Instant,
    ) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        t.record = Rc::new(record.clone());
        t.revision = revision;
        t.phase = Phase::Leased;
        if !t.leased {
            t.leased = true;
            let (session, job) = (t.session, t.job.clone());
            if let Some(s) = self
                .workers
                .get_mut(&session)
                .and_then(|w| w.serving.get_mut(&job))
            {
                s.leases += 1;
            }
        }
        self.arm_lease_expiry(key, now);
    }

    /// A timer at the local task's `lease_until` (at once when it is past).
    pub(super) fn arm_lease_expiry(&mut self, key: &str, now: Instant) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        let until_ms = t.record.lease_until_ms.unwrap_or_default();
        let at = self.clock.instant(now, until_ms);
        let generation = t.generation;
        self.lease_timer(key.to_string(), generation, at, now);
    }

    /// A `LeaseExpiry` timer at `at`, unless one for that very instant is still to come
    /// (heartbeats within a millisecond grant the same `lease_until`).
    fn lease_timer(&mut self, key: String, generation: u64, at: Instant, now: Instant) {
        if let Some(t) = self.tasks.get_mut(&key)
            && t.generation == generation
        {
            if at > now && t.lease_timer_at == Some(at) {
                return;
            }
            t.lease_timer_at = Some(at);
        }
        self.later
            .push(at, Alarm(Timer::LeaseExpiry { key, generation }));
    }

    /// A timer at the local task's offer deadline (at once when it is past).
    pub(super) fn arm_offer_expiry(&mut self, key: &str, now: Instant) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let at = t.offer_until.map_or(now, |at| at.max(now));
        let timer = Timer::OfferExpiry {
            key: key.to_string(),
            generation: t.generation,
        };
        self.later.push(at, Alarm(timer));
    }

    /// A heartbeat's write ended, one way or the other. The next waits as long as this
    /// one took: back to back, heartbeats left a `cancel` (a read, then a compare-and-set
    /// about as long as a write) no gap to land in; now half the time is gap, whatever the
    /// round trip to the task store.
    pub(super) fn extension_ended(&mut self, conn: &mut Connection, key: &str, now: Instant) {
        if let Some(t) = self.tasks.get_mut(key) {
            t.extending = t.extending.saturating_sub(1);
            if let Some(sent) = t.heartbeat_sent.take() {
                t.next_heartbeat = Some(after(now, now.saturating_duration_since(sent)));
            }
        }
        self.next_waiting(conn, key, now);
    }

    /// The message's AckWait: the job consumer's (its `lease_s`, when every broker agrees).
    fn ack_wait(&self, t: &LocalTask) -> Duration {
        self.consumer_ack_wait(&t.ns, &t.job)
    }

    /// Keeps the message of the lease `key` from being redelivered while the lease runs,
    /// when that is due, or arms the timer for when it will be. JetStream restarts the
    /// AckWait (`lease_s`) at each in-progress ack; a lease that ends before the AckWait
    /// started at the delivery needs none, which is the common case of a task completed
    /// well within its lease. The last keep of a lease (it ends within an AckWait from
    /// now, and no write of the holder's is out that may extend or end it) is a NAK
    /// delayed to just past `lease_until` instead: an in-progress ack there held the task
    /// of a holder gone silent a whole AckWait, some 0.9 `lease_s` past its lease, whether
    /// or not its session or this broker were still there to see the lease end.
    pub(super) fn keep_message(
        &mut self,
        conn: &mut Connection,
        key: &str,
        force: bool,
        now: Instant,
    ) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let ack_wait = self.ack_wait(t);
        // Sent this long before the AckWait runs out: for the delivery's way here (the basis
        // is its arrival, a little after JetStream started the AckWait), the loop's delays
        // and the in-progress ack's way back.
        let margin = (ack_wait / 10)
            .max(Duration::from_millis(100))
            .min(ack_wait / 2);
        let lease_end = self
            .clock
            .instant(now, t.record.lease_until_ms.unwrap_or_default());
        let due = t.ack_basis.map(|basis| after(basis, ack_wait - margin));
        if force || due.is_none_or(|due| due <= now) {
            let subject = t.ack_subject.clone();
            let writing = t.extending > 0 || t.phase == Phase::Finishing;
            if !force && !writing && lease_end < after(now, ack_wait) {
                let until = after(lease_end, PAST_LEASE);
                if !subject.is_empty() {
                    let delay = until.saturating_duration_since(now);
                    self.nak(conn, &subject, Some(delay));
                }
                if let Some(t) = self.tasks.get_mut(key) {
                    // As if the AckWait had started then: it runs out at `until`.
                    t.ack_basis = Some(until.checked_sub(ack_wait).unwrap_or(now));
                }
                // Nothing more to keep: a heartbeat that extends the lease sends its own.
                return;
            }
            if !subject.is_empty() {
                self.ack(conn, &subject, AckKind::InProgress);
            }
            if let Some(t) = self.tasks.get_mut(key) {
                t.ack_basis = Some(now);
            }
        }
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        let at = after(t.ack_basis.unwrap_or(now), ack_wait - margin);
        if lease_end <= at {
            return;
        }
        let at = at.max(now);
        if t.progress_at.is_some_and(|armed| armed <= at) {
            // An earlier check is coming; it looks again.
            return;
        }
        t.progress_at = Some(at);
        let timer = Timer::Progress {
            key: key.to_string(),
            generation: t.generation,
        };
        self.later.push(at, Alarm(timer));
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn leased(
        &mut self,
        conn: &mut Connection,
        key: String,
        session: SessionId,
        re: String,
        record: &TaskRecord,
        generation: u64,
        heartbeat: bool,
        now: Instant,
    ) {
        let until_ms = record.lease_until_ms.unwrap_or_default();
        if until_ms <= self.clock.ms(now) {
            // The task store answered after the lease this write granted had run out: the
            // session holds nothing, so its claim or heartbeat gets what one sent after the
            // lease ran out gets (spec 2.4), not an `ok` for a lease already over. The
            // attempt stays spent, as for any lease that expired; the task goes on as
            // after an expiry, and no `revoked` follows the answer that said so.
            let task = record.id.clone();
            self.refuse(session, &re, lease_lost(&task));
            self.lease_over(conn, &key, now);
            return;
        }
        // A heartbeat restarts the AckWait at once; a claim only when it must.
        self.keep_message(conn, &key, heartbeat, now);
        let text = FrameWriter::ok(Some(&re))
            .str("lease_until", &rfc3339::format_millis(until_ms))
            .finish();
        self.out.push_back(JobsOutput::Reply { session, re, text });
        let at = self.clock.instant(now, until_ms);
        self.lease_timer(key, generation, at, now);
    }

    pub(super) fn revoke(&mut self, session: SessionId, task: &str, reason: &str) {
        self.stats.revoked += 1;
        let text = FrameWriter::new(amp_frame::server_op::REVOKED)
            .str("task", task)
            .str("reason", reason)
            .finish();
        self.out.push_back(JobsOutput::Frame { session, text });
    }
}
