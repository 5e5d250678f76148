//! The jobs engine (spec 2.4): submit, offers, claims, leases, attempts and the task
//! store, as a sans-IO component the broker core owns and delegates to.
//!
//! JetStream holds each task's message on the job's work-queue stream and redelivers it
//! when the consumer's AckWait (the lease) runs out; the task store holds the truth about
//! who may work on it. Every ack, in-progress ack, NAK or TERM this component sends follows
//! a successful compare-and-set on the task record proving that this broker's session owns
//! the offer or the lease, because JetStream itself accepts acks from anyone holding an old
//! ack subject.

mod lease;
mod letters;
mod offer;
mod outcome;
mod queue;
mod store;
mod submit;

use offer::RecordFrom;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::binding;
use super::bounded_map::BoundedMap;
use super::clock::Clock;
use super::config::{Config, Job, Participant, Permissions};
use super::continuations::{Continuation, Continuations, Staged};
use super::dead_letters::{Letter, PAGE_BYTES};
use super::domains::{JsApis, TaskKv};
use super::envelope::{self, Envelope, Kind};
use super::held_bytes::{self, HeldBytes, Hold};
use super::ids::IdSource;
use super::permissions::{self, Action};
use super::pull_loop::{Answer, PullLoop};
use super::task_store::{
    Actor, Change, Eligible, OnDelivery, Refusal, Refused, TaskRecord, TaskState,
};
use super::timers::{Later, Timers, Wake};
use super::worker_choice::{self, Candidate};
use crate::amp::frame::{self as amp_frame, ClientFrame, ServeSlots};
use crate::amp::reply::{self, FrameWriter};
use crate::amp::{AmpError, ErrorCode};
use crate::deadline::{after, secs_as_millis};
use crate::jetstream::ack::{AckKind, AckMetadata};
use crate::jetstream::api::check_error;
use crate::jetstream::consumer::ConsumerAction;
use crate::jetstream::error::JsError;
use crate::jetstream::publish::parse_pub_ack;

use crate::nats::{self, Connection, Message, RequestError, RequestId, Sid};
use crate::proto::headers::HeaderMap;
use crate::rfc3339;
use crate::ws::metrics::NatsOp;

pub type SessionId = u64;

/// How long a JetStream request may take before the client hears `unavailable`: under
/// the 5 s within which a fleet request caught by a dying leaf link must be answered,
/// with a second to spare for the answer's way back on a loaded node.
const JS_TIMEOUT: Duration = Duration::from_secs(4);
/// Task messages whose sequence is remembered for a cancel (about 200 bytes each).
const PUBLISHED_SEQS: usize = 2048;
/// Cancels answered `unavailable` remembered for their retry (a task key each).
const UNSENT_CANCELS: usize = 1024;
/// Cancelled tasks whose refused repeat this broker publishes again (a task key each).
const REFUSED_REPEATS: usize = 1024;
/// A pull request's lifetime; the server ends it with a 408 and a new one follows. It is
/// also how long the queue may wait for a delivery lost on the way (a pull the server
/// served whole ends without a word, and its slots stay asked for until then): 30 s held a
/// job's tasks past their attempts' worth of time (simulator seed 0x526a16).
const PULL_EXPIRES: Duration = Duration::from_secs(10);
/// A task no local session may take goes back with this delay, so that brokers with an
/// eligible session get it first. When no session here is eligible at all, the delay
/// doubles with each delivery up to `NO_TAKER_DELAY_MAX`, so that tasks nobody present
/// may take (an `eligible` naming nobody, or only sessions gone) come round seldom:
/// JetStream redelivers before it delivers anything new, and a thousand such tasks every
/// half second took every pull of the job.
const NO_TAKER_DELAY: Duration = Duration::from_millis(500);
const NO_TAKER_DELAY_MAX: Duration = Duration::from_secs(4);

/// The longest a task waits when sessions here may take it but every one is busy: it
/// doubles too (a thousand tasks only a busy session may take, every half second, kept
/// the pulls of everyone's free slots busy with them). At 2 s a thousand of them still
/// needed 500 redeliveries a second to leave any gap for a new task (JetStream
/// redelivers first), more than a loaded 2-core node handled; 4 s, as with no taker.
const BUSY_TAKER_DELAY_MAX: Duration = Duration::from_secs(4);

/// How long a task with no local taker waits at its `delivered`-th delivery, up to `max`.
fn no_taker_delay(delivered: u64, max: Duration) -> Duration {
    let doublings = delivered.saturating_sub(1).min(8) as u32;
    NO_TAKER_DELAY.saturating_mul(1 << doublings).min(max)
}
/// A session that declined a task (or let its offer lapse) is not offered it again for
/// this long, so the task goes to someone else when anyone else can take it.
const DECLINE_MEMORY: Duration = Duration::from_secs(3);
/// Declines remembered at most; past it the oldest are forgotten early.
const MAX_DECLINES: usize = 65_536;
/// A task whose record cannot be read is retried after this.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// The longest a task message waits to publish again a `task_result` a full inbox
/// refused (see [`refused_result_delay`]).
const REFUSED_RESULT_MAX_DELAY: Duration = Duration::from_secs(30);

/// How long a task message whose `task_result` JetStream refused (its inbox full) waits
/// at its `delivered`-th delivery: room comes back with the inbox's `max_age` or an
/// operator, seldom within a second, and each try is a redelivery, a record read and a
/// publish.
fn refused_result_delay(delivered: u64) -> Duration {
    let doublings = delivered.saturating_sub(1).min(8) as u32;
    RETRY_DELAY
        .saturating_mul(1 << doublings)
        .min(REFUSED_RESULT_MAX_DELAY)
}
/// Compare-and-set attempts on one change before giving up with `unavailable`.
const MAX_CAS_TRIES: u8 = 8;
/// What a task record keeps free of `max_payload` (a quarter of it at most) when its
/// holder changes it: the rest of its life adds at most `MAX_HISTORY` history entries of
/// a state, a time and a participant (some 200 bytes each), an error and a cancel reason.
const RECORD_RESERVE: usize = 64 * 1024;

/// Before a consumer that could not be created is tried again.
const CONSUMER_RETRY: Duration = Duration::from_secs(2);
/// Deliveries of a task message without a record before it is terminated.
const MAX_ORPHAN_DELIVERIES: u64 = 5;
/// Distinct jobs one session may serve: each is a registry entry and pull bookkeeping.
pub const MAX_JOBS_PER_SESSION: usize = 64;
/// Distinct jobs one participant's sessions serve together on one broker: its many
/// sessions must not take every job queue here, nor the namespace's job consumers.
pub const MAX_JOBS_PER_PARTICIPANT: usize = 64;
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
    /// The same frame on the broker's initiative to each of these sessions (a job's
    /// consumer refused, told to its workers): one text, not a frame each.
    Each {
        sessions: Vec<SessionId>,
        text: String,
    },
    /// The jobs `ns/name` serves changed: its registry entry should be rewritten.
    ServeChanged { ns: String, name: String },
    /// Submit or redrive `re` of `session` is refused having created nothing: what the
    /// core charged for it is given back. Comes before its answer.
    Refund { session: SessionId, re: String },
    /// A request found `stream` of namespace `ns` gone: the core makes it again.
    StreamGone { ns: String, stream: String },
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
    /// The pull engine on demand: a status (408 at expiry) arrives on its own pull's
    /// subject with the count it did not deliver. Messages carry their stream subject, so
    /// only the total outstanding is known, which is all "one message per free slot" needs.
    pull: PullLoop,
    /// Messages delivered whose record is being read (they hold no slot yet).
    unplaced: u32,
    /// Slots freed by completions whose pull rides on their message's `+ACK` (`+NXT`),
    /// which goes once the `task_result` is stored: counted as asked for until then, so
    /// that no other pull takes their place meanwhile.
    acks_due: u32,
    /// The server's time (ns since the epoch, plus [`TRUST_MARGIN_NANOS`]) when it last
    /// answered this broker's consumer create, made after every (re)connection; `None`
    /// until then. A first delivery of a message stored later was never delivered
    /// before, by this consumer or by an earlier one lost to a re-creation or a restart,
    /// so the record in its header is still the task's (bar a cancel); any other
    /// delivery reads the task store.
    trust_after_nanos: Option<u64>,
    /// The highest consumer sequence delivered to this broker since it last created the
    /// consumer: one that goes back means the consumer was created anew meanwhile.
    last_consumer_seq: u64,
    /// Its serving sessions were told JetStream refuses its consumer (once until it is
    /// made).
    told: bool,
    /// The consumer's AckWait as its last create (or update) answered: what JetStream
    /// redelivers by, which the broker keeps messages and times their release by. It is
    /// the job's `lease_s` unless another broker made the consumer with another one.
    ack_wait: Option<Duration>,
}

/// A message stored before a restart was stamped before the server went down, and the
/// consumer create answered after it came back and the broker reconnected: by the same
/// server's clock when the stream has one replica (a replicated consumer keeps its state
/// through a restart). The margin covers that clock being stepped back across the
/// restart, up to the downtime plus a quarter of a second.
const TRUST_MARGIN_NANOS: u64 = 250_000_000;

/// A task message's header carrying its record as created: `<revision> <record JSON>`.
const RECORD_HEADER: &str = "AMP-Task-Record";
/// A task message's header naming the use of its task id it is of
/// ([`TaskRecord::use_id`]).
const USE_HEADER: &str = "AMP-Task-Use";

/// Puts the record as created (at `revision`) in the task message's headers, unless
/// that would take the message past `max_payload` (the delivery reads it then).
fn carry_record(sub: &mut Submission, revision: u64, max_payload: usize) {
    let Ok(record) = std::str::from_utf8(&sub.record) else {
        return;
    };
    let mut value = String::with_capacity(sub.record.len() + 21);
    crate::proto::encode::push_decimal(&mut value, revision);
    value.push(' ');
    value.push_str(record);
    let added = RECORD_HEADER.len() + 2 + value.len() + 2;
    if sub.payload.len() + sub.headers.encoded_len() + added <= max_payload
        && let Err(e) = sub.headers.insert(RECORD_HEADER, &value)
    {
        log::warn!(task:% = sub.task; "task record not carried: {e}");
    }
}

/// What a consumer info says that the job queue uses: the server's time (`ts`, RFC 3339
/// with nanoseconds, as ns since the epoch) and the consumer's AckWait.
fn consumer_info_of(payload: &[u8]) -> (Option<u64>, Option<Duration>) {
    #[derive(serde::Deserialize)]
    struct Info {
        ts: Option<String>,
        config: Option<Config>,
    }
    #[derive(serde::Deserialize)]
    struct Config {
        ack_wait: Option<u64>,
    }
    let Ok(info) = serde_json::from_slice::<Info>(payload) else {
        return (None, None);
    };
    let ts = info
        .ts
        .and_then(|ts| crate::rfc3339::parse_nanos(&ts))
        .and_then(|ns| u64::try_from(ns).ok());
    let ack_wait = info
        .config
        .and_then(|c| c.ack_wait)
        .filter(|n| *n > 0)
        .map(Duration::from_nanos);
    (ts, ack_wait)
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
    /// Shared with the changes in flight, which read it while the broker changes itself.
    record: Rc<TaskRecord>,
    revision: u64,
    /// Set once claimed: the session's lease count includes it.
    leased: bool,
    /// Timers carry it; a timer for an older generation is stale.
    generation: u64,
    /// Heartbeats being written: the lease may be extending, so its expiry waits for them.
    extending: u32,
    /// When the heartbeat being written went out.
    heartbeat_sent: Option<Instant>,
    /// The next heartbeat waits until then: as long after the last one's answer as that
    /// write took.
    next_heartbeat: Option<Instant>,
    /// A `NextChange` timer is armed for the waiting changes.
    pacing: bool,
    /// The holder's changes waiting for the heartbeat being written: one heartbeat write
    /// at a time per lease, the rest in order behind it, so pipelined heartbeats do not
    /// fight each other (and a `cancel`) for the record's revision.
    waiting: std::collections::VecDeque<Op>,
    /// When the offer lapses unclaimed (set when the offer goes out).
    offer_until: Option<Instant>,
    /// When the offer went out (ms): the claim or decline records it in the history.
    offered_at_ms: i64,
    /// When the armed `Progress` timer fires, if one is.
    progress_at: Option<Instant>,
    /// When the newest `LeaseExpiry` timer fires (earlier ones find the lease running).
    lease_timer_at: Option<Instant>,
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

/// What a broker knows of the `task_result` of a cancel it answered `unavailable`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unsent {
    /// A publish of it may have landed: a retry publishes it again only within the
    /// inbox's duplicate window.
    Maybe,
    /// Every publish of it from here was refused (none stored), and the record does not
    /// say so yet: a retry may publish it at any age.
    Refused,
    /// As `Refused`, and the record says so (`TaskRecord::result_refused`, or
    /// `result_sent`): from then on the record, which any broker's publish that may have
    /// landed clears, decides. Trusting this broker's memory past that published a
    /// result another broker's retry had stored, its PubAck lost (review 2, finding 2).
    Recorded,
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
    /// The broker stored the `task_result` of a task whose message stays for a
    /// redelivery (see `TaskRecord::result_sent`).
    ResultSent,
    /// The broker stored the dead letter of a task whose message stays for a
    /// redelivery (see `TaskRecord::lettered`).
    Lettered,
    /// The task's result was refused for want of room, or may have landed unconfirmed
    /// (see `Change::ResultRefused`).
    ResultRefused(Refused),
}

impl Op {
    /// The session whose local task (offer or lease here) the change is made for; none
    /// for the changes a broker makes on its own or for a submitter.
    fn local_session(&self) -> Option<SessionId> {
        match self {
            Op::Offer { session, .. }
            | Op::Claim { session, .. }
            | Op::Heartbeat { session, .. }
            | Op::Complete { session, .. }
            | Op::Fail { session, .. }
            | Op::Requeue { session, .. } => Some(*session),
            Op::Exhaust
            | Op::Cancel { .. }
            | Op::ResultSent
            | Op::Lettered
            | Op::ResultRefused(_) => None,
        }
    }

    /// A change only the lease holder makes.
    fn by_holder(&self) -> bool {
        matches!(
            self,
            Op::Heartbeat { .. } | Op::Complete { .. } | Op::Fail { .. }
        )
    }

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
        /// A resubmit's republish: the record is bound to the message stored.
        dup: bool,
        /// The record as stored (its JSON) and its revision.
        stored: Box<(Vec<u8>, u64)>,
    },
    /// A record being rewritten as it was, bound to the task message a resubmit stored
    /// or given an expiry (`what`, for the log).
    Rewrite {
        key: String,
        what: &'static str,
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
        /// The message's `AMP-Task-Use` header.
        use_id: Option<String>,
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
    /// The record of a cancelled task whose refused repeat is due again.
    RepeatRead {
        key: String,
    },
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
            Pending::SubmitCreate(_) | Pending::Cas { .. } | Pending::Rewrite { .. } => {
                NatsOp::KvPut
            }
            Pending::SubmitExisting(_)
            | Pending::DeliveryRead { .. }
            | Pending::Read(_)
            | Pending::RepeatRead { .. }
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

/// A continuation of this module, opaque to the core's table that keeps it.
pub struct Awaiting(Pending);

/// A stored outcome to announce: who reached it, the task message's ack and the
/// requester's answer.
struct Outcome {
    record: TaskRecord,
    by: String,
    ack: Option<(String, AckKind)>,
    reply: Option<(SessionId, String, String)>,
    /// Its dead letter is stored (see [`Finish::lettered`]).
    lettered: bool,
}

/// What follows a stored outcome: the message's ack and the requester's answer.
struct Finish {
    /// The task's key.
    key: String,
    ack: Option<(String, AckKind)>,
    reply: Option<(SessionId, String, String)>,
    /// A redelivery of the task message publishes the result again (completed, failed).
    redelivery_resends: bool,
    /// A cancelled task: its message is gone, and only the client's retry of the cancel
    /// publishes the result again (see [`Jobs::unsent_cancels`]).
    cancelled: bool,
    /// A completed or failed task whose message stays for a redelivery (its dead letter
    /// not stored yet): once the result is stored, the record says so.
    stays: bool,
    /// Its dead letter was just stored: should the message stay for the result, the
    /// record says so.
    lettered: bool,
    /// A cancelled task's result published again for a later cancel: once stored, the
    /// record says so (see [`TaskRecord::result_sent`]).
    repeat: bool,
    /// A repeat no cancel waits on: what its refusal tells.
    unwaited: Option<Unwaited>,
}

/// When a repeat of a cancelled task's result that no cancel waits on (the cancel
/// answered `conflict`) was published, as what its refusal tells: whether the cancel's own
/// publish may still land after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unwaited {
    /// Within `LAST_REPEAT_MS` of the cancel, written at `cancelled_ms`: it may.
    Early { cancelled_ms: i64 },
    /// Past it: that publish, if made at all, was stored by then, and JetStream answers a
    /// repeat of a stored one (inside the duplicate window) as a duplicate, full or not.
    /// Refused, none is stored.
    Late,
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
    /// The record as created, for the task message's `AMP-Task-Record` header.
    record: Vec<u8>,
    /// The budget refused it: an existing task is answered, a missing one refused.
    over_budget: bool,
    /// Its payload and record against the broker's [`HeldBytes`].
    _hold: Hold,
}

