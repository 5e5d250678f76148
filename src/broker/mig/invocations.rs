//! The life of an invocation: the task record is watched and read (a retry finds its
//! first try's task), the job's queue counted against `max_queued`, the task submitted
//! through the jobs engine, and its outcome answered as a reply or as stream frames.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::envelope::{Code, Echo, MigError};
use super::invoke::{self, Invocation, Stage};
use super::{
    Answer, BACKPRESSURE_RETRY_MS, Ctx, JS_TIMEOUT, Mig, Pending, Sub, jobs_frame, metrics, millis,
    seen, take_rate,
};
use crate::amp::frame::ClientFrame;
use crate::broker::budget::Spend;
use crate::broker::in_flight::Ticket;
use crate::broker::jobs::SessionId;
use crate::broker::task_store::TaskRecord;
use crate::jetstream::kv::KvOperation;
use crate::jetstream::publish::parse_pub_ack;
use crate::jetstream::{ApiPrefix, JsError};
use crate::nats::{Connection, Message, RequestError};

impl Mig {
    pub(super) fn invoke(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        r: invoke::Request<'_>,
        ticket: Option<Ticket>,
        now: Instant,
    ) {
        let echo = Echo::of(r.header);
        let answer = Answer {
            reply: r.reply,
            echo: &echo,
            op: "invoke",
            // A label only when the tenant has it (see `on_request`).
            capability: if super::offers(ctx.config, r.ns, r.capability) {
                r.capability
            } else {
                ""
            },
            received: now,
        };
        let accepted = invoke::accept(ctx.config, &r).and_then(|accepted| {
            let bytes = accepted.payload.get().len();
            // Held until its task exists. Asked before the rate is charged, so that a
            // refusal for want of room spends none of it.
            let hold = super::hold_bytes(ctx.jobs, bytes)?;
            take_rate(ctx.rates, r.participant, r.ns, r.caller, bytes, now)?;
            // A message id names the stream and is what CANCEL finds: one another caller's
            // invocation here uses would let this one end its stream or its cancel.
            let taken = r.header.message_id_given
                && self
                    .by_message
                    .get(&(r.ns.to_string(), r.header.message_id.clone()))
                    .is_some_and(|sessions| {
                        sessions.iter().any(|s| {
                            self.invocations
                                .get(s)
                                .is_some_and(|i| i.caller != r.caller)
                        })
                    });
            if taken {
                return Err(MigError::new(
                    Code::InvalidRequest,
                    "message_id is in use by another caller's invocation",
                ));
            }
            let max = ctx.config.mig.max_pending;
            let share = caller_share(max);
            let mine = self
                .waiting_per_caller
                .get(&(r.ns.to_string(), r.caller.to_string()))
                .copied()
                .unwrap_or(0);
            // A caller also takes a slot only while it holds fewer than are free: with
            // the quarter alone, four callers held every slot of every tenant here; now
            // each after the third takes at most half of what is left.
            let free = max.saturating_sub(self.invocations.len() + self.claiming);
            if mine >= free || mine >= share {
                let message = if mine >= share {
                    format!("a caller waits on at most {share} invocations on this broker")
                } else {
                    "this broker waits on too many invocations".to_string()
                };
                return Err(MigError::new(Code::Backpressure, message)
                    .detail("retry_after_ms", json!(BACKPRESSURE_RETRY_MS)));
            }
            Ok((accepted, hold))
        });
        let (accepted, hold) = match accepted {
            Ok(a) => a,
            Err(e) => return self.respond(conn, &answer, Err(e), now),
        };
        let settings = &ctx.config.mig;
        let deadline_ms = r
            .header
            .deadline_ms
            .unwrap_or(settings.default_deadline_ms)
            .min(settings.max_deadline_ms);
        // A message id that names a stream or a forwarded cancel is taken for every broker
        // first: the check above sees only this broker's invocations. A stream's id is
        // taken even when this broker made it: every frame shows it to anyone reading
        // `stream.>`, who could otherwise send it to another broker as its own id. A
        // keyed unary invoke's made id reaches its caller only with the outcome, when
        // there is nothing left to cancel, so it is not worth a round trip.
        let named =
            accepted.streaming || (r.header.message_id_given && r.header.idempotency_key.is_some());
        // The check above has refused an id held here; one held on another broker may not
        // be in a bucket just made again yet.
        if named && self.reclaims.settling(now) {
            return self.respond(conn, &answer, Err(super::reclaim::settling()), now);
        }
        if named {
            let bound = settings.max_claims_per_caller;
            let caller = format!("{}/{}", r.ns, r.caller);
            if let Err(over) = self.claims_held.admit(&caller, bound, now) {
                let e = match over {
                    seen::Over::Caller(d) => MigError::new(
                        Code::RateLimited,
                        format!(
                            "a caller holds at most {bound} claimed message ids on this broker"
                        ),
                    )
                    .detail("retry_after_ms", json!(millis(d))),
                    seen::Over::Broker(d) => MigError::new(
                        Code::Unavailable,
                        "this broker holds as many claimed message ids as the bucket takes",
                    )
                    .detail("retry_after_ms", json!(millis(d))),
                };
                return self.respond(conn, &answer, Err(e), now);
            }
        }
        let mut inv = Invocation::new(&r, accepted, hold, deadline_ms, now);
        inv.ticket = ticket;
        *self
            .waiting_per_caller
            .entry((inv.ns.clone(), inv.caller.clone()))
            .or_insert(0) += 1;
        if !named {
            return self.begin(conn, inv, now);
        }
        inv.claimed = true;
        let claim = seen::claim_invocation(
            ctx.config.js_api(r.ns),
            r.ns,
            &r.header.message_id,
            r.caller,
            Duration::from_millis(deadline_ms),
        )
        .map_err(|e| e.to_string())
        .and_then(|c| {
            conn.request(&c.subject, c.headers.as_ref(), &c.payload, JS_TIMEOUT, now)
                .map_err(|e| e.to_string())
        });
        match claim {
            Ok(id) => {
                self.claiming += 1;
                let key = (inv.ns.clone(), r.header.message_id.clone());
                let caller = inv.caller.clone();
                self.claims.insert(
                    key,
                    super::cancel::Claim {
                        caller,
                        cancel: None,
                    },
                );
                let pending = Pending::InvocationClaim(Box::new(inv));
                self.staged.push(id, super::Awaiting(pending), now);
            }
            Err(e) => {
                self.claims_held
                    .settle(&format!("{}/{}", inv.ns, inv.caller), None, now);
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                self.refuse(conn, inv, e, now);
            }
        }
    }

