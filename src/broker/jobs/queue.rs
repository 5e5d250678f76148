//! A job's queue: its work-queue consumer and the pulls that feed this broker's
//! serving sessions.

use super::*;

impl Jobs {
    pub(super) fn ensure_queue(
        &mut self,
        conn: &mut Connection,
        ns: &str,
        job: &str,
        now: Instant,
    ) {
        let qk = queue_key(ns, job);
        if self.queues.contains_key(&qk) {
            return;
        }
        let pull = PullLoop::on_demand(
            binding::tasks_stream(ns),
            binding::job_consumer(job),
            conn.new_inbox(),
            PULL_EXPIRES,
        )
        .in_domain(self.api.of(ns).clone());
        self.queues.insert(
            qk.clone(),
            JobQueue {
                ns: ns.to_string(),
                job: job.to_string(),
                consumer: ConsumerState::Creating,
                pull,
                unplaced: 0,
                acks_due: 0,
                trust_after_nanos: None,
                last_consumer_seq: 0,
                told: false,
                ack_wait: None,
            },
        );
        self.create_consumer(conn, &qk, now);
    }

    pub(super) fn create_consumer(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        // Until the answer, the consumer may be one this broker has not seen created.
        if let Some(q) = self.queues.get_mut(qk) {
            q.trust_after_nanos = None;
        }
        let Some(q) = self.queues.get(qk) else {
            return;
        };
        let lease_s = self.job_config(&q.ns, &q.job).lease_s;
        let stream = binding::tasks_stream(&q.ns);
        let config = binding::job_consumer_config(&q.ns, &q.job, lease_s);
        let sent = self
            .api
            .of(&q.ns)
            .consumer_create(&stream, &config, ConsumerAction::CreateOrUpdate)
            .map_err(|e| e.to_string())
            .and_then(|req| {
                self.request(conn, &req.subject, None, &req.payload, now)
                    .map_err(|e| e.to_string())
            });
        match sent {
            Ok(id) => {
                self.await_reply(
                    id,
                    now,
                    Pending::ConsumerCreate {
                        queue: qk.to_string(),
                    },
                );
                if let Some(q) = self.queues.get_mut(qk) {
                    q.consumer = ConsumerState::Creating;
                }
            }
            Err(e) => {
                log::warn!(queue:% = qk; "consumer request failed: {e}");
                self.consumer_failed(qk, now);
            }
        }
    }

    /// The AckWait the consumer of `qk` has, as its create answered; a warning when it
    /// is not this broker's `lease_s` (only one AckWait holds for every broker serving
    /// the job: the last to make the consumer sets it).
    pub(super) fn consumer_ack_wait_read(&mut self, qk: &str, ack_wait: Option<Duration>) {
        let Some(q) = self.queues.get(qk) else {
            return;
        };
        let lease_s = self.job_config(&q.ns, &q.job).lease_s;
        if let Some(a) = ack_wait.filter(|a| *a != Duration::from_secs(lease_s)) {
            log::warn!(
                queue:% = qk;
                "the job consumer's AckWait is {} ms, not this broker's lease_s of {lease_s} s: \
                 brokers serving a job must agree on its lease_s; leases are kept by the consumer's",
                a.as_millis()
            );
        }
        if let Some(q) = self.queues.get_mut(qk) {
            q.ack_wait = ack_wait.or(q.ack_wait);
        }
    }

    /// The AckWait JetStream redelivers the messages of `ns/job` by: the consumer's, as
    /// read back, else the job's `lease_s` it is made with.
    pub(super) fn consumer_ack_wait(&self, ns: &str, job: &str) -> Duration {
        self.queues
            .get(&queue_key(ns, job))
            .and_then(|q| q.ack_wait)
            .unwrap_or_else(|| Duration::from_secs(self.job_config(ns, job).lease_s))
            .max(Duration::from_secs(1))
    }

    /// JetStream refused the job's consumer (its stream at `max_consumers`, say): the
    /// sessions that serve it here hear why once, since their `serve` was answered `ok`
    /// and nothing will be offered until the consumer is made.
    pub(super) fn tell_unserved(&mut self, qk: &str, why: &str) {
        let Some(q) = self.queues.get_mut(qk).filter(|q| !q.told) else {
            return;
        };
        q.told = true;
        let (ns, job) = (q.ns.clone(), q.job.clone());
        let e = AmpError::new(
            ErrorCode::Unavailable,
            format!(
                "job `{job}` is not offered: JetStream refused its consumer ({why}); the broker keeps asking"
            ),
        )
        .with_path("/job");
        let sessions = self
            .workers
            .iter()
            .filter(|(_, w)| w.ns == ns && w.serving.get(&job).is_some_and(|s| s.slots > 0))
            .map(|(&session, _)| session)
            .collect();
        self.out.push_back(JobsOutput::Each {
            sessions,
            text: reply::error(None, &e),
        });
    }

