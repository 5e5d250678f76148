//! MIG v0.1 over NATS (`mig-nats.md`): one more front end over the broker's jobs, so that
//! a MIG client on NATS discovers and invokes capabilities that AMP workers serve over
//! WebSocket. Tenant = namespace, capability = a job with a `mig` descriptor, invocation =
//! an AMP task submitted through the same jobs engine as a WebSocket `submit`.
//!
//! Sans-IO like the core: NATS messages, request replies, jobs answers and `now` in; NATS
//! publishes out through the connection it is handed. A MIG request that needs the jobs
//! engine acts as a pseudo session (ids from [`SESSION_BASE`] up), so the engine's answers
//! come back through the core's usual drain and are routed here.

pub mod caller;
mod cancel;
pub mod config;
pub mod envelope;
mod events;
mod invocations;
mod invoke;
mod metrics;
mod ops;
mod reclaim;
pub mod seen;
pub mod subjects;
#[cfg(test)]
mod tests;

use std::cell::OnceCell;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::bounded_map::BoundedMap;
use super::clock::Clock;
use super::config::{Config, Participant};
use super::continuations::Staged;
use super::held_bytes::{self, Hold};
use super::ids::IdSource;
use super::in_flight::{self, Tally, Ticket};
use super::jobs::{Caller, Jobs, SessionId};
use super::rate_limit::{self, DebtBucket, RateLimiter};
use super::registry::Registry;
use super::timers::Later;
use crate::amp::frame::ClientFrame;
use crate::nats::{Connection, Message, RequestError, Sid};

use caller::{Authenticator, Budget, Presented, Refusal};
use cancel::{CancelRequest, cancel_frame};
use envelope::{Code, Echo, HeaderError, MigError};
use invoke::{Invocation, Stage};
use metrics::Metrics;

/// Pseudo sessions of MIG requests handed to the jobs engine are numbered from here, far
/// above any WebSocket session number.
pub const SESSION_BASE: SessionId = 1 << 62;

pub fn is_mig_session(session: SessionId) -> bool {
    session >= SESSION_BASE
}

pub use invoke::INVOCATION_HEADERS;
pub use subjects::tenant_of;

pub use ops::FEATURES;
pub use reclaim::created;
/// How long a deadline's cancel waits for its submit's answer before it is forgotten: well
/// past the jobs engine's 4 s request timeout and a budget read before it.
const EXPIRED_SUBMIT_WAIT: Duration = Duration::from_secs(30);
/// `retry_after_ms` of `MIG_BACKPRESSURE`.
const BACKPRESSURE_RETRY_MS: u64 = 1000;
/// Finished invocations remembered for `cancel` (`already_finished`).
const FINISHED_MEMORY: usize = 16_384;
const JS_TIMEOUT: Duration = Duration::from_secs(5);

/// Sends a request of the typed JetStream builders; a name they refuse and a connection
/// that cannot take the request both come back as why it was not sent.
fn js_request(
    conn: &mut Connection,
    req: Result<crate::jetstream::Request, crate::jetstream::JsError>,
    now: Instant,
) -> Result<crate::nats::RequestId, String> {
    let req = req.map_err(|e| e.to_string())?;
    conn.request(
        &req.subject,
        req.headers.as_ref(),
        &req.payload,
        JS_TIMEOUT,
        now,
    )
    .map_err(|e| e.to_string())
}

/// What the core lends the front end for one step.
pub struct Ctx<'a> {
    pub config: &'a Config,
    pub jobs: &'a mut Jobs,
    pub rates: &'a mut RateLimiter,
    /// Task budgets (`tasks_per_window`), spent by each invoke that creates a task.
    pub budgets: &'a mut crate::broker::budget::Budgets,
    /// Each participant's requests in flight, shared with its WebSocket sessions.
    pub in_flight: &'a mut Tally,
    /// The registry of the request's tenant (serving slots and leases, for heartbeats).
    pub registry: Option<&'a Registry>,
}

enum Sub {
    /// Deliveries of a tenant's live event feed (index into `live`).
    Live(usize),
    /// The feed's pull subscription left at the last reconnect ([`PullLoop::retire`]):
    /// what the server sent on it before it had the UNSUB is published in its order,
    /// ahead of what the new pull brings. One per feed, replaced at the next reconnect.
    RetiredLive(usize),
    /// Changes of one invocation's task record.
    Task(SessionId),
    /// Cancels of one keyed invocation forwarded by other brokers.
    ForwardedCancel(SessionId),
    /// JetStream's word that `AMP_MIG_SEEN` was created ([`reclaim::made_advisory`]).
    SeenMade,
}