/// A timer of this engine, opaque to the core's table that keeps it.
pub struct Alarm(Timer);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Timer {
    OfferExpiry {
        key: String,
        generation: u64,
    },
    LeaseExpiry {
        key: String,
        generation: u64,
    },
    /// The holder's next waiting change may go (heartbeats are paced).
    NextChange {
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
    /// A refused repeat of cancelled task `key`'s result is due again (see
    /// [`Jobs::refused_repeats`]).
    Repeat {
        key: String,
    },
}

/// The jobs engine of one broker.
pub struct Jobs {
    /// Per participant (`ns`, `name`), the jobs its sessions here serve with slots, and
    /// how many of its sessions serve each: what `MAX_JOBS_PER_PARTICIPANT` bounds, kept
    /// in step with `serve` and session close rather than counted over every worker.
    participant_serving: HashMap<(String, String), HashMap<String, u32>>,
    broker_id: String,
    /// This process among those that ran under `broker_id`: session ids start again with
    /// every process, so the name a lease gives its holder carries it.
    incarnation: String,
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
    /// Requests sent since the core last filed them in its continuation table.
    pub(crate) staged: Staged<Awaiting>,
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
    /// Deadlines set since the core last filed them in its timer table.
    pub(crate) later: Later<Alarm>,
    out: VecDeque<JobsOutput>,
    next_generation: u64,
    stats: JobsStats,
    /// Bytes of submits waiting for JetStream (see [`HeldBytes`]).
    held: HeldBytes,
    /// A `dead_letters` page stops growing past this many bytes of letters.
    page_bytes: usize,
    /// The most one letter of a page may take: three quarters of what the asker may be
    /// sent at once, leaving room for what is queued beside it.
    letter_bytes: usize,
    /// Cancelled tasks whose cancel was answered `unavailable` (its write or its
    /// `task_result` unconfirmed or refused): the retry that finds the task cancelled
    /// publishes the result again and answers `ok`, where a cancel of a finished task
    /// answers `conflict`.
    unsent_cancels: BoundedMap<String, Unsent>,
    /// Cancelled tasks whose repeat of the result no cancel waits on was refused early
    /// ([`Unwaited::Early`]), with a timer each: the broker publishes it again until it is
    /// stored, found a duplicate or refused late, which sets `result_refused` for a later
    /// retry. Left alone, a cancel whose broker died before publishing the result, whose
    /// retry's repeat was refused, had no result stored ever.
    refused_repeats: BoundedMap<String, ()>,
    /// Paces the warnings about dead letters too large to store whole.
    trimmed_log: letters::TrimmedLog,
    /// Job queues whose consumer a reload changed the AckWait of (see
    /// [`Jobs::after_reload`]).
    consumer_updates: Vec<String>,
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
    /// Dead letters stored with parts left out to fit (a repeat is not counted again).
    pub dead_letters_trimmed: u64,
    /// Deliveries offered on the record their message carries, without a read.
    pub record_reads_spared: u64,
}

/// The namespace of a task: its submitter's (task ids are namespace-wide).
fn ns_of(record: &TaskRecord) -> &str {
    record.submitted_by.split_once('/').map_or("", |(ns, _)| ns)
}

/// The stream sequence of the task message a delivery's ack subject acknowledges.
fn message_seq(ack: &str) -> Option<u64> {
    AckMetadata::parse(ack).ok().map(|m| m.stream_sequence)
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

impl Jobs {
    /// Tells the core that `stream` of `ns` is gone; the answer for the request that
    /// found it so.
    fn stream_gone(&mut self, ns: &str, stream: String) -> AmpError {
        let e = crate::broker::remake::gone(&stream);
        let ns = ns.to_string();
        self.out.push_back(JobsOutput::StreamGone { ns, stream });
        e
    }
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
        let mut incarnation = ids.derive("incarnation").next_id();
        incarnation.truncate(8);
        Ok(Jobs {
            broker_id: broker_id.to_string(),
            incarnation,
            participant_serving: HashMap::new(),
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
            staged: Staged::default(),
            routes: HashMap::new(),
            watches: HashMap::new(),
            round_trips: Vec::new(),
            published: BoundedMap::new(PUBLISHED_SEQS),
            mig_enabled: config.mig.enabled,
            later: Later::default(),
            out: VecDeque::new(),
            next_generation: 0,
            stats: JobsStats::default(),
            held: HeldBytes::new(config.limits.max_buffered_bytes / 4),
            // A quarter of what the asker may be sent at once, as a `watch` burst.
            page_bytes: (config.limits.session_room() / 4).clamp(1, PAGE_BYTES),
            letter_bytes: config.limits.session_room() / 4 * 3,
            unsent_cancels: BoundedMap::new(UNSENT_CANCELS),
            refused_repeats: BoundedMap::new(REFUSED_REPEATS),
            trimmed_log: letters::TrimmedLog::default(),
            consumer_updates: Vec::new(),
        })
    }

    /// Submit bytes held while JetStream answers, shared with the core's held submits.
    pub fn held_bytes(&self) -> &HeldBytes {
        &self.held
    }

    /// A watch made for a delivery that no offer took (no taker, someone else's lease, an
    /// outcome) ends here.
    fn drop_untaken_watch(&mut self, conn: &mut Connection, key: &str, watch: Option<Sid>) {
        if let Some(sid) = watch
            && self.tasks.get(key).is_none_or(|t| t.watch != Some(sid))
        {
            self.drop_watch(conn, sid);
        }
    }

    /// Whether a timer still has something to do (see `Timers::prune`): those of tasks
    /// gone or moved on, and lease expiries and in-progress acks re-armed since, do not.
    pub(crate) fn alarm_matters(&self, Alarm(timer): &Alarm, at: Instant) -> bool {
        let task =
            |key: &str, generation: u64| self.tasks.get(key).filter(|t| t.generation == generation);
        match timer {
            Timer::OfferExpiry { key, generation } => task(key, *generation).is_some(),
            Timer::LeaseExpiry { key, generation } => {
                task(key, *generation).is_some_and(|t| t.lease_timer_at == Some(at))
            }
            Timer::Progress { key, generation } => {
                task(key, *generation).is_some_and(|t| t.progress_at == Some(at))
            }
            Timer::NextChange { key, generation } => task(key, *generation).is_some(),
            Timer::PullExpiry { .. } | Timer::ConsumerRetry { .. } => true,
            Timer::Repeat { key } => self.refused_repeats.get(key).is_some(),
        }
    }

    /// Offer watches held: each should belong to a task offered here.
    pub fn offer_watches(&self) -> usize {
        self.watches.len()
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
                "dead_letters_trimmed",
                "Dead letters stored with parts left out, too large to store whole",
                s.dead_letters_trimmed,
            ),
            (
                "jetstream_ops",
                "JetStream requests, acks and pulls sent for jobs",
                s.js_ops,
            ),
            (
                "record_reads_spared",
                "Task deliveries offered on the record their message carries, unread",
                s.record_reads_spared,
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
    /// leased keep the lease they were given. The consumers of job queues here whose
    /// AckWait is not the new `lease_s` are updated by [`Jobs::after_reload`].
    pub fn reload_settings(&mut self, config: &Config) {
        self.mig_enabled = config.mig.enabled;
        self.jobs = config
            .namespaces
            .iter()
            .map(|(ns, n)| (ns.clone(), n.jobs.clone()))
            .collect();
        let stale: Vec<String> = self
            .queues
            .iter()
            .filter(|(_, q)| {
                let lease = Duration::from_secs(self.job_config(&q.ns, &q.job).lease_s);
                q.ack_wait != Some(lease)
            })
            .map(|(qk, _)| qk.clone())
            .collect();
        self.consumer_updates.extend(stale);
    }

    /// Sends the consumer updates a reload asked for (it has no connection to send them
    /// on).
    pub fn after_reload(&mut self, conn: &mut Connection, now: Instant) {
        for qk in std::mem::take(&mut self.consumer_updates) {
            self.create_consumer(conn, &qk, now);
        }
    }

    /// The labels of `ns/name` changed (a reload): its workers are offered tasks by the
    /// new ones from now on; offers and leases already out stay.
    pub fn relabel(&mut self, ns: &str, name: &str, labels: &BTreeMap<String, String>) {
        for w in self.workers.values_mut() {
            if w.ns == ns && w.name == name {
                w.labels.clone_from(labels);
            }
        }
    }

    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
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

    /// Who holds an offer or a lease, in the task store: `<broker id>/<incarnation>/<session>`
    /// (read from the right, whatever the broker id holds).
    fn session_name(&self, session: SessionId) -> String {
        format!("{}/{}/{session}", self.broker_id, self.incarnation)
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
            ClientFrame::Submit(submit) => self.submit(conn, caller, submit, false, now),
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
        let (serves, entries, before) =
            self.workers
                .get(&caller.session)
                .map_or((false, 0, 0), |w| {
                    let entry = w.serving.get(job);
                    (
                        entry.is_some(),
                        w.serving.len(),
                        entry.map_or(0, |s| s.slots),
                    )
                });
        if !serves && slots == 0 {
            // Nothing to stop; recording it would let entries pile up unbounded.
            return Ok(());
        }
        // An entry left at `slots: 0` (its tasks may still be out) is checked again when
        // it starts anew, as a new one is.
        let starts = before == 0 && slots > 0;
        let participant = (caller.ns.to_string(), caller.name.to_string());
        let limit = if !serves && entries >= MAX_JOBS_PER_SESSION {
            Some(format!(
                "a session serves at most {MAX_JOBS_PER_SESSION} jobs"
            ))
        } else if starts
            && self
                .participant_serving
                .get(&participant)
                .is_some_and(|jobs| {
                    !jobs.contains_key(job) && jobs.len() >= MAX_JOBS_PER_PARTICIPANT
                })
        {
            Some(format!(
                "a participant's sessions serve at most {MAX_JOBS_PER_PARTICIPANT} jobs together on a broker"
            ))
        } else if starts
            && self.queues.len() >= MAX_JOB_QUEUES
            && !self.queues.contains_key(&queue_key(caller.ns, job))
            && !self.release_idle_queue(conn)
        {
            Some(format!("this broker serves at most {MAX_JOB_QUEUES} jobs"))
        } else {
            None
        };
        if let Some(message) = limit {
            return Err(AmpError::new(ErrorCode::Forbidden, message).with_path("/job"));
        }
        if starts {
            *self
                .participant_serving
                .entry(participant)
                .or_default()
                .entry(job.to_string())
                .or_default() += 1;
        } else if before > 0 && slots == 0 {
            self.stopped_serving(&participant, job);
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

    /// One session of `participant` no longer serves `job` (`slots: 0`, or closed).
    fn stopped_serving(&mut self, participant: &(String, String), job: &str) {
        let Some(jobs) = self.participant_serving.get_mut(participant) else {
            return;
        };
        if let Some(n) = jobs.get_mut(job) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                jobs.remove(job);
            }
        }
        if jobs.is_empty() {
            self.participant_serving.remove(participant);
        }
    }

    /// Room for another job's queue: forgets one that no session here serves and that
    /// holds nothing here (no task, no message being placed or acknowledged); false when
    /// there is none. Jobs are named by clients, so queues of jobs served once must not
    /// stay for good. Its consumer stays in JetStream for the brokers that serve it; a
    /// pull still out is abandoned, and what it still brings is handed back at once
    /// ([`Jobs::unread_delivery`]).
    fn release_idle_queue(&mut self, conn: &mut Connection) -> bool {
        let served: HashSet<String> = self
            .workers
            .values()
            .flat_map(|w| {
                w.serving
                    .iter()
                    .filter(|(_, s)| s.slots > 0)
                    .map(|(job, _)| queue_key(&w.ns, job))
            })
            .collect();
        let holding: HashSet<String> = self
            .tasks
            .values()
            .map(|t| queue_key(&t.ns, &t.job))
            .collect();
        let idle = self
            .queues
            .iter()
            .find(|(qk, q)| {
                !served.contains(*qk)
                    && !holding.contains(*qk)
                    && q.unplaced == 0
                    && q.acks_due == 0
            })
            .map(|(qk, _)| qk.clone());
        let Some(qk) = idle else {
            return false;
        };
        if let Some(mut q) = self.queues.remove(&qk)
            && let Some(sid) = q.pull.detach(conn)
        {
            self.routes.remove(&sid);
        }
        log::debug!(queue:% = qk; "job queue released: nobody here serves it");
        true
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
    /// they run out, and JetStream then redelivers the task: a lease is held by the
    /// session ([`Jobs::session_name`]), so no later session, not even the same worker's
    /// after a reconnect, can finish it.
    pub fn session_closed(&mut self, conn: &mut Connection, session: SessionId, now: Instant) {
        let Some(worker) = self.workers.remove(&session) else {
            return;
        };
        let participant = (worker.ns.clone(), worker.name.clone());
        for (job, _) in worker.serving.iter().filter(|(_, s)| s.slots > 0) {
            self.stopped_serving(&participant, job);
        }
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
                    self.unwatch(conn, &key);
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

    /// The NATS connection came back: pulls in flight died with the old one or are
    /// dropped by the server now that nobody listens on their subject (the queue's pulls
    /// are answered under a new one), and the server may have restarted with less of the
    /// consumer's state than it had, so no delivery's record is taken from its message
    /// until the consumer is created (or found) again, which also subscribes anew.
    pub fn on_reconnected(&mut self, conn: &mut Connection, now: Instant) {
        let keys: Vec<String> = self.queues.keys().cloned().collect();
        for qk in keys {
            let prefix = conn.new_inbox();
            if let Some(q) = self.queues.get_mut(&qk)
                && let Some(sid) = q.pull.forget_pulls(conn, prefix)
            {
                self.routes.remove(&sid);
            }
            self.create_consumer(conn, &qk, now);
        }
    }

    /// A delivery of a job queue on a subscription this broker had ended (see
    /// [`PullLoop::forget_pulls`]): a task this broker handles (a redelivery of one it
    /// holds) is taken as delivered; any other goes back at once rather than after its
    /// AckWait. False when it is no job queue's.
    pub fn unread_delivery(&mut self, conn: &mut Connection, msg: &Message, now: Instant) -> bool {
        let Some(ack) = msg.reply.as_deref() else {
            return false;
        };
        let Ok(meta) = AckMetadata::parse(ack) else {
            return false;
        };
        let Some((ns, job)) = binding::job_of_consumer(meta.stream, meta.consumer) else {
            return false;
        };
        let qk = queue_key(ns, job);
        let held = Envelope::from_json(&msg.payload)
            .is_ok_and(|env| self.tasks.contains_key(&task_key(ns, &env.id)));
        if held && self.queues.contains_key(&qk) {
            self.delivery(conn, &qk, msg, now);
        } else {
            self.nak(conn, ack, None);
        }
        true
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
        let Some(q) = self.queues.get_mut(&qk) else {
            return true;
        };
        match q.pull.answer(msg) {
            Answer::Message => self.delivery(conn, &qk, msg, now),
            Answer::Nothing => {}
            Answer::NoResponders => {
                // Nobody serves the consumer: JetStream is not ready, or the consumer is
                // gone. Pulling again at once would spin; create it again shortly.
                log::warn!(queue:% = qk; "pull had no responders; consumer again soon");
                self.consumer_failed(&qk, now);
            }
            Answer::Ended { why } => {
                if let Some(why) = why.filter(|w| !w.contains("Batch Completed")) {
                    log::warn!(queue:% = qk; "pull ended: {why}");
                    if why.contains("Consumer Deleted") {
                        self.create_consumer(conn, &qk, now);
                    } else {
                        // Refused (409 "Exceeded MaxWaiting", a leadership change, 400):
                        // pulling again at once would be refused again at once. The
                        // consumer is made again shortly, and pulled once it is there.
                        self.consumer_failed(&qk, now);
                    }
                    return true;
                }
                self.pull_more(conn, &qk, now);
            }
        }
        true
    }

    // ---- task store changes ------------------------------------------------------------

    fn participant_of(&self, key: &str) -> String {
        self.tasks
            .get(key)
            .map(|t| t.participant.clone())
            .unwrap_or_default()
    }

    // ---- replies and timers ------------------------------------------------------------

    /// The reply to a request; false when the request is not one of ours.
    /// The reply to request `id`, for a driver that runs this engine without the core
    /// (tests, benchmarks) and keeps `table` for it; false when the engine did not ask.
    pub fn reply_to(
        &mut self,
        table: &mut Continuations,
        conn: &mut Connection,
        id: RequestId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) -> bool {
        table.file(&mut self.staged, Continuation::Jobs);
        match table.take(id) {
            Some((Continuation::Jobs(pending), sent)) => {
                self.on_reply(conn, pending, sent, reply, now);
                true
            }
            Some((other, sent)) => {
                table.insert(id, other, sent);
                false
            }
            None => false,
        }
    }

    /// The reply to a request this engine made (see [`Staged`]).
    pub(crate) fn on_reply(
        &mut self,
        conn: &mut Connection,
        Awaiting(pending): Awaiting,
        sent: Instant,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        if let Some(op) = pending.op()
            && self.round_trips.len() < MAX_ROUND_TRIPS
        {
            let seconds = now.saturating_duration_since(sent).as_secs_f64();
            self.round_trips.push((op, seconds));
        }
        match pending {
            Pending::ConsumerCreate { queue } => match reply
                .map(|m| check_error(&m.payload).map(|()| consumer_info_of(&m.payload)))
            {
                Ok(Ok((answered_at, ack_wait))) => {
                    self.consumer_ack_wait_read(&queue, ack_wait);
                    if let Some(q) = self.queues.get_mut(&queue) {
                        q.trust_after_nanos =
                            answered_at.and_then(|t| t.checked_add(TRUST_MARGIN_NANOS));
                        q.last_consumer_seq = 0;
                        q.told = false;
                    }
                    self.consumer_ready(conn, &queue, now)
                }
                Ok(Err(e)) => {
                    log::warn!(queue:% = queue; "consumer refused: {e}");
                    if e.err_code() == Some(crate::jetstream::error::ERR_STREAM_NOT_FOUND)
                        && let Some((ns, _)) = queue.split_once('/')
                    {
                        self.stream_gone(ns, binding::tasks_stream(ns));
                    }
                    self.tell_unserved(&queue, &e.to_string());
                    self.consumer_failed(&queue, now);
                }
                Err(e) => {
                    log::warn!(queue:% = queue; "consumer request failed: {e}");
                    self.consumer_failed(&queue, now);
                }
            },
            Pending::SubmitCreate(sub) => {
                match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
                    Ok(Ok(ack)) => {
                        self.stats.submitted += 1;
                        // A new task: the message stored under its id before was an
                        // earlier task's, whose record expired.
                        self.published.remove(&task_key(&sub.ns, &sub.task));
                        let mut sub = *sub;
                        carry_record(&mut sub, ack.seq, conn.max_payload());
                        let stored = (std::mem::take(&mut sub.record), ack.seq);
                        self.publish_task(conn, sub, false, stored, now);
                    }
                    Ok(Err(JsError::WrongLastSequence(_))) => self.read_existing(conn, sub, now),
                    // JetStream answered that it stored nothing.
                    Ok(Err(e)) => self.refuse_unmade(sub.session, &sub.re, unavailable(e)),
                    // The create may have landed all the same (its answer was lost with
                    // the connection, or is late): a record with no message would stay
                    // `queued` for good if the client's retry came before it and was
                    // refused, so the broker looks (once the connection is back) and
                    // publishes it itself.
                    Err(RequestError::Timeout | RequestError::Disconnected) => {
                        self.read_existing(conn, sub, now)
                    }
                    // No stream holds the task store's subjects: it is gone.
                    Err(RequestError::NoResponders) => {
                        let e =
                            self.stream_gone(&sub.ns, format!("KV_{}", binding::TASK_STATE_BUCKET));
                        self.refuse_unmade(sub.session, &sub.re, e)
                    }
                    Err(e) => self.refuse(sub.session, &sub.re, unavailable(e)),
                }
            }
            Pending::SubmitExisting(sub) => match self.parse_record(&sub.ns, &sub.task, reply) {
                Err(JsError::KeyNotFound) if sub.over_budget => {
                    self.refuse(sub.session, &sub.re, AmpError::budget_exhausted())
                }
                Err(JsError::KeyNotFound) => {
                    let e = AmpError::new(
                        ErrorCode::Unavailable,
                        "the task store did not answer the submit in time and holds no \
                         record of the task; submit it again",
                    );
                    // Its charge is kept: the create may still land (a read can come
                    // from a replica behind it), and the retry is then a resubmit.
                    self.refuse(sub.session, &sub.re, e)
                }
                Ok((record, revision)) => {
                    if record.submitted_by != sub.from {
                        // Someone else's task: the same answer whatever its job, body or
                        // state, so a probe learns only that the id is taken.
                        let e = AmpError::new(
                            ErrorCode::Conflict,
                            format!("task id `{}` is taken", sub.task),
                        )
                        .with_path("/task");
                        self.refuse_unmade(sub.session, &sub.re, e);
                    } else if !record.same_submission(&sub.job, &sub.digest) {
                        let e = AmpError::new(
                            ErrorCode::Conflict,
                            format!("task `{}` exists with a different job or body", sub.task),
                        )
                        .with_path("/task");
                        self.refuse_unmade(sub.session, &sub.re, e);
                    } else if record.state == TaskState::Queued
                        && record.attempt == 0
                        && record.history.len() == 1
                        && record.msg_seq.is_none()
                        && self.published.get(&task_key(&sub.ns, &sub.task)).is_none()
                    {
                        // The copy is of the record's use, not of this submit's, whose
                        // record was never made.
                        let mut sub = sub;
                        sub.headers.remove(USE_HEADER);
                        if let Some(use_id) = &record.use_id
                            && let Err(e) = sub.headers.insert(USE_HEADER, use_id)
                        {
                            log::warn!(task:% = sub.task; "task use not carried: {e}");
                        }
                        // No delivery of its message has been seen, and it may never have
                        // been stored (refused, or its answer lost): publish again, at any
                        // age, or a task answered `unavailable` and retried past 90 s was
                        // `dup` and never queued. Within the duplicate window its message
                        // id makes a repeat a duplicate; past it a copy is stored. Either
                        // way the record is bound to the message stored: a copy stored
                        // before is terminated when delivered (`TaskRecord::msg_seq`), so
                        // a resubmit stores at most one more copy, never offered or
                        // finished twice, and the expiry of a record whose message was
                        // refused (`Jobs::expire_unqueued`) goes with the rewrite.
                        self.publish_task(conn, *sub, true, (record.to_json(), revision), now);
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
                stored,
            } => match reply.map(|m| parse_pub_ack(m.status(), &m.payload)) {
                Ok(Ok(ack)) => {
                    let key = task_key(&ns, &task);
                    if dup {
                        self.bind_record(conn, key.clone(), *stored, ack.seq, now);
                    }
                    *self.published.get_or_insert_with(key, || ack.seq) = ack.seq;
                    let text = FrameWriter::ok(Some(&re))
                        .str("task", &task)
                        .value("dup", &(dup || ack.duplicate))
                        .finish();
                    self.out.push_back(JobsOutput::Reply { session, re, text });
                }
                // No stream holds the job's subject: the tasks stream is gone. The
                // record expires unless a retry publishes it again meanwhile.
                Ok(Err(JsError::NoResponders)) | Err(RequestError::NoResponders) => {
                    if !dup {
                        self.expire_unqueued(conn, task_key(&ns, &task), *stored, now);
                    }
                    let e = self.stream_gone(&ns, binding::tasks_stream(&ns));
                    self.refuse(session, &re, e)
                }
                // JetStream answered that it stored nothing. Of a resubmit's publish
                // only: the first's message may be waiting all the same.
                Ok(Err(e)) => {
                    if !dup {
                        self.expire_unqueued(conn, task_key(&ns, &task), *stored, now);
                    }
                    self.refuse(session, &re, unavailable(e));
                }
                // It may be stored all the same: its delivery binds the record.
                Err(e) => self.refuse(session, &re, unavailable(e)),
            },
            Pending::DeliveryRead {
                queue,
                key,
                ack,
                delivered,
                env,
                use_id,
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
                    (read, RecordFrom::Store(use_id)),
                    ack_basis,
                    watch,
                    now,
                );
                self.drop_untaken_watch(conn, &key, watch);
            }
            Pending::Read(write) => {
                let (ns, task) = write.key.split_once('.').unwrap_or(("", ""));
                match self.parse_record_at(ns, task, reply) {
                    Ok((record, revision, stored_ms)) => {
                        let earlier_use = write.ack.is_some()
                            && self
                                .tasks
                                .get(&write.key)
                                .is_some_and(|t| !t.record.same_use(&record));
                        if earlier_use {
                            // The task's record expired and its id was used again while
                            // this change of a delivery waited (the record an unread offer
                            // was made on, say): the message is of the earlier use, and
                            // would bind the new record to itself.
                            return self.superseded(conn, write, now);
                        }
                        if let Some(t) = self.tasks.get_mut(&write.key) {
                            t.record = Rc::new(record.clone());
                            t.revision = revision;
                        }
                        if let Op::ResultRefused(refused) = write.op
                            && self.refusal_kept(&write.key, &record, refused, stored_ms, now)
                        {
                            if refused == Refused::Every {
                                self.refusal_recorded(&write.key);
                            }
                            return;
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
            Pending::Rewrite { key, what } => {
                // Refused for a change made meanwhile: a delivery's, which bound the record
                // to the message it delivered, a cancel, or another rewrite.
                if let Err(e) = reply
                    .map_err(|e| e.to_string())
                    .and_then(|m| parse_pub_ack(m.status(), &m.payload).map_err(|e| e.to_string()))
                {
                    log::info!(task:% = key; "task record not {what}: {e}");
                }
            }
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
            Pending::RepeatRead { key } => self.repeat_read(conn, &key, reply, now),
            Pending::Result(mut finish) => {
                let answer = reply
                    .map_err(|e| e.to_string())
                    .map(|m| parse_pub_ack(m.status(), &m.payload));
                let finish = match answer {
                    Ok(Ok(_)) => {
                        if finish.cancelled {
                            self.unsent_cancels.remove(&finish.key);
                        }
                        if std::mem::take(&mut finish.stays) || finish.repeat {
                            self.mark(conn, finish.key.clone(), Op::ResultSent, now);
                        }
                        finish
                    }
                    // A full inbox has room again once its `max_age` or an operator
                    // frees some: the result waits for it, as one unanswered does.
                    Ok(Err(e)) if e.store_unavailable() => {
                        log::warn!(task:% = finish.key; "task result refused for now: {e}");
                        if e == JsError::NoResponders {
                            let ns = finish.key.split_once('.').map_or("", |(ns, _)| ns);
                            self.stream_gone(ns, binding::inbox_stream(ns));
                        }
                        self.result_unsent(conn, finish, e.stored_nothing(), now)
                    }
                    // Refused as it is (a `max_msg_size` below its size): it would be
                    // refused again every time.
                    Ok(Err(e)) => {
                        log::error!(task:% = finish.key; "task result refused, given up: {e}");
                        if finish.cancelled {
                            self.unsent_cancels.remove(&finish.key);
                        }
                        finish
                    }
                    Err(e) => {
                        log::warn!(task:% = finish.key; "task result unanswered: {e}");
                        self.result_unsent(conn, finish, false, now)
                    }
                };
                self.finish(conn, finish, now);
            }
        }
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

    /// Reads the record of a submit's task id, which exists (its create was refused) or
    /// may (the budget refused the submit).
    fn read_existing(&mut self, conn: &mut Connection, sub: Box<Submission>, now: Instant) {
        let key = task_key(&sub.ns, &sub.task);
        let req = self.kv.get_request(&key);
        let sent = req.map_err(unavailable).and_then(|req| {
            self.request(conn, &req.subject, None, &req.payload, now)
                .map_err(|e| send_error(&e))
        });
        match sent {
            Ok(id) => self.await_reply(id, now, Pending::SubmitExisting(sub)),
            Err(e) => self.refuse(sub.session, &sub.re, e),
        }
    }

    fn parse_record(
        &self,
        ns: &str,
        task: &str,
        reply: Result<Message, RequestError>,
    ) -> Result<(TaskRecord, u64), JsError> {
        self.parse_record_at(ns, task, reply)
            .map(|(record, revision, _)| (record, revision))
    }

    /// As [`Jobs::parse_record`], with when the revision was stored (Unix ms, 0 if
    /// unknown).
    fn parse_record_at(
        &self,
        ns: &str,
        task: &str,
        reply: Result<Message, RequestError>,
    ) -> Result<(TaskRecord, u64, i64), JsError> {
        let m = reply.map_err(|e| JsError::Transport(e.to_string()))?;
        let key = task_key(ns, task);
        let entry = self.kv.parse_get(&key, m.headers.as_ref(), &m.payload)?;
        if entry.is_deleted() {
            return Err(JsError::KeyNotFound);
        }
        let record = TaskRecord::from_json(&entry.value)
            .map_err(|e| JsError::malformed(format_args!("task record {key}: {e}")))?;
        let stored_ms = i64::try_from(entry.created_nanos / 1_000_000).unwrap_or(0);
        Ok((record, entry.revision, stored_ms))
    }

    /// Timers due at `now`.
    /// Runs this engine's timers due at `now`, for a driver that runs it without the
    /// core (tests, benchmarks) and keeps `table` for it.
    pub fn timers_due(&mut self, table: &mut Timers, conn: &mut Connection, now: Instant) {
        loop {
            table.file(&mut self.later, Wake::Jobs);
            match table.pop_due(now) {
                Some((at, Wake::Jobs(alarm))) => self.on_alarm(conn, alarm, at, now),
                Some(_) => {}
                None => return,
            }
        }
    }

    /// A timer of this engine set for `at` fired.
    pub(crate) fn on_alarm(
        &mut self,
        conn: &mut Connection,
        Alarm(timer): Alarm,
        at: Instant,
        now: Instant,
    ) {
        match timer {
            Timer::OfferExpiry { key, generation } => {
                let due = self.tasks.get(&key).and_then(|t| {
                    (t.generation == generation && t.phase == Phase::Offered).then_some(t.session)
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
                    (t.generation == generation && t.phase == Phase::Leased && expired && settled)
                        .then(|| (t.session, t.record.id.clone()))
                });
                if let Some((session, task)) = due {
                    self.revoke(session, &task, "lease_expired");
                    self.lease_over(conn, &key, now);
                }
            }
            Timer::NextChange { key, generation } => {
                let current = self.tasks.get_mut(&key).is_some_and(|t| {
                    let current = t.generation == generation;
                    if current {
                        t.pacing = false;
                    }
                    current
                });
                if current {
                    self.next_waiting(conn, &key, now);
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
                let stale = self
                    .queues
                    .get_mut(&queue)
                    .is_some_and(|q| q.pull.over(pull));
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
            Timer::Repeat { key } => {
                if self.refused_repeats.remove(&key).is_some() {
                    self.repeat_due(conn, key, now);
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
        self.staged.push(id, Awaiting(pending), now);
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

#[cfg(all(test, feature = "testing"))]
mod tests {
    //! The jobs engine driven in process: the core on the NATS/JetStream model, leases
    //! running out on a virtual clock instead of a real one.

    use std::time::Duration;

    use serde_json::{Value, json};

    use super::{MAX_JOB_QUEUES, MAX_JOBS_PER_PARTICIPANT, MAX_JOBS_PER_SESSION};

    use crate::broker::config::Job;
    use crate::testing::harness::{self, Harness, Session};

    const LEASE_S: u64 = 3;

    fn bench(max_attempts: u32) -> Harness {
        let mut config = harness::development_config();
        let job = Job {
            lease_s: LEASE_S,
            offer_ms: 1000,
            max_attempts,
            ..Job::default()
        };
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.jobs.insert("render".into(), job);
        }
        Harness::new(config, 1, 7)
    }

    fn worker(h: &mut Harness, name: &str) -> Session {
        h.join(0, name, json!({"serve":[{"job":"render","slots":1}]}))
    }

    fn submit(h: &mut Harness, app: Session, n: u64) -> String {
        let ok = h.request(app, json!({"op":"submit","job":"render","body":{"n":n}}));
        assert_eq!(ok["op"], "ok", "{ok}");
        ok["task"].as_str().expect("task id").to_string()
    }

    fn offer(h: &mut Harness, w: Session, task: &str) -> Value {
        h.wait_for(w, |f| f["op"] == "offer" && f["task"] == task)
    }

    fn task_result(h: &mut Harness, app: Session, task: &str) -> Value {
        let m = h.wait_for(app, |f| {
            f["op"] == "message" && f["kind"] == "task_result" && f["body"]["task"] == task
        });
        h.send(app, json!({"op":"ack","seq":m["seq"]}));
        m["body"].clone()
    }

    #[test]
    fn a_refused_job_consumer_is_queued_once_for_all_of_its_workers() {
        // Each session serving the job is told; the frames were made at once, one per
        // worker (every session of the broker may serve it) in the core's queue before
        // any budget saw one, each carrying JetStream's text of the refusal: a server or
        // a responder that misbehaves sets that text's length, up to max_payload.
        const WORKERS: usize = 1024;
        let mut h = bench(3);
        let workers: Vec<Session> = (0..WORKERS).map(|_| worker(&mut h, "w")).collect();
        // An operator's limit of one consumer on the task stream; render's consumer is
        // deleted and its room taken before the broker's new one reaches the server.
        let info = h.nats_request("$JS.API.STREAM.INFO.AMP_TASKS_dev", &[], b"");
        let mut config = info["config"].clone();
        config["max_consumers"] = json!(1);
        let updated = h.nats_request(
            "$JS.API.STREAM.UPDATE.AMP_TASKS_dev",
            &[],
            config.to_string().as_bytes(),
        );
        assert!(updated["error"].is_null(), "{updated}");
        h.mute(0, true);
        let deleted = h.nats_request("$JS.API.CONSUMER.DELETE.AMP_TASKS_dev.job_render", &[], b"");
        assert_eq!(deleted["success"], true, "{deleted}");
        let filler = json!({"stream_name":"AMP_TASKS_dev",
            "config":{"durable_name":"filler","ack_policy":"explicit"}});
        let made = h.nats_request(
            "$JS.API.CONSUMER.CREATE.AMP_TASKS_dev.filler",
            &[],
            filler.to_string().as_bytes(),
        );
        assert!(made["error"].is_null(), "{made}");
        h.mute(0, false);
        // The lost create times out (4 s), and the next, 2 s later, is refused.
        h.hold_output = true;
        h.advance(Duration::from_secs(7));
        let queued = h.broker(0).footprint().queued_outputs;
        h.hold_output = false;
        h.advance(Duration::from_millis(1));
        for &w in &workers {
            let told = h.take(w);
            let refusals = told
                .iter()
                .filter(|f| {
                    f["code"] == "unavailable"
                        && f["message"]
                            .as_str()
                            .is_some_and(|m| m.starts_with("job `render` is not offered"))
                })
                .count();
            assert_eq!(refusals, 1, "{w:?} was told {told:?}");
        }
        assert!(
            queued < 16,
            "one refusal told to {WORKERS} workers left {queued} outputs in the core at once"
        );
    }

    #[test]
    fn heartbeats_leave_one_lease_timer_not_one_each() {
        // Each heartbeat's write re-arms the lease's expiry; the earlier timers used to
        // wait in the table until their own deadlines, so a worker heartbeating at the
        // frame rate under a long lease grew the broker's timer table without bound.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        let before = h.broker(0).footprint().timers;
        for i in 0..5_000 {
            let hb = h.request(w, json!({"op":"heartbeat","task":task}));
            assert_eq!(hb["op"], "ok", "{hb}");
            // Mostly a millisecond apart (the lease ends at a new instant each time),
            // now and then two in the same one (at the same instant again).
            if i % 10 != 0 {
                h.advance(Duration::from_millis(1));
            }
        }
        // The sweep leaves what matters and runs when the table has doubled, or holds a
        // thousand: never 5,000.
        let after = h.broker(0).footprint().timers;
        assert!(
            after <= 2 * before + 1024,
            "{before} timers armed before 5,000 heartbeats, {after} after"
        );
        let done = h.request(w, json!({"op":"complete","task":task}));
        assert_eq!(done["op"], "ok", "{done}");
    }

    #[test]
    fn jobs_nobody_serves_here_any_more_do_not_hold_the_brokers_job_queues() {
        // Any participant that may serve `>` could name 1,024 made-up jobs from a few
        // sessions and close them: the queues stayed, and every job after that was
        // refused on this broker until it restarted.
        let mut h = bench(3);
        for round in 0..(MAX_JOB_QUEUES / MAX_JOBS_PER_SESSION) {
            let serve: Vec<Value> = (0..MAX_JOBS_PER_SESSION)
                .map(|i| json!({"job": format!("junk{round}x{i}"), "slots": 1}))
                .collect();
            let s = h.join(0, &format!("squatter{round}"), json!({"serve": serve}));
            h.close(s);
        }
        let w = h.join(0, "w", json!({}));
        let r = h.request(w, json!({"op":"serve","job":"render","slots":1}));
        assert_eq!(r["op"], "ok", "{r}");
        let app = h.join(0, "app", json!({}));
        let task = submit(&mut h, app, 1);
        let offer = h.wait_for(w, |f| f["op"] == "offer");
        assert_eq!(offer["task"], task, "{offer}");
    }

    #[test]
    fn one_participants_sessions_serve_a_bounded_number_of_jobs_together() {
        // Sessions are bounded per participant (1,024 by default), jobs per session (64):
        // 16 open sessions of one participant that may serve `>` took every job queue
        // of the broker, and every other participant's `serve` was refused while they
        // stayed; across brokers, the namespace's job consumers too.
        let mut h = bench(3);
        let mut squatters = Vec::new();
        let mut refused = 0;
        for round in 0..(MAX_JOB_QUEUES / MAX_JOBS_PER_SESSION) {
            let s = h.join(0, "squatter", json!({}));
            for i in 0..MAX_JOBS_PER_SESSION {
                let job = format!("junk{round}x{i}");
                let r = h.request(s, json!({"op":"serve","job":job,"slots":1}));
                if r["op"] != "ok" {
                    assert_eq!(
                        (&r["code"], &r["path"]),
                        (&json!("forbidden"), &json!("/job")),
                        "{r}"
                    );
                    refused += 1;
                }
            }
            squatters.push(s);
        }
        assert_eq!(refused, MAX_JOB_QUEUES - MAX_JOBS_PER_PARTICIPANT);
        // A job it serves already may be served by more of its sessions.
        let more = h.join(0, "squatter", json!({}));
        let r = h.request(more, json!({"op":"serve","job":"junk0x0","slots":1}));
        assert_eq!(r["op"], "ok", "{r}");
        let w = h.join(0, "w", json!({}));
        let r = h.request(w, json!({"op":"serve","job":"render","slots":1}));
        assert_eq!(r["op"], "ok", "{r}");
        let app = h.join(0, "app", json!({}));
        let task = submit(&mut h, app, 1);
        let offer = h.wait_for(w, |f| f["op"] == "offer");
        assert_eq!(offer["task"], task, "{offer}");
    }

    /// The count of jobs a participant serves here follows every serve, `slots: 0` and
    /// session close. It was counted afresh over every worker at each `serve` of a job
    /// the session had no entry for, and an entry left at `slots: 0` was not one: a
    /// session that stopped its 64 jobs while another took 64 more served its own again
    /// without a check, 128 jobs for one participant.
    #[test]
    fn a_participants_job_count_follows_serve_stop_and_close() {
        let mut h = bench(3);
        let serve = |h: &mut Harness, s: Session, job: &str, slots: u32| {
            h.request(s, json!({"op":"serve","job":job,"slots":slots}))["op"] == "ok"
        };
        let a = h.join(0, "squatter", json!({}));
        for i in 0..MAX_JOBS_PER_PARTICIPANT {
            assert!(serve(&mut h, a, &format!("a{i}"), 1));
        }
        assert!(!serve(&mut h, a, "a-more", 1), "65 jobs");
        for i in 0..MAX_JOBS_PER_PARTICIPANT {
            assert!(serve(&mut h, a, &format!("a{i}"), 0));
        }
        let b = h.join(0, "squatter", json!({}));
        for i in 0..MAX_JOBS_PER_PARTICIPANT {
            assert!(serve(&mut h, b, &format!("b{i}"), 1));
        }
        assert!(
            !serve(&mut h, a, "a0", 1),
            "a stopped job served again past the limit"
        );
        // A job another of its sessions serves is no new job; new slots change nothing.
        let c = h.join(0, "squatter", json!({}));
        assert!(serve(&mut h, c, "b0", 2));
        assert!(serve(&mut h, b, "b0", 3));
        h.close(b);
        // b's close leaves only b0, which c still serves.
        for i in 1..MAX_JOBS_PER_PARTICIPANT {
            assert!(serve(&mut h, a, &format!("a{i}"), 1), "a{i} after b closed");
        }
        assert!(!serve(&mut h, a, "a0", 1), "b0 and a1..a63 are 64");
        assert!(serve(&mut h, c, "b0", 0));
        assert!(serve(&mut h, a, "a0", 1));
    }

    #[test]
    fn task_ids_the_broker_derives_cannot_be_taken_by_a_client() {
        // A worker can compute a letter's redrive id, and anyone who knows a MIG caller's
        // idempotency key its task id: taken first, the real redrive or invoke was refused.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        for task in ["mig-0123abcd", "redrive-00ff"] {
            let r = h.request(
                app,
                json!({"op":"submit","job":"render","task":task,"body":1}),
            );
            assert_eq!(
                (r["code"].as_str(), r["path"].as_str()),
                (Some("schema"), Some("/task")),
                "{r}"
            );
        }
        let r = h.request(
            app,
            json!({"op":"submit","job":"render","task":"my-mig-1","body":1}),
        );
        assert_eq!(r["op"], "ok", "{r}");
    }

    #[test]
    fn a_resubmit_past_the_duplicate_window_stores_no_second_task_message() {
        // A resubmit of a task still `queued` published its message again, so that one
        // never stored (an `unavailable` submit) is; past the stream's 120 s duplicate
        // window that stored one more copy each time (over budget too), each delivered
        // and offered on its own.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let submit = json!({"op":"submit","job":"render","task":"T","body":1,
                            "eligible":{"names":["nobody"]}});
        assert_eq!(h.request(app, submit.clone())["op"], "ok");
        let messages = |h: &Harness| h.server.stream_messages("AMP_TASKS_dev").len();
        assert_eq!(messages(&h), 1);
        h.advance(Duration::from_secs(30));
        let again = h.request(app, submit.clone());
        assert_eq!((&again["op"], &again["dup"]), (&json!("ok"), &json!(true)));
        assert_eq!(
            messages(&h),
            1,
            "within the window the repeat is a duplicate"
        );
        h.advance(Duration::from_secs(100));
        let again = h.request(app, submit);
        assert_eq!((&again["op"], &again["dup"]), (&json!("ok"), &json!(true)));
        assert_eq!(messages(&h), 1, "past it no copy is stored");
    }

    /// Sets `field` of `stream`'s configuration, as an operator's `nats stream edit`.
    fn set_stream_limit(h: &mut Harness, stream: &str, field: &str, value: i64) {
        let info = h.nats_request(&format!("$JS.API.STREAM.INFO.{stream}"), &[], b"");
        let mut config = info["config"].clone();
        config[field] = json!(value);
        let body = config.to_string();
        let update = format!("$JS.API.STREAM.UPDATE.{stream}");
        let r = h.nats_request(&update, &[], body.as_bytes());
        assert!(r.get("error").is_none() && r != Value::Null, "{r}");
    }

    /// Sets the tasks stream's `max_msg_size` (`-1`: none): below a task's size, every
    /// task message is refused as JetStream refuses one at a full stream, say.
    fn limit_task_messages(h: &mut Harness, max_msg_size: i64) {
        set_stream_limit(h, "AMP_TASKS_dev", "max_msg_size", max_msg_size);
    }

    /// Fills the inbox stream (discard `new`): `from` sends one message, and `max_msgs`
    /// becomes what the stream holds, so JetStream refuses the next one (10077).
    /// `app` submits a task and cancels it with the inbox full (filled by sending to
    /// `other`): the cancel's result is refused, and the cancel answered `unavailable`.
    fn cancel_refused_by_a_full_inbox(h: &mut Harness) -> (Session, String, Session, Value) {
        let app = h.join(0, "app", json!({}));
        let task = submit(h, app, 1);
        let other = h.join(0, "other", json!({}));
        fill_inbox(h, app, "other");
        let c = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "unavailable", "{c}");
        (app, task, other, c)
    }

    fn fill_inbox(h: &mut Harness, from: Session, to: &str) {
        let sent = h.request(from, json!({"op":"send","to":to,"body":"filler"}));
        assert_eq!(sent["op"], "ok", "{sent}");
        let held = h.server.stream_messages("AMP_INBOX_dev").len();
        set_stream_limit(h, "AMP_INBOX_dev", "max_msgs", held as i64);
    }

    fn task_results(h: &mut Harness, app: Session) -> Vec<Value> {
        h.take(app)
            .into_iter()
            .filter(|f| f["kind"] == "task_result")
            .collect()
    }

    #[test]
    fn a_task_result_the_full_inbox_refused_is_stored_once_the_inbox_has_room() {
        // A result the submitter's inbox stream refused (full) was given up ("a refusal
        // would only repeat") and the task message acked all the same: nothing was left
        // to publish it again, and the submitter never heard, room or not.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        fill_inbox(&mut h, app, "w1");
        let done = h.request(w, json!({"op":"complete","task":task,"result":{"px":9}}));
        assert_eq!(done["op"], "ok", "{done}");
        h.advance(Duration::from_secs(60));
        assert!(task_results(&mut h, app).is_empty());
        assert_eq!(
            h.server.stream_messages("AMP_TASKS_dev").len(),
            1,
            "the message waits to publish the result again"
        );
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let r = task_result(&mut h, app, &task);
        assert_eq!(
            (&r["state"], &r["result"]["px"]),
            (&json!("completed"), &json!(9))
        );
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
        // Past the inbox's duplicate window: still the one result.
        h.advance(Duration::from_secs(150));
        let late = task_results(&mut h, app);
        assert!(late.is_empty(), "{} more results: {late:?}", late.len());
        assert!(
            h.take(w).iter().all(|f| f["op"] != "offer"),
            "offered again"
        );
    }

    #[test]
    fn a_failed_task_out_of_attempts_whose_result_the_full_inbox_refused_keeps_one_letter_and_tells_later()
     {
        let mut h = bench(1);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        fill_inbox(&mut h, app, "w1");
        let f = h.request(w, json!({"op":"fail","task":task,"error":{"code":"x"}}));
        assert_eq!(f["op"], "ok", "{f}");
        h.advance(Duration::from_secs(150));
        assert!(task_results(&mut h, app).is_empty());
        assert_eq!(h.server.stream_messages("AMP_DLQ_dev").len(), 1);
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        assert_eq!(task_result(&mut h, app, &task)["state"], "failed");
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
        h.advance(Duration::from_secs(150));
        assert!(task_results(&mut h, app).is_empty());
        assert_eq!(h.server.stream_messages("AMP_DLQ_dev").len(), 1);
    }

    #[test]
    fn a_cancel_whose_task_result_the_full_inbox_refused_is_unavailable_until_a_retry_stores_it() {
        // The cancel answered `ok` with no result stored, and its retry `conflict`.
        let mut h = bench(3);
        let (app, task, other, c) = cancel_refused_by_a_full_inbox(&mut h);
        assert!(c["retry_after_ms"].as_u64().is_some(), "{c}");
        // Past the 90 s within which a cancel of a cancelled task republishes its result:
        // none was stored, so the retry still stores it.
        h.advance(Duration::from_secs(100));
        let c = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "unavailable", "still full: {c}");
        h.advance(Duration::from_secs(100));
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let c = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "cancelled");
        let again = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(again["code"], "conflict", "{again}");
        h.advance(Duration::from_secs(10));
        assert!(task_results(&mut h, app).is_empty());
        h.take(other);
    }

    #[test]
    fn a_refused_cancel_result_another_broker_stored_is_not_stored_again_by_a_late_retry() {
        // Broker 0 remembers that every publish it made of the cancel's result was
        // refused, and so republishes it on a retry past the 90 s repeat window; the
        // result a cancel through broker 1 stored meanwhile was stored a second time.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app, task, other, _) = cancel_refused_by_a_full_inbox(&mut h);
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let app_b = h.join(1, "app", json!({}));
        // The record says every publish of the result was refused: the retry of the
        // cancel answered `unavailable`, answered as it once the result is stored.
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "cancelled");
        // Past the inbox's 120 s duplicate window, the retry of the first cancel.
        h.advance(Duration::from_secs(150));
        let c = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "the result is stored: {c}");
        h.advance(Duration::from_secs(10));
        let late = task_results(&mut h, app);
        assert!(late.is_empty(), "{} more results: {late:?}", late.len());
        let stored = h.server.stream_messages("AMP_INBOX_dev");
        let results = stored
            .iter()
            .filter(|m| {
                serde_json::from_slice::<Value>(m.2).is_ok_and(|e| e["body"]["task"] == task)
            })
            .count();
        assert_eq!(results, 1, "task_results stored");
        h.take(other);
        h.take(app_b);
    }

    /// The latest record of `task` in the task store's stream.
    fn last_record(h: &Harness, task: &str) -> Value {
        h.server
            .stream_messages("KV_AMP_TASK_STATE")
            .iter()
            .rev()
            .filter_map(|m| serde_json::from_slice::<Value>(m.2).ok())
            .find(|r| r["id"] == task)
            .expect("record")
    }

    /// The `task_result`s of `task` stored in the namespace's inbox stream.
    fn stored_results(h: &Harness, task: &str) -> usize {
        h.server
            .stream_messages("AMP_INBOX_dev")
            .iter()
            .filter(|m| {
                serde_json::from_slice::<Value>(m.2)
                    .is_ok_and(|e| e["kind"] == "task_result" && e["body"]["task"] == task)
            })
            .count()
    }

    #[test]
    fn a_completion_whose_ack_is_lost_under_a_long_lease_leaves_one_task_result() {
        // The redelivery of a finished task's message publishes its result again, which
        // its message id dedupes within the inbox's duplicate window. That was 120 s
        // whatever the lease: an ack lost under a 300 s lease brought the message back
        // past it, and the submitter got a second `task_result`.
        let mut h = Harness::new(with_lease(300), 1, 7);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        h.lose_write(0, b"$JS.ACK.AMP_TASKS_dev.");
        let done = h.request(w, json!({"op":"complete","task":task}));
        assert_eq!(done["op"], "ok", "{done}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "completed");
        assert_eq!(
            h.server.stream_messages("AMP_TASKS_dev").len(),
            1,
            "ack lost"
        );
        h.advance(Duration::from_secs(420));
        assert!(
            h.server.stream_messages("AMP_TASKS_dev").is_empty(),
            "the redelivery acks the message away"
        );
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
        h.take(app);
    }

    #[test]
    fn a_task_result_refused_for_longer_than_the_record_is_kept_is_stored_once_there_is_room() {
        // The finished record expired after `keep_finished_s` (here 300 s) while the full
        // inbox refused its result: the next redelivery found no record, and the message
        // was terminated as one without a task. The result was never stored.
        let mut h = Harness::new(keeping_finished_records(300), 1, 7);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        fill_inbox(&mut h, app, "w1");
        let done = h.request(w, json!({"op":"complete","task":task,"result":{"px":9}}));
        assert_eq!(done["op"], "ok", "{done}");
        h.advance(Duration::from_secs(900));
        assert!(task_results(&mut h, app).is_empty());
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let r = task_result(&mut h, app, &task);
        assert_eq!(r["result"]["px"], 9, "{r}");
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
        // Stored: the record expires after all, and nothing more is published.
        h.advance(Duration::from_secs(900));
        assert!(task_results(&mut h, app).is_empty());
        let status = h.request(app, json!({"op":"status","task":task}));
        assert_eq!(status["code"], "not_found", "{status}");
        h.take(w);
    }

    #[test]
    fn a_full_inbox_costs_a_refused_result_one_record_write_per_half_its_life() {
        // Each redelivery's refusal rewrote the record to restart its expiry: one write
        // per finished task every 30 s for as long as the inbox stayed full, which anyone
        // with `send` can make it (review 2, finding 4: 2400 an hour for 20 tasks).
        let mut h = Harness::new(keeping_finished_records(300), 1, 7);
        let app = h.join(0, "app", json!({}));
        let w = h.join(0, "w1", json!({"serve":[{"job":"render","slots":4}]}));
        let other = h.join(0, "other", json!({}));
        fill_inbox(&mut h, app, "other");
        const N: u64 = 20;
        for n in 0..N {
            let task = submit(&mut h, app, n);
            offer(&mut h, w, &task);
            assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
            let done = h.request(w, json!({"op":"complete","task":task}));
            assert_eq!(done["op"], "ok", "{done}");
        }
        let writes = |h: &mut Harness| {
            h.nats_request("$JS.API.STREAM.INFO.KV_AMP_TASK_STATE", &[], b"")["state"]["last_seq"]
                .as_u64()
                .unwrap_or(0)
        };
        h.advance(Duration::from_secs(300));
        let before = writes(&mut h);
        h.advance(Duration::from_secs(3600));
        let hour = writes(&mut h) - before;
        // The record lives 303 s here (keep_finished_s 300; the 3 s lease and 300 s).
        let most = N * (3600 / 151 + 1);
        assert!(
            hour <= most,
            "{hour} task-store writes in an hour, {most} at most"
        );
        assert!(hour >= N, "its expiry must still start over: {hour} writes");
        h.take(other);
        h.take(app);
    }

    #[test]
    fn a_cancel_whose_result_is_refused_for_longer_than_the_record_is_kept_is_stored_by_a_retry() {
        // The cancelled record expired `keep_finished_s` (here 300 s) after the cancel,
        // however often its retries were refused meanwhile: the next retry found no task,
        // and the result was never stored.
        let mut h = Harness::new(keeping_finished_records(300), 1, 7);
        let app = h.join(0, "app", json!({}));
        let task = submit(&mut h, app, 1);
        let other = h.join(0, "other", json!({}));
        fill_inbox(&mut h, app, "other");
        for _ in 0..4 {
            let c = h.request(app, json!({"op":"cancel","task":task}));
            assert_eq!(c["code"], "unavailable", "{c}");
            h.advance(Duration::from_secs(200));
        }
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let c = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "cancelled");
        h.take(other);
    }

    #[test]
    fn a_refused_cancel_result_is_stored_by_a_late_retry_through_another_broker() {
        // Only the broker whose publishes were refused knew that none was stored: a retry
        // through another broker past the 90 s repeat window answered `conflict`, and
        // the result was never stored.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app, task, other, _) = cancel_refused_by_a_full_inbox(&mut h);
        h.advance(Duration::from_secs(150));
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let app_b = h.join(1, "app", json!({}));
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(stored_results(&h, &task), 1);
        // Stored once: later retries, here or there, store nothing more (the first
        // broker answers its remembered cancel `ok`, the other `conflict`).
        h.advance(Duration::from_secs(150));
        for s in [app, app_b] {
            let again = h.request(s, json!({"op":"cancel","task":task}));
            assert!(
                again["op"] == "ok" || again["code"] == "conflict",
                "{again}"
            );
        }
        h.advance(Duration::from_secs(10));
        assert_eq!(stored_results(&h, &task), 1);
        h.take(other);
    }

    #[test]
    fn a_cleared_result_refused_is_not_overridden_by_the_refusing_brokers_memory() {
        // Broker 0's publishes of the cancel's result were all refused (the record says
        // result_refused). A retry through broker 1 past the repeat window publishes it:
        // stored, but its PubAck lost, so broker 1 clears the flag (a publish that may
        // have landed). A retry through broker 0 past the inbox's window published it
        // again all the same (its own memory said every publish was refused): a second
        // task_result (review 2, finding 2).
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app, task, other, _) = cancel_refused_by_a_full_inbox(&mut h);
        h.advance(Duration::from_secs(150));
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let app_b = h.join(1, "app", json!({}));
        h.lose_read(1, b"\"stream\":\"AMP_INBOX_dev\"");
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "unavailable", "its PubAck lost: {c}");
        assert_eq!(stored_results(&h, &task), 1, "stored, its PubAck lost");
        let record = last_record(&h, &task);
        assert_eq!(record["state"], "cancelled");
        assert!(record.get("result_refused").is_none(), "cleared: {record}");
        assert!(record.get("result_sent").is_none(), "{record}");
        h.advance(Duration::from_secs(150));
        let c = h.request(app, json!({"op":"cancel","task":task}));
        h.advance(Duration::from_secs(10));
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
        assert_eq!(
            c["code"], "conflict",
            "the record says it may be stored: {c}"
        );
        h.take(other);
        h.take(app_b);
    }

    #[test]
    fn a_refused_repeat_of_a_result_the_cancel_stored_lets_no_late_retry_store_it_again() {
        // A cancel through broker 1 of the task broker 0 just cancelled repeats its
        // result, with no reply to give: that repeat reached the full inbox first and was
        // refused, then broker 0's own publish found room. Broker 1 recorded that every
        // publish of it was refused, and a cancel past the inbox's duplicate window
        // stored a second result (review finding 3).
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app, app_b, other, task) = cancel_with_its_result_held(&mut h, 0);
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "conflict", "{c}");
        assert_eq!(stored_results(&h, &task), 0, "the repeat refused");
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        h.release_writes(0);
        let c = h.wait_for(app, |f| f["re"] == "c0");
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "cancelled");
        // Past the inbox's duplicate window, a cancel through either broker.
        h.advance(Duration::from_secs(150));
        let late: Vec<Value> = [app_b, app]
            .into_iter()
            .map(|s| h.request(s, json!({"op":"cancel","task":task})))
            .collect();
        h.advance(Duration::from_secs(10));
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
        for c in late {
            assert_eq!(c["code"], "conflict", "{c}");
        }
        h.take(other);
        h.take(app_b);
    }

    #[test]
    fn a_cancels_own_publish_landing_after_refused_repeats_is_stored_once() {
        // Broker 1 publishes its refused repeat again on its own; the cancel's publish
        // through broker 0, late on the way, lands between those repeats: the next one is
        // a duplicate, and nothing is stored a second time, then or past the window.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app, app_b, other, task) = cancel_with_its_result_held(&mut h, 1);
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "conflict", "{c}");
        h.advance(Duration::from_secs(5));
        assert_eq!(stored_results(&h, &task), 0, "the repeats refused");
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        h.release_writes(0);
        assert_eq!(stored_results(&h, &task), 1, "the cancel's own publish");
        h.advance(Duration::from_secs(150));
        assert_eq!(
            last_record(&h, &task)["result_sent"],
            true,
            "a repeat found it"
        );
        let late: Vec<Value> = [app_b, app]
            .into_iter()
            .map(|s| h.request(s, json!({"op":"cancel","task":task})))
            .collect();
        h.advance(Duration::from_secs(10));
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
        for c in late {
            assert_eq!(c["code"], "conflict", "{c}");
        }
        h.take(other);
    }

    /// Broker 0 writes the cancel of a task whose submitter's inbox is full (filled by
    /// `other`, joined on broker `other_on`), its publish of the result held on the way;
    /// the submitter (`app` on broker 0) also has a session on broker 1.
    fn cancel_with_its_result_held(
        h: &mut Harness,
        other_on: usize,
    ) -> (Session, Session, Session, String) {
        let app = h.join(0, "app", json!({}));
        let task = submit(h, app, 1);
        let app_b = h.join(1, "app", json!({}));
        let other = h.join(other_on, "other", json!({}));
        fill_inbox(h, app, "other");
        h.hold_writes(0, super::binding::inbox_subject("dev", "app").as_bytes());
        h.send(app, json!({"op":"cancel","id":"c0","task":task}));
        (app, app_b, other, task)
    }

    /// Broker 0 writes the cancel of a task whose submitter's inbox is full, and dies
    /// before its publish of the result leaves; the client's retry through broker 1
    /// finds the task cancelled (`conflict`) and its repeat of the result is refused.
    fn cancel_whose_broker_died_before_publishing(h: &mut Harness) -> (Session, String) {
        let (_, app_b, other, task) = cancel_with_its_result_held(h, 1);
        assert_eq!(last_record(h, &task)["state"], "cancelled", "written");
        h.crash(0);
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["code"], "conflict", "{c}");
        assert_eq!(stored_results(h, &task), 0, "the repeat refused");
        h.take(other);
        (app_b, task)
    }

