//! Submitting a task: the task store record is created first (it decides whether the
//! id is new), then the task message goes to the job's queue.

use super::*;

/// Task ids the broker derives itself (`mig/invoke.rs`, `dead_letters.rs`).
const RESERVED_TASK_PREFIXES: [&str; 2] = ["mig-", "redrive-"];

impl Jobs {
    /// Why a submit or a redrive is refused whatever its rate, its budget or JetStream
    /// say. Asked before the rate and the budget are charged: a request that fails changes
    /// nothing (spec 2.6), and a refused submit used to spend a task of the budget.
    pub fn refusal(
        permissions: &Permissions,
        session: SessionId,
        frame: &ClientFrame,
    ) -> Option<AmpError> {
        match frame {
            ClientFrame::Submit(s) => Jobs::submit_refusal(permissions, session, s),
            ClientFrame::Redrive { job, .. } => letters::redrive_refusal(permissions, job),
            _ => None,
        }
    }

    fn submit_refusal(
        permissions: &Permissions,
        session: SessionId,
        submit: &amp_frame::Submit,
    ) -> Option<AmpError> {
        let job = submit.job.as_str();
        if !permissions::allows(permissions, Action::Submit, job) {
            return Some(not_permitted("submitting to", job));
        }
        let task = submit.task.as_deref()?;
        let prefix = RESERVED_TASK_PREFIXES
            .iter()
            .find(|p| task.starts_with(*p))?;
        // The broker derives these ids (a MIG caller's idempotency key, a redrive of a
        // dead letter): taken first by a client, the real one would be refused.
        (!crate::broker::mig::is_mig_session(session)).then(|| {
            AmpError::new(
                ErrorCode::Schema,
                format!("task ids starting `{prefix}` are the broker's own"),
            )
            .with_path("/task")
        })
    }

    /// A submit with its task id that the participant's budget refused: a retry of a task
    /// whose create landed but whose answer was lost is answered from the task store as
    /// any resubmit (`dup`), and only a task that does not exist is refused
    /// `budget_exhausted`. Nothing is created.
    pub fn submit_over_budget(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        submit: amp_frame::Submit,
        now: Instant,
    ) {
        self.submit(conn, caller, submit, true, now);
    }

    pub(super) fn submit(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        submit: amp_frame::Submit,
        over_budget: bool,
        now: Instant,
    ) {
        let p = &caller.participant.permissions;
        if let Some(e) = Jobs::submit_refusal(p, caller.session, &submit) {
            return self.refuse_unmade(caller.session, &submit.id, e);
        }
        let who = (caller.ns, caller.name);
        self.submit_as(conn, caller.session, who, submit, over_budget, now);
    }

    /// A submit by participant `ns/name`, whose permission to submit was checked.
    pub(super) fn submit_as(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        (ns, name): (&str, &str),
        submit: amp_frame::Submit,
        over_budget: bool,
        now: Instant,
    ) {
        let job = submit.job.as_str();
        let task = submit.task.clone().unwrap_or_else(|| self.ids.next_id());
        let from = format!("{ns}/{name}");
        let max_attempts = submit
            .max_attempts
            .unwrap_or_else(|| self.job_config(ns, job).max_attempts)
            .max(1);
        let eligible = submit.eligible.map(|e| Eligible {
            names: e.names,
            labels: e.labels,
        });
        let now_ms = self.clock.ms(now);
        let mut record = TaskRecord::submitted(
            &task,
            job,
            &from,
            &submit.body.to_value(),
            max_attempts,
            eligible,
            now_ms,
        );
        // The MIG front's own submits: a client's, or a redriven letter of an invoke's
        // task, carrying the header is answered in its inbox as any task.
        record.via_mig = crate::broker::mig::is_mig_session(session)
            && submit.headers.contains_key("mig_capability");
        let use_id = self.ids.next_id();
        record.use_id = Some(use_id.clone());
        let body = submit.body.into_text();
        let env = Envelope {
            id: task.clone(),
            kind: Kind::Task,
            from: from.clone(),
            to: None,
            topic: None,
            job: Some(job.to_string()),
            ts: rfc3339::format_millis(now_ms),
            headers: submit.headers,
            body,
        };
        let mut headers = HeaderMap::new();
        let mut stamped = vec![
            ("Nats-Msg-Id", task.as_str()),
            ("AMP-From", from.as_str()),
            ("AMP-Kind", Kind::Task.as_str()),
            (USE_HEADER, use_id.as_str()),
        ];
        if let Some(tp) = env.headers.get("traceparent") {
            stamped.push(("traceparent", tp.as_str()));
        }
        for (k, v) in stamped {
            // The traceparent is the only value the client chose.
            if let Err(e) = headers.insert(k, v) {
                let e = AmpError::new(ErrorCode::Schema, format!("header not storable: {e}"))
                    .with_path("/headers/traceparent");
                return self.refuse_unmade(session, &submit.id, e);
            }
        }
        let payload = env.to_json();
        let size = payload.len() + headers.encoded_len();
        let record_json = record.to_json();
        let max = conn.max_payload();
        if size > max || record_json.len() > max {
            let e = AmpError::new(
                ErrorCode::TooLarge,
                format!(
                    "the stored task would be {} bytes; the server allows {max}",
                    size.max(record_json.len())
                ),
            );
            return self.refuse_unmade(session, &submit.id, e);
        }
        let Some(hold) = self.held.take(size + record_json.len()) else {
            return self.refuse_unmade(session, &submit.id, held_bytes::full());
        };
        let sub = Submission {
            session,
            re: submit.id.clone(),
            from: from.clone(),
            ns: ns.to_string(),
            task: task.clone(),
            job: job.to_string(),
            digest: record.body_sha256.clone(),
            subject: binding::job_subject(ns, job),
            headers,
            payload,
            record: record_json,
            over_budget,
            _hold: hold,
        };
        let key = task_key(ns, &task);
        let req = match self.kv.create_request(&key, &sub.record, None) {
            Ok(r) => r,
            Err(e) => {
                let e = AmpError::new(ErrorCode::Schema, format!("task id not storable: {e}"))
                    .with_path("/task");
                return self.refuse_unmade(session, &submit.id, e);
            }
        };
        if over_budget {
            return self.read_existing(conn, Box::new(sub), now);
        }
        match self.request(conn, &req.subject, req.headers.as_ref(), &req.payload, now) {
            Ok(id) => {
                self.await_reply(id, now, Pending::SubmitCreate(Box::new(sub)));
            }
            Err(e) => self.refuse_unmade(session, &submit.id, send_error(&e)),
        }
    }