enum Pending {
    Record(SessionId),
    Depth(SessionId),
    LiveConsumer(usize),
    /// Where a live feed's stream stands, its consumer lost.
    LiveStream(usize),
    /// An invoke's message id being taken for it, before it starts.
    InvocationClaim(Box<Invocation>),
    /// Who holds the message id an invoke found taken.
    InvocationOwner(Box<Invocation>),
    /// A PUBLISH's signed id being recorded, before its event is stored.
    Claim(Box<events::ClaimedPublish>),
    /// The signed id of a PUBLISH dropped unanswered being recorded, for its caller
    /// (`ns/name`) in `claims_held`, counted in its requests in flight.
    DroppedClaim(String, Ticket),
    Publish(Box<events::PublishRequest>),
    Replay(Box<events::ReplayPage>),
    /// A cancel forwarded to the broker that may hold its invocation.
    Forwarded(Box<cancel::Forwarded>),
    /// An id this broker holds claimed again in tenant `ns`'s bucket made anew.
    Reclaim(String),
    /// Which `AMP_MIG_SEEN` is there (`reclaim.rs`).
    SeenCheck,
}

/// A continuation of this module, opaque to the core's table that keeps it.
pub struct Awaiting(Pending);

impl Awaiting {
    /// The tenant whose `AMP_MIG_SEEN` this request went to, when it is a claim or a read
    /// there: a claim with no responders found the bucket gone, for the core to make again.
    pub(crate) fn seen_tenant(&self) -> Option<&str> {
        match &self.0 {
            Pending::InvocationClaim(inv) | Pending::InvocationOwner(inv) => Some(&inv.ns),
            Pending::Claim(p) => Some(p.ns()),
            Pending::DroppedClaim(caller, _) => Some(caller_tenant(caller)),
            Pending::Reclaim(ns) => Some(ns),
            _ => None,
        }
    }
}

/// The tenant of a caller named `ns/name`.
fn caller_tenant(caller: &str) -> &str {
    caller.split_once('/').map_or(caller, |(ns, _)| ns)
}

/// A timer of the front end, in the core's table.
pub enum Alarm {
    /// An invocation's deadline.
    Deadline(SessionId),
    /// A live event feed's pull check (index into `live`).
    LiveCheck(usize, u64),
    /// A live event feed whose consumer could not be made asks again.
    LiveRetry(usize),
    /// An invocation's task record read again (`rechecks`).
    Recheck(SessionId),
    /// Which `AMP_MIG_SEEN` is there is asked again (`reclaim.rs`).
    SeenCheck,
}

/// The labels of a MIG caller in the jobs engine: none (they never serve).
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

pub struct Mig {
    broker_id: String,
    subs: HashMap<Sid, Sub>,
    /// Requests sent since the core last filed them in its continuation table.
    pub(crate) staged: Staged<Awaiting>,
    invocations: HashMap<SessionId, Invocation>,
    /// Invocations waiting per caller (`(tenant, name)`): each holds at most its share of
    /// `mig.max_pending`.
    waiting_per_caller: HashMap<(String, String), usize>,
    /// Invocations whose message id is being taken for them (counted in `max_pending`).
    claiming: usize,
    /// The same by `(tenant, message_id)`, for a CANCEL that comes meanwhile.
    claims: HashMap<(String, String), cancel::Claim>,
    /// Live claims this broker made in `AMP_MIG_SEEN`, per caller.
    claims_held: seen::Ledger,
    /// The ids this broker holds, claimed again in `AMP_MIG_SEEN` made anew.
    reclaims: reclaim::Reclaims,
    cancels: HashMap<SessionId, CancelRequest>,
    /// Invocations answered at their deadline while their submit was out, by session:
    /// `(tenant, caller, task, when)` to cancel once the submit is answered (a cancel sent
    /// before the task store has the task finds nothing, and the task runs on).
    expired_submits: HashMap<SessionId, (String, String, String, Instant)>,
    /// Local invocations by `(tenant, message_id)`, for `cancel`.
    by_message: HashMap<(String, String), Vec<SessionId>>,
    /// `(tenant, message_id)` of finished invocations -> caller.
    finished: BoundedMap<(String, String), String>,
    next_session: SessionId,
    auth: Authenticator,
    metrics: Metrics,
    kv: crate::jetstream::kv::Kv,
    clock: Clock,
    /// Message ids of requests and events that come without one.
    ids: IdSource,
    /// The issuing account's public key (`A...`), when the broker issues JWTs.
    issuer: Option<String>,
    live: Vec<events::LiveFeed>,
    /// Deadlines set since the core last filed them in its timer table.
    pub(crate) later: Later<Alarm>,
    /// Each caller's pace (`ns/name`): MIG requests come on NATS, past the WebSocket
    /// frame limiter, so they are paced here the same way.
    pace: BoundedMap<String, Pace>,
    /// Answers to refusals of requests that proved nobody, per reply prefix and in all.
    refusals: Budget,
}