    #[test]
    fn a_refused_repeat_of_a_result_whose_cancel_broker_died_is_stored_by_a_late_retry() {
        // The refused repeat left `result_refused` alone (the cancel's own publish might
        // land after it), so with that publish never made, a cancel past the repeat
        // window answered `conflict` and no result was ever stored.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app_b, task) = cancel_whose_broker_died_before_publishing(&mut h);
        h.advance(Duration::from_secs(150));
        // Broker 1's own repeats of it, the last refused 80 s after the cancel, found
        // no copy stored (JetStream answers a repeat of one a duplicate, full or not).
        assert_eq!(last_record(&h, &task)["result_refused"], true);
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        let c = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(c["op"], "ok", "{c}");
        assert_eq!(task_result(&mut h, app_b, &task)["state"], "cancelled");
        h.advance(Duration::from_secs(150));
        let again = h.request(app_b, json!({"op":"cancel","task":task}));
        assert_eq!(again["code"], "conflict", "{again}");
        h.advance(Duration::from_secs(10));
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
    }

    #[test]
    fn a_refused_repeat_of_a_result_whose_cancel_broker_died_is_stored_once_there_is_room() {
        // The same with room back inside the repeat window and no cancel after it: the
        // client told `conflict` waits for a result nobody publishes.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (app_b, task) = cancel_whose_broker_died_before_publishing(&mut h);
        h.advance(Duration::from_secs(20));
        set_stream_limit(&mut h, "AMP_INBOX_dev", "max_msgs", -1);
        h.advance(Duration::from_secs(300));
        assert_eq!(stored_results(&h, &task), 1, "task_results stored");
        assert_eq!(task_result(&mut h, app_b, &task)["state"], "cancelled");
    }

