//! The core's side of the MIG front end (`broker::mig`): lends it the configuration, the
//! jobs engine and the rate limiter for each step, and routes what belongs to it.

use std::time::Instant;

use super::{Broker, SessionId};
use crate::broker::mig::{self, Ctx};
use crate::nats::{Connection, Message, RequestError, Sid};

impl Broker {
    /// The front end and what it borrows, for a request of tenant `ns`.
    fn mig_parts(&mut self, ns: Option<&str>) -> (&mut mig::Mig, Ctx<'_>) {
        let registry = ns.and_then(|ns| self.registries.get(ns)).map(|(r, _)| r);
        let ctx = Ctx {
            config: &self.config,
            jobs: &mut self.jobs,
            rates: &mut self.rates,
            budgets: &mut self.budgets,
            in_flight: &mut self.in_flight,
            registry,
        };
        (&mut self.mig, ctx)
    }

    /// A NATS message on one of the front end's subscriptions; false when it is not one.
    pub(super) fn mig_message(
        &mut self,
        conn: &mut Connection,
        sid: Sid,
        msg: &Message,
        now: Instant,
    ) -> bool {
        if !self.mig.owns(sid) {
            return false;
        }
        let (front, mut ctx) = self.mig_parts(mig::tenant_of(&msg.subject));
        front.on_message(conn, &mut ctx, sid, msg, now);
        self.drive_budgets(conn, now);
        true
    }

    /// A message on a MIG request subject, of whichever connection; answered on `conn`.
    pub(super) fn mig_request(&mut self, conn: &mut Connection, msg: &Message, now: Instant) {
        let (front, mut ctx) = self.mig_parts(mig::tenant_of(&msg.subject));
        front.on_request(conn, &mut ctx, msg, now);
        self.drive_budgets(conn, now);
    }

    /// A reply to a request of the front end.
    pub(super) fn mig_reply(
        &mut self,
        conn: &mut Connection,
        pending: mig::Awaiting,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        if let Err(RequestError::NoResponders) = &reply
            && let Some(ns) = pending.seen_tenant()
        {
            let ns = ns.to_string();
            let bucket = ["KV_", mig::seen::BUCKET].concat();
            self.stream_gone(conn, &ns, &bucket, now);
        }
        let (front, mut ctx) = self.mig_parts(None);
        front.on_reply(conn, &mut ctx, pending, reply, now);
        self.drive_budgets(conn, now);
    }

    /// `AMP_MIG_SEEN` was made again by this broker, `created` then (unknown: asked),
    /// or found made by another.
    pub(super) fn mig_seen_made(
        &mut self,
        conn: &mut Connection,
        created: Option<&str>,
        now: Instant,
    ) {
        let (front, ctx) = self.mig_parts(None);
        match created {
            Some(created) => front.seen_is(conn, ctx.config, created, now),
            None => front.check_seen(conn, now),
        }
    }

    /// A jobs engine answer to one of the front end's pseudo sessions.
    pub(super) fn mig_jobs_reply(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        text: &str,
        now: Instant,
    ) {
        let (front, mut ctx) = self.mig_parts(None);
        front.on_jobs_reply(conn, &mut ctx, session, text, now);
        self.drive_budgets(conn, now);
    }

    pub(super) fn mig_alarm(&mut self, conn: &mut Connection, alarm: mig::Alarm, now: Instant) {
        let (front, mut ctx) = self.mig_parts(None);
        front.on_alarm(conn, &mut ctx, alarm, now);
        self.drive_budgets(conn, now);
    }

    /// A participant's task budget settled: MIG invocations waiting for it go on.
    pub(super) fn mig_budget_settled(
        &mut self,
        conn: &mut Connection,
        participant: &str,
        ok: bool,
        now: Instant,
    ) {
        let (front, mut ctx) = self.mig_parts(None);
        front.budget_settled(conn, &mut ctx, participant, ok, now);
        self.drive_budgets(conn, now);
    }
}
