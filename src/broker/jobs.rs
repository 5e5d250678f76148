//! The jobs engine (spec 2.4): submit, offers, claims, leases, attempts and the task
//! store, as a sans-IO component the broker core owns and delegates to.
//!
//! JetStream holds each task's message on the job's work-queue stream and redelivers it
//! when the consumer's AckWait (the lease) runs out; the task store holds the truth about
//! who may work on it. Every ack, in-progress ack, NAK or TERM this component sends follows
//! a successful compare-and-set on the task record proving that this broker's session owns
//! the offer or the lease, because JetStream itself accepts acks from anyone holding an old
//! ack subject.

mod letters;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::binding;
use super::bounded_map::BoundedMap;
use super::clock::Clock;
use super::config::{Config, Job, Participant};
use super::dead_letters::Letter;
use super::domains::{JsApis, TaskKv};
use super::envelope::{self, Envelope, Kind};
use super::ids::IdSource;
use super::permissions::{self, Action};
use super::task_store::{Actor, Change, Eligible, OnDelivery, Refusal, TaskRecord, TaskState};
use super::worker_choice::{self, Candidate};
use crate::amp::frame::{self as amp_frame, ClientFrame, ServeSlots};
use crate::amp::reply::{self, FrameWriter};
use crate::amp::{AmpError, ErrorCode};
use crate::deadline::{after, secs_as_millis};
use crate::jetstream::ack::{AckKind, AckMetadata};
use crate::jetstream::api::check_error;
use crate::jetstream::error::JsError;
use crate::jetstream::message::Delivery;
use crate::jetstream::publish::parse_pub_ack;
use crate::jetstream::pull::{Inbound, PullRequest, classify};
use crate::nats::{self, Connection, Message, RequestError, RequestId, Sid};
use crate::proto::headers::HeaderMap;
use crate::rfc3339;
use crate::ws::metrics::NatsOp;

pub type SessionId = u64;

/// How long a JetStream request may take before the client hears `unavailable`: under
/// the 5 s within which a fleet request caught by a dying leaf link must be answered,
/// with a second to spare for the answer's way back on a loaded node.
/// Task messages whose sequence is remembered for a cancel (about 200 bytes each).
const PUBLISHED_SEQS: usize = 2048;
const JS_TIMEOUT: Duration = Duration::from_secs(4);
/// A pull request's lifetime; the server ends it with a 408 and a new one follows.
const PULL_EXPIRES: Duration = Duration::from_secs(30);
/// After this much silence past its expiry a pull is taken as gone.
const PULL_GRACE: Duration = Duration::from_secs(5);
/// A task no local session may take goes back with this delay, so that brokers with an
/// eligible session get it first.
const NO_TAKER_DELAY: Duration = Duration::from_millis(500);
/// A session that declined a task (or let its offer lapse) is not offered it again for
/// this long, so the task goes to someone else when anyone else can take it.
const DECLINE_MEMORY: Duration = Duration::from_secs(3);
/// Declines remembered at most; past it the oldest are forgotten early.
const MAX_DECLINES: usize = 65_536;
/// A task whose record cannot be read is retried after this.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Compare-and-set attempts on one change before giving up with `unavailable`.
const MAX_CAS_TRIES: u8 = 8;
/// Before a consumer that could not be created is tried again.
const CONSUMER_RETRY: Duration = Duration::from_secs(2);
/// Deliveries of a task message without a record before it is terminated.
const MAX_ORPHAN_DELIVERIES: u64 = 5;
/// Distinct jobs one session may serve: each is a registry entry and pull bookkeeping.
pub const MAX_JOBS_PER_SESSION: usize = 64;
/// Distinct job queues (a durable consumer and its pulls each) one broker opens.
pub const MAX_JOB_QUEUES: usize = 1024;
/// Offers out at once that other brokers can ask about (one NATS subscription each, see
/// `offer_subject`); an offer past it is written to the task store instead.
const MAX_OFFER_WATCHES: usize = 4096;
/// How long a `status` waits for the broker holding an offer to say so.
const OFFER_ASK_TIMEOUT: Duration = Duration::from_secs(2);
/// Round-trip samples kept between two `drain_round_trips`; past it they are dropped.
const MAX_ROUND_TRIPS: usize = 4096;

/// Where the broker holding an unwritten offer of task `<ns>.<task>` answers `status`:
/// under the brokers' own reply prefix, which no participant's NATS credential reaches.
fn offer_subject(key: &str) -> String {
    format!("{}.OFFER.{key}", super::scoped_jwt::BROKER_INBOX_PREFIX)
}

/// What the component asks the core to do.
#[derive(Debug, Clone, PartialEq)]
pub enum JobsOutput {
    /// The answer (`ok` or `error`) to request `re` of `session`.
    Reply {
        session: SessionId,
        re: String,
        text: String,
    },
    /// A frame on the broker's initiative (`offer`, `revoked`).
    Frame { session: SessionId, text: String },
    /// The jobs `ns/name` serves changed: its registry entry should be rewritten.
    ServeChanged { ns: String, name: String },
}

/// The session a request comes from, as the core knows it.
#[derive(Debug, Clone, Copy)]
pub struct Caller<'a> {
    pub session: SessionId,
    pub ns: &'a str,
    pub name: &'a str,
    /// Its configuration entry: permissions.
    pub participant: &'a Participant,
    /// Its labels (configured and announced), for `eligible.labels`.
    pub labels: &'a BTreeMap<String, String>,
}

/// One job this broker serves: its consumer and the pulls it has outstanding.
struct JobQueue {
    ns: String,
    job: String,
    consumer: ConsumerState,
    sid: Option<Sid>,
    /// Pulls are answered on `<prefix>.<n>`: a status (408 at expiry) arrives on its own
    /// pull's subject with the count it did not deliver. Messages carry their stream
    /// subject, so only the total outstanding is known, which is all "one message per free
    /// slot" needs.
    deliver_prefix: String,
    /// Messages asked for and not yet delivered, over all outstanding pulls.
    requested: u32,
    /// Outstanding pulls by number, with their batch.
    pulls: HashMap<u64, u32>,
    next_pull: u64,
    /// Messages delivered whose record is being read (they hold no slot yet).
    unplaced: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConsumerState {
    Creating,
    Ready,
    Failed,
}

/// A session that serves jobs.
struct Worker {
    ns: String,
    name: String,
    labels: BTreeMap<String, String>,
    serving: BTreeMap<String, Serving>,
}

struct Serving {
    slots: u32,
    /// Offers out plus leases held.
    in_flight: u32,
    leases: u32,
    idle_since: Instant,
}

/// A task offered or leased through this broker.
struct LocalTask {
    ns: String,
    job: String,
    session: SessionId,
    participant: String,
    ack_subject: String,
    phase: Phase,
    record: TaskRecord,
    revision: u64,
    /// Set once claimed: the session's lease count includes it.
    leased: bool,
    /// Timers carry it; a timer for an older generation is stale.
    generation: u64,
    /// Heartbeats being written: the lease may be extending, so its expiry waits for them.
    extending: u32,
    /// When the offer lapses unclaimed (set when the offer goes out).
    offer_until: Option<Instant>,
    /// When the offer went out (ms): the claim or decline records it in the history.
    offered_at_ms: i64,
    /// When the armed `Progress` timer fires, if one is.
    progress_at: Option<Instant>,
    /// The subscription answering `status` for this unwritten offer (`offer_subject`).
    watch: Option<Sid>,
    /// When JetStream (re)started the message's AckWait, as near as this broker knows: the
    /// delivery's arrival or the last in-progress ack. Unknown: the claim sends one at once.
    ack_basis: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The `offered` write is in flight (offers past `MAX_OFFER_WATCHES`).
    Offering,
    Offered,
    Claiming,
    Leased,
    /// A complete or fail is being written.
    Finishing,
}

/// A change being written to the task store, and what follows it.
#[derive(Debug, Clone)]
enum Op {
    Offer {
        session: SessionId,
        env: Box<Envelope>,
    },
    Exhaust,
    Claim {
        session: SessionId,
        re: String,
    },
    Heartbeat {
        session: SessionId,
        re: String,
        /// Kept in the record, where MIG streams it to the caller.
        progress: Option<Value>,
    },
    Complete {
        session: SessionId,
        re: String,
        result: Option<Value>,
    },
    Fail {
        session: SessionId,
        re: String,
        error: Value,
        retry: bool,
    },
    /// A decline (`re` set) or an offer not claimed in time, or the session went away.
    Requeue {
        session: SessionId,
        re: Option<String>,
    },
    Cancel {
        session: SessionId,
        re: String,
        by: String,
    },
}

impl Op {
    fn answer_to(&self) -> Option<(SessionId, &str)> {
        match self {
            Op::Claim { session, re }
            | Op::Heartbeat { session, re, .. }
            | Op::Complete { session, re, .. }
            | Op::Fail { session, re, .. }
            | Op::Cancel { session, re, .. } => Some((*session, re)),
            Op::Requeue {
                session,
                re: Some(re),
            } => Some((*session, re)),
            _ => None,
        }
    }
}

/// The message a change was about, when the change came from a delivery.
#[derive(Debug, Clone)]
struct Write {
    key: String,
    op: Op,
    /// The delivery's ack subject, for changes that start from a delivery.
    ack: Option<String>,
    tries: u8,
}

/// A JetStream round trip waiting for its reply.
enum Pending {
    ConsumerCreate {
        queue: String,
    },
    SubmitCreate(Box<Submission>),
    SubmitExisting(Box<Submission>),
    SubmitPublish {
        session: SessionId,
        re: String,
        ns: String,
        task: String,
        dup: bool,
    },
    /// The removal of a cancelled task's message from the job's queue.
    MessageDelete {
        key: String,
    },
    /// The record of a delivered task.
    DeliveryRead {
        queue: String,
        key: String,
        ack: String,
        delivered: u64,
        env: Box<Envelope>,
        ack_basis: Option<Instant>,
        /// The offer watch, made before the read (see `delivery`).
        watch: Option<Sid>,
    },
    /// A read before a change (cancel, or after a compare-and-set conflict).
    Read(Write),
    /// The compare-and-set of a change.
    Cas {
        write: Write,
        next: Box<TaskRecord>,
    },
    Status {
        session: SessionId,
        re: String,
        key: String,
        /// `ns/name` of the asker: only the submitter and the lease holder are answered.
        asker: String,
    },
    /// A queued task's status waits for the broker holding an unwritten offer, if any.
    StatusOffer {
        session: SessionId,
        re: String,
        record: Box<TaskRecord>,
    },
    /// A `task_result` on its way to the submitter's inbox; then the message's ack.
    Result(Finish),
    /// A failed task's message, read for its dead letter.
    LetterRead(Box<Outcome>),
    /// Its dead letter being stored.
    LetterStore {
        outcome: Box<Outcome>,
        letter: Box<Letter>,
    },
    /// A `dead_letters` page, read one letter after another.
    LetterPage(Box<letters::LetterPage>),
    /// A `redrive`'s letter.
    Redrive(Box<letters::RedriveRead>),
}

impl Pending {
    /// The kind of JetStream request, for the round-trip histogram; `None` for requests
    /// to other brokers.
    fn op(&self) -> Option<NatsOp> {
        Some(match self {
            Pending::ConsumerCreate { .. } => NatsOp::ConsumerCreate,
            Pending::SubmitCreate(_) | Pending::Cas { .. } => NatsOp::KvPut,
            Pending::SubmitExisting(_)
            | Pending::DeliveryRead { .. }
            | Pending::Read(_)
            | Pending::Status { .. } => NatsOp::KvGet,
            Pending::SubmitPublish { .. } | Pending::Result(_) | Pending::LetterStore { .. } => {
                NatsOp::StreamPublish
            }
            Pending::LetterRead(_) | Pending::LetterPage(_) | Pending::Redrive(_) => {
                NatsOp::StreamMsgGet
            }
            Pending::MessageDelete { .. } => NatsOp::StreamMsgDelete,
            Pending::StatusOffer { .. } => return None,
        })
    }
}

/// A stored outcome to announce: who reached it, the task message's ack and the
/// requester's answer.
struct Outcome {
    record: TaskRecord,
    by: String,
    ack: Option<(String, AckKind)>,
    reply: Option<(SessionId, String, String)>,
}

/// What follows a stored outcome: the message's ack and the requester's answer.
struct Finish {
    ack: Option<(String, AckKind)>,
    reply: Option<(SessionId, String, String)>,
    /// A redelivery of the task message publishes the result again (completed, failed).
    redelivery_resends: bool,
}

impl Finish {
    /// The result did not reach the submitter's inbox (e.g. while its stream elects a
    /// leader): leave the task message for redelivery, which sends the result again
    /// (deduplicated by its message id), instead of acknowledging it away.
    fn result_unsent(mut self) -> Finish {
        if self.redelivery_resends
            && let Some((_, kind)) = &mut self.ack
        {
            *kind = AckKind::Nak {
                delay: Some(RETRY_DELAY),
            };
        }
        self
    }
}

struct Submission {
    session: SessionId,
    re: String,
    /// `ns/name` of the submitter: a task id is namespace-wide, a resubmit is only its own.
    from: String,
    ns: String,
    task: String,
    job: String,
    digest: String,
    subject: String,
    headers: HeaderMap,
    payload: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    OfferExpiry {
        key: String,
        generation: u64,
    },
    LeaseExpiry {
        key: String,
        generation: u64,
    },
    /// The lease outlives the message's AckWait: an in-progress ack is due.
    Progress {
        key: String,
        generation: u64,
    },
    PullExpiry {
        queue: String,
        pull: u64,
    },
    ConsumerRetry {
        queue: String,
    },
}

/// The jobs engine of one broker.
pub struct Jobs {
    broker_id: String,
    jobs: BTreeMap<String, BTreeMap<String, Job>>,
    kv: TaskKv,
    api: JsApis,
    clock: Clock,
    /// Ids of tasks submitted without one.
    ids: IdSource,
    workers: HashMap<SessionId, Worker>,
    queues: HashMap<String, JobQueue>,
    tasks: HashMap<String, LocalTask>,
    /// Recent declines: task key -> (session, when).
    declines: HashMap<String, Vec<(SessionId, Instant)>>,
    /// Requests in flight, with when each was sent.
    pending: HashMap<RequestId, (Pending, Instant)>,
    routes: HashMap<Sid, String>,
    /// Offer watches: subscription -> task key.
    watches: HashMap<Sid, String>,
    round_trips: Vec<(NatsOp, f64)>,
    /// The stream sequence of each task message this broker published (task key -> seq),
    /// so a task cancelled while it waits can be taken out of the queue: otherwise it
    /// counts against `max_queued` until a serving broker pulls it.
    published: BoundedMap<String, u64>,
    /// MIG over NATS is on: dead letters of capabilities are published there too.
    mig_enabled: bool,
    timers: BinaryHeap<Reverse<(Instant, Timer)>>,
    out: VecDeque<JobsOutput>,
    next_generation: u64,
    stats: JobsStats,
}

/// Counters for metrics and the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobsStats {
    pub submitted: u64,
    pub offers: u64,
    pub claims: u64,
    pub completed: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub cas_conflicts: u64,
    pub revoked: u64,
    /// JetStream requests and acks sent for jobs.
    pub js_ops: u64,
    /// Dead letters stored (a repeat of one is counted again).
    pub dead_letters: u64,
}