    /// Refuses a submit or redrive that created nothing: what the core charged for it
    /// (a task of the participant's budget) is given back first (spec 2.6: a request
    /// that fails changes nothing). A conflict, a too large task, a redrive of no letter
    /// each spent a task of the budget
    /// (`broker_budget::a_submit_the_engine_refuses_spends_nothing_of_the_budget`).
    pub(super) fn refuse_unmade(&mut self, session: SessionId, re: &str, e: AmpError) {
        self.out.push_back(JobsOutput::Refund {
            session,
            re: re.to_string(),
        });
        self.refuse(session, re, e);
    }

    /// Stores the task message of `sub`, whose record is `stored` (JSON, revision).
    pub(super) fn publish_task(
        &mut self,
        conn: &mut Connection,
        sub: Submission,
        dup: bool,
        stored: (Vec<u8>, u64),
        now: Instant,
    ) {
        let key = task_key(&sub.ns, &sub.task);
        match self.request(conn, &sub.subject, Some(&sub.headers), &sub.payload, now) {
            Ok(id) => {
                self.await_reply(
                    id,
                    now,
                    Pending::SubmitPublish {
                        session: sub.session,
                        re: sub.re,
                        ns: sub.ns,
                        task: sub.task,
                        dup,
                        stored: Box::new(stored),
                    },
                );
            }
            Err(e) => {
                // Not sent, so not stored; a resubmit's says nothing of the first's.
                if !dup {
                    self.expire_unqueued(conn, key, stored, now);
                }
                self.refuse(sub.session, &sub.re, send_error(&e));
            }
        }
    }

    /// Binds the record `stored` (JSON, revision) to the task message at `seq`, which a
    /// resubmit stored or found stored.
    pub(super) fn bind_record(
        &mut self,
        conn: &mut Connection,
        key: String,
        (json, revision): (Vec<u8>, u64),
        seq: u64,
        now: Instant,
    ) {
        let mut record = match TaskRecord::from_json(&json) {
            Ok(r) => r,
            Err(e) => return log::warn!(task:% = key; "task record not bound: {e}"),
        };
        record.msg_seq = Some(seq);
        let json = record.to_json();
        let what = "bound to its task message";
        self.rewrite(conn, key, (&json, revision), None, what, now);
    }

    /// The record `stored` (JSON, revision) of a task whose first message JetStream
    /// refused (or that was never sent) expires as a finished task's does, unless a retry stores
    /// the message first (its bind rewrites the record without the expiry); else it
    /// would stay `queued` for good, with nothing to deliver. A change made meanwhile
    /// wins: the message was stored after all (a delivery or a resubmit bound the
    /// record), or the task was cancelled.
    pub(super) fn expire_unqueued(
        &mut self,
        conn: &mut Connection,
        key: String,
        (json, revision): (Vec<u8>, u64),
        now: Instant,
    ) {
        let job = match TaskRecord::from_json(&json) {
            Ok(r) => r.job,
            Err(e) => return log::warn!(task:% = key; "task record given no expiry: {e}"),
        };
        let ns = key.split_once('.').map_or("", |(ns, _)| ns);
        let config = self.job_config(ns, &job);
        let ack_wait = self.consumer_ack_wait(ns, &job);
        let ttl = crate::jetstream::MsgTtl::After(Duration::from_secs(
            super::store::finished_ttl_s(&config, ack_wait),
        ));
        let what = "given its expiry";
        self.rewrite(conn, key, (&json, revision), Some(ttl), what, now);
    }

    /// Writes `json` over `revision` of `key` (`what` it is for, for the log).
    fn rewrite(
        &mut self,
        conn: &mut Connection,
        key: String,
        (json, revision): (&[u8], u64),
        ttl: Option<crate::jetstream::MsgTtl>,
        what: &'static str,
        now: Instant,
    ) {
        let sent = self
            .kv
            .replace_request(&key, json, revision, ttl)
            .map_err(|e| e.to_string())
            .and_then(|req| {
                self.request(conn, &req.subject, req.headers.as_ref(), &req.payload, now)
                    .map_err(|e| e.to_string())
            });
        match sent {
            Ok(id) => self.await_reply(id, now, Pending::Rewrite { key, what }),
            Err(e) => log::info!(task:% = key; "task record not {what}: {e}"),
        }
    }
}
