//! Policy: per-participant rate limits and task budgets (counted in JetStream and
//! shared by every broker) before a frame reaches the jobs engine.

use super::*;

impl Broker {
    /// The publish-path token buckets (`send`, `publish`, `submit`): one message and the
    /// body's bytes. What was charged (`None` for a participant without limits), for a
    /// [`refund_rate`](Self::refund_rate).
    pub(super) fn take_rate(
        &mut self,
        ns: &str,
        name: &str,
        body_bytes: usize,
        now: Instant,
    ) -> Result<Option<u64>, AmpError> {
        let limits = self
            .config
            .participant(ns, name)
            .and_then(|p| p.policy.as_ref())
            .and_then(rate_limit::Limits::from_policy);
        self.take_rate_with(ns, name, limits, body_bytes, now)
    }

    /// [`take_rate`](Self::take_rate) with the participant's limits already looked up.
    pub(super) fn take_rate_with(
        &mut self,
        ns: &str,
        name: &str,
        limits: Option<rate_limit::Limits>,
        body_bytes: usize,
        now: Instant,
    ) -> Result<Option<u64>, AmpError> {
        let Some(limits) = limits else {
            return Ok(None);
        };
        let bytes = body_bytes as u64;
        self.rates
            .try_take(&participant_key(ns, name), &limits, 1, bytes, now)
            .map(|()| Some(bytes))
            .map_err(|r| AmpError::rate_limited(r.retry_after_ms))
    }

    /// Gives a session's participant back a charge of [`take_rate`](Self::take_rate) for a
    /// request that stored nothing (spec 2.6: a failed request changes nothing a later
    /// one can observe). A session already gone keeps its participant's charge.
    pub(super) fn refund_rate(&mut self, session: SessionId, charged: Option<u64>) {
        let Some(bytes) = charged else { return };
        let Some((ns, name)) = self
            .sessions
            .get(&session)
            .and_then(|s| s.state.participant())
        else {
            return;
        };
        let limits = self
            .config
            .participant(ns, name)
            .and_then(|p| p.policy.as_ref())
            .and_then(rate_limit::Limits::from_policy);
        if let Some(limits) = limits {
            let key = participant_key(ns, name);
            self.rates.refund(&key, &limits, 1, bytes);
        }
    }

    /// See [`Jobs::refusal`]; `None` for a participant a reload removed (the frame is
    /// dropped at [`Core::hand_to_jobs`]).
    pub(super) fn refusal(
        &self,
        session: SessionId,
        ns: &str,
        name: &str,
        frame: &ClientFrame,
    ) -> Option<AmpError> {
        let participant = self.config.participant(ns, name)?;
        Jobs::refusal(&participant.permissions, session, frame)
    }

    pub(super) fn hand_to_jobs(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        frame: ClientFrame,
        now: Instant,
    ) {
        self.with_caller(session, ns, name, |jobs, caller| {
            jobs.frame(conn, caller, frame, now);
        })
    }