/// A caller's request buckets: requests at `limits.max_frames_per_s`, and the
/// participants its heartbeats look at at `limits.presence_listed_per_s` (a heartbeat
/// reads every registry entry of the tenant, as `who` does).
struct Pace {
    requests: DebtBucket,
    listed: DebtBucket,
}

/// Callers whose pace is remembered at once (the oldest forgotten first).
const PACE_MEMORY: usize = 65_536;

/// Where an answer goes and what it is counted as.
struct Answer<'a> {
    reply: &'a str,
    echo: &'a Echo,
    op: &'static str,
    capability: &'a str,
    received: Instant,
}

impl Mig {
    /// `clock` gives the wall time at each `now`; `ids` makes message ids.
    pub fn new(broker_id: &str, clock: Clock, ids: IdSource) -> Result<Mig, String> {
        let kv = crate::jetstream::kv::Kv::new(
            crate::jetstream::api::ApiPrefix::default(),
            super::binding::TASK_STATE_BUCKET,
        )
        .map_err(|e| e.to_string())?;
        Ok(Mig {
            broker_id: broker_id.to_string(),
            subs: HashMap::new(),
            staged: Staged::default(),
            invocations: HashMap::new(),
            waiting_per_caller: HashMap::new(),
            claiming: 0,
            claims: HashMap::new(),
            claims_held: seen::Ledger::default(),
            reclaims: reclaim::Reclaims::default(),
            cancels: HashMap::new(),
            expired_submits: HashMap::new(),
            by_message: HashMap::new(),
            finished: BoundedMap::new(FINISHED_MEMORY),
            next_session: SESSION_BASE,
            auth: Authenticator::new(),
            metrics: Metrics::default(),
            kv,
            clock,
            ids,
            issuer: None,
            live: Vec::new(),
            later: Later::default(),
            pace: BoundedMap::new(PACE_MEMORY),
            refusals: Budget::default(),
        })
    }

    /// Every tenant's request subjects, each with its queue group (one per operation, so
    /// each request is answered by one broker), when MIG is enabled. The core subscribes
    /// them, on the connection for what untrusted parties send, and hands each message
    /// to [`Mig::on_request`].
    pub fn request_subscriptions(config: &Config) -> Vec<(String, &'static str)> {
        if !config.mig.enabled {
            return Vec::new();
        }
        // A tenant homed in another JetStream domain (a fleet namespace at a leaf site)
        // keeps its task store, queues and topics there, which this front end does not
        // address: the brokers of that domain answer its requests, not this one.
        config
            .namespaces
            .iter()
            .filter(|(_, n)| n.jetstream_domain.is_none())
            .flat_map(|(ns, _)| subjects::request_subscriptions(ns))
            .collect()
    }

    /// Starts the live event feeds when MIG is enabled.
    pub fn start(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        now: Instant,
    ) -> Result<(), String> {
        if !config.mig.enabled {
            return Ok(());
        }
        self.watch_seen(conn, now)?;
        self.start_live(conn, config, now)
    }

    /// Record changes made while the connection was down were missed: read the record of
    /// every invocation waiting on one again.
    fn reread_records(&mut self, conn: &mut Connection, now: Instant) {
        let waiting: Vec<SessionId> = self
            .invocations
            .iter()
            .filter(|(_, i)| i.stage == Stage::Waiting)
            .map(|(s, _)| *s)
            .collect();
        for session in waiting {
            self.read_record(conn, session, now);
        }
    }

    /// Accept the scoped user JWTs this account signs as `Bearer` credentials.
    pub fn set_issuer(&mut self, account_public_key: String) {
        self.issuer = Some(account_public_key);
    }

    pub fn owns(&self, sid: Sid) -> bool {
        self.subs.contains_key(&sid)
    }

    pub fn render_metrics(&self, out: &mut String) {
        self.metrics.render(out, self.auth.verifications());
    }

