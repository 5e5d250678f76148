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
pub mod config;
pub mod envelope;
mod events;
mod invoke;
mod metrics;
pub mod subjects;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

use super::bounded_map::BoundedMap;
use super::config::{Config, Participant};
use super::jobs::{Caller, Jobs, SessionId};
use super::permissions::{self, Action};
use super::rate_limit::{self, RateLimiter};
use super::registry::Registry;
use crate::amp::frame::{ClientFrame, TaskRef};
use crate::nats::{Connection, Message, RequestError, RequestId, Sid};
use crate::rfc3339;

use caller::{Authenticator, Presented, Refusal};
use envelope::{Code, Echo, HeaderError, MigError};
use invoke::{Invocation, Stage};
use metrics::Metrics;

/// Pseudo sessions of MIG requests handed to the jobs engine are numbered from here, far
/// above any WebSocket session number.
pub const SESSION_BASE: SessionId = 1 << 62;

pub fn is_mig_session(session: SessionId) -> bool {
    session >= SESSION_BASE
}

pub use subjects::tenant_of;

/// Features `hello` can enable: the ones this broker implements.
pub const FEATURES: &[&str] = &["streaming", "replay", "cancel", "heartbeat", "idempotency"];
/// Versions this broker speaks, highest first.
const VERSIONS: &[&str] = &[envelope::MIG_VERSION];
/// `suggested_interval_ms` of a heartbeat that asks for none, and its bounds.
const HEARTBEAT_DEFAULT_MS: u64 = 5000;
const HEARTBEAT_MIN_MS: u64 = 1000;
const HEARTBEAT_MAX_MS: u64 = 300_000;
/// `retry_after_ms` of `MIG_BACKPRESSURE`.
const BACKPRESSURE_RETRY_MS: u64 = 1000;
/// Finished invocations remembered for `cancel` (`already_finished`).
const FINISHED_MEMORY: usize = 16_384;
const JS_TIMEOUT: Duration = Duration::from_secs(5);

/// What the core lends the front end for one step.
pub struct Ctx<'a> {
    pub config: &'a Config,
    pub jobs: &'a mut Jobs,
    pub rates: &'a mut RateLimiter,
    /// The registry of the request's tenant (serving slots and leases, for heartbeats).
    pub registry: Option<&'a Registry>,
}

enum Sub {
    Requests,
    /// Deliveries of a tenant's live event feed (index into `live`).
    Live(usize),
    /// Changes of one invocation's task record.
    Task(SessionId),
}

enum Pending {
    Record(SessionId),
    Depth(SessionId),
    LiveConsumer(usize),
    Publish(Box<events::PublishRequest>),
    Replay(Box<events::ReplayPage>),
}

/// A `cancel` waiting for the jobs engine.
struct CancelRequest {
    reply: String,
    echo: Echo,
    target: String,
    received: Instant,
    /// The local invocation it ends, if any.
    invocation: Option<SessionId>,
}

/// The labels of a MIG caller in the jobs engine: none (they never serve).
static NO_LABELS: BTreeMap<String, String> = BTreeMap::new();

pub struct Mig {
    broker_id: String,
    subs: HashMap<Sid, Sub>,
    pending: HashMap<RequestId, Pending>,
    invocations: HashMap<SessionId, Invocation>,
    cancels: HashMap<SessionId, CancelRequest>,
    /// Local invocations by `(tenant, message_id)`, for `cancel`.
    by_message: HashMap<(String, String), Vec<SessionId>>,
    /// `(tenant, message_id)` of finished invocations -> caller.
    finished: BoundedMap<(String, String), String>,
    deadlines: BinaryHeap<Reverse<(Instant, SessionId)>>,
    next_session: SessionId,
    auth: Authenticator,
    metrics: Metrics,
    kv: crate::jetstream::kv::Kv,
    anchor: (Instant, i64),
    /// The issuing account's public key (`A...`), when the broker issues JWTs.
    issuer: Option<String>,
    live: Vec<events::LiveFeed>,
    live_checks: BinaryHeap<Reverse<(Instant, usize)>>,
}