    pub(super) fn consumer_failed(&mut self, qk: &str, now: Instant) {
        if let Some(q) = self.queues.get_mut(qk) {
            q.consumer = ConsumerState::Failed;
        }
        self.later.push(
            now + CONSUMER_RETRY,
            Alarm(Timer::ConsumerRetry {
                queue: qk.to_string(),
            }),
        );
    }

    pub(super) fn consumer_ready(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        let Some(q) = self.queues.get_mut(qk) else {
            return;
        };
        q.consumer = ConsumerState::Ready;
        if q.pull.sid().is_none() {
            match q.pull.attach(conn) {
                Ok(sid) => {
                    self.routes.insert(sid, qk.to_string());
                }
                Err(e) => {
                    log::warn!(queue:% = qk; "pull subscription failed: {e}");
                    return self.consumer_failed(qk, now);
                }
            }
        }
        self.pull_more(conn, qk, now);
    }

    /// Slots and free slots of this broker's sessions serving the job.
    pub(super) fn slots(&self, ns: &str, job: &str) -> (u32, u32) {
        self.workers
            .values()
            .filter(|w| w.ns == ns)
            .filter_map(|w| w.serving.get(job))
            .fold((0u32, 0u32), |(all, free), s| {
                (
                    all.saturating_add(s.slots),
                    free.saturating_add(s.slots.saturating_sub(s.in_flight)),
                )
            })
    }

    /// Asks for one message per free slot not already asked for (see
    /// [`PullLoop::fill`] for when it waits).
    pub(super) fn pull_more(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        self.refill(conn, qk, None, now);
    }

    /// `+ACK` of a finished message of the job queue its ack subject names: the ack
    /// carries the queue's next pull when one is wanted (`+NXT`, one message to the server
    /// for the ack and for the slot the message held), else the queue pulls as usual.
    pub(super) fn ack_done(&mut self, conn: &mut Connection, ack: &str, now: Instant) {
        let Some(qk) = self.queue_of_ack(ack) else {
            return self.ack(conn, ack, AckKind::Ack);
        };
        self.ack_settled(&qk);
        if !self.refill(conn, &qk, Some(ack), now) {
            self.ack(conn, ack, AckKind::Ack);
            self.pull_more(conn, &qk, now);
        }
    }

    /// A message of queue `qk` was acked (or NAKed): a completion's slot waiting for its
    /// ack, if any, is free to be pulled for. (Another ack taken for one only pulls a
    /// moment early.)
    pub(super) fn ack_settled(&mut self, qk: &str) {
        if let Some(q) = self.queues.get_mut(qk) {
            q.acks_due = q.acks_due.saturating_sub(1);
        }
    }

    /// The job queue whose message `ack` acknowledges, when this broker has it.
    pub(super) fn queue_of_ack(&self, ack: &str) -> Option<String> {
        let m = AckMetadata::parse(ack).ok()?;
        let (ns, job) = binding::job_of_consumer(m.stream, m.consumer)?;
        Some(queue_key(ns, job)).filter(|qk| self.queues.contains_key(qk))
    }

    /// Pulls for queue `qk` as [`PullLoop::fill`] says, or with `ack`, as
    /// [`PullLoop::ack_and_fill`] says; true when a pull was sent.
    fn refill(&mut self, conn: &mut Connection, qk: &str, ack: Option<&str>, now: Instant) -> bool {
        let Some(q) = self.queues.get(qk) else {
            return false;
        };
        if q.consumer != ConsumerState::Ready {
            return false;
        }
        let (slots, free) = self.slots(&q.ns, &q.job);
        let Some(q) = self.queues.get_mut(qk) else {
            return false;
        };
        let in_hand = q.unplaced.saturating_add(q.acks_due);
        let sent = match ack {
            Some(ack) => q.pull.ack_and_fill(conn, ack, free, in_hand, now),
            None => q.pull.fill(conn, slots, free, in_hand, now),
        };
        let share = match sent {
            Ok(Some(share)) => share,
            Ok(None) => return false,
            Err(e) => {
                log::warn!(queue:% = qk; "{e}");
                return false;
            }
        };
        self.stats.js_ops += 1;
        self.later.push(
            share.over_at,
            Alarm(Timer::PullExpiry {
                queue: qk.to_string(),
                pull: share.pull,
            }),
        );
        true
    }
}
