//! Outcomes: the `task_result` to the submitter's inbox, the task message's ack, and
//! the removal of a cancelled task from its queue.

use super::*;

impl Jobs {
    /// Takes the message of cancelled task `key` out of its job's queue. No broker held it
    /// (else its ack terminates it), so it would wait there, counted by `max_queued`, until
    /// a serving broker pulled it only to find it cancelled.
    pub(super) fn delete_message(
        &mut self,
        conn: &mut Connection,
        key: &str,
        seq: u64,
        now: Instant,
    ) {
        let ns = key.split_once('.').map_or(key, |(ns, _)| ns);
        let req = match self
            .api
            .of(ns)
            .msg_delete(&binding::tasks_stream(ns), seq, false)
        {
            Ok(r) => r,
            Err(e) => return log::warn!(task:% = key; "cancelled task not dequeued: {e}"),
        };
        match self.request(conn, &req.subject, None, &req.payload, now) {
            Ok(id) => {
                let key = key.to_string();
                self.await_reply(id, now, Pending::MessageDelete { key });
            }
            Err(e) => log::warn!(task:% = key; "cancelled task not dequeued: {e}"),
        }
    }

    /// Sends the `task_result` to the submitter's inbox, then the message's ack, then the
    /// answer: the result is stored before the message can go, so a crash in between
    /// leaves a message whose redelivery publishes the result again. A record that says
    /// its result is stored publishes none.
    pub(super) fn publish_result(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        by: &str,
        ack: Option<(String, AckKind)>,
        reply: Option<(SessionId, String, String)>,
        now: Instant,
    ) {
        let finish = Finish::new(record, ack, reply);
        self.send_result(conn, record, by, finish, now);
    }

    /// [`publish_result`](Self::publish_result) of an outcome whose dead letter, if any,
    /// was stored (`o.lettered`).
    pub(super) fn announce(&mut self, conn: &mut Connection, o: Outcome, now: Instant) {
        let mut finish = Finish::new(&o.record, o.ack, o.reply);
        finish.lettered = o.lettered;
        self.send_result(conn, &o.record, &o.by, finish, now);
    }

    /// [`publish_result`](Self::publish_result) of cancelled task `record` for a cancel
    /// that came after the one that cancelled it.
    pub(super) fn repeat_result(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        by: &str,
        reply: Option<(SessionId, String, String)>,
        now: Instant,
    ) {
        let mut finish = Finish::new(record, None, reply);
        finish.repeat = true;
        if finish.reply.is_none()
            && let Some(cancelled_ms) = store::changed_ms(record.history.last())
        {
            finish.unwaited = Some(
                if self.clock.ms(now) - cancelled_ms < store::LAST_REPEAT_MS {
                    Unwaited::Early { cancelled_ms }
                } else {
                    Unwaited::Late
                },
            );
        }
        self.send_result(conn, record, by, finish, now);
    }

    /// The repeat of cancelled task `key`'s result refused at `now`, published within
    /// [`LAST_REPEAT_MS`] of the cancel made at `cancelled_ms`, is published again by this
    /// broker (one timer per task), as a refused result waits for its redelivery: as long
    /// again as the cancel is old, 1 s to 30 s, and once past `LAST_REPEAT_MS`.
    fn repeat_later(&mut self, key: &str, cancelled_ms: i64, now: Instant) {
        if self.refused_repeats.get(&key.to_owned()).is_some() {
            return;
        }
        // A cancel dated ahead of this clock (stepped back, or another broker's ahead) is
        // of no known age: waited on as long as it is ahead, else it was repeated every
        // second until this clock caught up.
        let age_ms = self.clock.ms(now).saturating_sub(cancelled_ms);
        let max_ms = i64::try_from(REFUSED_RESULT_MAX_DELAY.as_millis()).unwrap_or(i64::MAX);
        let wait_ms = age_ms
            .saturating_abs()
            .clamp(1_000, max_ms)
            .min(store::LAST_REPEAT_MS.saturating_sub(age_ms))
            .max(1);
        let at = now + Duration::from_millis(wait_ms.unsigned_abs());
        self.refused_repeats
            .get_or_insert_with(key.to_owned(), || ());
        let key = key.to_owned();
        self.later.push(at, Alarm(Timer::Repeat { key }));
    }

