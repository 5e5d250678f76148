//! CANCEL (mig-nats.md section 4): only the caller of an invocation may cancel it; the task
//! is cancelled through the jobs engine, so its holder hears `revoked`.

use std::time::Instant;

use serde_json::{Map, Value, json};

use super::envelope::{self, Code, Echo, MigError};
use super::invoke::{self, Stage};
use super::{Answer, BACKPRESSURE_RETRY_MS, Ctx, Mig, jobs_frame};
use crate::amp::frame::{ClientFrame, TaskRef};
use crate::broker::in_flight::Ticket;
use crate::broker::jobs::SessionId;
use crate::nats::Connection;

/// A `cancel` waiting for the jobs engine.
pub struct CancelRequest {
    reply: String,
    echo: Echo,
    target: String,
    received: Instant,
    /// The local invocation it ends, if any.
    invocation: Option<SessionId>,
    /// Forwarded by another broker: `reply` is that broker's, which answers the caller
    /// (and counts the request); the outcome goes back as `{result}` or `{error}`.
    forwarded: bool,
    /// Another caller's invocation here has this message id: the caller's own may still be
    /// on another broker, and only a search that finds none answers `MIG_FORBIDDEN`.
    foreign: bool,
    /// Its place in its caller's requests in flight until it is answered (one another
    /// broker forwarded is counted there).
    _ticket: Option<Ticket>,
}

/// A cancel sent to the broker holding the keyed invocation, if one does.
pub struct Forwarded {
    request: CancelRequest,
    ns: String,
    name: String,
}

/// How long the broker holding a keyed invocation has to answer a forwarded cancel.
const FORWARD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

impl Mig {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cancel(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        ns: &str,
        name: &str,
        target: &str,
        reply: &str,
        header: &envelope::Header,
        body: &Map<String, Value>,
        ticket: Option<Ticket>,
        now: Instant,
    ) {
        let echo = Echo::of(header);
        let answer = Answer {
            reply,
            echo: &echo,
            op: "cancel",
            capability: "",
            received: now,
        };
        let named = body.get("target_message_id").and_then(Value::as_str);
        if named.is_some_and(|t| t != target) || target.contains('.') || target.is_empty() {
            let e = MigError::new(
                Code::InvalidRequest,
                "target_message_id is not the message id of the subject",
            );
            return self.respond(conn, &answer, Err(e), now);
        }
        let reason = body
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or("cancelled by the caller")
            .chars()
            .take(256)
            .collect::<String>();
        let key = (ns.to_string(), target.to_string());
        let local: Vec<SessionId> = self.by_message.get(&key).cloned().unwrap_or_default();
        let mine = local
            .iter()
            .copied()
            .find(|s| self.invocations.get(s).is_some_and(|i| i.caller == name));
        let foreign = mine.is_none()
            && (!local.is_empty() || self.finished.get(&key).is_some_and(|c| c != name));
        if self.cancels.len() >= ctx.config.mig.max_pending {
            let e = MigError::new(
                Code::Backpressure,
                "this broker has too many cancels in flight",
            )
            .detail("retry_after_ms", json!(BACKPRESSURE_RETRY_MS));
            return self.respond(conn, &answer, Err(e), now);
        }
        let request = CancelRequest {
            reply: reply.to_string(),
            echo: echo.clone(),
            target: target.to_string(),
            received: now,
            invocation: mine,
            forwarded: false,
            foreign,
            _ticket: ticket,
        };
        // The caller's invocation of this id is still having the id claimed: the cancel
        // waits for that answer (the invocation has not started, so it is not found yet).
        if mine.is_none()
            && let Some(claim) = self.claims.get_mut(&key)
            && claim.caller == name
            && claim.cancel.is_none()
        {
            claim.cancel = Some((request, reason));
            return;
        }
        match mine {
            Some(s) => {
                if let Some(inv) = self.invocations.get_mut(&s) {
                    inv.cancel_reason = Some(reason);
                }
                self.cancel_task(conn, ctx, s, request, now);
            }
            None if !foreign && self.finished.get(&key).is_some() => {
                let ack = cancel_ack(target, false, "already_finished");
                self.respond(conn, &answer, Ok(ack), now);
            }
            None => {
                // Another broker's invocation, or none. A keyed one's holder listens on a
                // subject of its message id; with nobody there, the task store decides.
                let subject = super::subjects::forwarded_cancel_subject(ns, target);
                let body = json!({"caller": name, "reason": reason}).to_string();
                let f = Forwarded {
                    request,
                    ns: ns.to_string(),
                    name: name.to_string(),
                };
                match conn.request(&subject, None, body.as_bytes(), FORWARD_TIMEOUT, now) {
                    Ok(id) => {
                        self.staged.push(
                            id,
                            super::Awaiting(super::Pending::Forwarded(Box::new(f))),
                            now,
                        );
                    }
                    Err(_) => self.cancel_in_store(conn, ctx, f, now),
                }
            }
        }
    }