/// The namespace of a task: its submitter's (task ids are namespace-wide).
fn ns_of(record: &TaskRecord) -> &str {
    record.submitted_by.split_once('/').map_or("", |(ns, _)| ns)
}

fn task_key(ns: &str, task: &str) -> String {
    binding::task_key(ns, task)
}

fn queue_key(ns: &str, job: &str) -> String {
    format!("{ns}/{job}")
}

fn not_permitted(what: &str, job: &str) -> AmpError {
    AmpError::new(
        ErrorCode::Forbidden,
        format!("{what} `{job}` is not permitted"),
    )
    .with_path("/job")
}

fn unavailable(e: impl std::fmt::Display) -> AmpError {
    AmpError::new(
        ErrorCode::Unavailable,
        format!("JetStream is unavailable: {e}"),
    )
}

fn lease_lost(task: &str) -> AmpError {
    AmpError::new(
        ErrorCode::LeaseLost,
        format!("this session holds no offer or lease of task `{task}`"),
    )
}

fn send_error(e: &nats::Error) -> AmpError {
    match e {
        nats::Error::MaxPayloadExceeded { size, max } => AmpError::new(
            ErrorCode::TooLarge,
            format!("the stored message would be {size} bytes; the server allows {max}"),
        ),
        other => unavailable(other),
    }
}

impl Jobs {
    /// `clock` gives the wall time at each `now`; `ids` makes the ids of tasks submitted
    /// without one.
    pub fn new(
        broker_id: &str,
        config: &Config,
        clock: Clock,
        ids: IdSource,
    ) -> Result<Jobs, String> {
        let api = JsApis::new(config);
        let kv = TaskKv::new(config).map_err(|e| e.to_string())?;
        Ok(Jobs {
            broker_id: broker_id.to_string(),
            jobs: config
                .namespaces
                .iter()
                .map(|(ns, n)| (ns.clone(), n.jobs.clone()))
                .collect(),
            kv,
            api,
            clock,
            ids,
            workers: HashMap::new(),
            queues: HashMap::new(),
            tasks: HashMap::new(),
            declines: HashMap::new(),
            pending: HashMap::new(),
            routes: HashMap::new(),
            watches: HashMap::new(),
            round_trips: Vec::new(),
            published: BoundedMap::new(PUBLISHED_SEQS),
            mig_enabled: config.mig.enabled,
            timers: BinaryHeap::new(),
            out: VecDeque::new(),
            next_generation: 0,
            stats: JobsStats::default(),
        })
    }

    pub fn stats(&self) -> JobsStats {
        self.stats
    }

