//! The one read-apply-write driver of the task store: every change (claim, heartbeat,
//! complete, fail, requeue, cancel) is a compare-and-set on the record's revision,
//! re-read and re-applied on conflict.

use super::*;

/// How long after a change a repair may still publish what the change published (a
/// cancel's `task_result`) again: well inside the inbox's duplicate window (120 s at the
/// least), so the repeat is deduplicated whatever the brokers' clocks say.
const REPEAT_WINDOW_MS: i128 = 90_000;
/// From how long after a cancel a refused repeat of its result tells that none is stored
/// ([`Unwaited::Late`]): the cancel's own publish follows its write within a request's
/// timeout, so it has landed by then if it ever does, and the repeat is still inside
/// [`REPEAT_WINDOW_MS`] with room for the brokers' clocks to differ.
pub(super) const LAST_REPEAT_MS: i64 = 80_000;

/// How long a finished task's record stays: its job's `keep_finished_s`, and at least
/// until what may still come for it has come. A redelivery of its message (an ack lost)
/// comes within the consumer's AckWait (`ack_wait`, the job's `lease_s` when brokers
/// agree); a resubmit of its id within the tasks stream's duplicate window (at most
/// `binding::TASKS_DUPLICATE_WINDOW_MAX_S` after its message, stored before the task
/// finished) stores no message, so it must still find the record, not make a new one
/// that would stay `queued` with nothing to offer; a cancel's retry repeats the result
/// within `REPEAT_WINDOW_MS`. All of these are past 300 s after the lease.
pub(super) fn finished_ttl_s(job: &crate::broker::config::Job, ack_wait: Duration) -> u64 {
    const AFTER_LEASE_S: u64 = 300;
    let redelivery_s = job.lease_s.max(ack_wait.as_secs());
    job.keep_finished_s
        .max(redelivery_s.saturating_add(AFTER_LEASE_S))
}

/// When the change of history entry `entry` was made (ms since the epoch).
pub(super) fn changed_ms(entry: Option<&crate::broker::task_store::HistoryEntry>) -> Option<i64> {
    entry
        .and_then(|h| crate::rfc3339::parse_nanos(&h.at))
        .and_then(|ns| i64::try_from(ns / 1_000_000).ok())
}

impl Jobs {
    /// Whether what the change of history entry `entry` published may be published again
    /// ([`REPEAT_WINDOW_MS`]).
    pub(super) fn repeatable(
        &self,
        entry: Option<&crate::broker::task_store::HistoryEntry>,
        now: Instant,
    ) -> bool {
        changed_ms(entry)
            .is_some_and(|ms| i128::from(self.clock.ms(now)) - i128::from(ms) < REPEAT_WINDOW_MS)
    }

    pub(super) fn write_local(&mut self, conn: &mut Connection, key: String, op: Op, now: Instant) {
        let Some((record, revision, ack)) = self
            .tasks
            .get(&key)
            .map(|t| (Rc::clone(&t.record), t.revision, t.ack_subject.clone()))
        else {
            return;
        };
        let write = Write {
            key,
            op,
            ack: Some(ack),
            tries: 0,
        };
        self.cas(conn, write, &record, revision, now);
    }

    pub(super) fn read(&mut self, conn: &mut Connection, write: Write, now: Instant) {
        let req = match self.kv.get_request(&write.key) {
            Ok(r) => r,
            Err(_) => {
                let task = write.key.clone();
                return self.write_failed(conn, write, not_found(&task), now);
            }
        };
        match self.request(conn, &req.subject, None, &req.payload, now) {
            Ok(id) => {
                self.await_reply(id, now, Pending::Read(write));
            }
            Err(e) => self.write_failed(conn, write, send_error(&e), now),
        }
    }