    /// A refused repeat of cancelled task `key`'s result is due again: the record says
    /// whether it still is to publish.
    pub(super) fn repeat_due(&mut self, conn: &mut Connection, key: String, now: Instant) {
        let req = match self.kv.get_request(&key) {
            Ok(r) => r,
            Err(e) => return log::warn!(task:% = key; "refused task result not repeated: {e}"),
        };
        match self.request(conn, &req.subject, None, &req.payload, now) {
            Ok(id) => self.await_reply(id, now, Pending::RepeatRead { key }),
            Err(e) => log::warn!(task:% = key; "refused task result not repeated: {e}"),
        }
    }

    /// Publishes the result again unless it is stored (`result_sent`), the record says
    /// none is and a retry may publish it (`result_refused`), or the repeat window is
    /// over: a repeat then could be a second result. A record that cannot be read ends
    /// the repeats, as before them.
    pub(super) fn repeat_read(
        &mut self,
        conn: &mut Connection,
        key: &str,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let (ns, task) = key.split_once('.').unwrap_or(("", ""));
        match self.parse_record(ns, task, reply) {
            Ok((record, _))
                if record.state == TaskState::Cancelled
                    && !record.result_sent
                    && !record.result_refused
                    && self.repeatable(record.history.last(), now) =>
            {
                let by = record.submitted_by.clone();
                self.repeat_result(conn, &record, &by, None, now);
            }
            Ok(_) => {}
            Err(e) => log::warn!(task:% = key; "refused task result not repeated: {e}"),
        }
    }

    fn send_result(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        by: &str,
        mut finish: Finish,
        now: Instant,
    ) {
        let Some((ns, submitter)) = record
            .submitted_by
            .split_once('/')
            .filter(|_| !record.via_mig && !record.result_sent)
        else {
            if finish.cancelled {
                // Nothing to store (a repeat of the cancel stored it): a retry of a cancel
                // answered `unavailable` is answered as stored.
                self.unsent_cancels.remove(&finish.key);
            }
            return self.finish(conn, finish, now);
        };
        finish.stays =
            finish.redelivery_resends && matches!(finish.ack, Some((_, AckKind::Nak { .. })));
        let key = finish.key.clone();
        let id = envelope::idempotent_id(
            Kind::TaskResult,
            "broker",
            &record.submitted_by,
            &record.use_scoped(&key),
        );
        let body = crate::amp::Body::from_value(&record.result_body()).into_text();
        let env = Envelope {
            id: id.clone(),
            kind: Kind::TaskResult,
            from: by.to_string(),
            to: Some(record.submitted_by.clone()),
            topic: None,
            job: Some(record.job.clone()),
            ts: rfc3339::format_millis(self.clock.ms(now)),
            headers: BTreeMap::new(),
            body,
        };
        let mut headers = HeaderMap::new();
        for (k, v) in [
            ("Nats-Msg-Id", id.as_str()),
            ("AMP-From", by),
            ("AMP-Kind", Kind::TaskResult.as_str()),
        ] {
            let _ = headers.insert(k, v);
        }
        let subject = binding::inbox_subject(ns, submitter);
        match self.request(conn, &subject, Some(&headers), &env.to_json(), now) {
            Ok(rid) => {
                self.await_reply(rid, now, Pending::Result(finish));
            }
            Err(e) => {
                log::warn!(task:% = key; "task result not sent: {e}");
                let finish = self.result_unsent(conn, finish, false, now);
                self.finish(conn, finish, now);
            }
        }
    }