    /// The unkeyed task of `message_id`, cancelled through the task store.
    fn cancel_in_store(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        f: Forwarded,
        now: Instant,
    ) {
        let task = invoke::task_id(&f.ns, &f.name, None, &f.request.target);
        let s = self.new_session();
        self.cancels.insert(s, f.request);
        jobs_frame(conn, ctx, s, &f.ns, &f.name, cancel_frame(&task), now);
    }

    /// The holder's answer to a forwarded cancel; no responders (or none in time): no
    /// broker holds a keyed invocation of that message id.
    pub(super) fn forward_answered(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        f: Forwarded,
        reply: Result<crate::nats::Message, crate::nats::RequestError>,
        now: Instant,
    ) {
        let answer: Option<Value> = reply
            .ok()
            .filter(|m| m.status().is_none())
            .and_then(|m| serde_json::from_slice(&m.payload).ok());
        let Some(answer) = answer else {
            return self.cancel_in_store(conn, ctx, f, now);
        };
        self.metrics.forwarded_cancel();
        let result = match answer.get("error") {
            Some(e) => Err(MigError::from_value(e)),
            None => Ok(answer.get("result").cloned().unwrap_or(Value::Null)),
        };
        self.answer_cancel(conn, &f.request, result, now);
    }

    /// The caller's answer to its cancel.
    fn answer_cancel(
        &mut self,
        conn: &mut Connection,
        c: &CancelRequest,
        result: Result<Value, MigError>,
        now: Instant,
    ) {
        let answer = Answer {
            reply: &c.reply,
            echo: &c.echo,
            op: "cancel",
            capability: "",
            received: c.received,
        };
        self.respond(conn, &answer, result, now);
    }

    /// A cancel another broker forwarded for local keyed invocation `session`.
    pub(super) fn forwarded_cancel(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        msg: &crate::nats::Message,
        now: Instant,
    ) {
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        let body: Value = serde_json::from_slice(&msg.payload).unwrap_or(Value::Null);
        let caller = body
            .get("caller")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        let target = inv.echo.message_id.clone().unwrap_or_default();
        let request = CancelRequest {
            reply: reply.to_string(),
            echo: inv.echo.clone(),
            target,
            received: now,
            invocation: Some(session),
            forwarded: true,
            foreign: false,
            _ticket: None,
        };
        if inv.caller != caller {
            return self.answer_forwarded(conn, &request, Err(forbidden()));
        }
        let reason = body
            .get("reason")
            .and_then(Value::as_str)
            .unwrap_or_default();
        inv.cancel_reason = Some(reason.chars().take(256).collect());
        self.cancel_task(conn, ctx, session, request, now);
    }

    fn answer_forwarded(
        &mut self,
        conn: &mut Connection,
        c: &CancelRequest,
        result: Result<Value, MigError>,
    ) {
        let body = match result {
            Ok(v) => json!({"result": v}),
            Err(e) => json!({"error": e.to_value()}),
        };
        if let Err(e) = conn.publish(&c.reply, None, None, body.to_string().as_bytes()) {
            log::warn!("forwarded cancel not answered: {e}");
        }
    }