/// Where an answer goes and what it is counted as.
struct Answer<'a> {
    reply: &'a str,
    echo: &'a Echo,
    op: &'static str,
    capability: &'a str,
    received: Instant,
}

impl Mig {
    /// `wall_ms` is the Unix time in milliseconds at `now`.
    pub fn new(broker_id: &str, now: Instant, wall_ms: i64) -> Result<Mig, String> {
        let kv = crate::jetstream::kv::Kv::new(
            crate::jetstream::api::ApiPrefix::default(),
            super::binding::TASK_STATE_BUCKET,
        )
        .map_err(|e| e.to_string())?;
        Ok(Mig {
            broker_id: broker_id.to_string(),
            subs: HashMap::new(),
            pending: HashMap::new(),
            invocations: HashMap::new(),
            cancels: HashMap::new(),
            by_message: HashMap::new(),
            finished: BoundedMap::new(FINISHED_MEMORY),
            deadlines: BinaryHeap::new(),
            next_session: SESSION_BASE,
            auth: Authenticator::new(),
            metrics: Metrics::default(),
            kv,
            anchor: (now, wall_ms),
            issuer: None,
            live: Vec::new(),
            live_checks: BinaryHeap::new(),
        })
    }

    /// Subscribes to every tenant's request subjects (one queue group per operation, so
    /// each request is answered by one broker) when MIG is enabled.
    pub fn start(
        &mut self,
        conn: &mut Connection,
        config: &Config,
        now: Instant,
    ) -> Result<(), String> {
        if !config.mig.enabled {
            return Ok(());
        }
        for ns in config.namespaces.keys() {
            for (subject, queue) in subjects::request_subscriptions(ns) {
                let sid = conn
                    .subscribe(&subject, Some(queue))
                    .map_err(|e| format!("MIG subscription {subject}: {e}"))?;
                self.subs.insert(sid, Sub::Requests);
            }
        }
        self.start_live(conn, config, now)
    }

    /// Accept the scoped user JWTs this account signs as `Bearer` credentials.
    pub fn set_issuer(&mut self, account_public_key: String) {
        self.issuer = Some(account_public_key);
    }

    pub fn awaits(&self, id: RequestId) -> bool {
        self.pending.contains_key(&id)
    }

    pub fn owns(&self, sid: Sid) -> bool {
        self.subs.contains_key(&sid)
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        let live = self.live_checks.peek().map(|Reverse((at, _))| *at);
        self.deadlines
            .peek()
            .map(|Reverse((at, _))| *at)
            .into_iter()
            .chain(live)
            .min()
    }

    pub fn render_metrics(&self, out: &mut String) {
        self.metrics.render(out);
    }