    #[test]
    fn refused_repeats_of_a_cancel_dated_ahead_of_the_clock_are_not_made_every_second() {
        // The wait is as long as the cancel is old, read off the wall clock: with the
        // clock stepped back 600 s after the cancel its age was negative, and the broker
        // published the result every second until the clock caught up.
        let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
        let (_, task) = cancel_whose_broker_died_before_publishing(&mut h);
        let spy = h.server.accept(h.now);
        let sub = format!(
            "CONNECT {{\"verbose\":false}}\r\nSUB {} 1\r\n",
            super::binding::inbox_subject("dev", "app")
        );
        h.server.receive(spy, sub.as_bytes(), h.now);
        h.step_wall_clock(Duration::from_secs(600), false);
        h.advance(Duration::from_secs(120));
        let out = String::from_utf8_lossy(&h.server.take_output(spy)).into_owned();
        let repeats = out.matches(task.as_str()).count();
        assert!(repeats <= 10, "{repeats} repeats in 120 s");
        assert_eq!(stored_results(&h, &task), 0, "the inbox is still full");
    }

    #[test]
    fn a_task_id_used_again_gets_its_result_and_letter_under_longer_duplicate_windows() {
        // A result's and a letter's message ids were derived from the task id alone: with
        // the inbox's and the dead letters' duplicate windows lengthened past the finished
        // record's lifetime (an operator's `nats stream edit`), the next use of the id had
        // its result and letter taken for duplicates of the first's, never stored.
        let mut config = keeping_finished_records(300);
        if let Some(job) = config
            .namespaces
            .get_mut("dev")
            .and_then(|ns| ns.jobs.get_mut("render"))
        {
            job.max_attempts = 1;
        }
        let mut h = Harness::new(config, 1, 7);
        let day = (86_400 * NANOS) as i64;
        for stream in ["AMP_INBOX_dev", "AMP_DLQ_dev"] {
            set_stream_limit(&mut h, stream, "duplicate_window", day);
        }
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        for n in [1, 2] {
            let submit = json!({"op":"submit","job":"render","task":"T","body":{"n":n}});
            let ok = h.request(app, submit);
            assert_eq!(
                (&ok["op"], &ok["dup"]),
                (&json!("ok"), &json!(false)),
                "{ok}"
            );
            offer(&mut h, w, "T");
            assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
            let code = format!("e{n}");
            let f = h.request(w, json!({"op":"fail","task":"T","error":{"code":code}}));
            assert_eq!(f["op"], "ok", "{f}");
            let r = task_result(&mut h, app, "T");
            assert_eq!(
                (&r["state"], &r["error"]["code"]),
                (&json!("failed"), &json!(code))
            );
            assert_eq!(h.server.stream_messages("AMP_DLQ_dev").len(), n as usize);
            h.advance(Duration::from_secs(400));
        }
    }