    /// The message id of `inv` was taken for it (or was taken before: by its own caller,
    /// whose retry goes on, or by someone else's invocation).
    pub(super) fn invocation_claimed(
        &mut self,
        conn: &mut Connection,
        ctx: &Ctx<'_>,
        inv: Invocation,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        self.claiming = self.claiming.saturating_sub(1);
        let message_id = inv.echo.message_id.clone().unwrap_or_default();
        let acked = reply.map(|m| parse_pub_ack(m.status(), &m.payload));
        // Counted until the key's TTL has passed; also when the answer was lost, since
        // the server may have stored the key. JetStream's refusals stored nothing.
        let ttl = inv.deadline.saturating_duration_since(inv.received) + seen::INVOCATION_MARGIN;
        let created = matches!(acked, Ok(Ok(_)) | Err(_)).then_some(ttl);
        self.claims_held
            .settle(&format!("{}/{}", inv.ns, inv.caller), created, now);
        let refusal = match acked {
            Ok(Ok(_)) => return self.claimed_for(conn, inv, now),
            Ok(Err(JsError::WrongLastSequence(_))) => {
                let read = super::js_request(
                    conn,
                    seen::invocation_owner(ctx.config.js_api(&inv.ns), &inv.ns, &message_id),
                    now,
                );
                match read {
                    Ok(id) => {
                        self.claiming += 1;
                        let pending = Pending::InvocationOwner(Box::new(inv));
                        return self.staged.push(id, super::Awaiting(pending), now);
                    }
                    Err(e) => MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}")),
                }
            }
            Ok(Err(e)) => MigError::new(
                Code::Unavailable,
                format!("JetStream did not record the message id: {e}"),
            ),
            Err(RequestError::NoResponders) => seen::gone(),
            Err(e) => MigError::new(Code::Unavailable, format!("JetStream did not answer: {e}")),
        };
        self.refuse(conn, inv, refusal, now)
    }

    /// Who holds the message id `inv` found taken.
    pub(super) fn invocation_owner_read(
        &mut self,
        conn: &mut Connection,
        ctx: &Ctx<'_>,
        inv: Invocation,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        self.claiming = self.claiming.saturating_sub(1);
        let message_id = inv.echo.message_id.as_deref().unwrap_or_default();
        let key = seen::invocation_key(&inv.ns, message_id);
        let kv = crate::jetstream::kv::Kv::new(ctx.config.js_api(&inv.ns), seen::BUCKET);
        let entry = match (reply, kv) {
            (Ok(m), Ok(kv)) => kv.parse_get(&key, m.headers.as_ref(), &m.payload),
            (Err(e), _) => Err(JsError::Invalid(e.to_string())),
            (_, Err(e)) => Err(e),
        };
        let refusal = match entry {
            Ok(e) if e.operation == KvOperation::Put && e.value == inv.caller.as_bytes() => {
                return self.claimed_for(conn, inv, now);
            }
            Ok(e) if e.operation == KvOperation::Put => MigError::new(
                Code::InvalidRequest,
                "message_id is in use by another caller's invocation",
            ),
            // Taken a moment ago, gone now: its holder's time ran out.
            Ok(_) | Err(JsError::KeyNotFound) => MigError::new(
                Code::Unavailable,
                "message_id was released while it was claimed; try again",
            ),
            Err(e) => MigError::new(
                Code::Unavailable,
                format!("the holder of the message id could not be read: {e}"),
            ),
        };
        self.refuse(conn, inv, refusal, now)
    }

    /// The message id is `inv`'s: it starts, unless its caller cancelled it meanwhile.
    fn claimed_for(&mut self, conn: &mut Connection, inv: Invocation, now: Instant) {
        let key = (
            inv.ns.clone(),
            inv.echo.message_id.clone().unwrap_or_default(),
        );
        match self.claim_settled(conn, &key, false, now) {
            Some(reason) => self.refuse(conn, inv, invoke::cancelled(&reason), now),
            None => self.begin(conn, inv, now),
        }
    }

    /// An invocation that never started ends here: it only waited (no stream frame, no
    /// watch), so the refusal is its reply.
    fn refuse(&mut self, conn: &mut Connection, inv: Invocation, e: MigError, now: Instant) {
        let key = (
            inv.ns.clone(),
            inv.echo.message_id.clone().unwrap_or_default(),
        );
        self.claim_settled(conn, &key, true, now);
        self.unwait(&inv.ns, &inv.caller);
        let answer = Answer {
            reply: &inv.reply,
            echo: &inv.echo,
            op: "invoke",
            capability: &inv.capability,
            received: inv.received,
        };
        self.respond(conn, &answer, Err(e), now);
    }

    /// One invocation of `(ns, caller)` stopped waiting.
    fn unwait(&mut self, ns: &str, caller: &str) {
        let key = (ns.to_string(), caller.to_string());
        if let Some(n) = self.waiting_per_caller.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.waiting_per_caller.remove(&key);
            }
        }
    }

    /// The invocation's task record is watched and read; a stream gets its `started`.
    fn begin(&mut self, conn: &mut Connection, mut inv: Invocation, now: Instant) {
        let session = self.new_session();
        let key = crate::broker::binding::task_key(&inv.ns, &inv.task);
        let watched = self
            .kv
            .key_subject(&key)
            .map_err(|e| e.to_string())
            .and_then(|subject| conn.subscribe(&subject, None).map_err(|e| e.to_string()));
        let sid = match watched {
            Ok(sid) => sid,
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("cannot watch the task: {e}"));
                return self.refuse(conn, inv, e, now);
            }
        };
        let read = super::js_request(conn, self.kv.get_request(&key), now);
        let id = match read {
            Ok(id) => id,
            Err(e) => {
                let _ = conn.unsubscribe(sid, None);
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                return self.refuse(conn, inv, e, now);
            }
        };
        self.subs.insert(sid, Sub::Task(session));
        self.staged
            .push(id, super::Awaiting(Pending::Record(session)), now);
        inv.reads = 1;
        self.later
            .push(inv.deadline, super::Alarm::Deadline(session));
        self.by_message
            .entry((
                inv.ns.clone(),
                inv.echo.message_id.clone().unwrap_or_default(),
            ))
            .or_default()
            .push(session);
        inv.watch = Some(sid);
        if inv.echo.idempotency_key.is_some() {
            let message_id = inv.echo.message_id.as_deref().unwrap_or_default();
            let subject = super::subjects::forwarded_cancel_subject(&inv.ns, message_id);
            match conn.subscribe(&subject, None) {
                Ok(sid) => {
                    self.subs.insert(sid, Sub::ForwardedCancel(session));
                    inv.cancel_watch = Some(sid);
                }
                // Only a cancel through another broker is lost: it answers `not_found`.
                Err(e) => log::warn!("no forwarded cancels for an invocation: {e}"),
            }
        }
        if inv.stream.is_some() {
            // The reply is the stream's first frame; the rest follow on the stream subject.
            let started = json!({"kind": "control", "payload": {"status": "started"}});
            let reply = inv.reply.clone();
            // A frame of a few hundred bytes (the echo is bounded) is never too large.
            let _ = self.stream_frame(conn, &mut inv, Some(&reply), started, now);
        }
        self.invocations.insert(session, inv);
    }

    /// A message on the task record's subject. Every write to the task store is a
    /// compare-and-set publish there, and nats-server hands a publish to core subscribers
    /// also when the stream refuses it (a complete that lost its race, a refused
    /// heartbeat's progress), as it does anyone's publish: so it is no record, only a
    /// sign that the record may have changed, and the stored record is read. Signs that
    /// come while a read is out make one more read after it.
    pub(super) fn record_changed(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        msg: &Message,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        if !worth_reading(inv, msg) {
            return;
        }
        inv.rechecks = RECHECKS.len() as u8;
        if inv.reads > 0 {
            inv.stale = true;
            return;
        }
        self.read_record(conn, session, now);
    }

    /// Reads the stored task record of an invocation (`record_read` takes the answer).
    pub(super) fn read_record(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        let key = crate::broker::binding::task_key(&inv.ns, &inv.task);
        let sent = self.kv.get_request(&key).ok().and_then(|req| {
            conn.request(&req.subject, None, &req.payload, JS_TIMEOUT, now)
                .ok()
        });
        // Not sent (no connection): the reconnect reads every waiting record again.
        inv.stale = sent.is_none();
        if let Some(id) = sent {
            inv.reads += 1;
            self.staged
                .push(id, super::Awaiting(Pending::Record(session)), now);
        }
    }

    pub(super) fn record_read(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        inv.reads = inv.reads.saturating_sub(1);
        // The first read decides whether the task is submitted; a later one that fails
        // leaves the invocation waiting for the next change, a reconnect or its deadline.
        let looking = inv.stage == Stage::Looking;
        let key = crate::broker::binding::task_key(&inv.ns, &inv.task);
        let entry = match reply {
            Ok(m) => self.kv.parse_get(&key, m.headers.as_ref(), &m.payload),
            Err(_) if !looking => return self.read_again(conn, session, now),
            Err(e) => {
                let e = MigError::new(
                    Code::Unavailable,
                    format!("the task store did not answer: {e}"),
                );
                return self.finish(conn, session, Err(e), now);
            }
        };
        match entry {
            Ok(entry) if entry.operation == crate::jetstream::kv::KvOperation::Put => {
                match TaskRecord::from_json(&entry.value) {
                    Ok(record) => {
                        if let Some(inv) = self.invocations.get_mut(&session) {
                            if looking {
                                inv.waits();
                            }
                            if shows(inv, &record) {
                                inv.rechecks = 0;
                            }
                        }
                        self.on_record(conn, session, record, now)
                    }
                    Err(_) => self.finish(
                        conn,
                        session,
                        Err(MigError::new(
                            Code::Internal,
                            "the task record is unreadable",
                        )),
                        now,
                    ),
                }
            }
            Ok(_) | Err(crate::jetstream::JsError::KeyNotFound) => {
                // Only a new invocation submits; a re-read waits on.
                if looking {
                    self.spend_budget(conn, ctx, session, now)
                }
            }
            Err(_) if !looking => {}
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("the task store refused: {e}"));
                self.finish(conn, session, Err(e), now)
            }
        }
        self.read_again(conn, session, now);
    }

    /// Once every read is in: the record is read again at once when its subject had a
    /// message meanwhile, or a while later when the store has not shown the last one
    /// yet. That message reaches the broker as the write reaches the server, which may
    /// be before the stream has stored it (in a cluster, before its raft round ends or a
    /// replica answering direct gets has it); a write the stream refused is never shown,
    /// and costs its few reads.
    fn read_again(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        if inv.reads > 0 {
            return;
        }
        if inv.stale {
            return self.read_record(conn, session, now);
        }
        let done = RECHECKS.len().saturating_sub(usize::from(inv.rechecks));
        if let Some(wait) = RECHECKS.get(done).filter(|_| !inv.recheck_due) {
            inv.rechecks = inv.rechecks.saturating_sub(1);
            inv.recheck_due = true;
            let at = crate::deadline::after(now, *wait);
            self.later.push(at, super::Alarm::Recheck(session));
        }
    }

    /// A read again that [`Mig::read_again`] set for later.
    pub(super) fn recheck(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        inv.recheck_due = false;
        // A read out now comes back to `read_again`.
        if inv.reads == 0 {
            self.read_record(conn, session, now);
        }
    }

    /// Before a new task: the caller's task budget, as a WebSocket `submit` spends it (a
    /// retry that finds its first try's task spends nothing).
    pub(super) fn spend_budget(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        let budget = crate::broker::budget::Budget::of(ctx.config, &inv.ns, &inv.caller);
        let Some(budget) = budget else {
            return self.count_queue(conn, ctx, session, now);
        };
        let key = format!("{}/{}", inv.ns, inv.caller);
        let unix_ms = u64::try_from(self.clock.ms(now)).unwrap_or(0);
        match ctx.budgets.try_spend(&key, budget, unix_ms) {
            Spend::Granted => self.count_queue(conn, ctx, session, now),
            Spend::Exhausted => {
                let e = MigError::new(Code::RateLimited, "the task budget of this window is spent")
                    .detail("amp_code", json!("budget_exhausted"));
                self.finish(conn, session, Err(e), now)
            }
            Spend::Wait => inv.stage = Stage::Budget,
        }
    }

    /// The budget of participant `ns/name` was read or reserved (`ok`) or could not be:
    /// the invocations waiting for it go on, or end `MIG_UNAVAILABLE`.
    pub fn budget_settled(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        participant: &str,
        ok: bool,
        now: Instant,
    ) {
        let waiting: Vec<SessionId> = self
            .invocations
            .iter()
            .filter(|(_, i)| {
                i.stage == Stage::Budget && format!("{}/{}", i.ns, i.caller) == participant
            })
            .map(|(s, _)| *s)
            .collect();
        for session in waiting {
            if ok {
                self.spend_budget(conn, ctx, session, now);
            } else {
                let e = MigError::new(Code::Unavailable, "the task budget could not be read");
                self.finish(conn, session, Err(e), now);
            }
        }
    }

    /// Before a new task: how many the job holds, when it has a `max_queued`.
    pub(super) fn count_queue(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        let max = ctx
            .config
            .namespaces
            .get(&inv.ns)
            .and_then(|n| n.jobs.get(&inv.job))
            .and_then(|j| j.max_queued);
        if max.is_none() {
            return self.submit(conn, ctx, session, now);
        }
        inv.stage = Stage::Counting;
        let sent = super::js_request(
            conn,
            ApiPrefix::default().stream_info_subjects(
                &crate::broker::binding::tasks_stream(&inv.ns),
                &crate::broker::binding::job_subject(&inv.ns, &inv.job),
            ),
            now,
        );
        match sent {
            Ok(id) => {
                self.staged
                    .push(id, super::Awaiting(Pending::Depth(session)), now);
            }
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                self.finish(conn, session, Err(e), now)
            }
        }
    }

    pub(super) fn depth_read(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get(&session) else {
            return;
        };
        let max = ctx
            .config
            .namespaces
            .get(&inv.ns)
            .and_then(|n| n.jobs.get(&inv.job))
            .and_then(|j| j.max_queued)
            .unwrap_or(u64::MAX);
        let subject = crate::broker::binding::job_subject(&inv.ns, &inv.job);
        let info: Option<Value> = reply
            .ok()
            .and_then(|m| serde_json::from_slice(&m.payload).ok());
        let Some(info) = info.filter(|v| v.get("error").is_none()) else {
            let e = MigError::new(Code::Unavailable, "the task stream did not answer");
            return self.finish(conn, session, Err(e), now);
        };
        let queued = info["state"]["subjects"][&subject].as_u64().unwrap_or(0);
        if queued >= max {
            let e = MigError::new(
                Code::Backpressure,
                format!("the capability has {queued} tasks waiting or running (max_queued {max})"),
            )
            .detail("retry_after_ms", json!(BACKPRESSURE_RETRY_MS));
            return self.finish(conn, session, Err(e), now);
        }
        self.submit(conn, ctx, session, now);
    }

    pub(super) fn submit(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        // Submitted once: nothing goes back to an earlier stage.
        let Some((body, hold)) = inv.payload.take() else {
            let e = MigError::new(Code::Internal, "the invocation was submitted twice");
            return self.finish(conn, session, Err(e), now);
        };
        inv.stage = Stage::Submitting;
        // The jobs engine holds the task message against the same bound until the task
        // exists; let go first, so that its hold finds the room this one had.
        drop(hold);
        let frame = ClientFrame::Submit(inv.submit_frame(body));
        let (ns, caller) = (inv.ns.clone(), inv.caller.clone());
        jobs_frame(conn, ctx, session, &ns, &caller, frame, now);
    }

    pub(super) fn on_record(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        record: TaskRecord,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get(&session) else {
            return;
        };
        if record.submitted_by != format!("{}/{}", inv.ns, inv.caller) {
            let e = MigError::new(Code::Internal, "the task belongs to someone else");
            return self.finish(conn, session, Err(e), now);
        }
        if record.job != inv.job || record.body_sha256 != inv.digest {
            let e = MigError::new(
                Code::InvalidRequest,
                "this idempotency_key was used with another capability or payload",
            )
            .detail("amp_code", json!("conflict"));
            return self.finish(conn, session, Err(e), now);
        }
        if !record.state.is_terminal() {
            return self.progress(conn, session, record, now);
        }
        let outcome = inv.outcome(&record);
        self.finish(conn, session, outcome, now);
    }

    /// A running task's record: a progress frame when a heartbeat reported new progress.
    pub(super) fn progress(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        record: TaskRecord,
        now: Instant,
    ) {
        let Some(mut inv) = self.invocations.remove(&session) else {
            return;
        };
        if let (Some(stream), Some(progress)) = (inv.stream.as_mut(), record.progress)
            && record.progress_n > stream.progress_n
        {
            stream.progress_n = record.progress_n;
            let frame = json!({"kind": "response", "end_stream": false, "payload": progress});
            // Progress too large is left out (the stream goes on; its `amp.seq` shows the gap).
            if let Err(e) = self.stream_frame(conn, &mut inv, None, frame, now) {
                log::warn!(capability:% = inv.capability; "MIG stream frame not sent: {}", e.message);
            }
        }
        self.invocations.insert(session, inv);
    }

    /// Publishes the next frame of a streaming invoke: on `reply` (the `started` frame) or
    /// on the stream subject, numbered in `header.meta["amp.seq"]`; the error to send in
    /// its place when it is past the server's `max_payload` (any other failure is logged).
    pub(super) fn stream_frame(
        &mut self,
        conn: &mut Connection,
        inv: &mut Invocation,
        reply: Option<&str>,
        fields: Value,
        now: Instant,
    ) -> Result<(), MigError> {
        let ts = self.timestamp(now);
        let Some(stream) = inv.stream.as_mut() else {
            return Ok(());
        };
        stream.seq += 1;
        let mut header = inv.echo.header(&ts);
        header["meta"] = json!({"amp.seq": stream.seq});
        let mut frame = json!({
            "header": header,
            "stream_id": inv.echo.message_id,
            "capability": inv.capability,
        });
        if let (Some(f), Some(extra)) = (frame.as_object_mut(), fields.as_object()) {
            f.extend(extra.clone());
        }
        let subject = reply.unwrap_or(&stream.subject);
        let headers = inv.echo.nats_headers();
        match conn.publish(subject, None, Some(&headers), frame.to_string().as_bytes()) {
            Ok(()) => Ok(()),
            Err(crate::nats::Error::MaxPayloadExceeded { size, max }) => {
                Err(super::too_large_reply(size, max))
            }
            Err(e) => {
                log::warn!(subject:% = subject; "MIG stream frame not sent: {e}");
                Ok(())
            }
        }
    }

    /// Answers an invocation and forgets it.
    pub(super) fn finish(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        result: Result<Value, MigError>,
        now: Instant,
    ) {
        let Some(mut inv) = self.invocations.remove(&session) else {
            return;
        };
        if let Some(c) = inv.cancel_after_submit.take() {
            self.cancel_overtaken(conn, c, now);
        }
        self.unwait(&inv.ns, &inv.caller);
        for sid in [inv.watch, inv.cancel_watch].into_iter().flatten() {
            self.subs.remove(&sid);
            let _ = conn.unsubscribe(sid, None);
        }
        let message_id = inv.echo.message_id.clone().unwrap_or_default();
        let key = (inv.ns.clone(), message_id.clone());
        if let Some(list) = self.by_message.get_mut(&key) {
            list.retain(|s| *s != session);
            if list.is_empty() {
                self.by_message.remove(&key);
            }
        }
        *self.finished.get_or_insert_with(key, String::new) = inv.caller.clone();
        let outcome = match &result {
            Ok(_) => "success",
            Err(e) => e.code.as_str(),
        };
        let ts = self.timestamp(now);
        metrics::audit(
            &format!("{}/{}", inv.ns, inv.caller),
            &inv.ns,
            &inv.capability,
            outcome,
            &ts,
            &message_id,
            &inv.task,
        );
        if inv.stream.is_some() {
            let mut inv = inv;
            let last = |result: &Result<Value, MigError>| match result {
                Ok(v) => json!({"kind": "response", "end_stream": true, "payload": v["payload"]}),
                Err(e) => json!({"kind": "error", "end_stream": true, "error": e.to_value()}),
            };
            let mut result = result;
            if let Err(e) = self.stream_frame(conn, &mut inv, None, last(&result), now) {
                // Unsent, the stream would never end: it ends with why, in a small frame.
                result = Err(e);
                if let Err(e) = self.stream_frame(conn, &mut inv, None, last(&result), now) {
                    log::warn!(capability:% = inv.capability; "MIG stream frame not sent: {}", e.message);
                }
            }
            let code = result.as_ref().err().map_or("OK", |e| e.code.as_str());
            let took = now.saturating_duration_since(inv.received);
            self.metrics.request("invoke", &inv.capability, code, took);
            return;
        }
        let answer = Answer {
            reply: &inv.reply,
            echo: &inv.echo,
            op: "invoke",
            capability: &inv.capability,
            received: inv.received,
        };
        self.respond(conn, &answer, result, now);
    }
}