    fn wall_ms(&self, now: Instant) -> i64 {
        let (anchor, ms) = self.anchor;
        match now.checked_duration_since(anchor) {
            Some(d) => ms.saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)),
            None => ms
                .saturating_sub(i64::try_from(anchor.duration_since(now).as_millis()).unwrap_or(0)),
        }
    }

    fn timestamp(&self, now: Instant) -> String {
        rfc3339::format_millis(self.wall_ms(now))
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
            Some(Sub::Requests) => self.on_request(conn, ctx, msg, now),
            Some(Sub::Live(feed)) => {
                let feed = *feed;
                self.live_delivery(conn, feed, msg, now);
            }
            Some(Sub::Task(session)) => {
                let session = *session;
                if crate::jetstream::kv::operation_of(msg.headers.as_ref()).0
                    != crate::jetstream::kv::KvOperation::Put
                {
                    return;
                }
                if let Ok(record) = super::task_store::TaskRecord::from_json(&msg.payload) {
                    self.on_record(conn, session, record, now);
                }
            }
            None => {}
        }
    }

    /// A reply to a request this front end made; false when it is not one.
    pub fn on_reply(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        id: RequestId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) -> bool {
        let Some(p) = self.pending.remove(&id) else {
            return false;
        };
        match p {
            Pending::Record(session) => self.record_read(conn, ctx, session, reply, now),
            Pending::Depth(session) => self.depth_read(conn, ctx, session, reply, now),
            Pending::LiveConsumer(feed) => {
                let ok =
                    reply.is_ok_and(|m| crate::jetstream::api::check_error(&m.payload).is_ok());
                self.live_consumer_ready(conn, feed, ok, now);
            }
            Pending::Publish(p) => self.published(conn, *p, reply, now),
            Pending::Replay(page) => self.replay_read(conn, *page, reply, now),
        }
        true
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
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        if inv.stage != Stage::Submitting {
            return;
        }
        match error {
            None => {
                inv.stage = Stage::Waiting;
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

    pub fn handle_timeout(&mut self, conn: &mut Connection, ctx: &mut Ctx<'_>, now: Instant) {
        self.live_timeouts(conn, now);
        while let Some(Reverse((at, session))) = self.deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            let Some(inv) = self.invocations.get(&session) else {
                continue;
            };
            let submitted = inv.stage >= Stage::Submitting;
            let (ns, caller, task) = (inv.ns.clone(), inv.caller.clone(), inv.task.clone());
            self.finish(
                conn,
                session,
                Err(MigError::new(Code::Timeout, "deadline exceeded")),
                now,
            );
            if submitted {
                // The holder gets `revoked`; the answer is nobody's business.
                let s = self.new_session();
                jobs_frame(conn, ctx, s, &ns, &caller, cancel_frame(&task), now);
            }
        }
    }

    // ---- requests --------------------------------------------------------------------

    fn on_request(
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
        let body: Option<Map<String, Value>> = match serde_json::from_slice(&msg.payload) {
            Ok(Value::Object(m)) => Some(m),
            _ => None,
        };
        let header = body
            .as_ref()
            .map(|b| envelope::parse_header(b, msg.headers.as_ref(), super::envelope::unique_id));
        let (message_id, timestamp) = match &header {
            Some(Ok(h)) => (
                h.message_id_given.then_some(h.message_id.as_str()),
                h.timestamp.as_deref(),
            ),
            _ => (None, None),
        };
        let presented = Presented {
            ns,
            subject: &msg.subject,
            reply: msg.reply.as_deref(),
            authorization: msg.headers.as_ref().and_then(|h| h.get("Authorization")),
            message_id,
            timestamp,
        };
        let wall = self.wall_ms(now);
        let verdict =
            self.auth
                .authenticate(ctx.config, self.issuer.as_deref(), &presented, now, wall);
        let Some(reply) = msg.reply.as_deref() else {
            self.metrics.rejected("no_reply_subject");
            return;
        };
        let mut echo = Echo {
            tenant_id: ns.to_string(),
            ..Echo::default()
        };
        if let Some(Ok(h)) = &header {
            echo = Echo::of(h);
        }
        let capability = match op {
            subjects::Op::Invoke(c) => c,
            _ => "",
        };
        let answer = Answer {
            reply,
            echo: &echo,
            op: op.label(),
            capability,
            received: now,
        };
        let name = match verdict {
            Ok(name) => name,
            Err(Refusal::Drop(reason)) => {
                self.metrics.rejected(reason);
                return;
            }
            Err(Refusal::Unauthorized) => {
                let e = MigError::new(Code::Unauthorized, "authentication failed");
                return self.respond(conn, &answer, Err(e), now);
            }
            Err(Refusal::Throttled(d)) => {
                let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
                let e = MigError::new(Code::RateLimited, "too many failed attempts")
                    .detail("retry_after_ms", json!(ms));
                return self.respond(conn, &answer, Err(e), now);
            }
        };
        let (Some(body), Some(header)) = (body, header) else {
            let e = MigError::new(Code::InvalidRequest, "the body must be a JSON object");
            return self.respond(conn, &answer, Err(e), now);
        };
        let header = match header {
            Ok(h) => h,
            Err(HeaderError::Invalid(m)) => {
                return self.respond(
                    conn,
                    &answer,
                    Err(MigError::new(Code::InvalidRequest, m)),
                    now,
                );
            }
            Err(HeaderError::Version(v)) => {
                let e = MigError::new(
                    Code::VersionMismatch,
                    format!("mig_version `{v}` is not supported; this broker speaks 0.1"),
                );
                return self.respond(conn, &answer, Err(e), now);
            }
        };
        if header.tenant_id != ns {
            let e = MigError::new(
                Code::Forbidden,
                "header.tenant_id is not the tenant of the subject",
            );
            return self.respond(conn, &answer, Err(e), now);
        }
        let Some(participant) = ctx.config.participant(ns, &name) else {
            let e = MigError::new(Code::Unauthorized, "authentication failed");
            return self.respond(conn, &answer, Err(e), now);
        };
        let result = match op {
            subjects::Op::Hello => hello(&body, &self.broker_id),
            subjects::Op::Discover => Ok(discover(
                ctx.config,
                ns,
                participant,
                &body,
                conn.max_payload(),
            )),
            subjects::Op::Heartbeat => heartbeat(ctx, ns, &body),
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
                return self.invoke(conn, ctx, inv, now);
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
                    now,
                );
            }
            subjects::Op::Subscribe => {
                return self.replay(conn, ns, participant, &answer, &body, now);
            }
            subjects::Op::Cancel(target) => {
                return self.cancel(conn, ctx, ns, &name, target, reply, &header, &body, now);
            }
        };
        self.respond(conn, &answer, result, now);
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
        if let Err(e) = conn.publish(a.reply, None, Some(&headers), &body) {
            log::warn!(subject:% = a.reply; "MIG reply not sent: {e}");
        }
        let took = now.saturating_duration_since(a.received);
        self.metrics.request(a.op, a.capability, code, took);
    }

    // ---- invoke ----------------------------------------------------------------------

    fn invoke(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        r: invoke::Request<'_>,
        now: Instant,
    ) {
        let echo = Echo::of(r.header);
        let answer = Answer {
            reply: r.reply,
            echo: &echo,
            op: "invoke",
            capability: r.capability,
            received: now,
        };
        let accepted = invoke::accept(ctx.config, &r).and_then(|job| {
            let bytes = r.body.get("payload").map_or(0, |p| p.to_string().len());
            take_rate(ctx.rates, r.participant, r.ns, r.caller, bytes, now)?;
            if self.invocations.len() >= ctx.config.mig.max_pending {
                return Err(MigError::new(
                    Code::Backpressure,
                    "this broker waits on too many invocations",
                )
                .detail("retry_after_ms", json!(BACKPRESSURE_RETRY_MS)));
            }
            Ok(job)
        });
        let accepted = match accepted {
            Ok(a) => a,
            Err(e) => return self.respond(conn, &answer, Err(e), now),
        };
        let session = self.new_session();
        let settings = &ctx.config.mig;
        let deadline_ms = r
            .header
            .deadline_ms
            .unwrap_or(settings.default_deadline_ms)
            .min(settings.max_deadline_ms);
        let mut inv = Invocation::new(&r, accepted, deadline_ms, now);
        let key = super::binding::task_key(r.ns, &inv.task);
        let watched = self
            .kv
            .key_subject(&key)
            .map_err(|e| e.to_string())
            .and_then(|subject| conn.subscribe(&subject, None).map_err(|e| e.to_string()));
        let sid = match watched {
            Ok(sid) => sid,
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("cannot watch the task: {e}"));
                return self.respond(conn, &answer, Err(e), now);
            }
        };
        let read = self
            .kv
            .get_request(&key)
            .map_err(|e| e.to_string())
            .and_then(|req| {
                conn.request(&req.subject, None, &req.payload, JS_TIMEOUT, now)
                    .map_err(|e| e.to_string())
            });
        let id = match read {
            Ok(id) => id,
            Err(e) => {
                let _ = conn.unsubscribe(sid, None);
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                return self.respond(conn, &answer, Err(e), now);
            }
        };
        self.subs.insert(sid, Sub::Task(session));
        self.pending.insert(id, Pending::Record(session));
        self.deadlines.push(Reverse((inv.deadline, session)));
        self.by_message
            .entry((
                inv.ns.clone(),
                inv.echo.message_id.clone().unwrap_or_default(),
            ))
            .or_default()
            .push(session);
        inv.watch = Some(sid);
        if inv.stream.is_some() {
            // The reply is the stream's first frame; the rest follow on the stream subject.
            let started = json!({"kind": "control", "payload": {"status": "started"}});
            let reply = inv.reply.clone();
            self.stream_frame(conn, &mut inv, Some(&reply), started, now);
        }
        self.invocations.insert(session, inv);
    }

    fn record_read(
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
        let key = super::binding::task_key(&inv.ns, &inv.task);
        let entry = match reply {
            Ok(m) => self.kv.parse_get(&key, m.headers.as_ref(), &m.payload),
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
                match super::task_store::TaskRecord::from_json(&entry.value) {
                    Ok(record) => {
                        if let Some(inv) = self.invocations.get_mut(&session) {
                            inv.stage = Stage::Waiting;
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
                self.count_queue(conn, ctx, session, now)
            }
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("the task store refused: {e}"));
                self.finish(conn, session, Err(e), now)
            }
        }
    }

    /// Before a new task: how many the job holds, when it has a `max_queued`.
    fn count_queue(
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
        let subject = format!(
            "$JS.API.STREAM.INFO.{}",
            super::binding::tasks_stream(&inv.ns)
        );
        let filter = json!({"subjects_filter": super::binding::job_subject(&inv.ns, &inv.job)});
        match conn.request(
            &subject,
            None,
            filter.to_string().as_bytes(),
            JS_TIMEOUT,
            now,
        ) {
            Ok(id) => {
                self.pending.insert(id, Pending::Depth(session));
            }
            Err(e) => {
                let e = MigError::new(Code::Unavailable, format!("NATS is unavailable: {e}"));
                self.finish(conn, session, Err(e), now)
            }
        }
    }

    fn depth_read(
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
        let subject = super::binding::job_subject(&inv.ns, &inv.job);
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

    fn submit(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        session: SessionId,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get_mut(&session) else {
            return;
        };
        inv.stage = Stage::Submitting;
        let frame = ClientFrame::Submit(inv.submit_frame());
        let (ns, caller) = (inv.ns.clone(), inv.caller.clone());
        jobs_frame(conn, ctx, session, &ns, &caller, frame, now);
    }

    fn on_record(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        record: super::task_store::TaskRecord,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.get(&session) else {
            return;
        };
        if record.submitted_by != format!("{}/{}", inv.ns, inv.caller) {
            let e = MigError::new(Code::Internal, "the task belongs to someone else");
            return self.finish(conn, session, Err(e), now);
        }
        if record.job != inv.job
            || record.body_sha256 != super::task_store::body_digest(&inv.payload)
        {
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
    fn progress(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        record: super::task_store::TaskRecord,
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
            self.stream_frame(conn, &mut inv, None, frame, now);
        }
        self.invocations.insert(session, inv);
    }

    /// Publishes the next frame of a streaming invoke: on `reply` (the `started` frame) or
    /// on the stream subject, numbered in `header.meta["amp.seq"]`.
    fn stream_frame(
        &mut self,
        conn: &mut Connection,
        inv: &mut Invocation,
        reply: Option<&str>,
        fields: Value,
        now: Instant,
    ) {
        let ts = self.timestamp(now);
        let Some(stream) = inv.stream.as_mut() else {
            return;
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
        if let Err(e) = conn.publish(subject, None, Some(&headers), frame.to_string().as_bytes()) {
            log::warn!(subject:% = subject; "MIG stream frame not sent: {e}");
        }
    }

    /// Answers an invocation and forgets it.
    fn finish(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        result: Result<Value, MigError>,
        now: Instant,
    ) {
        let Some(inv) = self.invocations.remove(&session) else {
            return;
        };
        if let Some(sid) = inv.watch {
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
            let frame = match &result {
                Ok(v) => json!({"kind": "response", "end_stream": true, "payload": v["payload"]}),
                Err(e) => json!({"kind": "error", "end_stream": true, "error": e.to_value()}),
            };
            self.stream_frame(conn, &mut inv, None, frame, now);
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

    // ---- cancel ----------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn cancel(
        &mut self,
        conn: &mut Connection,
        ctx: &mut Ctx<'_>,
        ns: &str,
        name: &str,
        target: &str,
        reply: &str,
        header: &envelope::Header,
        body: &Map<String, Value>,
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
        let foreign = !local.is_empty() || self.finished.get(&key).is_some_and(|c| c != name);
        let request = CancelRequest {
            reply: reply.to_string(),
            echo: echo.clone(),
            target: target.to_string(),
            received: now,
            invocation: mine,
        };
        match mine {
            Some(s) => {
                if let Some(inv) = self.invocations.get_mut(&s) {
                    inv.cancel_reason = Some(reason);
                }
                self.cancel_task(conn, ctx, s, request, now);
            }
            None if foreign => {
                let e = MigError::new(
                    Code::Forbidden,
                    "only the caller of an invocation may cancel it",
                );
                self.respond(conn, &answer, Err(e), now);
            }
            None if self.finished.get(&key).is_some() => {
                let ack = cancel_ack(target, false, "already_finished");
                self.respond(conn, &answer, Ok(ack), now);
            }
            None => {
                // Another broker's invocation, or none: ask the task store.
                let task = invoke::task_id(ns, name, None, target);
                let s = self.new_session();
                self.cancels.insert(s, request);
                jobs_frame(conn, ctx, s, ns, name, cancel_frame(&task), now);
            }
        }
    }

    /// Cancels the task of local invocation `session` on behalf of `request`.
    fn cancel_task(
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
            Stage::Looking | Stage::Counting => {
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

    fn cancel_answered(
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
            Some("not_found") => Ok(cancel_ack(&c.target, false, "not_found")),
            Some(_) => Err(MigError::from_amp_error(
                error.as_ref().unwrap_or(&Value::Null),
            )),
        };
        let answer = Answer {
            reply: &c.reply,
            echo: &c.echo,
            op: "cancel",
            capability: "",
            received: c.received,
        };
        self.respond(conn, &answer, result, now);
    }
}

fn cancel_ack(target: &str, accepted: bool, status: &str) -> Value {
    json!({"target_message_id": target, "accepted": accepted, "status": status})
}

fn cancel_frame(task: &str) -> ClientFrame {
    ClientFrame::Cancel(TaskRef {
        id: "cancel".to_string(),
        task: task.to_string(),
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

fn strings(body: &Map<String, Value>, name: &str) -> Result<Option<Vec<String>>, MigError> {
    match body.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.len() <= 64 => items
            .iter()
            .map(|v| v.as_str().map(|s| s.trim().to_string()))
            .collect::<Option<Vec<String>>>()
            .map(Some)
            .ok_or_else(|| MigError::new(Code::InvalidRequest, format!("{name} must be strings"))),
        Some(_) => Err(MigError::new(
            Code::InvalidRequest,
            format!("{name} must be an array of at most 64 strings"),
        )),
    }
}

fn hello(body: &Map<String, Value>, server_id: &str) -> Result<Value, MigError> {
    let versions = strings(body, "supported_versions")?.unwrap_or_default();
    let bindings = strings(body, "requested_bindings")?.unwrap_or_default();
    let requested = strings(body, "requested_features")?;
    // The highest version both sides speak; an empty list means this one.
    let selected = if versions.is_empty() {
        VERSIONS.first().copied()
    } else {
        VERSIONS
            .iter()
            .copied()
            .find(|v| versions.iter().any(|c| c == v))
    };
    let Some(selected) = selected else {
        return Err(MigError::new(
            Code::VersionMismatch,
            format!(
                "no common version: this broker speaks {}",
                VERSIONS.join(", ")
            ),
        ));
    };
    if !bindings.is_empty() && !bindings.iter().any(|b| b == "nats") {
        return Err(MigError::new(
            Code::InvalidRequest,
            "this is the NATS binding; requested_bindings does not include nats",
        ));
    }
    let enabled: Vec<&str> = FEATURES
        .iter()
        .copied()
        .filter(|f| {
            requested
                .as_ref()
                .is_none_or(|r| r.is_empty() || r.iter().any(|x| x == f))
        })
        .collect();
    Ok(json!({
        "selected_version": selected,
        "selected_binding": "nats",
        "enabled_features": enabled,
        "server_id": server_id,
    }))
}

fn discover(
    config: &Config,
    ns: &str,
    participant: &Participant,
    body: &Map<String, Value>,
    max_payload: usize,
) -> Value {
    let query = body.get("query").and_then(Value::as_str).unwrap_or("");
    let schemas = body
        .get("include_schema_refs")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let qos = body
        .get("include_qos")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut caps: Vec<Value> = config
        .namespaces
        .get(ns)
        .into_iter()
        .flat_map(|n| n.jobs.iter())
        .filter(|(job, _)| permissions::allows(&participant.permissions, Action::Submit, job))
        .filter_map(|(_, j)| j.mig.as_ref())
        .filter(|c| c.id.contains(query))
        .map(|c| {
            let mut d = json!({
                "id": c.id,
                "version": c.version,
                "modes": c.modes,
                "auth_scopes": c.auth_scopes,
                "event_topics": c.event_topics,
            });
            if schemas {
                d["input_schema_uri"] = json!(c.input_schema_uri);
                d["output_schema_uri"] = json!(c.output_schema_uri);
            }
            if qos {
                d["qos"] = json!({
                    "max_payload_bytes": max_payload,
                    "supports_replay": true,
                    "delivery_semantics": "at_least_once",
                    "supports_ordering": true,
                });
            }
            d
        })
        .collect();
    caps.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    json!({"capabilities": caps})
}

fn heartbeat(ctx: &Ctx<'_>, ns: &str, body: &Map<String, Value>) -> Result<Value, MigError> {
    let interval = match body.get("interval_ms") {
        None | Some(Value::Null) => HEARTBEAT_DEFAULT_MS,
        Some(v) => v.as_u64().filter(|&ms| ms >= 1).ok_or_else(|| {
            MigError::new(
                Code::InvalidRequest,
                "interval_ms must be a positive integer",
            )
        })?,
    };
    let capabilities: Vec<&str> = ctx
        .config
        .namespaces
        .get(ns)
        .into_iter()
        .flat_map(|n| n.jobs.iter())
        .filter(|(_, j)| j.mig.is_some())
        .map(|(job, _)| job.as_str())
        .collect();
    let (mut leases, mut slots) = (0u64, 0u64);
    for (_, entry) in ctx.registry.into_iter().flat_map(Registry::entries) {
        for job in &capabilities {
            slots += entry["serve"][job].as_u64().unwrap_or(0);
            leases += entry["load"][job].as_u64().unwrap_or(0);
        }
    }
    let load = if slots == 0 {
        0.0
    } else {
        leases as f64 / slots as f64
    };
    Ok(json!({
        "suggested_interval_ms": interval.clamp(HEARTBEAT_MIN_MS, HEARTBEAT_MAX_MS),
        "load_factor": load,
    }))
}