    #[test]
    fn a_task_ids_every_use_out_of_attempts_is_a_mig_notice_of_its_own_with_the_body_as_stored() {
        // The MIG dead-letter notice parsed the body and wrote it again (`9E15` came out
        // as `9000000000000000.0`, keys sorted, white space gone), and its message id was
        // derived from the task id alone: a later use of the id out of attempts was
        // announced under the first use's id, a duplicate to any receiver that keeps ids.
        let mut config = keeping_finished_records(300);
        config.mig.enabled = true;
        if let Some(job) = config
            .namespaces
            .get_mut("dev")
            .and_then(|ns| ns.jobs.get_mut("render"))
        {
            job.max_attempts = 1;
            job.mig = serde_json::from_value(json!({"id": "dev.render"})).ok();
        }
        let mut h = Harness::new(config, 1, 7);
        let listener = h.server.accept(h.now);
        let sub = b"CONNECT {\"headers\":true,\"verbose\":false}\r\nSUB mig.v0_1.dev.dlq.> 1\r\n";
        h.server.receive(listener, sub, h.now);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let bodies = [r#"{"b": 9E15, "a": 1.0e2}"#, r#"[ 1.50, 1e2 ]"#];
        for body in bodies {
            let text =
                format!(r#"{{"op":"submit","id":"raw","job":"render","task":"T","body":{body}}}"#);
            let ok = h.request_text(app, "raw", &text);
            assert_eq!(ok["op"], "ok", "{ok}");
            offer(&mut h, w, "T");
            assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
            let f = h.request(w, json!({"op":"fail","task":"T","error":{"code":"no"}}));
            assert_eq!(f["op"], "ok", "{f}");
            assert_eq!(task_result(&mut h, app, "T")["state"], "failed");
            h.advance(Duration::from_secs(400));
        }
        let out = String::from_utf8_lossy(&h.server.take_output(listener)).into_owned();
        // Each notice's JSON is a line of its own: no body here holds a line break.
        let notices: Vec<&str> = out.split("\r\n").filter(|l| l.starts_with('{')).collect();
        assert_eq!(notices.len(), 2, "{out}");
        let mut ids = Vec::new();
        for (notice, body) in notices.iter().zip(bodies) {
            let payload = format!(r#""payload":{body}"#);
            assert!(notice.contains(&payload), "{body} not as stored: {notice}");
            let v: Value = serde_json::from_str(notice).unwrap_or_else(|e| panic!("{e}: {notice}"));
            assert_eq!(v["task_id"], "T", "{notice}");
            ids.push(v["header"]["message_id"].clone());
        }
        assert!(ids[0].is_string(), "{ids:?}");
        assert_ne!(
            ids[0], ids[1],
            "the second use's notice has the first's message id"
        );
    }

    /// Stores a second copy of a task message, as a republish past the stream's
    /// duplicate window does.
    fn store_copy(h: &mut Harness, payload: &[u8], msg_id: &str) {
        let headers = [("Nats-Msg-Id", msg_id), ("AMP-Kind", "task")];
        let ack = h.nats_request("amp.dev.job.render", &headers, payload);
        assert!(ack["seq"].is_u64(), "copy not stored: {ack}");
    }

    #[test]
    fn a_submit_the_tasks_stream_refused_is_queued_by_a_retry_past_the_duplicate_window() {
        // The record is made before the message: a message JetStream refused left a
        // record `queued` and nothing to deliver. A retry within 90 s published again;
        // a later one was told `ok`, `dup: true`, for a task never offered nor finished.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let submit = json!({"op":"submit","job":"render","task":"T","body":{"n":1}});
        limit_task_messages(&mut h, 16);
        let refused = h.request(app, submit.clone());
        assert_eq!(refused["code"], "unavailable", "{refused}");
        h.advance(Duration::from_secs(100));
        limit_task_messages(&mut h, -1);
        let again = h.request(app, submit);
        assert_eq!(again["op"], "ok", "{again}");
        let w = worker(&mut h, "w1");
        offer(&mut h, w, "T");
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        assert_eq!(
            h.request(w, json!({"op":"complete","task":"T"}))["op"],
            "ok"
        );
        assert_eq!(task_result(&mut h, app, "T")["state"], "completed");
    }

    #[test]
    fn a_reused_task_id_whose_message_was_refused_is_queued_by_its_retry() {
        // The broker remembers the sequence of each task message it stored; a task id
        // used again once its finished record had expired still found the first use's
        // there, and its retry was answered `dup` as if the new message were stored.
        let config = keeping_finished_records(300);
        let mut h = Harness::new(config, 1, 7);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let submit = json!({"op":"submit","job":"render","task":"T","body":{"n":1}});
        assert_eq!(h.request(app, submit.clone())["op"], "ok");
        offer(&mut h, w, "T");
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        assert_eq!(
            h.request(w, json!({"op":"complete","task":"T"}))["op"],
            "ok"
        );
        task_result(&mut h, app, "T");
        h.advance(Duration::from_secs(400));
        let status = h.request(app, json!({"op":"status","task":"T"}));
        assert_eq!(status["code"], "not_found", "the record expired: {status}");
        limit_task_messages(&mut h, 16);
        let refused = h.request(app, submit.clone());
        assert_eq!(refused["code"], "unavailable", "{refused}");
        limit_task_messages(&mut h, -1);
        assert_eq!(h.request(app, submit)["op"], "ok");
        offer(&mut h, w, "T");
    }

    /// Task `T` of `dev/alice` (body `{"n":1}`, headers `{"use":"first"}`) cancelled
    /// through broker 1 while queued: broker 0 stored its message, so the cancel could
    /// not remove it, and it outlives its record, which `wait` lets expire. Session
    /// `submitter` then submits `T` again with `body` and headers `{"use":"second"}`.
    fn reuse_an_id_whose_message_was_left(
        h: &mut Harness,
        alice: Session,
        submitter: Session,
        body: Value,
        wait: impl FnOnce(&mut Harness),
    ) {
        let first = json!({"op":"submit","job":"render","task":"T","body":{"n":1},
                           "headers":{"use":"first"}});
        assert_eq!(h.request(alice, first)["op"], "ok");
        let alice_b = h.join(1, "alice", json!({}));
        let cancel = h.request(alice_b, json!({"op":"cancel","task":"T"}));
        assert_eq!(cancel["op"], "ok", "{cancel}");
        h.close(alice_b);
        let of_t = |h: &Harness| {
            let stored = h.server.stream_messages("AMP_TASKS_dev");
            let id = |m: &(u64, &str, &[u8])| {
                serde_json::from_slice::<Value>(m.2).ok()?["id"]
                    .as_str()
                    .map(String::from)
            };
            stored
                .iter()
                .filter(|m| id(m).as_deref() == Some("T"))
                .count()
        };
        assert_eq!(of_t(h), 1, "the first message stays");
        wait(h);
        let status = h.request(alice, json!({"op":"status","task":"T"}));
        assert_eq!(status["code"], "not_found", "the record expired: {status}");
        let again = json!({"op":"submit","job":"render","task":"T","body":body,
                           "headers":{"use":"second"}});
        let again = h.request(submitter, again);
        assert_eq!((&again["op"], &again["dup"]), (&json!("ok"), &json!(false)));
        assert_eq!(of_t(h), 2, "and waits before the new one");
    }

    /// The `completed` `task_result` of `T` that `app` gets.
    fn completed_result(h: &mut Harness, app: Session) -> Value {
        let m = h.wait_for(app, |f| {
            f["kind"] == "task_result"
                && f["body"]["task"] == "T"
                && f["body"]["state"] == "completed"
        });
        m["body"].clone()
    }

    #[test]
    fn a_task_id_used_again_runs_its_own_body_not_a_message_its_first_use_left() {
        // The record bound itself to whichever message of its id came first: the first
        // use's message, left in the queue by a cancel that could not remove it, was
        // offered under the new record, ran (cancelled as it was), and its result went
        // to the new submitter, whose own task was then terminated as a copy. Someone
        // else reusing the id got alice's body and result; alice herself the old body.
        for reuser in ["mallory", "alice"] {
            let mut h = Harness::new(keeping_finished_records(300), 2, 7);
            let alice = h.join(0, "alice", json!({}));
            let submitter = match reuser {
                "alice" => alice,
                name => h.join(0, name, json!({})),
            };
            let wait = |h: &mut Harness| h.advance(Duration::from_secs(400));
            reuse_an_id_whose_message_was_left(&mut h, alice, submitter, json!({"n":2}), wait);
            let w = worker(&mut h, "w1");
            let o = offer(&mut h, w, "T");
            assert_eq!(
                (&o["body"], &o["from"]),
                (&json!({"n":2}), &json!(format!("dev/{reuser}"))),
                "{o}"
            );
            assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
            let done = h.request(w, json!({"op":"complete","task":"T","result":{"of":2}}));
            assert_eq!(done["op"], "ok", "{done}");
            let r = completed_result(&mut h, submitter);
            assert_eq!(r["result"], json!({"of":2}), "{r}");
            h.advance(Duration::from_secs(10));
            assert!(
                h.take(w).iter().all(|f| f["op"] != "offer"),
                "offered again"
            );
            assert!(
                h.server.stream_messages("AMP_TASKS_dev").is_empty(),
                "the first use's message is terminated"
            );
        }
    }

    #[test]
    fn a_task_id_its_submitter_uses_again_with_the_same_body_runs_the_new_submission() {
        // The earlier message was the record's submission by submitter, job and body,
        // so it was offered (with the cancelled submit's headers) and bound the record,
        // and the new submit's message was terminated as a copy.
        let mut h = Harness::new(keeping_finished_records(300), 2, 7);
        let alice = h.join(0, "alice", json!({}));
        let wait = |h: &mut Harness| h.advance(Duration::from_secs(400));
        reuse_an_id_whose_message_was_left(&mut h, alice, alice, json!({"n":1}), wait);
        let w = worker(&mut h, "w1");
        let o = offer(&mut h, w, "T");
        assert_eq!(o["headers"]["use"], "second", "{o}");
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        let done = h.request(w, json!({"op":"complete","task":"T","result":{"of":2}}));
        assert_eq!(done["op"], "ok", "{done}");
        assert_eq!(completed_result(&mut h, alice)["result"], json!({"of":2}));
        h.advance(Duration::from_secs(10));
        assert!(
            h.take(w).iter().all(|f| f["op"] != "offer"),
            "offered again"
        );
        let mut more = task_results(&mut h, alice);
        more.retain(|f| f["body"]["state"] != "cancelled");
        assert!(more.is_empty(), "{} more results: {more:?}", more.len());
        assert!(
            h.server.stream_messages("AMP_TASKS_dev").is_empty(),
            "the first use's message is terminated"
        );
    }

    #[test]
    fn a_message_with_a_records_use_id_and_another_submission_is_not_offered_as_its_task() {
        // With a use id on both sides the use id alone decided: one who can publish into
        // the task stream and read a queued record's use id (the task store, or the
        // header of the record's own message) had its message, another body or another
        // submitter's, offered as the victim's task (a review finding: only brokers, or
        // who holds JetStream rights in the account, can do so).
        for (from, body) in [
            ("dev/alice", json!({"evil":1})),
            ("dev/mallory", json!({"n":1})),
        ] {
            let mut h = Harness::new(with_lease(LEASE_S), 2, 7);
            let alice = h.join(0, "alice", json!({}));
            let submit = json!({"op":"submit","job":"render","task":"T","body":{"n":1}});
            assert_eq!(h.request(alice, submit)["op"], "ok");
            let use_id = h
                .server
                .stream_messages("KV_AMP_TASK_STATE")
                .iter()
                .find(|m| m.1 == "$KV.AMP_TASK_STATE.dev.T")
                .and_then(|m| serde_json::from_slice::<Value>(m.2).ok())
                .and_then(|r| r["use_id"].as_str().map(String::from))
                .expect("the record's use id");
            let forged = json!({"id":"T","kind":"task","from":from,"job":"render",
                                "ts":"2026-12-07T00:00:00.000Z","body":body});
            let headers = [
                (super::USE_HEADER, use_id.as_str()),
                ("Nats-Msg-Id", "forged"),
            ];
            let ack = h.nats_request(
                "amp.dev.job.render",
                &headers,
                forged.to_string().as_bytes(),
            );
            assert!(ack["seq"].is_u64(), "{ack}");
            // The record's own message is offered on broker 0, so nothing bound the
            // record to it yet when broker 1 is delivered the forged one.
            let w0 = worker(&mut h, "w0");
            let o = offer(&mut h, w0, "T");
            assert_eq!(o["body"], json!({"n":1}), "{o}");
            let w1 = h.join(1, "w1", json!({"serve":[{"job":"render","slots":1}]}));
            // Within w0's offer (`offer_ms` 1000): after it, the task is w1's to take.
            h.advance(Duration::from_millis(300));
            let offered: Vec<Value> = h
                .take(w1)
                .into_iter()
                .filter(|f| f["op"] == "offer")
                .collect();
            assert!(offered.is_empty(), "offered as alice's task: {offered:?}");
            assert_eq!(h.request(w0, json!({"op":"claim","task":"T"}))["op"], "ok");
            let done = h.request(w0, json!({"op":"complete","task":"T","result":1}));
            assert_eq!(done["op"], "ok", "{done}");
            assert_eq!(completed_result(&mut h, alice)["result"], 1);
            h.advance(Duration::from_secs(10));
            assert!(
                h.server.stream_messages("AMP_TASKS_dev").is_empty(),
                "the forged message is terminated"
            );
        }
    }

    #[test]
    fn a_message_of_a_task_ids_first_use_offered_from_its_own_headers_is_not_leased() {
        // A first delivery is offered from the record its message carries, unread: the
        // first use's message, delivered after the id was used again, was offered as the
        // record it carried; its claim's compare-and-set met the new record, read it,
        // and bound it to the old message, which then ran for the new submitter.
        let mut h = Harness::new(keeping_finished_records(300), 2, 7);
        let app = h.join(0, "app", json!({}));
        let alice = h.join(0, "alice", json!({}));
        let mallory = h.join(0, "mallory", json!({}));
        // Its one slot busy, the worker pulls nothing while the id expires and is reused.
        let w = worker(&mut h, "w1");
        let busy = submit(&mut h, app, 0);
        offer(&mut h, w, &busy);
        assert_eq!(h.request(w, json!({"op":"claim","task":busy}))["op"], "ok");
        // Stored well after the broker saw the consumer: its record is trusted unread.
        h.advance(Duration::from_secs(1));
        assert_eq!(
            h.request(w, json!({"op":"heartbeat","task":busy}))["op"],
            "ok"
        );
        let wait = |h: &mut Harness| {
            for _ in 0..200 {
                h.advance(Duration::from_secs(2));
                let hb = h.request(w, json!({"op":"heartbeat","task":busy}));
                assert_eq!(hb["op"], "ok", "{hb}");
            }
        };
        reuse_an_id_whose_message_was_left(&mut h, alice, mallory, json!({"n":2}), wait);
        assert!(
            h.take(w).iter().all(|f| f["op"] != "offer"),
            "nothing offered while the slot is busy"
        );
        assert_eq!(
            h.request(w, json!({"op":"complete","task":busy}))["op"],
            "ok"
        );
        // The old message comes first, offered unread (README: such an offer's claim
        // answers `lease_lost`); it is not leased, and terminated.
        let o = offer(&mut h, w, "T");
        assert_eq!(o["body"], json!({"n":1}), "{o}");
        let claim = h.request(w, json!({"op":"claim","task":"T"}));
        assert_eq!(claim["code"], "lease_lost", "{claim}");
        let o = offer(&mut h, w, "T");
        assert_eq!(
            (&o["body"], &o["from"]),
            (&json!({"n":2}), &json!("dev/mallory")),
            "{o}"
        );
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        let done = h.request(w, json!({"op":"complete","task":"T","result":{"of":2}}));
        assert_eq!(done["op"], "ok", "{done}");
        assert_eq!(completed_result(&mut h, mallory)["result"], json!({"of":2}));
        h.advance(Duration::from_secs(10));
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
    }

    #[test]
    fn a_dead_letter_refused_past_the_duplicate_window_leaves_one_task_result() {
        // A letter that could not be stored NAKs the task message for a redelivery that
        // stores it then; each redelivery announced the outcome again, and once the
        // inbox's 120 s duplicate window had passed the submitter got a second
        // `task_result` (and another every second after that).
        let mut h = bench(1);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let dlq = h.nats_request("$JS.API.STREAM.INFO.AMP_DLQ_dev", &[], b"")["config"].clone();
        let gone = h.nats_request("$JS.API.STREAM.DELETE.AMP_DLQ_dev", &[], b"");
        assert_eq!(gone["success"], true, "{gone}");
        // Kept from being made again: a stream on one of its subjects.
        let blocker = json!({"name":"BLOCKER","subjects":["amp.dev.dlq.nobody"]});
        let made = h.nats_request(
            "$JS.API.STREAM.CREATE.BLOCKER",
            &[],
            blocker.to_string().as_bytes(),
        );
        assert!(made.get("error").is_none(), "{made}");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        let f = h.request(w, json!({"op":"fail","task":task,"error":{"code":"x"}}));
        assert_eq!(f["op"], "ok", "{f}");
        assert_eq!(task_result(&mut h, app, &task)["state"], "failed");
        h.advance(Duration::from_secs(150));
        let results = |h: &mut Harness| {
            h.take(app)
                .into_iter()
                .filter(|f| f["kind"] == "task_result")
                .collect::<Vec<Value>>()
        };
        let late = results(&mut h);
        assert!(late.is_empty(), "{} more results: {late:?}", late.len());
        assert_eq!(
            h.server.stream_messages("AMP_TASKS_dev").len(),
            1,
            "the message waits for its letter"
        );
        // The stream back: the letter is stored, the message goes, no result follows.
        let gone = h.nats_request("$JS.API.STREAM.DELETE.BLOCKER", &[], b"");
        assert_eq!(gone["success"], true, "{gone}");
        let made = h.nats_request(
            "$JS.API.STREAM.CREATE.AMP_DLQ_dev",
            &[],
            dlq.to_string().as_bytes(),
        );
        assert!(made.get("error").is_none(), "{made}");
        h.advance(Duration::from_secs(5));
        assert_eq!(h.server.stream_messages("AMP_DLQ_dev").len(), 1);
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
        assert!(results(&mut h).is_empty());
    }

    #[test]
    fn a_submit_whose_message_was_refused_and_never_retried_leaves_no_record_for_good() {
        // The record is made before the message: one whose message JetStream refused
        // stayed `queued` with nothing to deliver, and nothing ever removed it.
        let config = keeping_finished_records(300);
        let mut h = Harness::new(config, 1, 7);
        let app = h.join(0, "app", json!({}));
        let status =
            |h: &mut Harness, task: &str| h.request(app, json!({"op":"status","task":task}));
        limit_task_messages(&mut h, 16);
        for task in ["A", "B"] {
            let r = h.request(
                app,
                json!({"op":"submit","job":"render","task":task,"body":1}),
            );
            assert_eq!(r["code"], "unavailable", "{r}");
        }
        limit_task_messages(&mut h, -1);
        // B's retry stores its message: B is kept as long as it waits (nobody serves the
        // job yet), A, never retried, goes as a finished record would.
        h.advance(Duration::from_secs(30));
        let r = h.request(
            app,
            json!({"op":"submit","job":"render","task":"B","body":1}),
        );
        assert_eq!((&r["op"], &r["dup"]), (&json!("ok"), &json!(true)), "{r}");
        assert_eq!(status(&mut h, "A")["task"]["state"], "queued");
        h.advance(Duration::from_secs(400));
        let a = status(&mut h, "A");
        assert_eq!(a["code"], "not_found", "{a}");
        assert_eq!(status(&mut h, "B")["task"]["state"], "queued");
        let w = worker(&mut h, "w1");
        offer(&mut h, w, "B");
        // A's id is free again, and a retry of A now is a task like any other.
        let r = h.request(
            app,
            json!({"op":"submit","job":"render","task":"A","body":1}),
        );
        assert_eq!((&r["op"], &r["dup"]), (&json!("ok"), &json!(false)), "{r}");
    }

    #[test]
    fn a_resubmit_jetstream_refuses_leaves_the_record_of_a_queued_task_alone() {
        // A resubmit on another broker past the duplicate window publishes again; that
        // publish refused said nothing of the first, whose message still waits, yet the
        // record was given an expiry: the message, delivered after it, found no record
        // and was terminated, a task answered `ok` lost.
        let config = keeping_finished_records(300);
        let mut h = Harness::new(config, 2, 7);
        let app = h.join(0, "app", json!({}));
        let r = h.request(
            app,
            json!({"op":"submit","job":"render","task":"T","body":1}),
        );
        assert_eq!((&r["op"], &r["dup"]), (&json!("ok"), &json!(false)), "{r}");
        h.advance(Duration::from_secs(130));
        limit_task_messages(&mut h, 16);
        let again = h.join(1, "app", json!({}));
        let r = h.request(
            again,
            json!({"op":"submit","job":"render","task":"T","body":1}),
        );
        assert_eq!(r["code"], "unavailable", "{r}");
        limit_task_messages(&mut h, -1);
        h.advance(Duration::from_secs(400));
        let status = h.request(app, json!({"op":"status","task":"T"}));
        assert_eq!(status["task"]["state"], "queued", "{status}");
        let w = worker(&mut h, "w1");
        offer(&mut h, w, "T");
    }

    /// Tasks a copy of whose message is stored: each copy is delivered, and each
    /// must be known as the task's second message, not taken for the task's own.
    #[test]
    fn a_second_message_of_a_finished_task_publishes_no_second_result() {
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let task = submit(&mut h, app, 1);
        let stored = h.server.stream_messages("AMP_TASKS_dev");
        let payload = stored
            .first()
            .map(|m| m.2.to_vec())
            .expect("the task message");
        let w = worker(&mut h, "w1");
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        assert_eq!(
            h.request(w, json!({"op":"complete","task":task}))["op"],
            "ok"
        );
        task_result(&mut h, app, &task);
        // Past the inbox's duplicate window, a second result would be a second message.
        h.advance(Duration::from_secs(150));
        store_copy(&mut h, &payload, "copy");
        h.advance(Duration::from_secs(10));
        let late: Vec<Value> = h
            .take(app)
            .into_iter()
            .filter(|f| f["kind"] == "task_result")
            .collect();
        assert!(late.is_empty(), "a second result: {late:?}");
        assert!(
            h.take(w).iter().all(|f| f["op"] != "offer"),
            "offered again"
        );
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
    }

    #[test]
    fn a_second_message_of_a_leased_task_is_neither_offered_nor_taken_for_the_lease() {
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let task = submit(&mut h, app, 1);
        let stored = h.server.stream_messages("AMP_TASKS_dev");
        let payload = stored
            .first()
            .map(|m| m.2.to_vec())
            .expect("the task message");
        let w1 = worker(&mut h, "w1");
        offer(&mut h, w1, &task);
        assert_eq!(h.request(w1, json!({"op":"claim","task":task}))["op"], "ok");
        let w2 = worker(&mut h, "w2");
        store_copy(&mut h, &payload, "copy");
        // The holder heartbeats through several lease lengths; the copy comes meanwhile.
        for _ in 0..6 {
            h.advance(Duration::from_secs(1));
            let hb = h.request(w1, json!({"op":"heartbeat","task":task}));
            assert_eq!(hb["op"], "ok", "{hb}");
        }
        assert!(
            h.take(w2).iter().all(|f| f["op"] != "offer"),
            "copy offered"
        );
        // Gone at once, not taken for the lease's message (whose in-progress acks then
        // went to the copy, and the task's own message came back after the result).
        assert_eq!(h.server.stream_messages("AMP_TASKS_dev").len(), 1);
        assert_eq!(
            h.request(w1, json!({"op":"complete","task":task}))["op"],
            "ok"
        );
        assert_eq!(task_result(&mut h, app, &task)["attempts"], 1);
        h.advance(Duration::from_secs(150));
        let late: Vec<Value> = h
            .take(app)
            .into_iter()
            .filter(|f| f["kind"] == "task_result")
            .collect();
        assert!(late.is_empty(), "a second result: {late:?}");
        let offers: Vec<Value> = [w1, w2]
            .into_iter()
            .flat_map(|w| h.take(w))
            .filter(|f| f["op"] == "offer")
            .collect();
        assert!(offers.is_empty(), "offered again: {offers:?}");
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
    }

    #[test]
    fn a_resubmit_through_another_broker_past_the_window_queues_one_task_not_two() {
        // That broker cannot tell whether the first message was stored: it stores it
        // again, and the copy that is not the record's is terminated unoffered.
        let mut config = harness::development_config();
        let job = Job {
            lease_s: LEASE_S,
            offer_ms: 1000,
            ..Job::default()
        };
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.jobs.insert("render".into(), job);
        }
        let mut h = Harness::new(config, 2, 7);
        let app0 = h.join(0, "app", json!({}));
        let app1 = h.join(1, "app", json!({}));
        let submit = json!({"op":"submit","job":"render","task":"T","body":{"n":1}});
        assert_eq!(h.request(app0, submit.clone())["op"], "ok");
        h.advance(Duration::from_secs(130));
        let again = h.request(app1, submit);
        assert_eq!((&again["op"], &again["dup"]), (&json!("ok"), &json!(true)));
        assert_eq!(h.server.stream_messages("AMP_TASKS_dev").len(), 2);
        let w = worker(&mut h, "w1");
        offer(&mut h, w, "T");
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        assert_eq!(
            h.request(w, json!({"op":"complete","task":"T"}))["op"],
            "ok"
        );
        task_result(&mut h, app0, "T");
        h.advance(Duration::from_secs(150));
        assert!(
            h.take(w).iter().all(|f| f["op"] != "offer"),
            "offered twice"
        );
        let late: Vec<Value> = [app0, app1]
            .into_iter()
            .flat_map(|a| h.take(a))
            .filter(|f| f["kind"] == "task_result")
            .collect();
        assert!(late.is_empty(), "a second result: {late:?}");
        assert!(h.server.stream_messages("AMP_TASKS_dev").is_empty());
    }

    /// One attempt per task, and 64 KiB that a session may be sent at once: the memory
    /// budget of all connections (`buffered`), below the 4 MiB outbound bound, or that
    /// bound.
    fn with_a_room_of_64_kib(buffered: bool) -> Harness {
        let mut config = with_lease(LEASE_S);
        if buffered {
            config.limits.max_buffered_bytes = 64 << 10;
        } else {
            config.limits.max_outbound_bytes = 64 << 10;
        }
        if let Some(job) = config
            .namespaces
            .get_mut("dev")
            .and_then(|ns| ns.jobs.get_mut("render"))
        {
            job.max_attempts = 1;
        }
        Harness::new(config, 1, 7)
    }

    fn within_a_small_memory_budget() -> Harness {
        with_a_room_of_64_kib(true)
    }

    /// A task of `app`'s with `body`, taken by `w` and ended with `end` (a `complete` or
    /// `fail` frame without its task).
    fn ended(h: &mut Harness, (app, body): (Session, &str), w: Session, end: Value) -> String {
        let ok = h.request(app, json!({"op":"submit","job":"render","body":body}));
        let task = ok["task"].as_str().unwrap_or_else(|| panic!("{ok}"));
        let task = task.to_string();
        offer(h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        let mut end = end;
        end["task"] = json!(task);
        let done = h.request(w, end);
        assert_eq!(done["op"], "ok", "{done}");
        task
    }

    #[test]
    fn a_status_past_what_a_session_may_be_sent_at_once_is_refused_as_too_large() {
        // The budget sheds the connection holding the most once past it: an answer
        // larger than the whole budget would close the asker. Before, it was sent.
        let mut h = within_a_small_memory_budget();
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let result = json!({"op":"complete","result":"x".repeat(100 << 10)});
        let big = ended(&mut h, (app, "b"), w, result);
        let status = h.request(app, json!({"op":"status","task":big}));
        let text = status.to_string();
        assert_eq!(
            (status["op"].as_str(), status["code"].as_str()),
            (Some("error"), Some("too_large")),
            "{} bytes: {}",
            text.len(),
            &text[..text.len().min(300)]
        );
        let small = ended(
            &mut h,
            (app, "s"),
            w,
            json!({"op":"complete","result":"done"}),
        );
        let status = h.request(app, json!({"op":"status","task":small}));
        assert_eq!(status["task"]["result"], "done", "{status}");
    }

    #[test]
    fn a_large_dead_letter_starts_a_page_of_its_own_and_hides_no_other() {
        // A page took a letter before checking its bytes: the small letter before a
        // large one and the large one made a page past the asker's room, answered
        // `too_large` without its `next`, so neither they nor any later letter could be
        // paged to.
        let mut h = with_a_room_of_64_kib(false);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let fail = json!({"op":"fail","error":{"code":"no","message":"no"}});
        let tasks: Vec<String> = [4 << 10, 60 << 10, 4 << 10]
            .iter()
            .map(|&n| ended(&mut h, (app, &"z".repeat(n)), w, fail.clone()))
            .collect();
        let listed = page_through_letters(&mut h, app, |page| {
            assert_eq!(page["op"], "ok", "{}", page["code"]);
            for l in page["letters"].as_array().into_iter().flatten() {
                // Past three quarters of the room alone, it comes without its body.
                let large = l["task"] == tasks[1];
                assert_eq!(l["body_omitted"] == true, large, "{}", l["task"]);
            }
        });
        assert_eq!(listed, tasks);
    }

    #[test]
    fn a_letter_whose_numbers_grow_when_written_again_hides_no_later_letter() {
        // A page was sized by its letters' stored bytes but showed each body parsed and
        // written again: `9E15` (4 bytes) came out as `9000000000000000.0` (18), so a
        // letter under three quarters of the room made a page past it, answered
        // `too_large` without its `next`: neither it nor any later letter could be paged
        // to (a review finding).
        let mut h = with_a_room_of_64_kib(false);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let fail = json!({"op":"fail","error":{"code":"no","message":"no"}});
        let first = ended(&mut h, (app, "a"), w, fail.clone());
        // About 20 KiB as sent and stored: alone on its page, and whole.
        let numbers = vec!["9E15"; 4000].join(",");
        let text = format!(r#"{{"op":"submit","id":"raw","job":"render","body":[{numbers}]}}"#);
        let ok = h.request_text(app, "raw", &text);
        let big = ok["task"]
            .as_str()
            .unwrap_or_else(|| panic!("{ok}"))
            .to_string();
        offer(&mut h, w, &big);
        assert_eq!(h.request(w, json!({"op":"claim","task":big}))["op"], "ok");
        let mut end = fail.clone();
        end["task"] = json!(big);
        assert_eq!(h.request(w, end)["op"], "ok");
        let last = ended(&mut h, (app, "c"), w, fail);
        let listed = page_through_letters(&mut h, app, |page| {
            assert_eq!(page["op"], "ok", "{}", page["message"]);
            for l in page["letters"].as_array().into_iter().flatten() {
                if l["task"] == big.as_str() {
                    let shown = l["body"].as_array().map(Vec::len);
                    assert_eq!(shown, Some(4000), "{}", l["body_omitted"]);
                }
            }
        });
        assert_eq!(listed, [first, big, last]);
    }

    /// The tasks of every letter of `render`'s dead letters, asked page after page (at
    /// most 10) by `app`; `check` sees each page.
    fn page_through_letters(
        h: &mut Harness,
        app: Session,
        mut check: impl FnMut(&Value),
    ) -> Vec<String> {
        let mut listed = Vec::new();
        let mut from = None;
        for _ in 0..10 {
            let mut req = json!({"op":"dead_letters","job":"render"});
            if let Some(seq) = from {
                req["from"] = json!({"seq": seq});
            }
            let page = h.request(app, req);
            check(&page);
            for l in page["letters"].as_array().into_iter().flatten() {
                listed.push(l["task"].as_str().unwrap_or_default().to_string());
            }
            from = page["next"]["seq"].as_u64();
            if from.is_none() {
                break;
            }
        }
        listed
    }

    #[test]
    fn dead_letter_pages_stay_within_what_a_session_may_be_sent_at_once() {
        // Pages grew to 256 KiB of letters whatever the memory budget: past it, the
        // asker would be shed. Now a quarter of what a session may be sent at once.
        let mut h = within_a_small_memory_budget();
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        // Bodies of 12 KiB (a submit's body is held within a quarter of the budget).
        let body = "y".repeat(12 << 10);
        let fail = json!({"op":"fail","error":{"code":"no","message":"no"}});
        let tasks: Vec<String> = (0..6)
            .map(|_| ended(&mut h, (app, &body), w, fail.clone()))
            .collect();
        let room = 64 << 10;
        let listed = page_through_letters(&mut h, app, |page| {
            let size = page.to_string().len();
            assert_eq!(page["op"], "ok", "{size} bytes");
            assert!(size < room, "a page of {size} bytes for a room of {room}");
        });
        assert_eq!(listed, tasks);
    }

    /// `with_lease(LEASE_S)` whose job keeps finished records `s` seconds.
    fn keeping_finished_records(s: u64) -> crate::broker::config::Config {
        let mut config = with_lease(LEASE_S);
        if let Some(job) = config
            .namespaces
            .get_mut("dev")
            .and_then(|ns| ns.jobs.get_mut("render"))
        {
            job.keep_finished_s = s;
        }
        config
    }

    fn with_lease(lease_s: u64) -> crate::broker::config::Config {
        let mut config = harness::development_config();
        let job = Job {
            lease_s,
            offer_ms: 1000,
            ..Job::default()
        };
        if let Some(ns) = config.namespaces.get_mut("dev") {
            ns.jobs.insert("render".into(), job);
        }
        config
    }

    fn job_consumer(h: &mut Harness) -> Value {
        h.nats_request("$JS.API.CONSUMER.INFO.AMP_TASKS_dev.job_render", &[], b"")
    }

    const NANOS: u64 = 1_000_000_000;

    #[test]
    fn a_reload_that_changes_lease_s_changes_the_job_consumers_ack_wait() {
        // The consumer was made once, with the lease_s of its day: a reload changed the
        // broker's lease_s and not the consumer's AckWait, which spec 2.4 says it is.
        let mut h = Harness::new(with_lease(30), 1, 7);
        worker(&mut h, "w1");
        assert_eq!(job_consumer(&mut h)["config"]["ack_wait"], 30 * NANOS);
        h.reload(with_lease(120));
        let info = job_consumer(&mut h);
        assert_eq!(info["config"]["ack_wait"], 120 * NANOS, "{info}");
    }

    #[test]
    fn a_reload_that_lengthens_a_lease_lengthens_the_inbox_and_dead_letter_windows() {
        // The window that keeps a repeated result or letter a duplicate must outlast the
        // lease (`a_completion_whose_ack_is_lost_under_a_long_lease_leaves_one_task_result`);
        // the streams were made under the lease the broker started with.
        let mut h = Harness::new(with_lease(30), 1, 7);
        let window = |h: &mut Harness, stream: &str| {
            let info = h.nats_request(&format!("$JS.API.STREAM.INFO.{stream}"), &[], b"");
            info["config"]["duplicate_window"].clone()
        };
        for stream in ["AMP_INBOX_dev", "AMP_DLQ_dev"] {
            assert_eq!(window(&mut h, stream), 120 * NANOS, "{stream}");
        }
        h.reload(with_lease(300));
        for stream in ["AMP_INBOX_dev", "AMP_DLQ_dev"] {
            assert_eq!(window(&mut h, stream), 390 * NANOS, "{stream}");
        }
        assert_eq!(window(&mut h, "AMP_TASKS_dev"), 120 * NANOS);
    }

    #[test]
    fn brokers_reloaded_together_with_different_leases_leave_the_longest_window() {
        // Each broker read the 120 s window, then updated it to its own need from that
        // read: the 300 s lease's 390 s landed after the 600 s lease's 690 s, and an ack
        // lost under the 600 s lease gave a second result (review finding 5).
        let mut h = Harness::new(with_lease(30), 2, 7);
        h.reload_each(&[with_lease(600), with_lease(300)]);
        for stream in ["AMP_INBOX_dev", "AMP_DLQ_dev"] {
            let info = h.nats_request(&format!("$JS.API.STREAM.INFO.{stream}"), &[], b"");
            assert_eq!(info["config"]["duplicate_window"], 690 * NANOS, "{stream}");
        }
    }

    #[test]
    fn a_window_a_stale_update_lowered_after_the_read_back_is_raised_again() {
        // The 300 s lease's update, made from the 120 s both brokers read, landed after
        // the 600 s broker had read its 690 s back: the window stayed at 390 s until that
        // broker started again or reloaded a longer lease.
        let mut h = Harness::new(with_lease(30), 2, 7);
        h.hold_writes(1, b"STREAM.UPDATE.AMP_INBOX_dev");
        h.reload_each(&[with_lease(600), with_lease(300)]);
        let window = |h: &mut Harness| {
            let info = h.nats_request("$JS.API.STREAM.INFO.AMP_INBOX_dev", &[], b"");
            info["config"]["duplicate_window"].clone()
        };
        assert_eq!(window(&mut h), 690 * NANOS, "raised and read back");
        h.release_writes(1);
        assert_eq!(window(&mut h), 390 * NANOS, "taken back");
        h.advance(Duration::from_secs(30));
        assert_eq!(window(&mut h), 690 * NANOS, "raised again");
    }

    #[test]
    fn a_lease_made_longer_by_a_reload_is_not_redelivered_while_it_runs() {
        // With the consumer's AckWait still at the old 3 s and the broker keeping the
        // message by a 10 s one, JetStream redelivered a leased task every 3 s.
        let mut h = Harness::new(with_lease(3), 1, 7);
        let app = h.join(0, "app", json!({}));
        // A free slot keeps a pull out, which a redelivery would answer.
        let w = h.join(0, "w1", json!({"serve":[{"job":"render","slots":2}]}));
        h.reload(with_lease(10));
        let task = submit(&mut h, app, 1);
        let o = offer(&mut h, w, &task);
        assert_eq!(o["lease_s"], 10, "{o}");
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        h.advance(Duration::from_secs(8));
        let info = job_consumer(&mut h);
        assert_eq!(
            (&info["delivered"]["consumer_seq"], &info["num_redelivered"]),
            (&json!(1), &json!(0)),
            "{info}"
        );
        assert_eq!(
            h.request(w, json!({"op":"complete","task":task}))["op"],
            "ok"
        );
        assert_eq!(task_result(&mut h, app, &task)["attempts"], 1);
    }

    #[test]
    fn a_submit_naming_a_mig_capability_in_its_headers_still_gets_its_task_result() {
        // Only the MIG front's own submits are answered as MIG replies; the header took
        // any task for one (a redriven MIG letter keeps it), and its result went nowhere.
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let ok = h.request(
            app,
            json!({"op":"submit","job":"render","task":"T","body":1,
                   "headers":{"mig_capability":"acme.render"}}),
        );
        assert_eq!(ok["op"], "ok", "{ok}");
        offer(&mut h, w, "T");
        assert_eq!(h.request(w, json!({"op":"claim","task":"T"}))["op"], "ok");
        assert_eq!(
            h.request(w, json!({"op":"complete","task":"T"}))["op"],
            "ok"
        );
        assert_eq!(task_result(&mut h, app, "T")["state"], "completed");
    }

    #[test]
    fn a_task_goes_from_submit_to_one_result() {
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        let o = offer(&mut h, w, &task);
        assert_eq!(
            (o["attempt"].as_u64(), o["body"]["n"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        let hb = h.request(w, json!({"op":"heartbeat","task":task,"progress":0.5}));
        assert_eq!(hb["op"], "ok", "{hb}");
        let done = h.request(w, json!({"op":"complete","task":task,"result":{"px":9}}));
        assert_eq!(done["op"], "ok", "{done}");
        let r = task_result(&mut h, app, &task);
        assert_eq!(r["state"], "completed");
        assert_eq!(r["result"]["px"], 9);
        assert_eq!(r["attempts"], 1);
        let again = h.request(w, json!({"op":"complete","task":task}));
        assert_eq!(again["code"], "lease_lost", "{again}");
    }

    #[test]
    fn a_lease_that_runs_out_is_revoked_and_the_task_offered_again_until_attempts_are_spent() {
        let mut h = bench(2);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        for attempt in 1..=2u64 {
            let o = offer(&mut h, w, &task);
            assert_eq!(o["attempt"].as_u64(), Some(attempt), "{o}");
            assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
            // The worker goes silent; the lease runs out on the virtual clock.
            let revoked = h.wait_for(w, |f| f["op"] == "revoked");
            assert_eq!(revoked["reason"], "lease_expired", "{revoked}");
            let late = h.request(w, json!({"op":"complete","task":task}));
            assert_eq!(late["code"], "lease_lost", "{late}");
        }
        let r = task_result(&mut h, app, &task);
        assert_eq!(
            (r["state"].as_str(), r["attempts"].as_u64()),
            (Some("failed"), Some(2))
        );
        h.advance(Duration::from_secs(4 * LEASE_S));
        let offers: Vec<Value> = h
            .take(w)
            .into_iter()
            .filter(|f| f["op"] == "offer")
            .collect();
        assert!(offers.is_empty(), "a failed task offered again: {offers:?}");
    }

    #[test]
    fn an_offer_left_unclaimed_goes_to_another_worker_without_spending_an_attempt() {
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let idle = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        let first = offer(&mut h, idle, &task);
        let busy = worker(&mut h, "w2");
        h.send(idle, json!({"op":"serve","job":"render","slots":0}));
        let o = offer(&mut h, busy, &task);
        assert_eq!(
            (first["attempt"].as_u64(), o["attempt"].as_u64()),
            (Some(1), Some(1))
        );
        assert_eq!(
            h.request(busy, json!({"op":"claim","task":task}))["op"],
            "ok"
        );
        let stale = h.request(idle, json!({"op":"claim","task":task}));
        assert_eq!(stale["code"], "lease_lost", "{stale}");
        assert_eq!(
            h.request(busy, json!({"op":"complete","task":task}))["op"],
            "ok"
        );
        assert_eq!(task_result(&mut h, app, &task)["attempts"], 1);
    }

    #[test]
    fn a_cancelled_task_tells_its_holder_and_its_submitter() {
        let mut h = bench(3);
        let app = h.join(0, "app", json!({}));
        let w = worker(&mut h, "w1");
        let task = submit(&mut h, app, 1);
        offer(&mut h, w, &task);
        assert_eq!(h.request(w, json!({"op":"claim","task":task}))["op"], "ok");
        let ok = h.request(app, json!({"op":"cancel","task":task}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let revoked = h.wait_for(w, |f| f["op"] == "revoked");
        assert_eq!(revoked["reason"], "cancelled");
        assert_eq!(task_result(&mut h, app, &task)["state"], "cancelled");
    }

    /// A broker restarted with the same `--broker-id` numbers its sessions as the last
    /// process did, and a second process started under the same id before the first
    /// stopped (a rolling deploy) has the same numbers at the same time. A lease named its
    /// holder `<broker id>/<session>`: a refused write whose record showed that name's
    /// running lease was taken as the session's own (`adopt_lease`), so another
    /// process's session became the holder of a lease it never claimed.
    #[test]
    fn two_processes_under_one_broker_id_never_name_a_session_alike() {
        use crate::broker::clock::Clock;
        use crate::ids::IdSource;
        let config = harness::development_config();
        let clock = Clock::new(std::time::Instant::now(), harness::WALL_MS);
        let process = |seed: u8| {
            super::Jobs::new("b1", &config, clock, IdSource::from_seed([seed; 32])).expect("jobs")
        };
        let (old, new) = (process(1), process(2));
        assert_ne!(old.session_name(1 << 32), new.session_name(1 << 32));
        assert_eq!(old.session_name(7), old.session_name(7));
    }
}