    /// Appends the jobs counters in Prometheus text format.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write;
        let s = &self.stats;
        for (name, help, v) in [
            ("submitted", "Tasks created in the task store", s.submitted),
            ("offers", "Offers sent to sessions", s.offers),
            ("claims", "Claims that took a lease", s.claims),
            ("completed", "Tasks completed", s.completed),
            (
                "failed",
                "Tasks failed (by the worker or out of attempts)",
                s.failed,
            ),
            (
                "cancelled",
                "Tasks cancelled by their submitter",
                s.cancelled,
            ),
            (
                "cas_conflicts",
                "Task store compare-and-set conflicts",
                s.cas_conflicts,
            ),
            ("revoked", "Leases revoked from sessions", s.revoked),
            (
                "dead_letters",
                "Dead letters stored for tasks failed with no attempts left",
                s.dead_letters,
            ),
            (
                "jetstream_ops",
                "JetStream requests, acks and pulls sent for jobs",
                s.js_ops,
            ),
        ] {
            let _ = writeln!(out, "# HELP amp_jobs_{name}_total {help}");
            let _ = writeln!(out, "# TYPE amp_jobs_{name}_total counter");
            let _ = writeln!(out, "amp_jobs_{name}_total {v}");
        }
    }

    /// Hands over the round trips of the JetStream requests answered since the last call,
    /// for `amp_nats_request_duration_seconds{op}`.
    pub fn drain_round_trips(&mut self, mut observe: impl FnMut(NatsOp, f64)) {
        for (op, seconds) in self.round_trips.drain(..) {
            observe(op, seconds);
        }
    }

    pub fn poll_output(&mut self) -> Option<JobsOutput> {
        self.out.pop_front()
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.timers.peek().map(|Reverse((at, _))| *at)
    }

    /// Whether `op` is one this component answers.
    pub fn handles(frame: &ClientFrame) -> bool {
        matches!(
            frame,
            ClientFrame::Serve { .. }
                | ClientFrame::Submit(_)
                | ClientFrame::Claim(_)
                | ClientFrame::Decline(_)
                | ClientFrame::Heartbeat(_)
                | ClientFrame::Complete(_)
                | ClientFrame::Fail(_)
                | ClientFrame::Status(_)
                | ClientFrame::Cancel(_)
                | ClientFrame::DeadLetters(_)
                | ClientFrame::Redrive { .. }
        )
    }

    /// The registry's `serve` and `load` of participant `ns/name` over its sessions here.
    pub fn registry_view(
        &self,
        ns: &str,
        name: &str,
    ) -> (BTreeMap<String, u32>, BTreeMap<String, u32>) {
        let mut serve = BTreeMap::new();
        let mut load = BTreeMap::new();
        for w in self
            .workers
            .values()
            .filter(|w| w.ns == ns && w.name == name)
        {
            for (job, s) in &w.serving {
                if s.slots > 0 {
                    *serve.entry(job.clone()).or_insert(0) += s.slots;
                }
                if s.leases > 0 || s.slots > 0 {
                    *load.entry(job.clone()).or_insert(0) += s.leases;
                }
            }
        }
        (serve, load)
    }

    /// Takes the job settings of a reloaded configuration; tasks already offered or
    /// leased keep the lease they were given.
    pub fn reload_settings(&mut self, config: &Config) {
        self.mig_enabled = config.mig.enabled;
        self.jobs = config
            .namespaces
            .iter()
            .map(|(ns, n)| (ns.clone(), n.jobs.clone()))
            .collect();
    }

    /// Whether the session serves at least one job.
    pub fn is_worker(&self, session: SessionId) -> bool {
        self.workers.contains_key(&session)
    }

    fn job_config(&self, ns: &str, job: &str) -> Job {
        self.jobs
            .get(ns)
            .and_then(|jobs| jobs.get(job))
            .cloned()
            .unwrap_or_default()
    }

    fn session_name(&self, session: SessionId) -> String {
        format!("{}/{session}", self.broker_id)
    }

    // ---- frames ------------------------------------------------------------------------

    /// Handles a jobs frame (those [`Jobs::handles`] says); any other frame is left
    /// alone and `false` returned.
    pub fn frame(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        frame: ClientFrame,
        now: Instant,
    ) -> bool {
        match frame {
            ClientFrame::Serve { id, job, slots } => {
                match self.serve(conn, caller, &job, slots, now) {
                    Ok(()) => self.reply(caller.session, &id, FrameWriter::ok(Some(&id))),
                    Err(e) => self.refuse(caller.session, &id, e),
                }
            }
            ClientFrame::Submit(submit) => self.submit(conn, caller, submit, now),
            ClientFrame::Claim(t) => self.claim(conn, caller, t.id, &t.task, now),
            ClientFrame::Decline(t) => self.decline(conn, caller, t.id, &t.task, now),
            ClientFrame::Heartbeat(h) => self.lease_op(
                conn,
                caller,
                &h.task,
                Op::Heartbeat {
                    session: caller.session,
                    re: h.id,
                    progress: h.progress,
                },
                now,
            ),
            ClientFrame::Complete(c) => self.lease_op(
                conn,
                caller,
                &c.task,
                Op::Complete {
                    session: caller.session,
                    re: c.id,
                    result: c.result,
                },
                now,
            ),
            ClientFrame::Fail(f) => {
                let error =
                    serde_json::to_value(FailErrorView::from(&f.error)).unwrap_or(Value::Null);
                self.lease_op(
                    conn,
                    caller,
                    &f.task,
                    Op::Fail {
                        session: caller.session,
                        re: f.id,
                        error,
                        retry: f.retry.unwrap_or(false),
                    },
                    now,
                )
            }
            ClientFrame::Status(t) => self.status(conn, caller, t.id, &t.task, now),
            ClientFrame::Cancel(t) => self.cancel(conn, caller, t.id, &t.task, now),
            ClientFrame::DeadLetters(d) => self.dead_letters(conn, caller, d, now),
            ClientFrame::Redrive { id, job, seq } => {
                self.redrive(conn, caller, (id, job, seq), now)
            }
            _ => return false,
        }
        true
    }

    /// The `serve` list of a `hello`: entries the participant may not serve are skipped.
    pub fn serve_from_hello(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        serve: &[ServeSlots],
        now: Instant,
    ) {
        for s in serve {
            if let Err(e) = self.serve(conn, caller, &s.job, s.slots, now) {
                log::warn!(
                    "hello serve refused session={} participant={}/{} job={}: {}",
                    caller.session,
                    caller.ns,
                    caller.name,
                    s.job,
                    e.message
                );
            }
        }
    }

    fn serve(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        job: &str,
        slots: u32,
        now: Instant,
    ) -> Result<(), AmpError> {
        if !permissions::allows(&caller.participant.permissions, Action::Serve, job) {
            return Err(AmpError::new(
                ErrorCode::Forbidden,
                format!("serving `{job}` is not permitted"),
            )
            .with_path("/job"));
        }
        let serves_it = self
            .workers
            .get(&caller.session)
            .map(|w| (w.serving.contains_key(job), w.serving.len()));
        if !serves_it.is_some_and(|(serves, _)| serves) {
            if slots == 0 {
                // Nothing to stop; recording it would let entries pile up unbounded.
                return Ok(());
            }
            let limit = if serves_it.is_some_and(|(_, n)| n >= MAX_JOBS_PER_SESSION) {
                Some(format!(
                    "a session serves at most {MAX_JOBS_PER_SESSION} jobs"
                ))
            } else if self.queues.len() >= MAX_JOB_QUEUES
                && !self.queues.contains_key(&queue_key(caller.ns, job))
            {
                Some(format!("this broker serves at most {MAX_JOB_QUEUES} jobs"))
            } else {
                None
            };
            if let Some(message) = limit {
                return Err(AmpError::new(ErrorCode::Forbidden, message).with_path("/job"));
            }
        }
        let worker = self
            .workers
            .entry(caller.session)
            .or_insert_with(|| Worker {
                ns: caller.ns.to_string(),
                name: caller.name.to_string(),
                labels: caller.labels.clone(),
                serving: BTreeMap::new(),
            });
        let entry = worker.serving.entry(job.to_string()).or_insert(Serving {
            slots: 0,
            in_flight: 0,
            leases: 0,
            idle_since: now,
        });
        if entry.slots == 0 && slots > 0 {
            entry.idle_since = now;
        }
        entry.slots = slots;
        self.out.push_back(JobsOutput::ServeChanged {
            ns: caller.ns.to_string(),
            name: caller.name.to_string(),
        });
        if slots > 0 {
            self.ensure_queue(conn, caller.ns, job, now);
            self.pull_more(conn, &queue_key(caller.ns, job), now);
        }
        Ok(())
    }

    fn submit(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        submit: amp_frame::Submit,
        now: Instant,
    ) {
        let session = caller.session;
        let job = submit.job.as_str();
        if !permissions::allows(&caller.participant.permissions, Action::Submit, job) {
            let e = AmpError::new(
                ErrorCode::Forbidden,
                format!("submitting to `{job}` is not permitted"),
            )
            .with_path("/job");
            return self.refuse(session, &submit.id, e);
        }
        self.submit_as(conn, session, caller.ns, caller.name, submit, now);
    }

    /// A submit by participant `ns/name`, whose permission to submit was checked.
    fn submit_as(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        ns: &str,
        name: &str,
        submit: amp_frame::Submit,
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
        // Only the submitter's own inbox is spared by it, so the header cannot hurt anyone.
        record.via_mig = submit.headers.contains_key("mig_capability");
        let body = submit.body.into_raw();
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
        ];
        if let Some(tp) = env.headers.get("traceparent") {
            stamped.push(("traceparent", tp.as_str()));
        }
        for (k, v) in stamped {
            if let Err(e) = headers.insert(k, v) {
                let e = AmpError::new(ErrorCode::Schema, format!("header not storable: {e}"))
                    .with_path("/headers");
                return self.refuse(session, &submit.id, e);
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
            return self.refuse(session, &submit.id, e);
        }
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
        };
        let key = task_key(ns, &task);
        let req = match self.kv.create_request(&key, &record_json, None) {
            Ok(r) => r,
            Err(e) => {
                let e = AmpError::new(ErrorCode::Schema, format!("task id not storable: {e}"))
                    .with_path("/task");
                return self.refuse(session, &submit.id, e);
            }
        };
        match self.request(conn, &req.subject, req.headers.as_ref(), &req.payload, now) {
            Ok(id) => {
                self.await_reply(id, now, Pending::SubmitCreate(Box::new(sub)));
            }
            Err(e) => self.refuse(session, &submit.id, send_error(&e)),
        }
    }

    fn publish_task(&mut self, conn: &mut Connection, sub: Submission, dup: bool, now: Instant) {
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
                    },
                );
            }
            Err(e) => self.refuse(sub.session, &sub.re, send_error(&e)),
        }
    }

    fn claim(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        let Some(key) = self.take_offer(caller, &re, task, Phase::Claiming) else {
            return;
        };
        let op = Op::Claim {
            session: caller.session,
            re,
        };
        self.write_local(conn, key, op, now);
    }

    fn decline(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        // No longer claimable; the slot stays taken until the record says queued.
        let Some(key) = self.take_offer(caller, &re, task, Phase::Finishing) else {
            return;
        };
        let op = Op::Requeue {
            session: caller.session,
            re: Some(re),
        };
        self.write_local(conn, key, op, now);
    }

    /// The task's key when its offer is out to the caller's session, moving it to `next`;
    /// otherwise answers `lease_lost`.
    fn take_offer(
        &mut self,
        caller: &Caller<'_>,
        re: &str,
        task: &str,
        next: Phase,
    ) -> Option<String> {
        let key = task_key(caller.ns, task);
        match self.tasks.get_mut(&key) {
            Some(t) if t.session == caller.session && t.phase == Phase::Offered => {
                t.phase = next;
                Some(key)
            }
            _ => {
                self.refuse(caller.session, re, lease_lost(task));
                None
            }
        }
    }

    /// `heartbeat`, `complete` and `fail`: changes only the lease holder may make.
    fn lease_op(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        task: &str,
        op: Op,
        now: Instant,
    ) {
        let key = task_key(caller.ns, task);
        let now_ms = self.clock.ms(now);
        let session = self.session_name(caller.session);
        let holds = self.tasks.get(&key).is_some_and(|t| {
            t.session == caller.session
                && t.phase == Phase::Leased
                && t.record.leased_to(&session, now_ms)
        });
        if !holds {
            if let Some((s, re)) = op.answer_to() {
                let re = re.to_string();
                self.refuse(s, &re, lease_lost(task));
            }
            return;
        }
        if let Some(t) = self.tasks.get_mut(&key) {
            match op {
                Op::Complete { .. } | Op::Fail { .. } => t.phase = Phase::Finishing,
                Op::Heartbeat { .. } => t.extending += 1,
                _ => {}
            }
        }
        self.write_local(conn, key, op, now);
    }

    fn status(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        let key = task_key(caller.ns, task);
        match self.kv.get_request(&key) {
            Ok(req) => match self.request(conn, &req.subject, None, &req.payload, now) {
                Ok(id) => {
                    self.await_reply(
                        id,
                        now,
                        Pending::Status {
                            session: caller.session,
                            re,
                            key,
                            asker: format!("{}/{}", caller.ns, caller.name),
                        },
                    );
                }
                Err(e) => self.refuse(caller.session, &re, send_error(&e)),
            },
            Err(_) => self.refuse(caller.session, &re, not_found(task)),
        }
    }

    fn cancel(
        &mut self,
        conn: &mut Connection,
        caller: &Caller<'_>,
        re: String,
        task: &str,
        now: Instant,
    ) {
        let key = task_key(caller.ns, task);
        let write = Write {
            key,
            op: Op::Cancel {
                session: caller.session,
                re,
                by: format!("{}/{}", caller.ns, caller.name),
            },
            ack: None,
            tries: 0,
        };
        self.read(conn, write, now);
    }

    /// The session is gone. Its offers go back to the queue at once; its leases stay until
    /// they run out (the worker may still finish through another session of a restarted
    /// process? no: leases are per session, so the task is re-offered after `lease_s`).
    pub fn session_closed(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(worker) = self.workers.remove(&session) else {
            return;
        };
        let keys: Vec<String> = self
            .tasks
            .iter()
            .filter(|(_, t)| t.session == session)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            let phase = self.tasks.get(&key).map(|t| t.phase);
            match phase {
                Some(Phase::Offered) => {
                    if let Some(t) = self.tasks.get_mut(&key) {
                        t.phase = Phase::Finishing;
                    }
                    let op = Op::Requeue { session, re: None };
                    self.write_local(conn, key, op, now);
                }
                Some(Phase::Leased) => {
                    // JetStream redelivers when the lease runs out.
                    self.tasks.remove(&key);
                }
                _ => {}
            }
        }
        self.out.push_back(JobsOutput::ServeChanged {
            ns: worker.ns,
            name: worker.name,
        });
    }

    // ---- the job queues ----------------------------------------------------------------

    fn ensure_queue(&mut self, conn: &mut Connection, ns: &str, job: &str, now: Instant) {
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

    fn create_consumer(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
        let Some(q) = self.queues.get(qk) else { return };
        let lease_s = self.job_config(&q.ns, &q.job).lease_s;
        let stream = binding::tasks_stream(&q.ns);
        let config = binding::job_consumer_config(&q.ns, &q.job, lease_s);
        let subject = self.api.of(&q.ns).subject(&format!(
            "CONSUMER.CREATE.{stream}.{}.{}",
            binding::job_consumer(&q.job),
            binding::job_subject(&q.ns, &q.job)
        ));
        let body = json!({"stream_name": stream, "config": config}).to_string();
        match self.request(conn, &subject, None, body.as_bytes(), now) {
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

    fn consumer_failed(&mut self, qk: &str, now: Instant) {
        if let Some(q) = self.queues.get_mut(qk) {
            q.consumer = ConsumerState::Failed;
        }
        self.timers.push(Reverse((
            now + CONSUMER_RETRY,
            Timer::ConsumerRetry {
                queue: qk.to_string(),
            },
        )));
    }

    fn consumer_ready(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
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
    fn slots(&self, ns: &str, job: &str) -> (u32, u32) {
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
    fn pull_more(&mut self, conn: &mut Connection, qk: &str, now: Instant) {
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
        self.timers.push(Reverse((
            now + PULL_EXPIRES + PULL_GRACE,
            Timer::PullExpiry {
                queue: qk.to_string(),
                pull: n,
            },
        )));
    }

    /// The NATS connection came back: pulls in flight died with the old one.
    pub fn on_reconnected(&mut self, conn: &mut Connection, now: Instant) {
        let keys: Vec<String> = self.queues.keys().cloned().collect();
        for qk in keys {
            if let Some(q) = self.queues.get_mut(&qk) {
                q.pulls.clear();
                q.requested = 0;
            }
            self.pull_more(conn, &qk, now);
        }
    }

    /// A message on a subscription; false when the subscription is not one of ours.
    pub fn on_message(
        &mut self,
        conn: &mut Connection,
        sid: Sid,
        msg: &Message,
        now: Instant,
    ) -> bool {
        if let Some(key) = self.watches.get(&sid).cloned() {
            self.answer_offer_watch(conn, &key, msg);
            return true;
        }
        let Some(qk) = self.routes.get(&sid).cloned() else {
            return false;
        };
        let pull_no = msg
            .subject
            .rsplit('.')
            .next()
            .and_then(|n| n.parse::<u64>().ok());
        let delivery = Delivery {
            subject: &msg.subject,
            reply: msg.reply.as_deref(),
            headers: msg.headers.as_ref(),
            payload: &msg.payload,
        };
        let inbound = classify(&delivery);
        if inbound != Inbound::Message {
            if inbound.ends_pull() {
                let undelivered = match &inbound {
                    Inbound::RequestTimeout {
                        pending_messages, ..
                    } => *pending_messages,
                    _ => msg
                        .header("Nats-Pending-Messages")
                        .and_then(|v| v.trim().parse::<u64>().ok()),
                };
                if let (Some(q), Some(n)) = (self.queues.get_mut(&qk), pull_no)
                    && let Some(batch) = q.pulls.remove(&n)
                {
                    let undelivered = undelivered
                        .map_or(batch, |p| u32::try_from(p).unwrap_or(u32::MAX).min(batch));
                    q.requested = q.requested.saturating_sub(undelivered);
                }
                if let Inbound::Status { code: 503, .. } = &inbound {
                    // Nobody serves the consumer: JetStream is not ready, or the consumer
                    // is gone. Pulling again at once would spin; create it again shortly.
                    log::warn!(queue:% = qk; "pull had no responders; consumer again soon"
                    );
                    self.consumer_failed(&qk, now);
                    return true;
                }
                if let Inbound::Conflict { description } | Inbound::Status { description, .. } =
                    &inbound
                {
                    log::warn!(queue:% = qk; "pull ended: {description}");
                    if description.contains("Consumer Deleted") {
                        self.create_consumer(conn, &qk, now);
                        return true;
                    }
                }
                self.pull_more(conn, &qk, now);
            }
            return true;
        }
        if let Some(q) = self.queues.get_mut(&qk) {
            q.requested = q.requested.saturating_sub(1);
        }
        self.delivery(conn, &qk, msg, now);
        true
    }

    /// Another broker asks (for a `status`) whether the offer of `key` is out here.
    fn answer_offer_watch(&mut self, conn: &mut Connection, key: &str, msg: &Message) {
        let Some(reply) = msg.reply.as_deref() else {
            return;
        };
        let answer = match self.unwritten_offer(key) {
            Some((by, at_ms)) => json!({"by": by, "at_ms": at_ms}),
            None => json!({}),
        };
        if let Err(e) = conn.publish(reply, None, None, answer.to_string().as_bytes()) {
            log::warn!(task:% = key; "offer watch answer not sent: {e}");
        }
    }

    fn delivery(&mut self, conn: &mut Connection, qk: &str, msg: &Message, now: Instant) {
        // JetStream started the message's AckWait when it sent it, a moment before `now`;
        // `keep_message`'s margin covers the moment.
        let ack_basis = Some(now);
        let Some(ack) = msg.reply.clone() else {
            return;
        };
        let delivered = AckMetadata::parse(&ack).map(|m| m.delivered).unwrap_or(1);
        let Some(ns) = self.queues.get(qk).map(|q| q.ns.clone()) else {
            return;
        };
        let env = match Envelope::from_json(&msg.payload) {
            Ok(env) if env.kind == Kind::Task => env,
            _ => {
                log::warn!(
                    queue:% = qk, subject:% = msg.subject;
                    "terminating a malformed task message"
                );
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("malformed task envelope".into()),
                    },
                );
                return self.pull_more(conn, qk, now);
            }
        };
        let key = task_key(&ns, &env.id);
        if let Some(t) = self.tasks.get_mut(&key) {
            // A redelivery of a task this broker already handles (its in-progress acks were
            // lost): keep the newest ack subject and carry on.
            t.ack_subject = ack;
            t.ack_basis = ack_basis;
            return self.pull_more(conn, qk, now);
        }
        match self.kv.get_request(&key) {
            Ok(req) => match self.request(conn, &req.subject, None, &req.payload, now) {
                Ok(id) => {
                    if let Some(q) = self.queues.get_mut(qk) {
                        q.unplaced += 1;
                    }
                    // The offer watch is made before the record's answer comes back on this
                    // connection, so the server has it before the offer can reach anybody:
                    // a `status` asked through another broker after the offer finds it.
                    let watch = self.watch(conn, &key);
                    self.await_reply(
                        id,
                        now,
                        Pending::DeliveryRead {
                            queue: qk.to_string(),
                            key,
                            ack,
                            delivered,
                            env: Box::new(env),
                            ack_basis,
                            watch,
                        },
                    );
                }
                Err(e) => {
                    log::warn!(task:% = key; "task record read failed: {e}");
                    self.nak(conn, &ack, Some(RETRY_DELAY));
                }
            },
            Err(e) => {
                log::warn!(task:% = key; "task id not a key: {e}");
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("task id is not a valid key".into()),
                    },
                );
            }
        }
    }

    /// The record of a delivered task arrived: offer it, finish it, or release it.
    #[allow(clippy::too_many_arguments)]
    fn placed(
        &mut self,
        conn: &mut Connection,
        qk: &str,
        key: String,
        ack: String,
        delivered: u64,
        env: Box<Envelope>,
        read: Result<(TaskRecord, u64), JsError>,
        ack_basis: Option<Instant>,
        premade_watch: Option<Sid>,
        now: Instant,
    ) {
        if let Some(q) = self.queues.get_mut(qk) {
            q.unplaced = q.unplaced.saturating_sub(1);
        }
        let (record, revision) = match read {
            Ok(r) => r,
            Err(JsError::KeyNotFound) if delivered >= MAX_ORPHAN_DELIVERIES => {
                log::warn!(task:% = key; "terminating a task without a record");
                self.ack(
                    conn,
                    &ack,
                    AckKind::Term {
                        reason: Some("no task record".into()),
                    },
                );
                return self.pull_more(conn, qk, now);
            }
            Err(e) => {
                log::warn!(task:% = key; "task record unreadable: {e}");
                self.nak(conn, &ack, Some(RETRY_DELAY));
                return self.pull_more(conn, qk, now);
            }
        };
        let now_ms = self.clock.ms(now);
        match record.on_delivery(now_ms) {
            OnDelivery::Finished => {
                // A crash or a lost ack between the outcome and the ack: make sure the
                // submitter heard (the result's message id dedupes a repeat).
                if matches!(record.state, TaskState::Completed | TaskState::Failed) {
                    let by = record.holder.clone().unwrap_or_default();
                    self.outcome(conn, &record, &by, Some((ack, AckKind::Ack)), None, now);
                } else {
                    self.ack(conn, &ack, AckKind::Ack);
                }
            }
            OnDelivery::Held { until_ms } => {
                let wait = u64::try_from(until_ms - now_ms).unwrap_or(0) + 50;
                self.nak(conn, &ack, Some(Duration::from_millis(wait)));
            }
            OnDelivery::Exhaust => {
                let write = Write {
                    key,
                    op: Op::Exhaust,
                    ack: Some(ack),
                    tries: 0,
                };
                self.cas(conn, write, &record, revision, now);
            }
            OnDelivery::Offer => {
                let Some(session) = self.choose(qk, &key, record.eligible.as_ref(), now) else {
                    self.nak(conn, &ack, Some(NO_TAKER_DELAY));
                    return self.pull_more(conn, qk, now);
                };
                let Some((ns, job)) = self.queues.get(qk).map(|q| (q.ns.clone(), q.job.clone()))
                else {
                    return;
                };
                let participant = self
                    .workers
                    .get(&session)
                    .map(|w| format!("{}/{}", w.ns, w.name))
                    .unwrap_or_default();
                self.slot_taken(session, &job);
                self.next_generation += 1;
                // An offer made on a record that already names another offer would have to
                // replace it, so it is written; so is one past the watches this broker keeps.
                let watch = premade_watch.filter(|_| record.state != TaskState::Offered);
                self.tasks.insert(
                    key.clone(),
                    LocalTask {
                        ns,
                        job,
                        session,
                        participant,
                        ack_subject: ack.clone(),
                        phase: Phase::Offering,
                        record: record.clone(),
                        revision,
                        leased: false,
                        generation: self.next_generation,
                        extending: 0,
                        offer_until: None,
                        offered_at_ms: self.clock.ms(now),
                        watch,
                        ack_basis,
                        progress_at: None,
                    },
                );
                match watch {
                    Some(_) => self.send_offer(&key, session, &env, &record, now),
                    None => {
                        let write = Write {
                            key,
                            op: Op::Offer { session, env },
                            ack: Some(ack),
                            tries: 0,
                        };
                        self.cas(conn, write, &record, revision, now);
                    }
                }
            }
        }
        self.pull_more(conn, qk, now);
    }

    fn choose(
        &mut self,
        qk: &str,
        key: &str,
        eligible: Option<&Eligible>,
        now: Instant,
    ) -> Option<SessionId> {
        if let Some(list) = self.declines.get_mut(key) {
            list.retain(|(_, at)| now.saturating_duration_since(*at) < DECLINE_MEMORY);
            if list.is_empty() {
                self.declines.remove(key);
            }
        }
        let declined = self.declines.get(key);
        let q = self.queues.get(qk)?;
        let candidates = self.workers.iter().filter_map(|(id, w)| {
            if declined.is_some_and(|d| d.iter().any(|(s, _)| s == id)) {
                return None;
            }
            let s = w.serving.get(&q.job).filter(|_| w.ns == q.ns)?;
            Some(Candidate {
                session: *id,
                name: &w.name,
                labels: &w.labels,
                slots: s.slots,
                in_flight: s.in_flight,
                idle_since: s.idle_since,
            })
        });
        worker_choice::choose(candidates, eligible)
    }

    fn remember_decline(&mut self, key: &str, session: SessionId, now: Instant) {
        if self.declines.len() >= MAX_DECLINES {
            self.declines.retain(|_, list| {
                list.retain(|(_, at)| now.saturating_duration_since(*at) < DECLINE_MEMORY);
                !list.is_empty()
            });
            if self.declines.len() >= MAX_DECLINES {
                self.declines.clear();
            }
        }
        self.declines
            .entry(key.to_string())
            .or_default()
            .push((session, now));
    }

    fn slot_taken(&mut self, session: SessionId, job: &str) {
        if let Some(s) = self
            .workers
            .get_mut(&session)
            .and_then(|w| w.serving.get_mut(job))
        {
            s.in_flight += 1;
        }
    }

    /// The local task `key` ends here (finished, lost, released): its slot frees.
    fn release_local(&mut self, conn: &mut Connection, key: &str, now: Instant) {
        self.unwatch(conn, key);
        let Some(t) = self.tasks.remove(key) else {
            return;
        };
        let was_leased = t.leased;
        if let Some(s) = self
            .workers
            .get_mut(&t.session)
            .and_then(|w| w.serving.get_mut(&t.job))
        {
            s.in_flight = s.in_flight.saturating_sub(1);
            if was_leased {
                s.leases = s.leases.saturating_sub(1);
                s.idle_since = now;
            }
        }
        self.pull_more(conn, &queue_key(&t.ns, &t.job), now);
    }

    // ---- task store changes ------------------------------------------------------------

    fn write_local(&mut self, conn: &mut Connection, key: String, op: Op, now: Instant) {
        let Some((record, revision, ack)) = self
            .tasks
            .get(&key)
            .map(|t| (t.record.clone(), t.revision, t.ack_subject.clone()))
        else {
            return;
        };
        let write = Write {
            key,
            op,
            ack: Some(ack),
            tries: 0,
        };
        self.cas(conn, write, &record, revision, now);
    }

    fn read(&mut self, conn: &mut Connection, write: Write, now: Instant) {
        let req = match self.kv.get_request(&write.key) {
            Ok(r) => r,
            Err(_) => {
                let task = write.key.clone();
                return self.write_failed(conn, write, not_found(&task), now);
            }
        };
        match self.request(conn, &req.subject, None, &req.payload, now) {
            Ok(id) => {
                self.await_reply(id, now, Pending::Read(write));
            }
            Err(e) => self.write_failed(conn, write, send_error(&e), now),
        }
    }

    fn change_for<'a>(&self, op: &'a Op, actor: &'a (String, String), key: &str) -> Change<'a> {
        let lease_ms = secs_as_millis(
            self.tasks
                .get(key)
                .map_or(30, |t| self.job_config(&t.ns, &t.job).lease_s),
        );
        let offered_at_ms = self.tasks.get(key).map_or(0, |t| t.offered_at_ms);
        let by = Actor {
            participant: &actor.0,
            session: &actor.1,
        };
        match op {
            Op::Offer { .. } => Change::Offer { to: by },
            Op::Exhaust => Change::Exhaust { by: &actor.0 },
            Op::Claim { .. } => Change::Claim {
                by,
                lease_ms,
                offered_at_ms,
            },
            Op::Heartbeat { progress, .. } => Change::Heartbeat {
                by,
                lease_ms,
                progress: progress.as_ref(),
            },
            Op::Complete { result, .. } => Change::Complete {
                by,
                result: result.clone(),
            },
            Op::Fail { error, retry, .. } => Change::Fail {
                by,
                error: error.clone(),
                retry: *retry,
            },
            Op::Requeue { .. } => Change::Requeue { by, offered_at_ms },
            Op::Cancel { by, .. } => Change::Cancel { by },
        }
    }

    /// Who makes the change: `ns/name` and `<broker>/<session>`.
    fn actor_of(&self, op: &Op, key: &str) -> (String, String) {
        let session = match op {
            Op::Offer { session, .. }
            | Op::Claim { session, .. }
            | Op::Heartbeat { session, .. }
            | Op::Complete { session, .. }
            | Op::Fail { session, .. }
            | Op::Requeue { session, .. }
            | Op::Cancel { session, .. } => *session,
            Op::Exhaust => return (format!("broker/{}", self.broker_id), String::new()),
        };
        let participant = match op {
            Op::Cancel { by, .. } => by.clone(),
            _ => self
                .tasks
                .get(key)
                .map(|t| t.participant.clone())
                .unwrap_or_default(),
        };
        (participant, self.session_name(session))
    }

    /// Applies the change to `record` and writes it if it applies.
    fn cas(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: &TaskRecord,
        revision: u64,
        now: Instant,
    ) {
        let now_ms = self.clock.ms(now);
        let actor = self.actor_of(&write.op, &write.key);
        let next = {
            let change = self.change_for(&write.op, &actor, &write.key);
            record.apply(&change, now_ms)
        };
        let next = match next {
            Ok(next) => next,
            Err(refusal) => return self.refused(conn, write, record, revision, refusal, now),
        };
        let req = match self
            .kv
            .update_request(&write.key, &next.to_json(), revision)
        {
            Ok(r) => r,
            Err(e) => return self.write_failed(conn, write, unavailable(e), now),
        };
        match self.request(conn, &req.subject, req.headers.as_ref(), &req.payload, now) {
            Ok(id) => {
                self.await_reply(
                    id,
                    now,
                    Pending::Cas {
                        write,
                        next: Box::new(next),
                    },
                );
            }
            Err(e) => self.write_failed(conn, write, send_error(&e), now),
        }
    }

    /// The change cannot be made on the record as it is (at `revision`).
    fn refused(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: &TaskRecord,
        revision: u64,
        refusal: Refusal,
        now: Instant,
    ) {
        let task = record.id.clone();
        let key = write.key.clone();
        if let Op::Heartbeat { .. } = write.op {
            self.extension_ended(&key);
        }
        if self.landed_earlier(&write.op, &key, record, now) {
            // An earlier try of this very change was answered `unavailable` but reached
            // the task store after all (it waited in the reconnect buffer): the retry
            // finishes what that write started.
            return self.written(conn, write, record.clone(), revision, now);
        }
        match write.op {
            Op::Offer { .. } => {
                // Someone else moved the task on (another broker's offer or lease, or an
                // outcome): this delivery is not ours to offer.
                if let Some(ack) = &write.ack {
                    match refusal {
                        Refusal::LeaseHeld { until_ms } => {
                            let wait = u64::try_from(until_ms - self.clock.ms(now)).unwrap_or(0);
                            self.nak(conn, ack, Some(Duration::from_millis(wait + 50)));
                        }
                        Refusal::Finished(_) => self.ack(conn, ack, AckKind::Ack),
                        _ => self.nak(conn, ack, Some(RETRY_DELAY)),
                    }
                }
                self.release_local(conn, &key, now);
            }
            Op::Exhaust => {
                if let (Some(ack), Refusal::Finished(_)) = (&write.ack, &refusal) {
                    self.ack(conn, ack, AckKind::Ack);
                }
            }
            Op::Cancel { session, re, .. } => {
                let e = match refusal {
                    Refusal::NotSubmitter => AmpError::new(
                        ErrorCode::Forbidden,
                        format!("only the submitter may cancel task `{task}`"),
                    ),
                    Refusal::Finished(state) => AmpError::new(
                        ErrorCode::Conflict,
                        format!("task `{task}` is already {}", state.as_str()),
                    ),
                    _ => unavailable("the task store did not settle"),
                };
                self.refuse(session, &re, e);
            }
            op => {
                if let Some((session, re)) = op.answer_to() {
                    let re = re.to_string();
                    self.refuse(session, &re, lease_lost(&task));
                }
                // The lease or offer is gone for good when the record shows someone else
                // or an outcome; a late heartbeat on a still-cached lease only fails.
                let mine = self.tasks.get(&key).is_some_and(|t| {
                    let s = self.session_name(t.session);
                    record.offered_to(&s) || record.leased_to(&s, self.clock.ms(now))
                });
                if !mine {
                    let holder = self.tasks.get(&key).map(|t| (t.session, t.phase));
                    if let Some((session, phase)) = holder {
                        if matches!(phase, Phase::Leased | Phase::Finishing | Phase::Claiming)
                            && record.state != TaskState::Offered
                        {
                            let reason = if record.state == TaskState::Cancelled {
                                "cancelled"
                            } else {
                                "lease_expired"
                            };
                            if phase != Phase::Claiming {
                                self.revoke(session, &task, reason);
                            }
                        }
                        if record.state == TaskState::Cancelled
                            && let Some(ack) = &write.ack
                        {
                            self.ack(
                                conn,
                                ack,
                                AckKind::Term {
                                    reason: Some("cancelled".into()),
                                },
                            );
                        }
                    }
                    self.release_local(conn, &key, now);
                } else if record.state == TaskState::Offered {
                    if let Some(t) = self.tasks.get_mut(&key) {
                        t.record = record.clone();
                        t.revision = revision;
                        t.phase = Phase::Offered;
                    }
                    self.arm_offer_expiry(&key, now);
                } else {
                    self.unwatch(conn, &key);
                    self.adopt_lease(&key, record, revision, now);
                }
            }
        }
    }

    /// Whether `op` is a claim or an outcome whose earlier try the record already shows
    /// as made by the same session.
    fn landed_earlier(&self, op: &Op, key: &str, record: &TaskRecord, now: Instant) -> bool {
        let Some(t) = self.tasks.get(key) else {
            return false;
        };
        let session = self.session_name(t.session);
        match op {
            Op::Claim { session: s, .. } => {
                *s == t.session
                    && t.phase == Phase::Claiming
                    && record.leased_to(&session, self.clock.ms(now))
            }
            Op::Complete { session: s, .. } => {
                *s == t.session
                    && record.state == TaskState::Completed
                    && record.finished_by(&session)
            }
            Op::Fail {
                session: s,
                retry: false,
                ..
            } => {
                *s == t.session && record.state == TaskState::Failed && record.finished_by(&session)
            }
            _ => false,
        }
    }

    /// The record shows this broker's session holding a lease the local state did not
    /// know of (a claim answered `unavailable` that landed later, then the offer lapsed or
    /// was declined): the session holds it until `lease_until`, with the slot, the lease
    /// count and the expiry timer that go with it.
    fn adopt_lease(&mut self, key: &str, record: &TaskRecord, revision: u64, now: Instant) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        t.record = record.clone();
        t.revision = revision;
        t.phase = Phase::Leased;
        if !t.leased {
            t.leased = true;
            let (session, job) = (t.session, t.job.clone());
            if let Some(s) = self
                .workers
                .get_mut(&session)
                .and_then(|w| w.serving.get_mut(&job))
            {
                s.leases += 1;
            }
        }
        self.arm_lease_expiry(key, now);
    }

    /// A timer at the local task's `lease_until` (at once when it is past).
    fn arm_lease_expiry(&mut self, key: &str, now: Instant) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let until_ms = t.record.lease_until_ms.unwrap_or_default();
        let at = self.clock.instant(now, until_ms);
        let timer = Timer::LeaseExpiry {
            key: key.to_string(),
            generation: t.generation,
        };
        self.timers.push(Reverse((at, timer)));
    }

    /// A timer at the local task's offer deadline (at once when it is past).
    fn arm_offer_expiry(&mut self, key: &str, now: Instant) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let at = t.offer_until.map_or(now, |at| at.max(now));
        let timer = Timer::OfferExpiry {
            key: key.to_string(),
            generation: t.generation,
        };
        self.timers.push(Reverse((at, timer)));
    }

    /// A heartbeat's write ended, one way or the other.
    fn extension_ended(&mut self, key: &str) {
        if let Some(t) = self.tasks.get_mut(key) {
            t.extending = t.extending.saturating_sub(1);
        }
    }

    /// A request of the change failed (JetStream unreachable, or too many conflicts).
    fn write_failed(&mut self, conn: &mut Connection, write: Write, e: AmpError, now: Instant) {
        log::warn!(task:% = write.key; "task change failed: {e}");
        if let Some((session, re)) = write.op.answer_to() {
            let re = re.to_string();
            self.refuse(session, &re, e);
        }
        match write.op {
            Op::Offer { .. } => {
                if let Some(ack) = &write.ack {
                    self.nak(conn, ack, Some(RETRY_DELAY));
                }
                self.release_local(conn, &write.key, now);
            }
            Op::Requeue { .. } => {
                // The record still says offered; JetStream redelivers after the lease and
                // the next delivery re-offers it.
                self.release_local(conn, &write.key, now);
            }
            Op::Claim { .. } => {
                if let Some(t) = self.tasks.get_mut(&write.key) {
                    t.phase = Phase::Offered;
                }
                // The offer may have lapsed while the claim was out; the claim itself may
                // still land (then the lapse finds the lease and keeps it).
                self.arm_offer_expiry(&write.key, now);
            }
            Op::Complete { .. } | Op::Fail { .. } => {
                if let Some(t) = self.tasks.get_mut(&write.key) {
                    t.phase = Phase::Leased;
                }
                // The expiry may have come and gone while the write was out.
                self.arm_lease_expiry(&write.key, now);
            }
            Op::Heartbeat { .. } => {
                self.extension_ended(&write.key);
                self.arm_lease_expiry(&write.key, now);
            }
            _ => {}
        }
    }

    /// The change is stored as revision `revision`.
    fn written(
        &mut self,
        conn: &mut Connection,
        write: Write,
        record: TaskRecord,
        revision: u64,
        now: Instant,
    ) {
        let key = write.key.clone();
        if let Some(t) = self.tasks.get_mut(&key) {
            t.record = record.clone();
            t.revision = revision;
            if let Some(ack) = &write.ack
                && t.ack_subject.is_empty()
            {
                t.ack_subject = ack.clone();
            }
        }
        let ack = self
            .tasks
            .get(&key)
            .map(|t| t.ack_subject.clone())
            .or(write.ack.clone());
        match write.op {
            Op::Offer { session, env } => {
                if !self.workers.contains_key(&session) {
                    // The session went away while the offer was being written.
                    if let Some(t) = self.tasks.get_mut(&key) {
                        t.phase = Phase::Finishing;
                    }
                    return self.write_local(conn, key, Op::Requeue { session, re: None }, now);
                }
                if let Some(t) = self.tasks.get_mut(&key) {
                    t.offered_at_ms = self.clock.ms(now);
                }
                self.send_offer(&key, session, &env, &record, now);
            }
            Op::Claim { session, re } => {
                self.stats.claims += 1;
                let Some(t) = self.tasks.get_mut(&key) else {
                    return;
                };
                t.phase = Phase::Leased;
                t.leased = true;
                let generation = t.generation;
                let job = t.job.clone();
                if let Some(s) = self
                    .workers
                    .get_mut(&session)
                    .and_then(|w| w.serving.get_mut(&job))
                {
                    s.leases += 1;
                }
                self.unwatch(conn, &key);
                self.leased(conn, key, session, re, &record, generation, false, now);
            }
            Op::Heartbeat { session, re, .. } => {
                self.extension_ended(&key);
                let generation = self.tasks.get(&key).map_or(0, |t| t.generation);
                self.leased(conn, key, session, re, &record, generation, true, now);
            }
            Op::Complete { session, re, .. } => {
                self.stats.completed += 1;
                let by = self.participant_of(&key);
                self.release_local(conn, &key, now);
                let reply = Some((session, re.clone(), reply::ok(Some(&re))));
                let ack = ack.map(|a| (a, AckKind::Ack));
                self.publish_result(conn, &record, &by, ack, reply, now);
            }
            Op::Fail { session, re, .. } => {
                let by = self.participant_of(&key);
                self.release_local(conn, &key, now);
                let text = FrameWriter::ok(Some(&re))
                    .str("state", record.state.as_str())
                    .finish();
                if record.state == TaskState::Failed {
                    self.stats.failed += 1;
                    let ack = ack.map(|a| {
                        (
                            a,
                            AckKind::Term {
                                reason: Some("failed".into()),
                            },
                        )
                    });
                    self.outcome(conn, &record, &by, ack, Some((session, re, text)), now);
                } else {
                    if let Some(a) = &ack {
                        self.nak(conn, a, None);
                    }
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
            }
            Op::Requeue { session, re } => {
                self.remember_decline(&key, session, now);
                self.release_local(conn, &key, now);
                if let Some(a) = &ack {
                    self.nak(conn, a, None);
                }
                if let Some(re) = re {
                    let text = reply::ok(Some(&re));
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
            }
            Op::Exhaust => {
                self.stats.failed += 1;
                let by = format!("broker/{}", self.broker_id);
                let ack = ack.map(|a| {
                    (
                        a,
                        AckKind::Term {
                            reason: Some("attempts exhausted".into()),
                        },
                    )
                });
                self.outcome(conn, &record, &by, ack, None, now);
            }
            Op::Cancel { session, re, by } => {
                self.stats.cancelled += 1;
                let local = self
                    .tasks
                    .get(&key)
                    .map(|t| (t.session, t.phase, t.ack_subject.clone()));
                let mut term = None;
                if let Some((holder, phase, ack_subject)) = local {
                    if matches!(phase, Phase::Leased | Phase::Finishing) {
                        self.revoke(holder, &record.id, "cancelled");
                    }
                    term = Some((
                        ack_subject,
                        AckKind::Term {
                            reason: Some("cancelled".into()),
                        },
                    ));
                    self.release_local(conn, &key, now);
                }
                let published = self.published.remove(&key);
                if term.is_none()
                    && let Some(seq) = published
                {
                    self.delete_message(conn, &key, seq, now);
                }
                let text = reply::ok(Some(&re));
                self.publish_result(conn, &record, &by, term, Some((session, re, text)), now);
            }
        }
    }

    /// Takes the message of cancelled task `key` out of its job's queue. No broker held it
    /// (else its ack terminates it), so it would wait there, counted by `max_queued`, until
    /// a serving broker pulled it only to find it cancelled.
    fn delete_message(&mut self, conn: &mut Connection, key: &str, seq: u64, now: Instant) {
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

    /// The offer of local task `key` goes to `session`, lapsing after the job's `offer_ms`.
    fn send_offer(
        &mut self,
        key: &str,
        session: SessionId,
        env: &Envelope,
        record: &TaskRecord,
        now: Instant,
    ) {
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        t.phase = Phase::Offered;
        let (ns, job, generation) = (t.ns.clone(), t.job.clone(), t.generation);
        let cfg = self.job_config(&ns, &job);
        let offer_until = after(now, Duration::from_millis(cfg.offer_ms));
        if let Some(t) = self.tasks.get_mut(key) {
            t.offer_until = Some(offer_until);
        }
        self.stats.offers += 1;
        let text = FrameWriter::new(amp_frame::server_op::OFFER)
            .str("task", &record.id)
            .str("job", &job)
            .str("from", &env.from)
            .raw("body", env.body.get())
            .value("headers", &env.headers)
            .value("attempt", &(record.attempt + 1))
            .value("max_attempts", &record.max_attempts)
            .value("lease_s", &cfg.lease_s)
            .value("offer_ms", &cfg.offer_ms)
            .finish();
        self.out.push_back(JobsOutput::Frame { session, text });
        let key = key.to_string();
        self.timers.push(Reverse((
            offer_until,
            Timer::OfferExpiry { key, generation },
        )));
    }

    /// A subscription that will answer `status` for an offer of `key` made here; none
    /// past the watches this broker keeps (such an offer is written instead).
    fn watch(&mut self, conn: &mut Connection, key: &str) -> Option<Sid> {
        if self.watches.len() >= MAX_OFFER_WATCHES {
            return None;
        }
        match conn.subscribe(&offer_subject(key), None) {
            Ok(sid) => {
                self.watches.insert(sid, key.to_string());
                Some(sid)
            }
            Err(e) => {
                log::warn!(task:% = key; "offer watch not made: {e}");
                None
            }
        }
    }

    /// The subscription answering `status` for the offer of `key` ends.
    fn unwatch(&mut self, conn: &mut Connection, key: &str) {
        if let Some(sid) = self.tasks.get_mut(key).and_then(|t| t.watch.take()) {
            self.drop_watch(conn, sid);
        }
    }

    fn drop_watch(&mut self, conn: &mut Connection, sid: Sid) {
        self.watches.remove(&sid);
        if let Err(e) = conn.unsubscribe(sid, None) {
            log::warn!("offer watch not ended: {e}");
        }
    }

    /// Sends the in-progress ack that keeps the message of the lease `key` from being
    /// redelivered when it is due, or arms the timer for when it will be. JetStream
    /// restarts the AckWait (`lease_s`) at each in-progress ack; a lease that ends before
    /// the AckWait started at the delivery needs none, which is the common case of a task
    /// completed well within its lease.
    fn keep_message(&mut self, conn: &mut Connection, key: &str, force: bool, now: Instant) {
        let Some(t) = self.tasks.get(key) else {
            return;
        };
        let ack_wait = Duration::from_secs(self.job_config(&t.ns, &t.job).lease_s.max(1));
        // Sent this long before the AckWait runs out: for the delivery's way here (the basis
        // is its arrival, a little after JetStream started the AckWait), the loop's delays
        // and the in-progress ack's way back.
        let margin = (ack_wait / 10)
            .max(Duration::from_millis(100))
            .min(ack_wait / 2);
        let lease_end = self
            .clock
            .instant(now, t.record.lease_until_ms.unwrap_or_default());
        let due = t.ack_basis.map(|basis| after(basis, ack_wait - margin));
        if force || due.is_none_or(|due| due <= now) {
            let subject = t.ack_subject.clone();
            if !subject.is_empty() {
                self.ack(conn, &subject, AckKind::InProgress);
            }
            if let Some(t) = self.tasks.get_mut(key) {
                t.ack_basis = Some(now);
            }
        }
        let Some(t) = self.tasks.get_mut(key) else {
            return;
        };
        let at = after(t.ack_basis.unwrap_or(now), ack_wait - margin);
        if lease_end <= at {
            return;
        }
        let at = at.max(now);
        if t.progress_at.is_some_and(|armed| armed <= at) {
            // An earlier check is coming; it looks again.
            return;
        }
        t.progress_at = Some(at);
        let timer = Timer::Progress {
            key: key.to_string(),
            generation: t.generation,
        };
        self.timers.push(Reverse((at, timer)));
    }

    #[allow(clippy::too_many_arguments)]
    fn leased(
        &mut self,
        conn: &mut Connection,
        key: String,
        session: SessionId,
        re: String,
        record: &TaskRecord,
        generation: u64,
        heartbeat: bool,
        now: Instant,
    ) {
        let until_ms = record.lease_until_ms.unwrap_or_default();
        // A heartbeat restarts the AckWait at once; a claim only when it must.
        self.keep_message(conn, &key, heartbeat, now);
        let text = FrameWriter::ok(Some(&re))
            .str("lease_until", &rfc3339::format_millis(until_ms))
            .finish();
        self.out.push_back(JobsOutput::Reply { session, re, text });
        let at = self.clock.instant(now, until_ms);
        self.timers
            .push(Reverse((at, Timer::LeaseExpiry { key, generation })));
    }

    fn participant_of(&self, key: &str) -> String {
        self.tasks
            .get(key)
            .map(|t| t.participant.clone())
            .unwrap_or_default()
    }

    fn revoke(&mut self, session: SessionId, task: &str, reason: &str) {
        self.stats.revoked += 1;
        let text = FrameWriter::new(amp_frame::server_op::REVOKED)
            .str("task", task)
            .str("reason", reason)
            .finish();
        self.out.push_back(JobsOutput::Frame { session, text });
    }

    /// Sends the `task_result` to the submitter's inbox, then the message's ack, then the
    /// answer: the result is stored before the message can go, so a crash in between
    /// leaves a message whose redelivery publishes the result again.
    fn publish_result(
        &mut self,
        conn: &mut Connection,
        record: &TaskRecord,
        by: &str,
        ack: Option<(String, AckKind)>,
        reply: Option<(SessionId, String, String)>,
        now: Instant,
    ) {
        let finish = Finish {
            ack,
            reply,
            redelivery_resends: matches!(record.state, TaskState::Completed | TaskState::Failed),
        };
        let Some((ns, submitter)) = record
            .submitted_by
            .split_once('/')
            .filter(|_| !record.via_mig)
        else {
            return self.finish(conn, finish);
        };
        let key = task_key(ns, &record.id);
        let id = envelope::idempotent_id(Kind::TaskResult, "broker", &record.submitted_by, &key);
        let body = serde_json::value::to_raw_value(&record.result_body())
            .unwrap_or_else(|_| serde_json::value::RawValue::NULL.to_owned());
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
                self.finish(conn, finish.result_unsent());
            }
        }
    }

    /// The outcome is stored and its `task_result` too: the message goes and the requester
    /// hears. The ack is not confirmed: one that is lost leaves the message to be
    /// redelivered after the lease, and that delivery finds the outcome and acks it away.
    fn finish(&mut self, conn: &mut Connection, finish: Finish) {
        if let Some((subject, kind)) = finish.ack {
            self.ack(conn, &subject, kind);
        }
        if let Some((session, re, text)) = finish.reply {
            self.out.push_back(JobsOutput::Reply { session, re, text });
        }
    }

    // ---- replies and timers ------------------------------------------------------------

    /// The reply to a request; false when the request is not one of ours.
    pub fn on_reply(
        &mut self,
        conn: &mut Connection,
        id: RequestId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) -> bool {
        let Some((pending, sent)) = self.pending.remove(&id) else {
            return false;
        };
        if let Some(op) = pending.op()
            && self.round_trips.len() < MAX_ROUND_TRIPS
        {
            let seconds = now.saturating_duration_since(sent).as_secs_f64();
            self.round_trips.push((op, seconds));
        }
        match pending {
            Pending::ConsumerCreate { queue } => match reply.map(|m| check_error(&m.payload)) {
                Ok(Ok(())) => self.consumer_ready(conn, &queue, now),
                Ok(Err(e)) => {
                    log::warn!(queue:% = queue; "consumer refused: {e}");
                    self.consumer_failed(&queue, now);
                }
                Err(e) => {
                    log::warn!(queue:% = queue; "consumer request failed: {e}");
                    self.consumer_failed(&queue, now);
                }
            },
            Pending::SubmitCreate(sub) => {
                match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
                    Ok(Ok(_)) => {
                        self.stats.submitted += 1;
                        self.publish_task(conn, *sub, false, now);
                    }
                    Ok(Err(JsError::WrongLastSequence(_))) => {
                        let key = task_key(&sub.ns, &sub.task);
                        let req = self.kv.get_request(&key);
                        let sent = req.map_err(unavailable).and_then(|req| {
                            self.request(conn, &req.subject, None, &req.payload, now)
                                .map_err(|e| send_error(&e))
                        });
                        match sent {
                            Ok(id) => {
                                self.await_reply(id, now, Pending::SubmitExisting(sub));
                            }
                            Err(e) => self.refuse(sub.session, &sub.re, e),
                        }
                    }
                    Ok(Err(e)) => self.refuse(sub.session, &sub.re, unavailable(e)),
                    Err(e) => self.refuse(sub.session, &sub.re, unavailable(e)),
                }
            }
            Pending::SubmitExisting(sub) => match self.parse_record(&sub.ns, &sub.task, reply) {
                Ok((record, _)) => {
                    if record.submitted_by != sub.from {
                        // Someone else's task: the same answer whatever its job, body or
                        // state, so a probe learns only that the id is taken.
                        let e = AmpError::new(
                            ErrorCode::Conflict,
                            format!("task id `{}` is taken", sub.task),
                        )
                        .with_path("/task");
                        self.refuse(sub.session, &sub.re, e);
                    } else if !record.same_submission(&sub.job, &sub.digest) {
                        let e = AmpError::new(
                            ErrorCode::Conflict,
                            format!("task `{}` exists with a different job or body", sub.task),
                        )
                        .with_path("/task");
                        self.refuse(sub.session, &sub.re, e);
                    } else if record.state == TaskState::Queued && record.attempt == 0 {
                        // The message may never have been stored (an `unavailable` before):
                        // publish again; its message id makes a repeat a duplicate.
                        self.publish_task(conn, *sub, true, now);
                    } else {
                        let text = FrameWriter::ok(Some(&sub.re))
                            .str("task", &sub.task)
                            .value("dup", &true)
                            .finish();
                        self.out.push_back(JobsOutput::Reply {
                            session: sub.session,
                            re: sub.re,
                            text,
                        });
                    }
                }
                Err(e) => self.refuse(sub.session, &sub.re, unavailable(e)),
            },
            Pending::SubmitPublish {
                session,
                re,
                ns,
                task,
                dup,
            } => match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
                Ok(Ok(ack)) => {
                    *self
                        .published
                        .get_or_insert_with(task_key(&ns, &task), || ack.seq) = ack.seq;
                    let text = FrameWriter::ok(Some(&re))
                        .str("task", &task)
                        .value("dup", &(dup || ack.duplicate))
                        .finish();
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
                Ok(Err(e)) => self.refuse(session, &re, unavailable(e)),
                Err(e) => self.refuse(session, &re, unavailable(e)),
            },
            Pending::DeliveryRead {
                queue,
                key,
                ack,
                delivered,
                env,
                ack_basis,
                watch,
            } => {
                let (ns, task) = key.split_once('.').unwrap_or(("", &key));
                let read = self.parse_record(ns, task, reply);
                self.placed(
                    conn,
                    &queue,
                    key.clone(),
                    ack,
                    delivered,
                    env,
                    read,
                    ack_basis,
                    watch,
                    now,
                );
                // A watch that no offer took ends here.
                if let Some(sid) = watch
                    && self.tasks.get(&key).is_none_or(|t| t.watch != Some(sid))
                {
                    self.drop_watch(conn, sid);
                }
            }
            Pending::Read(write) => {
                let (ns, task) = write.key.split_once('.').unwrap_or(("", ""));
                match self.parse_record(ns, task, reply) {
                    Ok((record, revision)) => {
                        if let Some(t) = self.tasks.get_mut(&write.key) {
                            t.record = record.clone();
                            t.revision = revision;
                        }
                        self.cas(conn, write, &record, revision, now);
                    }
                    Err(JsError::KeyNotFound) => {
                        let task = task.to_string();
                        self.write_failed(conn, write, not_found(&task), now);
                    }
                    Err(e) => self.write_failed(conn, write, unavailable(e), now),
                }
            }
            Pending::Cas { mut write, next } => {
                match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
                    Ok(Ok(ack)) => self.written(conn, write, *next, ack.seq, now),
                    Ok(Err(JsError::WrongLastSequence(_))) => {
                        self.stats.cas_conflicts += 1;
                        write.tries += 1;
                        if write.tries >= MAX_CAS_TRIES {
                            let e = unavailable("the task record keeps changing");
                            self.write_failed(conn, write, e, now);
                        } else {
                            self.read(conn, write, now);
                        }
                    }
                    Ok(Err(e)) => self.write_failed(conn, write, unavailable(e), now),
                    Err(e) => self.write_failed(conn, write, unavailable(e), now),
                }
            }
            Pending::Status {
                session,
                re,
                key,
                asker,
            } => {
                let (ns, task) = key.split_once('.').unwrap_or(("", ""));
                match self.parse_record(ns, task, reply) {
                    Ok((record, _)) if !record.may_see_status(&asker) => {
                        let e = AmpError::new(
                            ErrorCode::Forbidden,
                            format!("the status of task `{task}` is not yours to see"),
                        )
                        .with_path("/task");
                        self.refuse(session, &re, e);
                    }
                    Ok((record, _)) if record.state == TaskState::Queued => {
                        self.status_of_queued(conn, session, re, &key, record, now);
                    }
                    Ok((record, _)) => self.answer_status(session, re, &record),
                    Err(JsError::KeyNotFound) => {
                        let task = task.to_string();
                        self.refuse(session, &re, not_found(&task));
                    }
                    Err(e) => self.refuse(session, &re, unavailable(e)),
                }
            }
            Pending::StatusOffer {
                session,
                re,
                record,
            } => {
                let offer = reply
                    .ok()
                    .and_then(|m| serde_json::from_slice::<OfferAnswer>(&m.payload).ok())
                    .and_then(|a| Some((a.by?, a.at_ms?)))
                    .filter(|(by, _)| by.len() <= 129 && by.contains('/'));
                match offer {
                    Some((by, at_ms)) => {
                        let view = record.with_unwritten_offer(&by, at_ms);
                        self.answer_status(session, re, &view);
                    }
                    None => self.answer_status(session, re, &record),
                }
            }
            Pending::LetterRead(outcome) => self.letter_read(conn, outcome, reply, now),
            Pending::LetterStore { outcome, letter } => {
                self.letter_stored(conn, outcome, &letter, reply, now)
            }
            Pending::LetterPage(page) => self.letter_page(conn, *page, reply, now),
            Pending::Redrive(r) => self.redrive_read(conn, *r, reply, now),
            Pending::MessageDelete { key } => {
                // A message already gone (pulled and acked meanwhile) is the same outcome.
                if let Err(e) = reply
                    .map_err(|e| e.to_string())
                    .and_then(|m| check_error(&m.payload).map_err(|e| e.to_string()))
                    && !e.contains("no message found")
                {
                    log::warn!(task:% = key; "cancelled task not dequeued: {e}");
                }
            }
            Pending::Result(finish) => {
                let finish = match &reply {
                    Ok(m) => match parse_pub_ack(m.status(), &m.payload) {
                        Ok(_) => finish,
                        // A refusal would only repeat: the result is given up.
                        Err(e) => {
                            log::warn!("task result refused: {e}");
                            finish
                        }
                    },
                    Err(e) => {
                        log::warn!("task result unanswered: {e}");
                        finish.result_unsent()
                    }
                };
                self.finish(conn, finish);
            }
        }
        true
    }

    /// The record says `queued`: an offer may be out without having been written, here or
    /// at another broker, which answers on the offer's subject (nobody does: none is out).
    fn status_of_queued(
        &mut self,
        conn: &mut Connection,
        session: SessionId,
        re: String,
        key: &str,
        record: TaskRecord,
        now: Instant,
    ) {
        if let Some((by, at_ms)) = self.unwritten_offer(key) {
            let view = record.with_unwritten_offer(&by, at_ms);
            return self.answer_status(session, re, &view);
        }
        match conn.request(&offer_subject(key), None, b"", OFFER_ASK_TIMEOUT, now) {
            Ok(id) => {
                let record = Box::new(record);
                self.await_reply(
                    id,
                    now,
                    Pending::StatusOffer {
                        session,
                        re,
                        record,
                    },
                );
            }
            Err(_) => self.answer_status(session, re, &record),
        }
    }

    /// The offer of `key` out from here without having been written: to whom, since when.
    fn unwritten_offer(&self, key: &str) -> Option<(String, i64)> {
        self.tasks
            .get(key)
            .filter(|t| t.watch.is_some() && matches!(t.phase, Phase::Offered | Phase::Claiming))
            .map(|t| (t.participant.clone(), t.offered_at_ms))
    }

    fn answer_status(&mut self, session: SessionId, re: String, record: &TaskRecord) {
        let text = FrameWriter::ok(Some(&re))
            .value("task", &record.status_view())
            .finish();
        self.out.push_back(JobsOutput::Reply { session, re, text });
    }

    fn parse_record(
        &self,
        ns: &str,
        task: &str,
        reply: Result<Message, RequestError>,
    ) -> Result<(TaskRecord, u64), JsError> {
        let m = reply.map_err(|e| JsError::Transport(e.to_string()))?;
        let key = task_key(ns, task);
        let entry = self.kv.parse_get(&key, m.headers.as_ref(), &m.payload)?;
        if entry.is_deleted() {
            return Err(JsError::KeyNotFound);
        }
        let record = TaskRecord::from_json(&entry.value)
            .map_err(|e| JsError::Malformed(format!("task record {key}: {e}")))?;
        Ok((record, entry.revision))
    }

    /// Timers due at `now`.
    pub fn handle_timeout(&mut self, conn: &mut Connection, now: Instant) {
        while let Some(Reverse((at, _))) = self.timers.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, timer))) = self.timers.pop() else {
                break;
            };
            match timer {
                Timer::OfferExpiry { key, generation } => {
                    let due = self.tasks.get(&key).and_then(|t| {
                        (t.generation == generation && t.phase == Phase::Offered)
                            .then_some(t.session)
                    });
                    if let Some(session) = due {
                        if let Some(t) = self.tasks.get_mut(&key) {
                            t.phase = Phase::Finishing;
                        }
                        let op = Op::Requeue { session, re: None };
                        self.write_local(conn, key, op, now);
                    }
                }
                Timer::LeaseExpiry { key, generation } => {
                    let now_ms = self.clock.ms(now);
                    let due = self.tasks.get(&key).and_then(|t| {
                        let expired = t.record.lease_until_ms.is_none_or(|u| u <= now_ms);
                        // A heartbeat accepted before `lease_until` and still being written
                        // decides: its outcome re-arms this timer or extends the lease.
                        let settled = t.extending == 0;
                        (t.generation == generation
                            && t.phase == Phase::Leased
                            && expired
                            && settled)
                            .then(|| (t.session, t.record.id.clone()))
                    });
                    if let Some((session, task)) = due {
                        self.revoke(session, &task, "lease_expired");
                        self.release_local(conn, &key, now);
                    }
                }
                Timer::Progress { key, generation } => {
                    let held = self.tasks.get_mut(&key).is_some_and(|t| {
                        let mine = t.generation == generation && t.progress_at == Some(at);
                        if mine {
                            t.progress_at = None;
                        }
                        mine && matches!(t.phase, Phase::Leased | Phase::Finishing)
                    });
                    if held {
                        self.keep_message(conn, &key, false, now);
                    }
                }
                Timer::PullExpiry { queue, pull } => {
                    // Every pull up to the newest has expired by now; if their 408s were
                    // lost (a reconnect), nothing is outstanding any more.
                    let stale = self.queues.get_mut(&queue).is_some_and(|q| {
                        // Past its expiry a pull is over whether or not a status said so
                        // (a fully answered pull gets none): its entry goes.
                        q.pulls.remove(&pull);
                        let newest = q.next_pull.checked_sub(1) == Some(pull);
                        if newest && q.requested > 0 {
                            q.requested = 0;
                            q.pulls.clear();
                        }
                        newest
                    });
                    if stale {
                        self.pull_more(conn, &queue, now);
                    }
                }
                Timer::ConsumerRetry { queue } => {
                    let failed = self
                        .queues
                        .get(&queue)
                        .is_some_and(|q| q.consumer == ConsumerState::Failed);
                    if failed {
                        self.create_consumer(conn, &queue, now);
                    }
                }
            }
        }
    }

    // ---- helpers -----------------------------------------------------------------------

    fn request(
        &mut self,
        conn: &mut Connection,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        now: Instant,
    ) -> Result<RequestId, nats::Error> {
        self.stats.js_ops += 1;
        conn.request(subject, headers, payload, JS_TIMEOUT, now)
    }

    fn await_reply(&mut self, id: RequestId, now: Instant, pending: Pending) {
        self.pending.insert(id, (pending, now));
    }

    fn ack(&mut self, conn: &mut Connection, subject: &str, kind: AckKind) {
        self.stats.js_ops += 1;
        if let Err(e) = conn.publish(subject, None, None, &kind.payload()) {
            log::warn!("ack not sent: {e}");
        }
    }

    fn nak(&mut self, conn: &mut Connection, subject: &str, delay: Option<Duration>) {
        self.ack(conn, subject, AckKind::Nak { delay });
    }

    fn reply(&mut self, session: SessionId, re: &str, w: FrameWriter) {
        self.out.push_back(JobsOutput::Reply {
            session,
            re: re.to_string(),
            text: w.finish(),
        });
    }

    fn refuse(&mut self, session: SessionId, re: &str, e: AmpError) {
        self.out.push_back(JobsOutput::Reply {
            session,
            re: re.to_string(),
            text: reply::error(Some(re), &e),
        });
    }
}

/// What the broker holding an unwritten offer says about it (`{}`: none is out).
#[derive(serde::Deserialize)]
struct OfferAnswer {
    by: Option<String>,
    at_ms: Option<i64>,
}

fn not_found(task: &str) -> AmpError {
    AmpError::new(ErrorCode::NotFound, format!("no task `{task}`")).with_path("/task")
}

#[derive(serde::Serialize)]
struct FailErrorView<'a> {
    code: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<&'a str>,
}

impl<'a> From<&'a amp_frame::FailError> for FailErrorView<'a> {
    fn from(e: &'a amp_frame::FailError) -> Self {
        FailErrorView {
            code: &e.code,
            message: e.message.as_deref(),
        }
    }
}