/// Whether a message on the task record's subject would end the invocation or stream new
/// progress, were it the stored record: only then is the record read (a stored write
/// always comes with its own message, so one that says less needs no read).
fn worth_reading(inv: &Invocation, msg: &Message) -> bool {
    if crate::jetstream::kv::operation_of(msg.headers.as_ref()).0 != KvOperation::Put {
        return false;
    }
    TaskRecord::from_json(&msg.payload).is_ok_and(|record| shows(inv, &record))
}

/// Whether `record` ends the invocation or has progress its stream has not had.
fn shows(inv: &Invocation, record: &TaskRecord) -> bool {
    let progressed =
        |s: &invoke::Stream| record.progress.is_some() && record.progress_n > s.progress_n;
    record.state.is_terminal() || inv.stream.as_ref().is_some_and(progressed)
}

/// When a record whose subject had a message the store has not shown yet is read again,
/// each after the one before.
const RECHECKS: [Duration; 3] = [
    Duration::from_millis(10),
    Duration::from_millis(100),
    Duration::from_secs(1),
];

/// Invocations one caller may have waiting on a broker: a quarter of `mig.max_pending`, so
/// one caller (retrying one idempotency key, say, which spends no budget) cannot take
/// every slot from the rest of the tenant and the others; and fewer than are free.
pub(super) fn caller_share(max_pending: usize) -> usize {
    (max_pending / 4).max(1)
}