    /// Runs `f` with the jobs engine and the session's participant, if it is still there.
    fn with_caller(
        &mut self,
        session: SessionId,
        ns: &str,
        name: &str,
        f: impl FnOnce(&mut Jobs, &Caller<'_>),
    ) {
        let key = participant_key(ns, name);
        if let (Some(participant), Some(p)) =
            (self.config.participant(ns, name), self.presence.get(&key))
        {
            let caller = Caller {
                session,
                ns,
                name,
                participant,
                labels: &p.labels,
            };
            f(&mut self.jobs, &caller);
        }
    }

    /// Takes one task from the participant's budget. False when the submit was answered
    /// (`budget_exhausted`) or is held until a reservation in JetStream settles.
    pub(super) fn spend_budget(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        frame: &ClientFrame,
        now: Instant,
    ) -> bool {
        let budget = Budget::of(&self.config, ns, name);
        let Some(budget) = budget else { return true };
        let key = participant_key(ns, name);
        let spend = self
            .budgets
            .try_spend(&key, budget, self.clock.unix_seconds(now) * 1000);
        self.drive_budgets(conn, now);
        match spend {
            Spend::Granted => {
                if let (Some(s), Some(id)) = (self.sessions.get_mut(&session), frame.id()) {
                    s.charged.entry(id.to_string()).or_default().budget = true;
                }
                true
            }
            Spend::Exhausted => {
                match frame {
                    // A retry of a task that may exist (its create landed, its answer was
                    // lost) spends nothing: the task store answers it, and only a task
                    // that is not there is refused.
                    ClientFrame::Submit(s) if s.task.is_some() => {
                        let submit = s.clone();
                        self.with_caller(session, ns, name, |jobs, caller| {
                            jobs.submit_over_budget(conn, caller, submit, now)
                        })
                    }
                    _ => {
                        if let Some(id) = frame.id() {
                            self.fail(session, id, AmpError::budget_exhausted());
                        }
                    }
                }
                false
            }
            Spend::Wait => {
                let held = self.held_submits.get(&key).map_or(0, Vec::len);
                // Each held submit keeps its frame: past the caps the client waits, not us.
                let hold = (held < self.config.limits.max_held_submits)
                    .then(|| self.jobs.held_bytes().take(frame_bytes(frame)))
                    .flatten();
                let Some(hold) = hold else {
                    if let Some(id) = frame.id() {
                        let mut e = AmpError::new(
                            ErrorCode::Unavailable,
                            "too many submits are waiting for the task budget",
                        );
                        e.retry_after_ms = Some(HELD_SUBMIT_RETRY_MS);
                        self.fail(session, id, e);
                    }
                    return false;
                };
                self.held_submits
                    .entry(key)
                    .or_default()
                    .push((session, frame.clone(), hold));
                false
            }
        }
    }

    /// Request `re` of `session`, a submit or redrive, was refused having created
    /// nothing: what it was charged goes back, as for a send that stored nothing. A task
    /// of the budget goes back to this broker's reservation (no JetStream operation: the
    /// window's count in `AMP_BUDGET` says what the brokers reserved, and the task stays
    /// reserved here for the participant's next submit).
    pub(super) fn refund_unmade(&mut self, session: SessionId, re: &str, now: Instant) {
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        let Some(charge) = s.charged.remove(re) else {
            return;
        };
        let SessionState::Active { ns, name } = &s.state else {
            return;
        };
        let (ns, name) = (ns.clone(), name.clone());
        self.refund_rate(session, charge.rate);
        if !charge.budget {
            return;
        }
        if let Some(budget) = Budget::of(&self.config, &ns, &name) {
            let unix_ms = self.clock.unix_seconds(now) * 1000;
            self.budgets
                .refund(&participant_key(&ns, &name), budget, unix_ms);
        }
    }

    pub(super) fn drive_budgets(&mut self, conn: &mut Connection, now: Instant) {
        while let Some(op) = self.budgets.poll_op() {
            // Keys are `<ns>.<name>.<window>`: a fleet namespace counts in its domain.
            let ns = op.key.split('.').next().unwrap_or_default();
            let request = crate::broker::budget::bucket(self.config.js_api(ns))
                .and_then(|kv| op.request(&kv));
            match js_request(conn, request, now) {
                Ok(id) => self.await_reply(id, now, Pending::Budget { op }),
                Err(_) => {
                    let settled = self.budgets.on_reply(op.id, KvReply::Failed);
                    self.budget_settled(conn, settled, now);
                }
            }
        }
    }

    /// A reservation ended: held submits are tried again (or answered `unavailable`).
    pub(super) fn budget_settled(
        &mut self,
        conn: &mut Connection,
        settled: Option<Settled>,
        now: Instant,
    ) {
        let (participant, retry) = match settled {
            Some(Settled::Retry { participant }) => (participant, true),
            Some(Settled::Unavailable { participant }) => (participant, false),
            None => return,
        };
        self.mig_budget_settled(conn, &participant, retry, now);
        // Their bytes are free before any is tried again (and held again, if it must
        // wait once more, or as its task message).
        let held: Vec<_> = self
            .held_submits
            .remove(&participant)
            .unwrap_or_default()
            .into_iter()
            .map(|(session, frame, _hold)| (session, frame))
            .collect();
        for (session, frame) in held {
            if !retry {
                if let Some(id) = frame.id() {
                    self.fail(
                        session,
                        id,
                        unavailable("the task budget could not be read"),
                    );
                }
                continue;
            }
            let state = self.sessions.get(&session).map(|s| &s.state);
            if let Some(SessionState::Active { ns, name }) = state {
                // Already rate-limited once; only the budget is asked again.
                let (ns, name) = (ns.clone(), name.clone());
                if self.spend_budget(conn, session, &ns, &name, &frame, now) {
                    self.hand_to_jobs(conn, session, &ns, &name, frame, now);
                }
            }
        }
    }
}

/// What a held submit or redrive frame holds beyond its small fixed part.
fn frame_bytes(frame: &ClientFrame) -> usize {
    match frame {
        ClientFrame::Submit(s) => s.body.get().len(),
        _ => 0,
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! Budgets driven in process: the core on the NATS/JetStream model.

    use serde_json::json;

    use crate::broker::config::{Participant, Policy};
    use crate::testing::harness::{self, Harness};

    #[test]
    fn a_retry_of_a_stored_task_is_answered_when_the_budget_is_spent() {
        // Found by the simulator (generation 2, seeds 0xd0, 0x336, 0x347, 0x386): a submit
        // whose create landed but whose answer was lost (`unavailable`) spent the last
        // task of the window; its retry with the same task id was refused
        // `budget_exhausted` before the task store was asked, so the client never learnt
        // that its task existed.
        let mut config = harness::development_config();
        if let Some(ns) = config.namespaces.get_mut("dev")
            && let Some(open) = ns.open.as_deref().cloned()
        {
            let budgeted = Participant {
                policy: Some(Policy {
                    msgs_per_s: None,
                    burst: None,
                    bytes_per_s: None,
                    tasks_per_window: Some(2),
                    window_s: Some(86_400),
                }),
                ..open
            };
            ns.participants.insert("app".into(), budgeted.into());
        }
        let mut h = Harness::new(config, 1, 3);
        let app = h.join(0, "app", json!({}));
        let submit = |h: &mut Harness, task: &str, n: u64| {
            h.request(
                app,
                json!({"op":"submit","job":"render","task":task,"body":{"n":n}}),
            )
        };
        for task in ["t1", "t2"] {
            let ok = submit(&mut h, task, 1);
            assert_eq!(
                (&ok["op"], &ok["dup"]),
                (&json!("ok"), &json!(false)),
                "{ok}"
            );
        }
        let refused = submit(&mut h, "t3", 1);
        assert_eq!(refused["code"], "budget_exhausted", "{refused}");
        let again = submit(&mut h, "t1", 1);
        assert_eq!(
            (&again["op"], &again["dup"]),
            (&json!("ok"), &json!(true)),
            "{again}"
        );
        let other = submit(&mut h, "t2", 2);
        assert_eq!(other["code"], "conflict", "{other}");
        let no_id = h.request(app, json!({"op":"submit","job":"render","body":{}}));
        assert_eq!(no_id["code"], "budget_exhausted", "{no_id}");
    }
}
