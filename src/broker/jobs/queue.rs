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
        let deliver_prefix = conn.new_inbox();
        self.queues.insert(
            qk.clone(),
            JobQueue {
                ns: ns.to_string(),
                job: job.to_string(),
                consumer: ConsumerState::Creating,
                sid: None,
                deliver_prefix,
                requested: 0,
                pulls: HashMap::new(),
                next_pull: 0,
                unplaced: 0,
            },
        );
        self.create_consumer(conn, &qk, now);
    }

    pub(super) fn create_consumer(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        let Some(q) = self.queues.get(qk) else { return };
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
        if q.sid.is_none() {
            let pattern = format!("{}.*", q.deliver_prefix);
            match conn.subscribe(&pattern, None) {
                Ok(sid) => {
                    q.sid = Some(sid);
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

    /// Asks for one message per free slot not already asked for.
    pub(super) fn pull_more(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        let Some(q) = self.queues.get(qk) else { return };
        // While disconnected a pull would wait in the reconnect buffer and arrive next to
        // the one `on_reconnected` sends, asking for messages twice.
        if q.consumer != ConsumerState::Ready || q.sid.is_none() || !conn.is_connected() {
            return;
        }
        let outstanding = q.requested.saturating_add(q.unplaced);
        let (slots, free) = self.slots(&q.ns, &q.job);
        let want = free.saturating_sub(outstanding);
        // While messages are still coming, freed slots wait until a quarter of the job's
        // slots are free: one pull then serves several tasks instead of one each.
        if want == 0 || (outstanding > 0 && want < (slots / 4).max(1)) {
            return;
        }
        let pull = PullRequest {
            batch: u64::from(want),
            expires: Some(PULL_EXPIRES),
            ..PullRequest::default()
        };
        let req = match self.api.of(&q.ns).pull_next(
            &binding::tasks_stream(&q.ns),
            &binding::job_consumer(&q.job),
            &pull,
        ) {
            Ok(r) => r,
            Err(e) => return log::warn!(queue:% = qk; "pull request invalid: {e}"),
        };
        let n = q.next_pull;
        let reply = format!("{}.{n}", q.deliver_prefix);
        if let Err(e) = conn.publish(&req.subject, Some(&reply), None, &req.payload) {
            return log::warn!(queue:% = qk; "pull failed: {e}");
        }
        self.stats.js_ops += 1;
        if let Some(q) = self.queues.get_mut(qk) {
            q.next_pull += 1;
            q.pulls.insert(n, want);
            q.requested = q.requested.saturating_add(want);
        }
        self.later.push(
            now + PULL_EXPIRES + PULL_GRACE,
            Alarm(Timer::PullExpiry {
                queue: qk.to_string(),
                pull: n,
            }),
        );
    }
}