    /// A step of the wall clock was followed ([`Broker::observe_wall_clock`]).
    ///
    /// [`Broker::observe_wall_clock`]: crate::broker::Broker::observe_wall_clock
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
    }

    fn wall_ms(&self, now: Instant) -> i64 {
        self.clock.ms(now)
    }

    fn timestamp(&self, now: Instant) -> String {
        self.clock.timestamp(now)
    }

    fn new_session(&mut self) -> SessionId {
        let s = self.next_session;
        self.next_session = self.next_session.saturating_add(1);
        s
    }

    // ---- NATS in ---------------------------------------------------------------------

    pub fn on_message(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        sid: Sid,
        msg: &Message,
        now: Instant,
    ) {
        match self.subs.get(&sid) {
            Some(Sub::Live(feed)) => {
                let feed = *feed;
                self.live_delivery(conn, ctx.config, feed, msg, now);
            }
            Some(Sub::RetiredLive(feed)) => {
                let feed = *feed;
                self.retired_live_delivery(conn, feed, msg, now);
            }
            Some(Sub::Task(session)) => {
                let session = *session;
                self.record_changed(conn, session, msg, now);
            }
            Some(Sub::ForwardedCancel(session)) => {
                let session = *session;
                self.forwarded_cancel(conn, ctx, session, msg, now);
            }
            Some(Sub::SeenMade) => self.seen_advisory(conn, now),
            None => {}
        }
    }

    /// A reply to a request this front end made; false when it is not one.
    pub(crate) fn on_reply(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        Awaiting(p): Awaiting,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        match p {
            Pending::Record(session) => self.record_read(conn, ctx, session, reply, now),
            Pending::Depth(session) => self.depth_read(conn, ctx, session, reply, now),
            Pending::LiveConsumer(feed) => self.live_consumer_ready(conn, feed, reply, now),
            Pending::LiveStream(feed) => self.live_stream_read(conn, ctx.config, feed, reply, now),
            Pending::InvocationClaim(inv) => self.invocation_claimed(conn, ctx, *inv, reply, now),
            Pending::InvocationOwner(inv) => {
                self.invocation_owner_read(conn, ctx, *inv, reply, now)
            }
            Pending::Claim(p) => self.claimed(conn, *p, reply, now),
            Pending::DroppedClaim(caller, _ticket) => {
                let acked =
                    reply.map(|m| crate::jetstream::publish::parse_pub_ack(m.status(), &m.payload));
                self.settle_claim(&caller, &acked, now);
            }
            Pending::Publish(p) => self.published(conn, *p, reply, now),
            Pending::Replay(page) => self.replay_read(conn, *page, reply, now),
            Pending::Forwarded(f) => self.forward_answered(conn, ctx, *f, reply, now),
            Pending::Reclaim(_) => self.reclaimed(conn, ctx.config, reply.as_ref().map(drop), now),
            Pending::SeenCheck => self.seen_checked(conn, ctx.config, reply, now),
        }
    }

    /// An answer of the jobs engine to one of the pseudo sessions.
    pub fn on_jobs_reply(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        text: &str,
        now: Instant,
    ) {
        let frame: Value = serde_json::from_str(text).unwrap_or(Value::Null);
        // An AMP error answer is flat: `{"op":"error","re","code","message",...}`.
        let error = (frame.get("op").and_then(Value::as_str) == Some("error")).then_some(frame);
        if let Some(c) = self.cancels.remove(&session) {
            return self.cancel_answered(conn, c, error, now);
        }
        if let Some((ns, caller, task, _)) = self.expired_submits.remove(&session) {
            // Created (or found): it is cancelled as at the deadline; refused: no task.
            if error.is_none() {
                let s = self.new_session();
                jobs_frame(conn, ctx, s, &ns, &caller, cancel_frame(&task), now);
            }
            return;
        }
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        if inv.stage != Stage::Submitting {
            return;
        }
        match error {
            None => {
                inv.waits();
                if let Some(c) = inv.cancel_after_submit.take() {
                    self.cancel_task(conn, ctx, session, c, now);
                }
            }
            Some(e) => {
                let mut m = MigError::from_amp_error(&e);
                if e.get("code").and_then(Value::as_str) == Some("conflict") {
                    m.message =
                        "this idempotency_key was used with another capability or payload".into();
                }
                self.finish(conn, session, Err(m), now);
            }
        }
    }

    /// Whether a timer still has something to do (see `Timers::prune`): the deadline of
    /// an invocation already answered does not.
    pub(crate) fn alarm_matters(&self, alarm: &Alarm) -> bool {
        match alarm {
            Alarm::Deadline(session) | Alarm::Recheck(session) => {
                self.invocations.contains_key(session)
            }
            Alarm::LiveCheck(..) | Alarm::LiveRetry(_) | Alarm::SeenCheck => true,
        }
    }

    /// A timer of the front end fired.
    pub(crate) fn on_alarm(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        alarm: Alarm,
        now: Instant,
    ) {
        let session = match alarm {
            Alarm::LiveCheck(feed, generation) => {
                return self.live_check(conn, feed, generation, now);
            }
            Alarm::LiveRetry(feed) => return self.live_retry(conn, ctx.config, feed, now),
            Alarm::Recheck(session) => return self.recheck(conn, session, now),
            Alarm::SeenCheck => return self.seen_retry(conn, now),
            Alarm::Deadline(session) => session,
        };
        let Some(inv) = self.invocations.get(&session) else {
            return;
        };
        let stage = inv.stage;
        let (ns, caller, task) = (inv.ns.clone(), inv.caller.clone(), inv.task.clone());
        self.finish(
            conn,
            session,
            Err(MigError::new(Code::Timeout, "deadline exceeded")),
            now,
        );
        // The jobs engine answers every submit it takes (JetStream's answer or its
        // timeout, within seconds), so these entries leave; one it never took (a reload
        // removed the caller meanwhile) is forgotten once the answer is long overdue, and
        // past the bound the cancel goes out at once as it did.
        self.expired_submits
            .retain(|_, e| now.saturating_duration_since(e.3) < EXPIRED_SUBMIT_WAIT);
        if stage == Stage::Submitting && self.expired_submits.len() < ctx.config.mig.max_pending {
            self.expired_submits
                .insert(session, (ns, caller, task, now));
        } else if stage >= Stage::Submitting {
            // The holder gets `revoked`; the answer is nobody's business.
            let s = self.new_session();
            jobs_frame(conn, ctx, s, &ns, &caller, cancel_frame(&task), now);
        }
    }

    // ---- requests --------------------------------------------------------------------

    /// Takes an authenticated request from its caller's buckets (`cost` requests: a
    /// replay page counts each event it may read), or says in how many milliseconds it
    /// could pass.
    fn paced(
        &mut self,
        ctx: &Ctx<'_>,
        ns: &str,
        name: &str,
        op: &subjects::Op<'_>,
        cost: u64,
        now: Instant,
    ) -> Result<(), u64> {
        let limits = &ctx.config.limits;
        let pace = self
            .pace
            .get_or_insert_with(format!("{ns}/{name}"), || Pace {
                requests: DebtBucket::new(now),
                listed: DebtBucket::new(now),
            });
        pace.requests
            .take(cost as f64, f64::from(limits.max_frames_per_s), now)?;
        if matches!(op, subjects::Op::Heartbeat) {
            let present = ctx.registry.map_or(0, Registry::present);
            pace.listed
                .take(present as f64, f64::from(limits.presence_listed_per_s), now)?;
        }
        Ok(())
    }

    /// A message on one of the [`Mig::request_subscriptions`]; answers go out on `conn`.
    pub fn on_request(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        msg: &Message,
        now: Instant,
    ) {
        let Some((ns, op)) = subjects::parse(&msg.subject) else {
            return;
        };
        if matches!(op, subjects::Op::Publish(_)) && msg.reply.is_none() {
            // A delivered event (ours or anyone's) shares the subject: not a request.
            return;
        }
        let Some(reply) = msg.reply.as_deref() else {
            self.metrics.rejected("no_reply_subject");
            return;
        };
        // Only the header is read before a credential is proved, and only when needed
        // (a signature's id and time, a refusal's echo): the whole body after.
        let peeked = OnceCell::new();
        let peek = || peeked.get_or_init(|| envelope::peek_header(&msg.payload));
        let signed_fields = || {
            let h = envelope::parse_header(peek().as_ref()?, msg.headers.as_ref(), String::new);
            let h = h.ok().filter(|h| h.message_id_given)?;
            Some((h.message_id, h.timestamp?))
        };
        let presented = Presented {
            ns,
            subject: &msg.subject,
            reply: Some(reply),
            authorization: msg.headers.as_ref().and_then(|h| h.get("Authorization")),
            signed_fields: &signed_fields,
            exposed: matches!(op, subjects::Op::Publish(_)),
        };
        let wall = self.wall_ms(now);
        let verdict =
            self.auth
                .authenticate(ctx.config, self.issuer.as_deref(), &presented, now, wall);
        // Only a capability the tenant has is a label: any other name from the subject
        // (answered `MIG_UNSUPPORTED_CAPABILITY`, or refused before a credential was
        // proved) would fill the series with a caller's choice.
        let capability = match op {
            subjects::Op::Invoke(c) if offers(ctx.config, ns, c) => c,
            _ => "",
        };
        let proved = match verdict {
            Ok(p) => p,
            Err(refusal) => {
                if let Refusal::Misdirected { name, id } = &refusal {
                    let cap = ctx.config.limits.max_participant_requests_in_flight;
                    let ticket = ctx.in_flight.take(&format!("{ns}/{name}"), cap);
                    let signed = events::Signed { ns, name, id };
                    self.use_up_dropped(conn, ctx.config, signed, ticket, now);
                }
                let Some(e) = self.refusal_error(refusal) else {
                    return;
                };
                // Its reply subject is anyone's choice: a few such answers a second go to
                // one prefix, so nobody streams refusals into another's inbox.
                let owner = subjects::reply_owner(ns, reply).unwrap_or_default();
                let m = &ctx.config.mig;
                let key = format!("{ns}/{owner}");
                let budget = (m.refusals_per_prefix_per_s, m.refusals_per_s);
                if self.refusals.take(&key, budget.0, budget.1, now).is_err() {
                    self.metrics.rejected("refusal_unanswered");
                    return;
                }
                let echo = match peek()
                    .as_ref()
                    .map(|b| envelope::parse_header(b, msg.headers.as_ref(), || self.ids.next_id()))
                {
                    Some(Ok(h)) => Echo::of(&h),
                    _ => Echo {
                        tenant_id: ns.to_string(),
                        ..Echo::default()
                    },
                };
                let answer = Answer {
                    reply,
                    echo: &echo,
                    op: op.label(),
                    capability,
                    received: now,
                };
                return self.respond(conn, &answer, Err(e), now);
            }
        };
        let name = proved.name;
        // A request that asks JetStream (a refused signed PUBLISH too, for its claim)
        // holds a place in its participant's requests in flight until that is answered:
        // each holds one of the broker's NATS request slots, which everything shares.
        let cap = ctx.config.limits.max_participant_requests_in_flight;
        let asks = asks_jetstream(&op);
        let ticket = asks
            .then(|| ctx.in_flight.take(&format!("{ns}/{name}"), cap))
            .flatten();
        // A signed PUBLISH reaches every subscriber of its topic, and its signature does
        // not cover the body: whatever refuses it below records its id for every broker
        // first (`refuse_signed`), when its place allows.
        let exposed = match (&op, proved.signed_id.as_deref()) {
            (subjects::Op::Publish(_), Some(id)) => Some(events::Signed {
                ns,
                name: &name,
                id,
            }),
            _ => None,
        };
        let body: Option<Map<String, Value>> = match serde_json::from_slice(&msg.payload) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        };
        let header = body
            .as_ref()
            .map(|b| envelope::parse_header(b, msg.headers.as_ref(), || self.ids.next_id()));
        let mut echo = Echo {
            tenant_id: ns.to_string(),
            ..Echo::default()
        };
        if let Some(Ok(h)) = &header {
            echo = Echo::of(h);
        }
        let answer = Answer {
            reply,
            echo: &echo,
            op: op.label(),
            capability,
            received: now,
        };
        // A verified signature's id is used up at once, before anything can refuse its
        // request: a copy sent later (the caller's resend, or a subscriber's with its own
        // body) is a replay. A refused signed request is signed again with a new id.
        if let Some(id) = &proved.signed_id {
            let capacity = ctx.config.mig.max_signed_ids;
            let published = exposed.is_some();
            let taken = self
                .auth
                .take_signed(ns, &name, id, published, capacity, now, wall);
            if let Err(refusal) = taken {
                // A replay's id was used up by the request it copies.
                let replay = refusal == Refusal::Unauthorized;
                let Some(e) = self.refusal_error(refusal) else {
                    return;
                };
                let exposed = exposed.filter(|_| !replay);
                return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
            }
        }
        let cost = match op {
            subjects::Op::Subscribe => events::page_cost(body.as_ref()),
            _ => 1,
        };
        if asks && ticket.is_none() {
            self.metrics.rejected("requests_in_flight");
            let e = MigError::new(
                Code::RateLimited,
                format!(
                    "a participant has at most {cap} requests in flight; wait for their answers"
                ),
            )
            .detail("retry_after_ms", json!(in_flight::FULL_RETRY_MS))
            .detail("amp_code", json!("rate_limited"));
            // No place for a refused PUBLISH's claim either: its id is used up on this
            // broker only, as past `mig.max_claims_per_caller`.
            return self.refuse_signed(conn, ctx.config, None, &answer, e, now);
        }
        if let Err(ms) = self.paced(ctx, ns, &name, &op, cost, now) {
            self.metrics.rejected("rate_limited");
            let e = MigError::new(Code::RateLimited, "too many requests")
                .detail("retry_after_ms", json!(ms));
            return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
        }
        let (Some(body), Some(header)) = (body, header) else {
            let e = MigError::new(Code::InvalidRequest, "the body must be a JSON object");
            return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
        };
        let header = match header {
            Ok(h) => h,
            Err(HeaderError::Invalid(m)) => {
                let e = MigError::new(Code::InvalidRequest, m);
                return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
            }
            Err(HeaderError::Version(v)) => {
                let e = MigError::new(
                    Code::VersionMismatch,
                    format!("mig_version `{v}` is not supported; this broker speaks 0.1"),
                );
                return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
            }
        };
        // The signature was checked against the first `header` of the body; a second one
        // (JSON keeps the last) would have the request go on under another id.
        if proved
            .signed_id
            .as_ref()
            .is_some_and(|id| *id != header.message_id)
        {
            let e = MigError::new(Code::InvalidRequest, "the body has more than one header");
            return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
        }
        if header.tenant_id != ns {
            let e = MigError::new(
                Code::Forbidden,
                "header.tenant_id is not the tenant of the subject",
            );
            return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
        }

        let Some(participant) = ctx.config.participant(ns, &name) else {
            let e = MigError::new(Code::Unauthorized, "authentication failed");
            return self.refuse_signed(conn, ctx.config, exposed.zip(ticket), &answer, e, now);
        };
        let result = match op {
            subjects::Op::Hello => ops::hello(&body, &self.broker_id),
            subjects::Op::Discover => Ok(ops::discover(
                ctx.config,
                ns,
                participant,
                &body,
                conn.max_payload(),
            )),
            subjects::Op::Heartbeat => ops::heartbeat(ctx, ns, &body),
            subjects::Op::Invoke(cap) => {
                let inv = invoke::Request {
                    ns,
                    caller: &name,
                    participant,
                    capability: cap,
                    reply,
                    header: &header,
                    body: &body,
                };
                return self.invoke(conn, ctx, inv, ticket, now);
            }
            subjects::Op::Publish(topic) => {
                return self.publish(
                    conn,
                    ctx,
                    ns,
                    &name,
                    participant,
                    topic,
                    &answer,
                    &header,
                    &body,
                    ticket,
                    now,
                );
            }
            subjects::Op::Subscribe => {
                return self.replay(conn, ns, participant, &answer, &body, ticket, now);
            }
            subjects::Op::Cancel(target) => {
                return self.cancel(
                    conn, ctx, ns, &name, target, reply, &header, &body, ticket, now,
                );
            }
        };
        self.respond(conn, &answer, result, now);
    }

    /// The answer to a refusal of authentication (none for `Drop`, only counted).
    fn refusal_error(&mut self, r: Refusal) -> Option<MigError> {
        Some(match r {
            Refusal::Drop(reason) => {
                self.metrics.rejected(reason);
                return None;
            }
            Refusal::Misdirected { .. } => {
                self.metrics.rejected("reply_subject");
                return None;
            }
            Refusal::Unauthorized => MigError::new(Code::Unauthorized, "authentication failed"),
            Refusal::Exposed => {
                self.metrics.rejected("bearer_on_publish");
                MigError::new(
                    Code::Unauthorized,
                    "PUBLISH takes an NKey signature: its subject reaches every subscriber of the topic, headers included, so a Bearer credential there is handed to them (use a new one)",
                )
            }
            Refusal::Throttled(d) => MigError::new(Code::RateLimited, "too many failed attempts")
                .detail("retry_after_ms", json!(millis(d))),
            Refusal::Busy(d) => {
                self.metrics.rejected("verification_budget");
                MigError::new(
                    Code::RateLimited,
                    "too many credentials to check: try again later",
                )
                .detail("retry_after_ms", json!(millis(d)))
            }
            Refusal::Crowded(d) => {
                self.metrics.rejected("replay_cache_share");
                MigError::new(
                    Code::RateLimited,
                    "this broker remembers as many of your signed message ids as it may: send fewer signed requests",
                )
                .detail("retry_after_ms", json!(millis(d)))
            }
        })
    }

    /// Publishes a reply (success fields or an error) with the duplicated NATS headers.
    fn respond(
        &mut self,
        conn: &mut Connection,
        a: &Answer<'_>,
        result: Result<Value, MigError>,
        now: Instant,
    ) {
        let ts = self.timestamp(now);
        let (body, code) = match &result {
            Ok(fields) => (envelope::success_body(a.echo, &ts, fields.clone()), "OK"),
            Err(e) => (envelope::error_body(a.echo, &ts, e), e.code.as_str()),
        };
        let headers = a.echo.nats_headers();
        let code = match conn.publish(a.reply, None, Some(&headers), &body) {
            Ok(()) => code,
            // Unsent, the caller would wait out its timeout for nothing: it hears why, in
            // a few hundred bytes (the echo is bounded), and is counted as refused.
            Err(crate::nats::Error::MaxPayloadExceeded { size, max }) => {
                let e = too_large_reply(size, max);
                let body = envelope::error_body(a.echo, &ts, &e);
                if let Err(err) = conn.publish(a.reply, None, Some(&headers), &body) {
                    log::warn!(subject:% = a.reply; "MIG reply not sent: {err}");
                }
                e.code.as_str()
            }
            Err(e) => {
                log::warn!(subject:% = a.reply; "MIG reply not sent: {e}");
                code
            }
        };
        let took = now.saturating_duration_since(a.received);
        self.metrics.request(a.op, a.capability, code, took);
    }
}