    pub(super) fn change_for<'a>(
        &self,
        op: &'a Op,
        actor: &'a (String, String),
        key: &str,
    ) -> Change<'a> {
        let lease_ms = secs_as_millis(
            self.tasks
                .get(key)
                .map_or(30, |t| self.job_config(&t.ns, &t.job).lease_s),
        );
        let offered_at_ms = self.tasks.get(key).map_or(0, |t| t.offered_at_ms);
        let by = Actor {
            participant: &actor.0,
            session: &actor.1,
        };
        match op {
            Op::Offer { .. } => Change::Offer { to: by },
            Op::Exhaust => Change::Exhaust { by: &actor.0 },
            Op::ResultSent => Change::ResultSent,
            Op::Lettered => Change::Lettered,
            Op::ResultRefused(refused) => Change::ResultRefused(*refused),
            Op::Claim { .. } => Change::Claim {
                by,
                lease_ms,
                offered_at_ms,
            },
            Op::Heartbeat { progress, .. } => Change::Heartbeat {
                by,
                lease_ms,
                progress: progress.as_ref(),
            },
            Op::Complete { result, .. } => Change::Complete {
                by,
                result: result.clone(),
            },
            Op::Fail { error, retry, .. } => Change::Fail {
                by,
                error: error.clone(),
                retry: *retry,
            },
            Op::Requeue { .. } => Change::Requeue { by, offered_at_ms },
            Op::Cancel { by, .. } => Change::Cancel { by },
        }
    }

    /// Who makes the change: `ns/name` and `<broker>/<session>`.
    pub(super) fn actor_of(&self, op: &Op, key: &str) -> (String, String) {
        let session = match op {
            Op::Offer { session, .. }
            | Op::Claim { session, .. }
            | Op::Heartbeat { session, .. }
            | Op::Complete { session, .. }
            | Op::Fail { session, .. }
            | Op::Requeue { session, .. }
            | Op::Cancel { session, .. } => *session,
            Op::Exhaust | Op::ResultSent | Op::Lettered | Op::ResultRefused(_) => {
                return (format!("broker/{}", self.broker_id), String::new());
            }
        };
        let participant = match op {
            Op::Cancel { by, .. } => by.clone(),
            _ => self
                .tasks
                .get(key)
                .map(|t| t.participant.clone())
                .unwrap_or_default(),
        };
        (participant, self.session_name(session))
    }

    /// Applies the change to `record` and writes it if it applies. A change of the lease
    /// holder that leaves the task alive (a heartbeat, a fail to retry) must leave room
    /// for the changes still to come:
    /// a worker that filled the record to `max_payload` with its progress or result left
    /// no claim, requeue or cancel of the task writable, and a task that cycled for ever.
    pub(super) fn cas(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: &TaskRecord,
        revision: u64,
        now: Instant,
    ) {
        if let Some(session) = write.op.local_session()
            && self
                .tasks
                .get(&write.key)
                .is_none_or(|t| t.session != session)
        {
            // The offer or lease this change was for ended here while the change waited
            // (a conflict's re-read, say): made now it would act for nobody, or for the
            // session of a later offer of the task. Nothing is written.
            log::debug!(task:% = write.key; "change dropped: its local task is gone");
            if let Some((session, re)) = write.op.answer_to() {
                let task = write.key.split_once('.').map_or("", |(_, t)| t).to_string();
                let re = re.to_string();
                self.refuse(session, &re, lease_lost(&task));
            }
            return;
        }
        let delivered = write.ack.as_deref().and_then(message_seq);
        if let (Some(bound), Some(seq)) = (record.msg_seq, delivered)
            && bound != seq
        {
            return self.superseded(conn, write, now);
        }
        let now_ms = self.clock.ms(now);
        let actor = self.actor_of(&write.op, &write.key);
        let next = {
            let change = self.change_for(&write.op, &actor, &write.key);
            record.apply(&change, now_ms)
        };
        let mut next = match next {
            Ok(next) => next,
            Err(refusal) => return self.refused(conn, write, record, revision, refusal, now),
        };
        // Written with the first change a delivery makes, so no extra write is spent.
        next.msg_seq = next.msg_seq.or(delivered);
        let json = next.to_json();
        let max = conn.max_payload();
        let reserve = (max / 4).min(RECORD_RESERVE);
        // A change that ends the task needs no room after it (a `complete` after a large
        // progress adds a history entry and must still fit, it is the last write).
        let lives_on = !next.state.is_terminal();
        if write.op.by_holder() && lives_on && json.len() + reserve > max {
            let e = AmpError::new(
                ErrorCode::TooLarge,
                format!(
                    "the task record would be {} bytes: a worker's change leaves {reserve} of the server's {max} for the rest of the task's history",
                    json.len()
                ),
            );
            return self.write_failed(conn, write, e, now);
        }
        // One revision per task: a worker's large progress written at every heartbeat
        // stayed 64 times over, and a finished task's record for good.
        let ttl = (!lives_on)
            .then(|| crate::jetstream::MsgTtl::After(self.finished_ttl(&write.key, &next.job)));
        let req = match self.kv.replace_request(&write.key, &json, revision, ttl) {
            Ok(r) => r,
            Err(e) => return self.write_failed(conn, write, unavailable(e), now),
        };
        match self.request(conn, &req.subject, req.headers.as_ref(), &req.payload, now) {
            Ok(id) => {
                self.await_reply(
                    id,
                    now,
                    Pending::Cas {
                        write,
                        next: Box::new(next),
                    },
                );
            }
            Err(e) => self.write_failed(conn, write, send_error(&e), now),
        }
    }

    /// The change was for a delivery of a copy of the task's message, not of the one the
    /// record is bound to (`TaskRecord::msg_seq`): the copy goes for good, and whatever
    /// this broker held on it (an offer, unwritten) ends, as an offer that lost its task.
    pub(super) fn superseded(&mut self, conn: &mut Connection, write: Write, now: Instant) {
        log::info!(task:% = write.key; "a copy of the task message is terminated");
        let task = write.key.split_once('.').map_or("", |(_, t)| t).to_string();
        if let Some((session, re)) = write.op.answer_to() {
            let re = re.to_string();
            self.refuse(session, &re, lease_lost(&task));
        }
        if let Some(ack) = &write.ack {
            self.term_copy(conn, ack);
        }
        let leased = self
            .tasks
            .get(&write.key)
            .filter(|t| t.leased)
            .map(|t| t.session);
        if let Some(session) = leased {
            self.revoke(session, &task, "lease_expired");
        }
        if write.op.local_session().is_some() {
            self.release_local(conn, &write.key, now);
        }
    }

    /// Terminates a delivered copy of a task message (see [`Jobs::superseded`]).
    pub(super) fn term_copy(&mut self, conn: &mut Connection, ack: &str) {
        let reason = Some("a copy of the task's message".into());
        self.ack(conn, ack, AckKind::Term { reason });
    }

    /// The change cannot be made on the record as it is (at `revision`).
    pub(super) fn refused(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: &TaskRecord,
        revision: u64,
        refusal: Refusal,
        now: Instant,
    ) {
        let task = record.id.clone();
        let key = write.key.clone();
        if let Op::Heartbeat { .. } = write.op {
            self.extension_ended(conn, &key, now);
        }
        if self.landed_earlier(&write.op, &key, record, now) {
            // An earlier try of this very change was answered `unavailable` but reached
            // the task store after all (it waited in the reconnect buffer): the retry
            // finishes what that write started.
            return self.written(conn, write, record.clone(), revision, now);
        }
        match write.op {
            Op::Offer { .. } => {
                // Someone else moved the task on (another broker's offer or lease, or an
                // outcome): this delivery is not ours to offer.
                if let Some(ack) = write.ack {
                    match refusal {
                        Refusal::LeaseHeld { until_ms } => {
                            let wait = u64::try_from(until_ms - self.clock.ms(now)).unwrap_or(0);
                            self.nak(conn, &ack, Some(Duration::from_millis(wait + 50)));
                        }
                        // Its finisher may have died before telling the submitter.
                        Refusal::Finished(_) => self.finished_delivery(conn, record, ack, now),
                        _ => self.nak(conn, &ack, Some(RETRY_DELAY)),
                    }
                }
                self.release_local(conn, &key, now);
            }
            Op::Exhaust => {
                if let (Some(ack), Refusal::Finished(_)) = (write.ack, &refusal) {
                    // Maybe by this very exhaust, its answer lost on the way: the
                    // submitter may not have heard, and the outcome is told again (its
                    // idempotent id dedupes a repeat) before the message goes.
                    self.finished_delivery(conn, record, ack, now);
                }
            }
            Op::Cancel { session, re, by } => {
                // This may be the retry of the cancel that cancelled it, answered
                // `unavailable` when its write had landed after all: then its
                // `task_result` was never stored, and nothing else would store it (a
                // cancelled task's message is gone). Stored again; its idempotent id
                // keeps it one message within the dedupe window, and only then: a cancel
                // sent again later stored a second result (simulator seed 0x13da2e, a
                // repeat 122 s after the cancel).
                let recent = self.repeatable(record.history.last(), now);
                // Kept until the result is stored (`Jobs::result_unsent` says whether any
                // publish of it might have been).
                let unsent = self.unsent_cancels.get(&key).copied();
                // Every publish of it was refused: here (while the record may not say
                // so), or as the record says, through the broker the cancel went to
                // (`TaskRecord::result_refused`).
                // A retry here that the record says is stored (`result_sent`) repeats
                // nothing and is answered `ok`, as the cancel it retries.
                let refused = match unsent {
                    Some(Unsent::Refused) => true,
                    Some(Unsent::Maybe) => false,
                    Some(Unsent::Recorded) => record.result_refused || record.result_sent,
                    None => record.result_refused,
                };
                if let Refusal::Finished(TaskState::Cancelled) = refusal
                    && (recent || refused)
                {
                    if unsent.is_some() || refused {
                        // The retry of a cancel answered `unavailable` (its write or its
                        // result unconfirmed, or refused): answered as the cancel it
                        // repeats, once the result is stored (`unavailable` again if it
                        // is not). When every publish of it here was refused it is
                        // published again past the window too, unless the record says a
                        // repeat through another broker stored it.
                        let text = reply::ok(Some(&re));
                        let reply = Some((session, re, text));
                        return self.repeat_result(conn, record, &by, reply, now);
                    }
                    self.repeat_result(conn, record, &by, None, now);
                }
                if let Refusal::Finished(_) = refusal {
                    // Answered `conflict`: a later retry is no retry of this one's.
                    self.unsent_cancels.remove(&key);
                }
                let e = match refusal {
                    Refusal::NotSubmitter => AmpError::new(
                        ErrorCode::Forbidden,
                        format!("only the submitter may cancel task `{task}`"),
                    ),
                    Refusal::Finished(state) => AmpError::new(
                        ErrorCode::Conflict,
                        format!("task `{task}` is already {}", state.as_str()),
                    ),
                    _ => unavailable("the task store did not settle"),
                };
                self.refuse(session, &re, e);
            }
            // Recorded already (by another delivery's broker), or the record moved on:
            // a result stored meanwhile (`result_sent`).
            Op::ResultRefused(Refused::Every) => self.refusal_recorded(&key),
            Op::ResultSent | Op::Lettered | Op::ResultRefused(_) => {}
            op => {
                if let Some((session, re)) = op.answer_to() {
                    let re = re.to_string();
                    self.refuse(session, &re, lease_lost(&task));
                }
                // The lease or offer is gone for good when the record shows someone else
                // or an outcome; a late heartbeat on a still-cached lease only fails.
                let mine = self.tasks.get(&key).is_some_and(|t| {
                    let s = self.session_name(t.session);
                    record.offered_to(&s) || record.leased_to(&s, self.clock.ms(now))
                });
                if !mine {
                    let holder = self.tasks.get(&key).map(|t| (t.session, t.phase));
                    if let Some((session, phase)) = holder {
                        if matches!(phase, Phase::Leased | Phase::Finishing | Phase::Claiming)
                            && record.state != TaskState::Offered
                        {
                            let reason = if record.state == TaskState::Cancelled {
                                "cancelled"
                            } else {
                                "lease_expired"
                            };
                            if phase != Phase::Claiming {
                                self.revoke(session, &task, reason);
                            }
                        }
                        if record.state == TaskState::Cancelled
                            && let Some(ack) = &write.ack
                        {
                            self.ack(
                                conn,
                                ack,
                                AckKind::Term {
                                    reason: Some("cancelled".into()),
                                },
                            );
                        }
                    }
                    self.release_local(conn, &key, now);
                } else if record.state == TaskState::Offered {
                    if let Some(t) = self.tasks.get_mut(&key) {
                        t.record = Rc::new(record.clone());
                        t.revision = revision;
                        t.phase = Phase::Offered;
                    }
                    self.arm_offer_expiry(&key, now);
                } else {
                    self.unwatch(conn, &key);
                    self.adopt_lease(&key, record, revision, now);
                }
            }
        }
    }

    /// Whether `op` is a claim or an outcome whose earlier try the record already shows
    /// as made by the same session.
    pub(super) fn landed_earlier(
        &self,
        op: &Op,
        key: &str,
        record: &TaskRecord,
        now: Instant,
    ) -> bool {
        let Some(t) = self.tasks.get(key) else {
            return false;
        };
        let session = self.session_name(t.session);
        match op {
            Op::Claim { session: s, .. } => {
                *s == t.session
                    && t.phase == Phase::Claiming
                    && record.leased_to(&session, self.clock.ms(now))
            }
            Op::Complete { session: s, .. } => {
                *s == t.session
                    && record.state == TaskState::Completed
                    && record.finished_by(&session)
            }
            Op::Fail {
                session: s,
                retry: false,
                ..
            } => {
                *s == t.session && record.state == TaskState::Failed && record.finished_by(&session)
            }
            _ => false,
        }
    }

    /// A request of the change failed (JetStream unreachable, or too many conflicts).
    pub(super) fn write_failed(
        &mut self,
        conn: &mut Connection,
        write: Write,
        e: AmpError,
        now: Instant,
    ) {
        // A refusal the request earned (a task that does not exist, a worker's record
        // too large) is answered to its sender and is no trouble of the broker's: as a
        // warning, any client could write one per request (a MIG CANCEL of an unknown id).
        if matches!(e.code, ErrorCode::Unavailable | ErrorCode::Internal) {
            log::warn!(task:% = write.key; "task change failed: {e}");
        } else {
            log::debug!(task:% = write.key; "task change refused: {e}");
        }
        if matches!(write.op, Op::Cancel { .. }) && e.code == ErrorCode::Unavailable {
            // Its write may have landed all the same: see `unsent_cancels`.
            *self
                .unsent_cancels
                .get_or_insert_with(write.key.clone(), || Unsent::Maybe) = Unsent::Maybe;
        }
        if let Some((session, re)) = write.op.answer_to() {
            let re = re.to_string();
            self.refuse(session, &re, e);
        }
        match write.op {
            Op::Offer { .. } => {
                if let Some(ack) = &write.ack {
                    self.nak(conn, ack, Some(RETRY_DELAY));
                }
                self.release_local(conn, &write.key, now);
            }
            Op::Requeue { .. } => {
                // The record still says offered; JetStream redelivers after the lease and
                // the next delivery re-offers it.
                self.release_local(conn, &write.key, now);
            }
            Op::Claim { .. } => {
                if let Some(t) = self.tasks.get_mut(&write.key) {
                    t.phase = Phase::Offered;
                }
                // The offer may have lapsed while the claim was out; the claim itself may
                // still land (then the lapse finds the lease and keeps it).
                self.arm_offer_expiry(&write.key, now);
            }
            Op::Complete { .. } | Op::Fail { .. } => {
                if let Some(t) = self.tasks.get_mut(&write.key) {
                    t.phase = Phase::Leased;
                }
                // The expiry may have come and gone while the write was out.
                self.arm_lease_expiry(&write.key, now);
                self.next_waiting(conn, &write.key, now);
            }
            Op::Heartbeat { .. } => {
                self.extension_ended(conn, &write.key, now);
                self.arm_lease_expiry(&write.key, now);
            }
            _ => {}
        }
    }

    /// The change is stored as revision `revision`.
    pub(super) fn written(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: TaskRecord,
        revision: u64,
        now: Instant,
    ) {
        let key = write.key.clone();
        let record = Rc::new(record);
        if let Some(t) = self.tasks.get_mut(&key) {
            t.record = Rc::clone(&record);
            t.revision = revision;
            if let Some(ack) = &write.ack
                && t.ack_subject.is_empty()
            {
                t.ack_subject = ack.clone();
            }
        }
        let ack = self
            .tasks
            .get(&key)
            .map(|t| t.ack_subject.clone())
            .or(write.ack.clone());
        match write.op {
            Op::Offer { session, env } => {
                if !self.workers.contains_key(&session) {
                    // The session went away while the offer was being written.
                    if let Some(t) = self.tasks.get_mut(&key) {
                        t.phase = Phase::Finishing;
                    }
                    return self.write_local(conn, key, Op::Requeue { session, re: None }, now);
                }
                if let Some(t) = self.tasks.get_mut(&key) {
                    t.offered_at_ms = self.clock.ms(now);
                }
                self.send_offer(&key, session, &env, &record, now);
            }
            Op::Claim { session, re } => {
                self.stats.claims += 1;
                let Some(t) = self.tasks.get_mut(&key) else {
                    return;
                };
                t.phase = Phase::Leased;
                t.leased = true;
                let generation = t.generation;
                let job = t.job.clone();
                if let Some(s) = self
                    .workers
                    .get_mut(&session)
                    .and_then(|w| w.serving.get_mut(&job))
                {
                    s.leases += 1;
                }
                self.unwatch(conn, &key);
                self.leased(conn, key, session, re, &record, generation, false, now);
            }
            Op::Heartbeat { session, re, .. } => {
                self.extension_ended(conn, &key, now);
                let generation = self.tasks.get(&key).map_or(0, |t| t.generation);
                self.leased(conn, key, session, re, &record, generation, true, now);
            }
            Op::Complete { session, re, .. } => {
                self.stats.completed += 1;
                let by = self.participant_of(&key);
                // The freed slot's pull goes with the message's ack, once the result is
                // stored (`finish`), when there is an ack to carry it.
                if let Some(qk) = self.free_slot(conn, &key, now) {
                    let rides = ack
                        .as_deref()
                        .and_then(|a| self.queue_of_ack(a))
                        .is_some_and(|of_ack| of_ack == qk);
                    match self.queues.get_mut(&qk) {
                        Some(q) if rides => q.acks_due = q.acks_due.saturating_add(1),
                        _ => self.pull_more(conn, &qk, now),
                    }
                }
                let reply = Some((session, re.clone(), reply::ok(Some(&re))));
                let ack = ack.map(|a| (a, AckKind::Ack));
                self.publish_result(conn, &record, &by, ack, reply, now);
            }
            Op::Fail { session, re, .. } => {
                let by = self.participant_of(&key);
                self.release_local(conn, &key, now);
                let text = FrameWriter::ok(Some(&re))
                    .str("state", record.state.as_str())
                    .finish();
                if record.state == TaskState::Failed {
                    self.stats.failed += 1;
                    let ack = ack.map(|a| {
                        (
                            a,
                            AckKind::Term {
                                reason: Some("failed".into()),
                            },
                        )
                    });
                    self.outcome(conn, &record, &by, ack, Some((session, re, text)), now);
                } else {
                    if let Some(a) = &ack {
                        self.nak(conn, a, None);
                    }
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
            }
            Op::Requeue { session, re } => {
                self.remember_decline(&key, session, now);
                self.release_local(conn, &key, now);
                if let Some(a) = &ack {
                    self.nak(conn, a, None);
                }
                if let Some(re) = re {
                    let text = reply::ok(Some(&re));
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
            }
            Op::Exhaust => {
                self.stats.failed += 1;
                let by = format!("broker/{}", self.broker_id);
                let ack = ack.map(|a| {
                    (
                        a,
                        AckKind::Term {
                            reason: Some("attempts exhausted".into()),
                        },
                    )
                });
                self.outcome(conn, &record, &by, ack, None, now);
            }
            Op::Cancel { session, re, by } => {
                self.stats.cancelled += 1;
                self.unsent_cancels.remove(&key);
                let local = self
                    .tasks
                    .get(&key)
                    .map(|t| (t.session, t.phase, t.ack_subject.clone()));
                let mut term = None;
                if let Some((holder, phase, ack_subject)) = local {
                    if matches!(phase, Phase::Leased | Phase::Finishing) {
                        self.revoke(holder, &record.id, "cancelled");
                    }
                    term = Some((
                        ack_subject,
                        AckKind::Term {
                            reason: Some("cancelled".into()),
                        },
                    ));
                    self.release_local(conn, &key, now);
                }
                let published = self.published.remove(&key);
                if term.is_none()
                    && let Some(seq) = published
                {
                    self.delete_message(conn, &key, seq, now);
                }
                let text = reply::ok(Some(&re));
                self.publish_result(conn, &record, &by, term, Some((session, re, text)), now);
            }
            Op::ResultRefused(Refused::Every) => self.refusal_recorded(&key),
            Op::ResultSent | Op::Lettered | Op::ResultRefused(_) => {}
        }
    }

    /// How long the finished record of task `key` (of job `job`) is kept after its last
    /// write.
    fn finished_ttl(&self, key: &str, job: &str) -> Duration {
        let ns = key.split_once('.').map_or("", |(ns, _)| ns);
        let ack_wait = self.consumer_ack_wait(ns, job);
        Duration::from_secs(finished_ttl_s(&self.job_config(ns, job), ack_wait))
    }

    /// A refusal's write (`Op::ResultRefused`) of `record`, stored at `stored_ms`, is
    /// spared: it would change nothing but the expiry, and more than half of the record's
    /// life is left, which outlasts the next redelivery (at most 30 s away) or a cancel's
    /// retry made within half of `keep_finished_s`. Written at every refusal, a full inbox
    /// cost a write per finished task every 30 s (review 2, finding 4: 2400 an hour for
    /// 20 tasks); now one per half of the record's life.
    pub(super) fn refusal_kept(
        &self,
        key: &str,
        record: &TaskRecord,
        refused: Refused,
        stored_ms: i64,
        now: Instant,
    ) -> bool {
        let half_life =
            i64::try_from(self.finished_ttl(key, &record.job).as_millis() / 2).unwrap_or(i64::MAX);
        record.state.is_terminal()
            && !record.result_sent
            && record.result_refused == refused.flag(record)
            && self.clock.ms(now).saturating_sub(stored_ms) < half_life
    }

    /// This broker's `ResultRefused(Refused::Every)` of task `key` is in the record (or
    /// the record says the result is stored): the record decides from now on.
    pub(super) fn refusal_recorded(&mut self, key: &str) {
        if let Some(unsent) = self.unsent_cancels.get_mut(&key.to_owned())
            && *unsent == Unsent::Refused
        {
            *unsent = Unsent::Recorded;
        }
    }
}