    /// The result did not reach the submitter's inbox: unanswered (e.g. while its stream
    /// elects a leader), or refused by a full stream (`stored_nothing`). A completed or
    /// failed task's message is left for redelivery, which sends the result again
    /// (deduplicated by its message id), instead of acknowledged away; after a refusal
    /// it waits longer at each delivery ([`refused_result_delay`]). A cancelled task has
    /// no message left to come back: its cancel answers `unavailable` and the retry the
    /// client makes publishes the result again. It answered `ok`, and the client told so
    /// never retried: the submitter never heard of the outcome (`tests/jobs_engine.rs`,
    /// `a_cancel_whose_task_result_was_not_stored_is_unavailable_and_its_retry_stores_it`;
    /// refused, `jobs::tests::a_cancel_whose_task_result_the_full_inbox_refused_is_unavailable_until_a_retry_stores_it`).
    pub(super) fn result_unsent(
        &mut self,
        conn: &mut Connection,
        mut finish: Finish,
        stored_nothing: bool,
        now: Instant,
    ) -> Finish {
        let mut written = false;
        if finish.redelivery_resends
            && let Some((subject, kind)) = &mut finish.ack
        {
            let delay = match AckMetadata::parse(subject) {
                Ok(m) if stored_nothing => refused_result_delay(m.delivered),
                _ => RETRY_DELAY,
            };
            *kind = AckKind::Nak { delay: Some(delay) };
            if finish.lettered {
                // The redelivery is for the result alone: its letter is not stored
                // again (a second one once the letters' duplicate window has passed).
                self.mark(conn, finish.key.clone(), Op::Lettered, now);
                written = true;
            }
        }
        if finish.cancelled
            && let Some((_, re, text)) = &mut finish.reply
        {
            let mut e = unavailable("the task is cancelled but its task_result is not stored yet");
            e.retry_after_ms = u64::try_from(RETRY_DELAY.as_millis()).ok();
            *text = reply::error(Some(re.as_str()), &e);
            let fresh = if stored_nothing {
                Unsent::Refused
            } else {
                Unsent::Maybe
            };
            let unsent = self
                .unsent_cancels
                .get_or_insert_with(finish.key.clone(), || fresh);
            if !stored_nothing {
                *unsent = Unsent::Maybe;
            }
        }
        if (stored_nothing || finish.cancelled) && !written {
            // Its expiry starts over (`Change::ResultRefused`; the mark above does that
            // too), so the record outlives a full inbox as long as refusals keep coming;
            // and a cancelled one says whether a retry through any broker may publish it
            // again past the repeat window: not once a publish of it here may have landed.
            // A repeat no cancel waits on (answered `conflict`) tells nothing either way
            // while the cancel's own publish may still land after it: published again
            // until one tells (`Unwaited`); one whose cancel time the record does not
            // give (no parsable history entry) leaves the flag alone as before.
            let refused = if !stored_nothing
                || self.unsent_cancels.get(&finish.key) == Some(&Unsent::Maybe)
            {
                Refused::Maybe
            } else if finish.cancelled && finish.reply.is_none() {
                match finish.unwaited {
                    Some(Unwaited::Early { cancelled_ms }) => {
                        self.repeat_later(&finish.key, cancelled_ms, now);
                        Refused::Keep
                    }
                    Some(Unwaited::Late) => Refused::Every,
                    None => Refused::Keep,
                }
            } else {
                Refused::Every
            };
            self.mark(conn, finish.key.clone(), Op::ResultRefused(refused), now);
        }
        finish
    }

    /// Records what of the outcome of task `key` is stored (its `task_result`, its dead
    /// letter), so that the redelivery of its message stores it no more: read, then a
    /// compare-and-set like any change.
    pub(super) fn mark(&mut self, conn: &mut Connection, key: String, op: Op, now: Instant) {
        let write = Write {
            key,
            op,
            ack: None,
            tries: 0,
        };
        self.read(conn, write, now);
    }

    /// The outcome is stored and its `task_result` too: the message goes and the requester
    /// hears. The ack is not confirmed: one that is lost leaves the message to be
    /// redelivered after the lease, and that delivery finds the outcome and acks it away.
    pub(super) fn finish(&mut self, conn: &mut Connection, finish: Finish, now: Instant) {
        match finish.ack {
            Some((subject, AckKind::Ack)) => self.ack_done(conn, &subject, now),
            Some((subject, kind)) => {
                self.ack(conn, &subject, kind);
                // A completion whose result could not be stored is NAKed instead: its
                // queue still pulls for the slot the task held.
                if let Some(qk) = self.queue_of_ack(&subject) {
                    self.ack_settled(&qk);
                    self.pull_more(conn, &qk, now);
                }
            }
            None => {}
        }
        if let Some((session, re, text)) = finish.reply {
            self.out.push_back(JobsOutput::Reply { session, re, text });
        }
    }
}

impl Finish {
    fn new(
        record: &TaskRecord,
        ack: Option<(String, AckKind)>,
        reply: Option<(SessionId, String, String)>,
    ) -> Finish {
        Finish {
            key: task_key(ns_of(record), &record.id),
            ack,
            reply,
            redelivery_resends: matches!(record.state, TaskState::Completed | TaskState::Failed),
            cancelled: record.state == TaskState::Cancelled,
            stays: false,
            lettered: false,
            repeat: false,
            unwaited: None,
        }
    }
}