    /// Cancels the task of local invocation `session` on behalf of `request`.
    pub(super) fn cancel_task(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        request: CancelRequest,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        match inv.stage {
            Stage::Looking | Stage::Budget | Stage::Counting => {
                // Nothing submitted yet: nothing to cancel in the store.
                let reason = inv.cancel_reason.clone().unwrap_or_default();
                self.finish(conn, session, Err(invoke::cancelled(&reason)), now);
                self.cancel_answered(conn, request, None, now);
            }
            Stage::Submitting => inv.cancel_after_submit = Some(request),
            Stage::Waiting => {
                let (ns, caller, task) = (inv.ns.clone(), inv.caller.clone(), inv.task.clone());
                let s = self.new_session();
                self.cancels.insert(s, request);
                jobs_frame(conn, ctx, s, &ns, &caller, cancel_frame(&task), now);
            }
        }
    }

    pub(super) fn cancel_answered(
        &mut self,
        conn: &mut Connection,
        c: CancelRequest,
        error: Option<Value>,
        now: Instant,
    ) {
        let amp = error
            .as_ref()
            .and_then(|e| e.get("code"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let result = match amp.as_deref() {
            None => {
                if let Some(s) = c.invocation {
                    let reason = self
                        .invocations
                        .get(&s)
                        .and_then(|i| i.cancel_reason.clone())
                        .unwrap_or_default();
                    self.finish(conn, s, Err(invoke::cancelled(&reason)), now);
                }
                Ok(cancel_ack(&c.target, true, "cancelled"))
            }
            Some("conflict") => Ok(cancel_ack(&c.target, false, "already_finished")),
            Some("not_found") if c.foreign => Err(forbidden()),
            Some("not_found") => Ok(cancel_ack(&c.target, false, "not_found")),
            Some(_) => Err(MigError::from_amp_error(
                error.as_ref().unwrap_or(&Value::Null),
            )),
        };
        if c.forwarded {
            return self.answer_forwarded(conn, &c, result);
        }
        self.answer_cancel(conn, &c, result, now);
    }
}

/// An invocation whose message id is being claimed, and a cancel of it that came
/// meanwhile (with its reason).
pub(super) struct Claim {
    pub caller: String,
    pub cancel: Option<(CancelRequest, String)>,
}

impl Mig {
    /// A cancel held for an invocation that ended first (its submit refused, its deadline
    /// reached): it finds the invocation finished. Before, it was dropped unanswered and
    /// its caller (or the broker that forwarded it) waited for its own timeout.
    pub(super) fn cancel_overtaken(
        &mut self,
        conn: &mut Connection,
        c: CancelRequest,
        now: Instant,
    ) {
        let ack = cancel_ack(&c.target, false, "already_finished");
        if c.forwarded {
            return self.answer_forwarded(conn, &c, Ok(ack));
        }
        self.answer_cancel(conn, &c, Ok(ack), now);
    }

    /// The claim of `key` is settled: a cancel held for it is answered, `cancelled` when
    /// it stopped the invocation from starting, else `already_finished` (refused).
    pub(super) fn claim_settled(
        &mut self,
        conn: &mut Connection,
        key: &(String, String),
        refused: bool,
        now: Instant,
    ) -> Option<String> {
        let (c, reason) = self.claims.remove(key)?.cancel?;
        let ack = if refused {
            cancel_ack(&c.target, false, "already_finished")
        } else {
            cancel_ack(&c.target, true, "cancelled")
        };
        self.answer_cancel(conn, &c, Ok(ack), now);
        Some(reason)
    }
}

fn forbidden() -> MigError {
    MigError::new(
        Code::Forbidden,
        "only the caller of an invocation may cancel it",
    )
}

pub(super) fn cancel_ack(target: &str, accepted: bool, status: &str) -> Value {
    json!({"target_message_id": target, "accepted": accepted, "status": status})
}

pub(super) fn cancel_frame(task: &str) -> ClientFrame {
    ClientFrame::Cancel(TaskRef {
        id: "cancel".to_string(),
        task: task.to_string(),
    })
}