/// Whether the operation asks JetStream (or a broker that asks it) on its caller's behalf.
fn asks_jetstream(op: &subjects::Op<'_>) -> bool {
    use subjects::Op;
    match op {
        Op::Invoke(_) | Op::Publish(_) | Op::Subscribe | Op::Cancel(_) => true,
        Op::Hello | Op::Discover | Op::Heartbeat => false,
    }
}

/// What a caller hears in place of a reply (or a stream's last frame) of `size` bytes that
/// the server, allowing `max`, would refuse.
pub(super) fn too_large_reply(size: usize, max: usize) -> MigError {
    MigError::new(
        Code::InvalidRequest,
        format!("the reply is {size} bytes, more than the server's max_payload of {max}"),
    )
    .detail("amp_code", json!("too_large"))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// Holds `bytes` of a request against the bound that submits waiting for JetStream share
/// (`held_bytes.rs`), or refuses it `MIG_BACKPRESSURE`: a PUBLISH's event until it is
/// stored, an INVOKE's payload until its task exists.
fn hold_bytes(jobs: &Jobs, bytes: usize) -> Result<Hold, MigError> {
    jobs.held_bytes().take(bytes).ok_or_else(|| {
        MigError::new(
            Code::Backpressure,
            "the broker holds as many bytes as it may while JetStream answers",
        )
        .detail("retry_after_ms", json!(held_bytes::RETRY_AFTER_MS))
    })
}

/// Whether tenant `ns` has capability `id`.
pub(super) fn offers(config: &Config, ns: &str, id: &str) -> bool {
    config.namespaces.get(ns).is_some_and(|n| {
        n.jobs
            .values()
            .any(|j| j.mig.as_ref().is_some_and(|m| m.id == id))
    })
}

/// Hands a frame to the jobs engine as pseudo session `session` of `ns/name`.
fn jobs_frame(
    conn: &mut Connection,
    ctx: &mut Ctx<'_>,
    session: SessionId,
    ns: &str,
    name: &str,
    frame: ClientFrame,
    now: Instant,
) {
    let Some(participant) = ctx.config.participant(ns, name) else {
        return;
    };
    let caller = Caller {
        session,
        ns,
        name,
        participant,
        labels: &NO_LABELS,
    };
    ctx.jobs.frame(conn, &caller, frame, now);
}

/// The publish-path token buckets, as a WebSocket `submit` takes them.
fn take_rate(
    rates: &mut RateLimiter,
    participant: &Participant,
    ns: &str,
    name: &str,
    bytes: usize,
    now: Instant,
) -> Result<(), MigError> {
    let Some(limits) = participant
        .policy
        .as_ref()
        .and_then(rate_limit::Limits::from_policy)
    else {
        return Ok(());
    };
    rates
        .try_take(&format!("{ns}/{name}"), &limits, 1, bytes as u64, now)
        .map_err(|r| {
            MigError::new(Code::RateLimited, "rate limit reached")
                .detail("retry_after_ms", json!(r.retry_after_ms))
                .detail("amp_code", json!("rate_limited"))
        })
}
