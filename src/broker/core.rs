//! The broker's sans-IO core: AMP sessions in, NATS operations and session frames out.
//!
//! The core owns no socket and reads no clock. The runtime hands it session events (opened,
//! text frame, closed), NATS events (deliveries, request replies) and `now`; the core
//! answers by writing NATS operations into the connection it is given and by queueing
//! frames and closes for sessions (`poll_output`). Every JetStream round trip is a
//! continuation stored under its request id (`Pending`), so nothing ever waits.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::admission::Admission;
use super::api_queue::{ApiQueue, Lane};
use super::auth::{self, Credential};
use super::binding::{self, StreamSettings};
use super::bounded_map::BoundedMap;
use super::budget::{Budget, BudgetConfig, Budgets, KvOp, KvOpKind, KvReply, Settled, Spend};
use super::callout::{AUTH_CALLOUT_QUEUE, AUTH_CALLOUT_SUBJECT, Callout, CalloutConfig, Outcome};
use super::clock::Clock;
use super::config::{Config, Participant};
use super::continuations::{Continuation, Continuations};
use super::dead_letters;
use super::envelope::{self, Envelope, EnvelopeView, Kind};
use super::held_bytes::Hold;
use super::id_map::{IdMap, IdSet};
use super::ids::IdSource;
use super::in_flight;
use super::jobs::{Caller, Jobs, JobsOutput};
use super::mig::config::readable_dead_letters;
use super::outstanding::Outstanding;
use super::permissions::{self, Action};
use super::pull_loop::{Check, PullLoop, Pulled};
use super::rate_limit::{self, RateLimiter};
use super::registry::{Change, Registry};
use super::reload;
use super::remake::{self, Remakes};
use super::scoped_jwt;
use super::setup;
use super::throttle::{HelloThrottle, ThrottleConfig, Verdict};
use super::timers::{Timers, Wake};
use crate::amp::frame::{self as amp_frame, Auth, ClientFrame, Hello};
use crate::amp::reply::{self, FrameWriter};
use crate::amp::{AmpError, ErrorCode, FrameValidator, Rejected};
use crate::deadline::after;
use crate::jetstream::ack::{AckKind, AckMetadata};
use crate::jetstream::api::check_error;
use crate::jetstream::kv::{WatchAction, WatchRequestKind};
use crate::jetstream::publish::{parse_pub_ack, pub_ack_seq};
use crate::jetstream::{ConsumerAction, ConsumerConfig, Delivery, JsError, Request};
use crate::nats::{Connection, Event, Message, RequestError, RequestId, Sid};
use crate::nkeys::KeyPair;
use crate::proto::headers::HeaderMap;
use crate::ws::metrics::{AmpMetrics, NatsOp, SeriesCache};
use registry::{Fanout, Snapshot};

mod identity;
mod inbox;
mod mig_front;
mod policy;
mod registry;
mod resumed_durable;
mod session;
mod topics;

/// A WebSocket session, as numbered by the transport.
pub type SessionId = u64;

/// What the core asks the transport to do. A [`Output::Frame`]'s text is handed back
/// with [`Broker::frame_done`], saying whether its session took it.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Frame {
        session: SessionId,
        text: String,
    },
    Close {
        session: SessionId,
        code: u16,
        reason: String,
    },
    /// The session's participant logged in: the transport stops counting it among the
    /// connections waiting for a hello (which may be pushed out for room) and lifts
    /// their smaller output bound. Comes before the hello's answer.
    LoggedIn {
        session: SessionId,
    },
    /// Hand the core [`Input::Drained`] for this session once what was queued for it
    /// is written (the rest of a `watch`'s presence snapshot waits for it).
    WhenDrained {
        session: SessionId,
    },
}

/// An entry of the core's output queue. Presence changes are kept once, not as a frame
/// per watcher: their frames are made one at a time as [`Broker::poll_output`] takes
/// them, so the runtime can stop taking at its memory budget. One end of a registry
/// resync tells every watcher thousands of `down`s at once: as frames, names times
/// watchers of them were in the queue (a million for 5,000 names and 200 watchers)
/// before any budget saw one.
#[derive(Debug)]
enum Queued {
    One(Output),
    Presence(Fanout),
    /// The same frame for each of these sessions, each one's copy made as it is taken:
    /// the `error` told to every session of a participant, or every worker of a job,
    /// whose consumer JetStream refused. As a frame each, up to 1,024 copies (every
    /// worker, for a job) waited here at once, each as long as the text of the refusal
    /// the server's answer carries.
    Each {
        to: std::vec::IntoIter<SessionId>,
        text: String,
    },
}

impl From<Output> for Queued {
    fn from(output: Output) -> Queued {
        Queued::One(output)
    }
}

/// What the runtime hands the core. The core touches no socket, clock or random source:
/// every input comes with the `now` it happened at, and everything the core wants done
/// comes back as an [`Output`] (to sessions) or as commands on the sans-IO NATS
/// [`Connection`] it is lent (bytes the runtime writes to the server).
#[derive(Debug)]
pub enum Input<'a> {
    /// A WebSocket session was upgraded.
    SessionOpened {
        session: SessionId,
        peer: SocketAddr,
    },
    /// A text frame of a session.
    Frame { session: SessionId, text: &'a str },
    /// A session ended (closed by either side, or its transport failed), with the close
    /// code and, for a close of the broker's, its reason (a peer's is not logged).
    SessionClosed {
        session: SessionId,
        code: u16,
        reason: &'a str,
        by_peer: bool,
    },
    /// What the NATS connection reported: up (with the server's facts) or down, a
    /// message on one of the core's subscriptions, a reply or a failed request.
    Nats(Event),
    /// What ingress connection `which` ([`Broker::start_ingress`]) reported, with the
    /// INFO `server_id` of the server it is connected to (none while it is not: a
    /// callout is trusted only from a server this broker is connected to); the core is
    /// handed the main connection with it, for the answers.
    Ingress {
        which: Ingress,
        event: Event,
        server_id: Option<&'a str>,
    },
    /// A deadline [`Broker::poll_timeout`] gave has passed.
    Timeout,
    /// What [`Output::WhenDrained`] asked for: the session's queued output is written.
    Drained { session: SessionId },
}

impl Input<'_> {
    /// A session its peer closed normally (1000): what the simulator's and the tests'
    /// transports report.
    pub fn closed(session: SessionId) -> Input<'static> {
        Input::SessionClosed {
            session,
            code: 1000,
            reason: "",
            by_peer: true,
        }
    }
}

/// Sizes of what the core holds ([`Broker::footprint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    pub sessions: usize,
    pub present_participants: usize,
    /// NATS round trips waiting for their reply.
    pub in_flight: usize,
    /// Topic subscriptions' API requests out or waiting their turn.
    pub topic_requests: usize,
    /// `watch` snapshots not yet all sent.
    pub presence_snapshots: usize,
    /// Participants whose registry section this broker keeps track of (present here, or
    /// its removal still out).
    pub registry_sections: usize,
    /// Offer watches of the jobs engine (one per task offered here and not yet settled).
    pub offer_watches: usize,
    pub timers: usize,
    pub held_submits: usize,
    /// Outputs not yet taken with `poll_output` (a presence fan-out counts one, as does
    /// a frame for several sessions).
    pub queued_outputs: usize,
    /// The most requests one session has unanswered.
    pub max_session_outstanding: usize,
    /// The most inbox deliveries one session has unacknowledged.
    pub max_session_inflight: usize,
}

/// WebSocket close codes the core uses.
pub mod close {
    pub const NORMAL: u16 = 1000;
    pub const GOING_AWAY: u16 = 1001;
    pub const POLICY: u16 = 1008;
    /// Reported for a peer gone without a close frame; never sent.
    pub const ABNORMAL: u16 = 1006;
}

/// How long a JetStream request may take before the client hears `unavailable`: under
/// the 5 s within which a fleet request caught by a dying leaf link must be answered,
/// with a second to spare for the answer's way back on a loaded node.
const JS_TIMEOUT: Duration = Duration::from_secs(4);
/// `retry_after_ms` of a submit refused because too many wait for a budget reservation:
/// about one reservation round trip under load.
const HELD_SUBMIT_RETRY_MS: u64 = 1000;

impl SessionState {
    /// Past its hello and not closed by the broker.
    fn is_active(&self) -> bool {
        matches!(self, SessionState::Active { .. })
    }

    /// The participant of a session past its hello (closing or not).
    fn participant(&self) -> Option<(&str, &str)> {
        match self {
            SessionState::Active { ns, name } => Some((ns, name)),
            SessionState::Closing {
                participant: Some((ns, name)),
            } => Some((ns, name)),
            _ => None,
        }
    }
}

enum SessionState {
    AwaitingHello {
        nonce: [u8; 32],
    },
    /// Shared, so handing them to each frame's handler costs no copy.
    Active {
        ns: Rc<str>,
        name: Rc<str>,
    },
    /// Closed by the broker, waiting for the transport to report the end. An active
    /// session keeps its participant, so the end still releases what the session held
    /// (presence, inbox reader, registry entry).
    Closing {
        participant: Option<(Rc<str>, Rc<str>)>,
    },
}

/// A submit's or redrive's charges against its participant's policy.
#[derive(Debug, Default)]
struct Charge {
    /// A task of the budget.
    budget: bool,
    /// The rate, as [`Broker::take_rate`] charged it.
    rate: Option<u64>,
}

struct Session {
    state: SessionState,
    /// The client's address, for throttling failed hellos.
    peer: SocketAddr,
    /// Its participant's configuration entry from `hello` on, the configuration's own
    /// (a reload puts the new one in): a `send` reads its permissions and policy here,
    /// not by its name in the configuration's maps.
    entry: Option<Arc<Participant>>,
    /// The recipient its last `send` found in the configuration: a `send` to it again is
    /// not looked up by name in the configuration's maps. A reload forgets it.
    last_to: Option<Box<str>>,
    /// Ids of requests not yet answered (they must be unique while outstanding).
    outstanding: Outstanding,
    /// What those of them that are submits or redrives took of the participant's limits:
    /// one the jobs engine refuses having created nothing gives it back.
    charged: HashMap<String, Charge>,
    /// Requests in flight of its participant, shared from `hello` on with its other
    /// sessions and its MIG requests (`in_flight`): the session moves it only with
    /// `outstanding`, so it cannot drift.
    participant_outstanding: Rc<Cell<usize>>,
    /// Inbox deliveries not yet acknowledged: stream sequence -> ack subject.
    inflight: IdMap<u64, String>,
    /// Those of them JetStream gave again to a sibling session here (their ack wait ran
    /// out): still this session's to acknowledge (JetStream takes an ack of a stream
    /// sequence from any of its deliveries' subjects), never handed back, as a NAK would
    /// take the message from the sibling holding it now. At most `inbox_window`.
    moved: IdMap<u64, String>,
    subs: HashMap<String, topics::Subscription>,
    /// Consumers of subscriptions this session ended, their deletes not yet answered:
    /// they count against its subscriptions, or subscribe/unsubscribe would queue
    /// deletes without bound.
    deleting: usize,
}

/// A participant with at least one live session on this broker.
struct Presence {
    sessions: Vec<SessionId>,
    /// The labels its first session declared, and with the configuration's on top the
    /// ones in force: a reload recomputes those from these.
    declared: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    since: String,
    inbox: PullLoop,
    /// Sessions sent an inbox delivery that have not written their output since. The
    /// inbox pulls again once any of the participant's sessions has written its output
    /// (an empty queue), and the sessions still here then are `held`: the new pull's
    /// messages go to the others while there are any. Waiting for all of them let one
    /// session that stopped reading, its output kept short of its bound, hold every
    /// sibling to one pull per 15 s; sending it more would fill it to its bound instead.
    /// Sets: the choice of a delivery's session asks of each session whether it is held.
    unwritten: IdSet<SessionId>,
    held: IdSet<SessionId>,
    /// JetStream's refusal of the inbox consumer and how many times in a row: the
    /// participant's sessions are told, and the broker asks again ever more slowly.
    inbox_refused: Option<(u32, Box<str>)>,
    /// Whether a change of its registry entry waits for `REGISTRY_WRITE_GAP` to pass
    /// (`Timer::RegistryFlush`).
    registry_due: bool,
    /// Entries its sessions' `who`, `watch` and `dead_letters` may still look at
    /// (`limits.presence_listed_per_s`): the participant's, not each session's, or its
    /// rate grew with its sessions.
    listing: rate_limit::DebtBucket,
    /// Its registry entry as this broker writes it. Kept here while it is present: in
    /// tables of their own, keyed by participant, every refresh (a third of the TTL)
    /// made them again, 3 MB a wave at 10,000 participants. While its leaving is written
    /// (and the write gap and the last refresh timer run) they are in `registry_kept`.
    registry: registry::Written,
}

/// Whose pull loop a check timer is for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum PullOwner {
    Inbox(String),
    Sub(SessionId, String),
}

/// A continuation of the core, opaque to the table that keeps it.
pub struct Awaiting(Pending);

/// An inbox delivery a confirmed ack took from its session: stream sequence, ack
/// subject, and whether the session held it or it had moved to a sibling.
struct Kept {
    seq: u64,
    ack_subject: String,
    moved: bool,
}

/// A JetStream round trip waiting for its reply.
enum Pending {
    /// A `send` stored in an inbox, or a `publish` in the topics stream (`topic`):
    /// answer `ok {seq, dup}`. `charged`: the sender's rate, given back if nothing was
    /// stored.
    Send {
        session: SessionId,
        re: String,
        charged: Option<u64>,
        topic: bool,
    },
    /// An ack the client asked to be confirmed; the inbox delivery it took from the
    /// session, given back if it fails.
    AckSync {
        session: SessionId,
        re: String,
        keep: Option<Kept>,
    },
    /// The inbox consumer of a participant was created or found.
    InboxConsumer { participant: String },
    /// A compare-and-set write of this broker's section of a participant's registry
    /// entry; failures other than a refusal are logged, the next refresh retries.
    RegistryWrite { participant: String },
    /// A read of a participant's registry entry after a write was refused.
    RegistryRead { participant: String },
    /// A request of a namespace's registry watch.
    Watch { ns: String, kind: WatchRequestKind },
    /// A read or compare-and-set write of a participant's task budget.
    Budget { op: KvOp },
    /// Whether a durable subscription's consumer exists (its create config waits here).
    SubLookup {
        to: topics::SubRef,
        config: Box<ConsumerConfig>,
    },
    /// A subscription's consumer was created.
    SubConsumer(topics::SubRef),
    /// A subscription's consumer made anew (a plain one after a gap, a lost one).
    SubReset {
        session: SessionId,
        sub: String,
        serial: u64,
        consumer: String,
    },
    /// Where a namespace's topics stream stands, for the subscriptions waiting in
    /// `stream_checks`.
    StreamState { ns: String },
    /// A consumer's delete after `unsubscribe`: answer `ok` once it is done.
    SubDeleted { session: SessionId, re: String },
    /// A plain subscription's consumer deleted after its session or its consumer ended;
    /// one an ended subscription left counts against its participant (`ns/name`) until
    /// answered (a reset's, whose subscription lives on, does not).
    ConsumerGone { owner: Option<String> },
    /// A page of consumer names, counting a participant's durables.
    DurableCount(topics::DurableCount),
    /// Unacknowledged events of an ended durable subscription wait to be handed back.
    HandBack {
        stream: String,
        consumer: String,
        acks: Vec<String>,
        looks: u8,
    },
    /// A stream found gone, made again (`remake.rs`).
    Remake(remake::Key),
    /// A stream whose duplicate window a reload lengthened: read (`what` none), then
    /// updated (`what` it changed), then read again; `updates` sent so far
    /// (`setup::WINDOW_UPDATES`); `recheck`: the read [`WINDOW_RECHECK`] after the last.
    WindowRaise {
        key: remake::Key,
        what: Option<String>,
        updates: u8,
        recheck: bool,
    },
}

impl Pending {
    /// The kind of NATS operation this request is, for the round-trip histogram.
    fn op(&self) -> NatsOp {
        match self {
            Pending::Send { .. } => NatsOp::StreamPublish,
            Pending::AckSync { .. } => NatsOp::AckSync,
            Pending::InboxConsumer { .. }
            | Pending::SubConsumer(_)
            | Pending::SubReset { .. }
            | Pending::Watch {
                kind: WatchRequestKind::CreateConsumer { .. },
                ..
            } => NatsOp::ConsumerCreate,
            Pending::Watch {
                kind: WatchRequestKind::DeleteConsumer,
                ..
            }
            | Pending::SubDeleted { .. }
            | Pending::ConsumerGone { .. } => NatsOp::ConsumerDelete,
            Pending::SubLookup { .. } | Pending::HandBack { .. } => NatsOp::ConsumerInfo,
            Pending::StreamState { .. } => NatsOp::StreamInfo,
            Pending::Remake(_) => NatsOp::StreamCreate,
            Pending::WindowRaise { what: None, .. } => NatsOp::StreamInfo,
            Pending::WindowRaise { .. } => NatsOp::StreamUpdate,
            Pending::DurableCount(_) => NatsOp::ConsumerList,
            Pending::RegistryWrite { .. } => NatsOp::KvPut,
            Pending::RegistryRead { .. } => NatsOp::KvGet,
            Pending::Budget { op } => match op.kind {
                KvOpKind::Get => NatsOp::KvGet,
                KvOpKind::Write { .. } => NatsOp::KvPut,
            },
        }
    }

    /// Went out through the sessions' API queue (`Broker::api_request`).
    fn queued(&self) -> bool {
        matches!(
            self,
            Pending::SubLookup { .. }
                | Pending::SubConsumer(_)
                | Pending::SubReset { .. }
                | Pending::StreamState { .. }
                | Pending::SubDeleted { .. }
                | Pending::ConsumerGone { .. }
                | Pending::DurableCount(_)
                | Pending::HandBack { .. }
        )
    }

    /// A delete the session asked for (`unsubscribe`), counted in `Session::deleting`.
    fn deleting_for(&self) -> Option<SessionId> {
        match self {
            Pending::SubDeleted { session, .. } => Some(*session),
            _ => None,
        }
    }
}

/// The connections of its own that what untrusted parties send comes on
/// ([`Broker::start_ingress`]), each read at its own pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ingress {
    /// The auth callout's requests: whoever connects to the server makes one. Apart from
    /// MIG's, which any participant may flood, so that a flood there keeps no NATS client
    /// from logging in.
    Callout,
    /// MIG's requests but PUBLISH: any participant may send them, they are small, and a
    /// flood of them had better be read a little each turn.
    Requests,
    /// `mig.v0_1.<ns>.events.>`: PUBLISH requests, and, on the same subjects, every live
    /// event of the namespace's topics, which the brokers publish (those published over
    /// AMP included) and get back in their queue group: read at the pace the broker
    /// makes them, as the main connection is.
    Events,
}

impl std::fmt::Display for Ingress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ingress::Callout => "callout",
            Ingress::Requests => "requests",
            Ingress::Events => "events",
        })
    }
}

/// An ingress connection's side of the core ([`Broker::start_ingress`]).
#[derive(Default)]
struct IngressSubs {
    /// Its subscriptions, by its own sids; made only while the main connection is up
    /// ([`Broker::tend_ingress`]).
    routes: IdMap<Sid, Route>,
    subscribed: bool,
    /// A failure to subscribe was logged, and none succeeded since.
    failure_logged: bool,
}

enum Route {
    /// Shared: every delivery hands it on.
    Inbox {
        participant: Rc<str>,
    },
    /// `$SYS.REQ.USER.AUTH`: the server asks who a connecting client is.
    Callout,
    /// A MIG request subject ([`super::mig::Mig::request_subscriptions`]).
    MigRequest,
    Registry {
        ns: String,
    },
    Sub {
        session: SessionId,
        sub: String,
    },
    /// Durable take-overs by other brokers' sessions.
    DurableTakeover,
}

/// A timer of the core, opaque to the table that keeps it.
pub struct Alarm(Timer);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Timer {
    HelloTimeout(SessionId),
    RegistryRefresh(String),
    /// A pull loop's check, of the generation it was filed with.
    PullCheck(PullOwner, u64),
    /// A namespace's registry watch is due (a retry, or silence), of that generation.
    RegistryWatch {
        ns: String,
        generation: u64,
    },
    /// The inbox consumer request of a present participant was lost (NATS went away
    /// while it was in flight): ask again, or its inbox is never read.
    InboxConsumerRetry(String),
    /// A resumed durable subscription (session, sub, serial) stops waiting for the events
    /// its consumer had out (`core/resumed_durable.rs`).
    ResumeWait(SessionId, String, u64),
    /// A subscription (session, sub, serial) whose consumer could not be made again
    /// (JetStream away) tries again.
    SubRetry(SessionId, String, u64),
    /// A participant's registry entry changed within `REGISTRY_WRITE_GAP` of its last
    /// write: written now.
    RegistryFlush(String),
    /// A stream found gone whose create failed is asked for again.
    Remake(remake::Key),
    /// The duplicate window this broker raised and read back is read once more, after
    /// that many updates (see [`WINDOW_RECHECK`]).
    WindowRecheck(remake::Key, u8),
}

/// How long after a reload's raise of a duplicate window was read back the window is
/// read once more: an update another broker made from a read taken before ours, sent
/// before our read-back, lands within a request's timeout (`JS_TIMEOUT`) if it matters to
/// its sender, and may take the window back after our read-back. The stream's
/// configuration has no compare-and-set to refuse it.
const WINDOW_RECHECK: Duration = Duration::from_secs(10);

/// How long after a lost inbox consumer request it is sent again.
const INBOX_CONSUMER_RETRY: Duration = Duration::from_secs(1);
/// Inbox consumer creations out at once: nats-server creates a few hundred durables a
/// second, so this many are answered well within `JS_TIMEOUT` with room left in its API
/// queue for everything else.
const INBOX_CREATES_IN_FLIGHT: usize = 32;
/// Topic subscriptions' API requests out at once, every session's together (see
/// `api_queue.rs`): with the inbox creations' share, what this broker can have in
/// nats-server's API queue stays answered well within `JS_TIMEOUT`.
const SESSION_API_IN_FLIGHT: usize = 16;
/// `retry_after_ms` of a subscribe refused while the session's unsubscribed consumers
/// are still being deleted: about one delete's round trip under load.
const DELETING_RETRY_MS: u64 = 250;
/// `retry_after_ms` of a hello refused because its participant holds its share of the
/// broker's sessions: a client should not come straight back.
const SESSIONS_FULL_RETRY_MS: u64 = 5000;
/// The longest wait between two requests for an inbox consumer JetStream refused.
const INBOX_REFUSED_RETRY_MAX: Duration = Duration::from_secs(60);
/// A NATS server error is logged at most this often (each is counted): a publish refused
/// for every message would write a line per message.
const SERVER_ERROR_LOG_EVERY: Duration = Duration::from_secs(60);

pub struct Broker {
    config: Config,
    validator: FrameValidator,
    broker_id: String,
    /// Boxed, as is `presence`: a table has up to twice the slots of its entries, and a
    /// slot of the struct itself would cost its size for every empty one.
    sessions: IdMap<SessionId, Box<Session>>,
    presence: HashMap<String, Box<Presence>>,
    /// Inbox consumer creations, a few out at a time (see `admission.rs`).
    inbox_creates: Admission,
    /// Participants a reload listed in a namespace with an `open` entry, whose inbox
    /// consumers are made before they log in (start-up makes the others' in `setup.rs`):
    /// made-up names must not take their room.
    kept_inboxes: HashSet<String>,
    /// Present participants whose labels a reload changed: their registry entries are
    /// written again (a reload has no connection to write them on).
    relabeled: Vec<String>,
    /// Inbox and dead-letter streams whose duplicate window a reload lengthened (a
    /// longer lease): raised as start-up would (`setup::duplicate_window_update`).
    window_raises: Vec<remake::Key>,
    /// Topic subscriptions' API requests, a few out at a time, participants taking turns
    /// (by key, see [`Broker::lane`]).
    api: ApiQueue<(Request, Pending, Instant), String>,
    /// Set while `send_api_requests` runs: what it completes may queue more.
    api_sending: bool,
    /// Sessions that sent `watch`, by namespace: each change is told to them without a
    /// look at every session.
    watchers: HashMap<String, BTreeSet<SessionId>>,
    /// Watchers whose first `up`s are still being sent, a burst per drained output.
    snapshots: HashMap<SessionId, Snapshot>,
    /// Topic subscriptions of every session.
    topic_subs: usize,
    /// And of each participant (`ns/name`) with any.
    participant_subs: HashMap<String, usize>,
    /// Deletes of consumers its ended subscriptions left, per participant, not yet answered.
    participant_deleting: HashMap<String, usize>,
    /// Durable consumers being created here, per participant (see `durable_count_done`).
    durables_creating: HashMap<String, HashSet<String>>,
    /// Their consumers' deletes not yet answered: they count against
    /// `max_topic_subscriptions` too, so what waits in `api` stays bounded.
    topic_deleting: usize,
    /// Subscriptions whose consumers were lost, waiting to hear where their namespace's
    /// stream stands (`Pending::StreamState`): one question per namespace.
    stream_checks: HashMap<String, BTreeSet<(SessionId, String, u64)>>,
    /// Durable subscriptions' hand-backs under way, by (stream, consumer).
    hand_backs: BTreeMap<(String, String), topics::HandBack>,
    /// Every NATS round trip in flight, of every capability.
    continuations: Continuations,
    metrics: AmpMetrics,
    /// Where `frames_in` and `frames_out` count each op, by the op's number.
    frames_in: SeriesCache<{ amp_frame::Op::ALL.len() }>,
    frames_out: SeriesCache<{ amp_frame::server_op::ALL.len() }>,
    /// When a NATS server error was last logged, and those counted since without a line.
    server_error_logged: Option<Instant>,
    server_errors_unlogged: u64,
    routes: IdMap<Sid, Route>,
    /// The subscriptions of the ingress connections ([`Broker::start_ingress`]), by
    /// [`Ingress`]; none when what untrusted parties send shares `routes`.
    ingress: Option<[IngressSubs; 3]>,
    /// Durable subscriptions' pull subscriptions left at the last reconnect
    /// ([`PullLoop::retire`]): what the server sent on them before it had the UNSUB
    /// comes ahead of the new pull's events, and goes to the session in that order.
    /// Bounded by the durable subscriptions of that moment; replaced at the next.
    retired_pulls: HashMap<Sid, (SessionId, String)>,
    /// Every deadline, of every capability.
    timers: Timers,
    out: VecDeque<Queued>,
    throttle: HelloThrottle,
    rates: RateLimiter,
    /// Per namespace: the registry mirror and the subscriptions its watch asked for.
    registries: HashMap<String, (Registry, HashMap<String, Sid>)>,
    /// Numbers generated subscription and consumer names.
    next_sub: u64,
    /// Tells this broker process from earlier ones with the same id (made from the seed).
    incarnation: String,
    /// Offers, claims, leases and the task store.
    jobs: Jobs,
    /// With an issuer account: `hello` returns a scoped user JWT, and the broker answers
    /// the NATS auth callout.
    callout: Option<Callout>,
    issuer: Option<KeyPair>,
    /// Task budgets counted in JetStream, shared by every broker.
    budgets: Budgets,
    /// Streams and buckets found gone, being made again as start-up made them.
    remakes: Remakes,
    stream_settings: StreamSettings,
    /// Submits waiting for a budget reservation, per participant.
    held_submits: HashMap<String, Vec<(SessionId, ClientFrame, Hold)>>,
    /// Participants with an inbox consumer retry armed, and when (`Timer::InboxConsumerRetry`).
    inbox_retrying: HashMap<String, Instant>,
    /// The `listing` buckets of participants whose last session ended before they were
    /// full again, taken up by their next hello: logging in again must not refill one.
    listing_debts: BoundedMap<String, rate_limit::DebtBucket>,
    /// What this broker knows of the registry entries of participants no longer present,
    /// while it matters (a present one's is in its `Presence`).
    registry_kept: registry::Kept,
    /// The MIG/NATS front end over the same jobs.
    mig: super::mig::Mig,
    /// Each participant's requests in flight, its sessions' and its MIG requests'.
    in_flight: in_flight::Tally,
    /// Wall time at each `now` (timestamps, JWT times, budget windows).
    clock: Clock,
    /// Writes every `send`'s `ts`, keeping the text of the last second.
    stamps: crate::rfc3339::MillisWriter,
    /// Ids of messages and events sent without an idempotency key.
    ids: IdSource,
    /// Hello challenges.
    nonces: IdSource,
    /// The last stored envelope's text and headers, emptied and written again by the
    /// next: every `send` stores one.
    store_scratch: (String, HeaderMap),
    /// The last `send`'s envelope and inbox subject, their strings emptied and written
    /// again by the next (each at most a participant key, an id or a timestamp long).
    send_scratch: (Option<Box<Envelope>>, String),
    /// Frames' buffers handed back by the shell once done with their text
    /// ([`frame_done`](Self::frame_done)), for the `ok` and `message` frames every message
    /// makes: at most `SPARE_FRAMES`, each at most `SPARE_FRAME_BYTES`.
    spare_frames: Vec<String>,
}

/// Frame buffers kept for reuse, and the largest kept.
const SPARE_FRAMES: usize = 32;
const SPARE_FRAME_BYTES: usize = 16 << 10;

impl Broker {
    /// A broker that reads no clock and no random source of its own: `clock` gives the
    /// wall time at every `now` it is handed, and `seed` (32 secret random bytes; the
    /// runtime draws them from the OS, see [`super::clock`]) makes every generated id and
    /// hello challenge. Fails if the built-in frame schema does not compile.
    pub fn new(
        config: Config,
        broker_id: String,
        clock: Clock,
        seed: [u8; 32],
    ) -> Result<Broker, String> {
        let root = IdSource::from_seed(seed);
        let jobs = Jobs::new(&broker_id, &config, clock, root.derive("jobs"))?;
        let mig = super::mig::Mig::new(&broker_id, clock, root.derive("mig"))?;
        let metrics = AmpMetrics::new();
        Ok(Broker {
            config,
            validator: FrameValidator::new()?,
            broker_id,
            sessions: IdMap::default(),
            presence: HashMap::new(),
            inbox_creates: Admission::new(INBOX_CREATES_IN_FLIGHT),
            kept_inboxes: HashSet::new(),
            relabeled: Vec::new(),
            window_raises: Vec::new(),
            api: ApiQueue::new(SESSION_API_IN_FLIGHT),
            api_sending: false,
            watchers: HashMap::new(),
            snapshots: HashMap::new(),
            topic_subs: 0,
            participant_subs: HashMap::new(),
            participant_deleting: HashMap::new(),
            durables_creating: HashMap::new(),
            topic_deleting: 0,
            stream_checks: HashMap::new(),
            hand_backs: BTreeMap::new(),
            continuations: Continuations::default(),
            frames_in: SeriesCache::new(metrics.frames_in),
            frames_out: SeriesCache::new(metrics.frames_out),
            metrics,
            server_error_logged: None,
            server_errors_unlogged: 0,
            routes: IdMap::default(),
            ingress: None,
            retired_pulls: HashMap::new(),
            timers: Timers::default(),
            out: VecDeque::new(),
            throttle: HelloThrottle::new(ThrottleConfig::default()),
            rates: RateLimiter::new(65_536),
            registries: HashMap::new(),
            next_sub: 0,
            incarnation: root.derive("incarnation").next_id()[..8].to_string(),
            jobs,
            callout: None,
            issuer: None,
            budgets: Budgets::new(BudgetConfig::default()),
            remakes: Remakes::default(),
            stream_settings: StreamSettings::default(),
            held_submits: HashMap::new(),
            inbox_retrying: HashMap::new(),
            listing_debts: BoundedMap::new(registry::LISTING_DEBTS),
            registry_kept: registry::Kept::default(),
            mig,
            in_flight: Default::default(),
            clock,
            stamps: Default::default(),
            ids: root.derive("core"),
            nonces: root.derive("nonces"),
            store_scratch: Default::default(),
            send_scratch: Default::default(),
            spare_frames: Vec::new(),
        })
    }

    /// Issues scoped user JWTs signed by `issuer` (an account key) in `hello`, and serves
    /// the NATS auth callout with the same participants.
    /// `server_keys` pins the nats-servers whose callout requests are answered (see
    /// [`CalloutConfig::trusted_servers`]); the configuration's `callout.server_keys` are added.
    pub fn with_issuer(mut self, issuer: KeyPair, server_keys: &[String]) -> Broker {
        let mut callout = CalloutConfig::new(issuer.clone());
        callout.trusted_servers = server_keys.to_vec();
        for key in &self.config.callout.server_keys {
            if !callout.trusted_servers.contains(key) {
                callout.trusted_servers.push(key.clone());
            }
        }
        self.callout = Some(Callout::new(callout));
        self.mig.set_issuer(issuer.public_key());
        self.issuer = Some(issuer);
        self
    }

    /// The settings start-up made the streams with (`--replicas`): a stream found gone
    /// is made again with them.
    pub fn with_stream_settings(mut self, settings: StreamSettings) -> Broker {
        self.stream_settings = settings;
        self
    }

    /// Ready unless a stream or bucket found gone is not back yet (named), for `/readyz`.
    pub fn readiness(&self) -> Result<(), String> {
        self.remakes.readiness()
    }

    /// The ingress connections what untrusted parties may send wants: the auth callout's
    /// requests (anyone who connects to the server) and MIG requests (any participant
    /// with a NATS credential), which nats-server delivers as fast as they are sent, and
    /// MIG's live events. They had better come on connections of their own
    /// ([`Broker::start_ingress`]).
    pub fn ingresses(&self) -> Vec<Ingress> {
        let wanted = self.untrusted_subscriptions();
        [Ingress::Callout, Ingress::Requests, Ingress::Events]
            .into_iter()
            .filter(|which| wanted.iter().any(|(w, ..)| w == which))
            .collect()
    }

    /// Takes what untrusted parties send (see [`Broker::ingresses`]) off the connection
    /// [`Broker::start`] is given, onto connections of its own: call it before `start`,
    /// then [`Broker::tend_ingress`] with each turn's events, and hand their events in as
    /// [`Input::Ingress`]. A flood there then waits in the server ahead of nothing else,
    /// and the server cutting such a connection as a slow consumer cuts nothing else;
    /// they are only read: answers go out on the one each input is handled with.
    pub fn start_ingress(&mut self) {
        self.ingress = Some(Default::default());
    }

    /// Subscribes the ingress connection `ingress` (`which` one) while the main
    /// connection `conn` is up and not silent ([`Connection::is_silent`]), and ends its
    /// subscriptions while it is not (nor yet, at start): what the ingress brings is
    /// answered on the main connection, so without it this broker answers nothing, and a
    /// queue group member that answers nothing still gets its share of the group's
    /// requests (nats-server even prefers members on the requester's server) while the
    /// other brokers could have answered them. Call it after the main connection's events
    /// of each round.
    pub fn tend_ingress(&mut self, conn: &Connection, which: Ingress, ingress: &mut Connection) {
        let up = conn.is_connected() && !conn.is_silent();
        let side = |i: &[IngressSubs; 3]| i.get(which as usize).map(|s| s.subscribed);
        if self.ingress.as_ref().and_then(side).is_none_or(|s| s == up) {
            return;
        }
        let made = if up {
            self.subscribe_untrusted(ingress, Some(which))
        } else {
            Ok(Vec::new())
        };
        let Some(subs) = self
            .ingress
            .as_mut()
            .and_then(|i| i.get_mut(which as usize))
        else {
            return;
        };
        match made {
            Ok(made) => {
                // Ended here at once; what the server sent before it had the UNSUB is
                // dropped by the connection as a message of no subscription.
                for (sid, _) in subs.routes.drain() {
                    let _ = ingress.unsubscribe(sid, None);
                }
                subs.routes.extend(made);
                subs.subscribed = up;
                subs.failure_logged = false;
            }
            // Tried again at the next call: the ingress's write buffer had no room for
            // the SUBs, or the connection is closed for good.
            Err(e) if !subs.failure_logged => {
                subs.failure_logged = true;
                log::warn!("NATS ingress ({which}) subscriptions not made: {e}");
            }
            Err(_) => {}
        }
    }

    /// What untrusted parties send, each subject with its queue group, route and the
    /// ingress connection it comes on.
    fn untrusted_subscriptions(&self) -> Vec<(Ingress, String, &'static str, Route)> {
        let mut wanted = Vec::new();
        if self.callout.is_some() {
            wanted.push((
                Ingress::Callout,
                AUTH_CALLOUT_SUBJECT.to_string(),
                AUTH_CALLOUT_QUEUE,
                Route::Callout,
            ));
        }
        for (subject, queue) in super::mig::Mig::request_subscriptions(&self.config) {
            let which = if queue == super::mig::subjects::EVENTS_QUEUE {
                Ingress::Events
            } else {
                Ingress::Requests
            };
            wanted.push((which, subject, queue, Route::MigRequest));
        }
        wanted
    }

    /// What untrusted parties send on ingress connection `which` (all of it for `None`),
    /// subscribed on `conn`; none when one fails (those made before it are ended).
    fn subscribe_untrusted(
        &self,
        conn: &mut Connection,
        which: Option<Ingress>,
    ) -> Result<Vec<(Sid, Route)>, String> {
        let wanted = self.untrusted_subscriptions().into_iter();
        let mut subscribed = Vec::new();
        for (_, subject, queue, route) in wanted.filter(|(w, ..)| which.is_none_or(|x| x == *w)) {
            match conn.subscribe(&subject, Some(queue)) {
                Ok(sid) => subscribed.push((sid, route)),
                Err(e) => {
                    for (sid, _) in subscribed {
                        let _ = conn.unsubscribe(sid, None);
                    }
                    return Err(format!("subscription {subject}: {e}"));
                }
            }
        }
        Ok(subscribed)
    }

    /// Starts what runs for the broker's whole life: one registry watch per namespace,
    /// and the subscription for other brokers' durable take-overs.
    pub fn start(&mut self, conn: &mut Connection, now: Instant) -> Result<(), String> {
        if self.ingress.is_none() {
            let subscribed = self.subscribe_untrusted(conn, None)?;
            self.routes.extend(subscribed);
        }
        let sid = conn
            .subscribe(&format!("{}.>", topics::DURABLE_TAKEOVER_PREFIX), None)
            .map_err(|e| format!("durable take-over subscription: {e}"))?;
        self.routes.insert(sid, Route::DurableTakeover);
        self.mig.start(conn, &self.config, now)?;
        let namespaces: Vec<String> = self.config.namespaces.keys().cloned().collect();
        for ns in namespaces {
            let prefix = conn.new_inbox();
            // The process's incarnation too: a broker started again at once under the
            // same id finds its last process's consumer still there (it outlives its
            // subscriber by up to 15 s) and would be refused its own.
            let base = format!("amp_registry_{}_{}_{ns}", self.broker_id, self.incarnation);
            let ttl = self.config.limits.registry_ttl_s;
            let registry = Registry::new(&ns, self.config.js_api(&ns), &prefix, &base, ttl, now)
                .map_err(|e| format!("registry watch of {ns}: {e}"))?;
            self.registries
                .insert(ns.clone(), (registry, HashMap::new()));
            self.drive_registry(conn, &ns, now);
        }
        Ok(())
    }

    /// Swaps in a re-read configuration. Refused, with the members named, when it changes
    /// what only a restart applies, or removes a listed participant from a namespace with
    /// an `open` entry (see [`reload`]); otherwise sessions whose participant
    /// is gone or whose credential changed, or that hold a subscription the new
    /// permissions do not allow, are closed (1008) and every other session goes on under
    /// the new permissions from its next frame. Returns how many were closed.
    pub fn reload(&mut self, new: Config) -> Result<usize, String> {
        let restart = reload::restart_only_changes(&self.config, &new);
        if !restart.is_empty() {
            return Err(format!(
                "these members change only with a restart: {}",
                restart.join(", ")
            ));
        }
        let delisted = reload::delisted_under_open(&self.config, &new);
        if !delisted.is_empty() {
            return Err(format!(
                "removing a listed participant from a namespace with an `open` entry would \
                 hand its name, inbox, durable subscriptions and tasks to every holder of the \
                 open credential: {}; to revoke it, keep it listed under a credential nobody \
                 holds (its sessions close)",
                delisted.join(", ")
            ));
        }
        let mut ended: Vec<(SessionId, &'static str)> = self
            .sessions
            .iter()
            .filter_map(|(&id, s)| match &s.state {
                SessionState::Active { ns, name } => {
                    let serving = self.jobs.is_worker(id);
                    reload::session_verdict(&self.config, &new, ns, name, serving)
                        .or_else(|| {
                            // Deliveries come without a frame to check them at.
                            let p = new.participant(ns, name)?;
                            s.subs
                                .values()
                                .any(|t| {
                                    !t.topic().is_some_and(|topic| {
                                        permissions::allows(
                                            &p.permissions,
                                            Action::Subscribe,
                                            topic,
                                        )
                                    })
                                })
                                .then_some("subscribe permission withdrawn")
                        })
                        .map(|why| (id, why))
                }
                _ => None,
            })
            .collect();
        ended.sort_unstable();
        for (ns, n) in &new.namespaces {
            let before = self.config.namespaces.get(ns);
            let was_open = before.is_some_and(|b| b.open.is_some());
            if n.open.is_none() {
                continue;
            }
            for name in n.participants.keys() {
                if !was_open || !before.is_some_and(|b| b.participants.contains_key(name)) {
                    let key = participant_key(ns, name);
                    self.inbox_creates.push(&key);
                    self.kept_inboxes.insert(key);
                }
            }
        }
        for (ns, n) in &new.namespaces {
            let Some(before) = self.config.namespaces.get(ns) else {
                continue;
            };
            let window = |n| setup::outcome_window_s(n, self.stream_settings);
            if window(n) > window(before) {
                for stream in [binding::inbox_stream(ns), binding::dlq_stream(ns)] {
                    self.window_raises.push((ns.clone(), stream));
                }
                for cap in setup::window_caps(ns, n, self.stream_settings) {
                    log::warn!("{cap}");
                }
            }
        }
        self.config = new;
        for s in self.sessions.values_mut() {
            if let SessionState::Active { ns, name } = &s.state {
                s.entry = self.config.entry(ns, name).cloned();
            }
            s.last_to = None;
        }
        self.jobs.reload_settings(&self.config);
        self.relabel();
        for &(session, why) in &ended {
            let participant = self.participant_of(session).unwrap_or_default();
            log::info!(session:% = format_args!("{}-{session}", self.broker_id), participant:% = participant; "reload closes the session: {why}");
            self.close(session, close::POLICY, "configuration changed");
        }
        Ok(ended.len())
    }

    /// The configuration's labels are the operator's: a reload that changed them applies
    /// to open sessions, to the offers their workers may take and to their registry
    /// entries, not only to sessions that come later.
    fn relabel(&mut self) {
        for (key, p) in &mut self.presence {
            let Some((ns, name)) = key.split_once('/') else {
                continue;
            };
            let labels = session::labels(&p.declared, self.config.participant(ns, name));
            if labels != p.labels {
                self.jobs.relabel(ns, name, &labels);
                p.labels = labels;
                self.relabeled.push(key.clone());
            }
        }
    }

    /// The OS wall clock read `wall_ms` at `now` (the runtime says so every turn): a step
    /// of it is followed. Deadlines already armed keep their monotonic instants.
    pub fn observe_wall_clock(&mut self, now: Instant, wall_ms: i64) {
        let Some((clock, step)) = self.clock.follow(now, wall_ms) else {
            return;
        };
        log::warn!(
            "the wall clock stepped {} ms {}: timestamps, JWTs, the auth callout and MIG signature windows follow it",
            step.unsigned_abs(),
            if step > 0 { "ahead" } else { "back" }
        );
        self.clock = clock;
        self.jobs.set_clock(clock);
        self.mig.set_clock(clock);
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    /// Gives back the room a burst (a reconnect storm's 10,000 hellos, their consumers and
    /// registry writes) left in the core's tables, and forgets registry write times past
    /// their gap; the shell calls it before it trims the heap.
    pub fn compact(&mut self, now: Instant) {
        use crate::heap::Compact;
        self.registry_kept
            .last
            .retain(|_, at| after(*at, registry::REGISTRY_WRITE_GAP) > now);
        self.registry_kept.last.compact_tables();
        let rate = f64::from(self.config.limits.presence_listed_per_s);
        self.listing_debts
            .retain(|_, bucket| !bucket.refilled(rate, now));
        self.listing_debts.compact_tables();
        self.sessions.compact();
        self.presence.compact();
        self.continuations.compact();
        self.prune_timers();
        self.timers.compact();
        self.routes.compact();
        self.out.compact();
        self.snapshots.compact();
        self.retired_pulls.compact();
        self.held_submits.compact();
        self.registry_kept.refreshing.compact();
        self.inbox_retrying.compact();
        self.registry_kept.sections.compact();
        self.participant_subs.compact();
        self.participant_deleting.compact();
        self.durables_creating.compact();
        self.in_flight.compact();
    }

    /// What the core holds, for bounds checks (simulators, tests).
    pub fn footprint(&self) -> Footprint {
        Footprint {
            sessions: self.sessions.len(),
            present_participants: self.presence.len(),
            in_flight: self.continuations.in_flight(),
            topic_requests: self.api.backlog(),
            presence_snapshots: self.snapshots.len(),
            registry_sections: self.registry_kept.sections.len(),
            offer_watches: self.jobs.offer_watches(),
            timers: self.timers.armed(),
            held_submits: self.held_submits.values().map(Vec::len).sum(),
            queued_outputs: self.out.len(),
            max_session_outstanding: self
                .sessions
                .values()
                .map(|s| s.outstanding.len())
                .max()
                .unwrap_or(0),
            max_session_inflight: self
                .sessions
                .values()
                .map(|s| s.inflight.len())
                .max()
                .unwrap_or(0),
        }
    }

    pub fn poll_output(&mut self) -> Option<Output> {
        loop {
            match self.out.pop_front()? {
                Queued::One(output) => return Some(output),
                Queued::Presence(mut fanout) => {
                    if let Some(frame) = self.next_presence_frame(&mut fanout) {
                        self.out.push_front(Queued::Presence(fanout));
                        return Some(frame);
                    }
                }
                Queued::Each { mut to, text } => {
                    let Some(session) = to.next() else { continue };
                    // The last one is sent the text itself.
                    if to.len() == 0 {
                        return Some(Output::Frame { session, text });
                    }
                    let mut frame = self.frame_buffer(text.len());
                    frame.push_str(&text);
                    self.out.push_front(Queued::Each { to, text });
                    return Some(Output::Frame {
                        session,
                        text: frame,
                    });
                }
            }
        }
    }

    /// Whether output waits to be taken with [`Broker::poll_output`].
    pub fn has_output(&self) -> bool {
        !self.out.is_empty()
    }

    /// Gives back the text of an [`Output::Frame`] once the embedder is done with it, to
    /// be the buffer of a later frame; `sent`: its session took it (queued to be written),
    /// and it counts in `amp_frames_out_total` (an `error` in `amp_errors_total` too).
    /// Counted when queued here instead, a frame for a session closed before it was taken
    /// (gone, or shed for a full queue) counted as sent.
    pub fn frame_done(&mut self, mut text: String, sent: bool) {
        if sent {
            self.count_frame(&text);
        }
        if self.spare_frames.len() < SPARE_FRAMES && text.capacity() <= SPARE_FRAME_BYTES {
            text.clear();
            self.spare_frames.push(text);
        }
    }

    /// A buffer for a frame of about `bytes`: a kept one when there is one.
    fn frame_buffer(&mut self, bytes: usize) -> String {
        let mut buf = self.spare_frames.pop().unwrap_or_default();
        buf.reserve(bytes);
        buf
    }

    /// Hands the core one input; then drain [`Broker::poll_output`], write what the
    /// connection buffered, and call again with [`Input::Timeout`] by
    /// [`Broker::poll_timeout`].
    pub fn handle(&mut self, conn: &mut Connection, input: Input<'_>, now: Instant) {
        match input {
            Input::SessionOpened { session, peer } => self.session_opened(session, peer, now),
            Input::Frame { session, text } => self.session_frame(conn, session, text, now),
            Input::SessionClosed {
                session,
                code,
                reason,
                by_peer,
            } => {
                self.log_session_end(session, code, reason, by_peer);
                self.session_closed(conn, session, now)
            }
            Input::Nats(event) => self.nats_event(conn, event, now),
            Input::Ingress {
                which,
                event,
                server_id,
            } => self.ingress_event(conn, which, event, server_id, now),
            Input::Timeout => self.handle_timeout(conn, now),
            Input::Drained { session } => {
                self.continue_snapshot(session);
                self.grant_pulls(conn, session, now);
                self.grant_inbox(conn, session, now);
            }
        }
        // Creations and updates a reload queued (it has no connection to send them on).
        if !self.kept_inboxes.is_empty() {
            self.send_inbox_creates(conn, now);
        }
        for key in std::mem::take(&mut self.window_raises) {
            self.send_window_raise(conn, key, None, 0, false, now);
        }
        self.jobs.after_reload(conn, now);
        for key in std::mem::take(&mut self.relabeled) {
            if let Some((ns, name)) = key.split_once('/') {
                self.registry_changed(conn, ns, name, now);
            }
        }
        self.file_continuations();
        self.file_timers();
    }

    /// When the core next wants [`Input::Timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.next_at()
    }

    // ---- NATS side -----------------------------------------------------------------

    /// An event from the NATS connection.
    fn nats_event(&mut self, conn: &mut Connection, event: Event, now: Instant) {
        match event {
            Event::Message { sid, msg } => match self.routes.get(&sid) {
                Some(Route::Inbox { participant }) => {
                    let participant = Rc::clone(participant);
                    self.inbox_delivery(conn, &participant, msg, now);
                }
                Some(Route::Sub { session, sub }) => {
                    let (session, sub) = (*session, sub.clone());
                    self.topic_delivery(conn, session, &sub, msg, now);
                }
                Some(Route::Callout) => self.answer_callout(conn, &msg, now),
                Some(Route::MigRequest) => self.mig_request(conn, &msg, now),
                Some(Route::DurableTakeover) => self.durable_taken(conn, &msg, now),
                Some(Route::Registry { ns }) => {
                    let ns = ns.clone();
                    if let Some((registry, _)) = self.registries.get_mut(&ns) {
                        registry.watcher().on_message(&delivery(&msg), now);
                    }
                    self.drive_registry(conn, &ns, now);
                }
                None => {
                    if !self.mig_message(conn, sid, &msg, now)
                        && !self.jobs.on_message(conn, sid, &msg, now)
                    {
                        self.unmatched("message", &msg.subject);
                    }
                }
            },
            Event::Unread { sid, msg } => match self.retired_pulls.get(&sid) {
                Some((session, sub)) => {
                    let (session, sub) = (*session, sub.clone());
                    self.retired_pull_delivery(conn, session, &sub, msg, now);
                }
                // A MIG live feed's pull subscription left at the reconnect, or none.
                None => {
                    if !self.mig_message(conn, sid, &msg, now) {
                        self.unread_delivery(conn, &msg, now);
                    }
                }
            },
            Event::Response { id, msg } => self.reply(conn, id, Ok(msg), now),
            Event::RequestFailed { id, error } => self.reply(conn, id, Err(error), now),
            Event::InvalidMessages { dropped } => {
                let before = self
                    .metrics
                    .registry
                    .value("amp_nats_invalid_messages_total", "")
                    .unwrap_or(0.0);
                if before < 1.0 {
                    log::warn!(
                        "dropped a NATS message with an invalid subject (counted in amp_nats_invalid_messages_total)",
                    );
                }
                let id = self.metrics.nats_invalid_messages;
                self.metrics.registry.add(id, "", dropped as f64);
            }
            Event::ServerError(text) => {
                self.metrics
                    .registry
                    .inc(self.metrics.nats_server_errors, "");
                if self
                    .server_error_logged
                    .is_some_and(|t| now.saturating_duration_since(t) < SERVER_ERROR_LOG_EVERY)
                {
                    self.server_errors_unlogged += 1;
                } else {
                    self.server_error_logged = Some(now);
                    let more = std::mem::take(&mut self.server_errors_unlogged);
                    log::warn!(
                        "NATS server error: {text} ({more} more since the last such line; each counted in amp_nats_server_errors_total)"
                    );
                }
            }
            Event::LameDuck => {
                log::info!(
                    "NATS server announced lame duck mode: moving to another server when one is known"
                );
            }
            Event::Reconnected { .. } => {
                self.metrics.registry.inc(self.metrics.nats_reconnects, "");
                // Pulls still held by the server came back with their subscriptions:
                // each inbox pulls on a fresh one (`PullLoop::retire`), and what the old
                // one still brings is handed back (`unread_delivery`).
                let inboxes: Vec<String> = self
                    .presence
                    .iter()
                    .filter(|(_, p)| p.inbox.sid().is_some())
                    .map(|(key, _)| key.clone())
                    .collect();
                for key in inboxes {
                    if let Some(sid) = self
                        .presence
                        .get_mut(&key)
                        .and_then(|p| p.inbox.retire(conn))
                    {
                        self.routes.remove(&sid);
                    }
                    self.start_inbox(conn, &key, now);
                }
                self.restart_subscriptions(conn, now);
                // Registry watches start over: resumed after an outage shorter than half
                // the entries' TTL, else reading their buckets again (deletes made
                // meanwhile may have aged out of the stream).
                let namespaces: Vec<String> = self.registries.keys().cloned().collect();
                for ns in namespaces {
                    if let Some((registry, _)) = self.registries.get_mut(&ns) {
                        registry.restart("the NATS connection was lost", now);
                    }
                    self.drive_registry(conn, &ns, now);
                }
                self.jobs.on_reconnected(conn, now);
                self.mig.after_reconnect(conn, now);
            }
            _ => {}
        }
        self.drain_jobs(conn, now);
    }

    /// An event of ingress connection `which`, connected to `server_id`; `conn` is the
    /// main one. An ingress makes no requests and holds no JetStream subscription, and
    /// the server gives its subscriptions back at a reconnect: only its messages and the
    /// connection-wide reports (counted as the main connection's are) matter here.
    fn ingress_event(
        &mut self,
        conn: &mut Connection,
        which: Ingress,
        event: Event,
        server_id: Option<&str>,
        now: Instant,
    ) {
        match event {
            Event::Message { sid, msg } => {
                let side = self.ingress.as_ref().and_then(|i| i.get(which as usize));
                match side.and_then(|i| i.routes.get(&sid)) {
                    // Their answers go out on the main connection, and with it down a
                    // MIG request would also find JetStream gone: dropped (core NATS
                    // requests are at most once; callers ask again after their timeout),
                    // rather than each failing into the reconnect buffer and the log.
                    // What the server sent before it had the ingress's UNSUB
                    // (`tend_ingress`, which forgets the routes at once) comes here.
                    _ if !conn.is_connected() => {
                        let id = self.metrics.nats_ingress_dropped;
                        self.metrics.registry.inc(id, "");
                    }
                    Some(Route::Callout) => {
                        // The ingress may be on another server of a cluster than the
                        // main connection, and the requests it is handed mostly come
                        // from its own (nats-server prefers members on the requester's
                        // server): both connections' servers are trusted unpinned.
                        if let (Some(callout), Some(id)) = (self.callout.as_mut(), server_id) {
                            callout.learn_server(id);
                        }
                        self.answer_callout(conn, &msg, now)
                    }
                    Some(Route::MigRequest) => self.mig_request(conn, &msg, now),
                    _ => self.unmatched("message", &msg.subject),
                }
                self.drain_jobs(conn, now);
            }
            // What the server handed a subscription this ingress had ended (`tend_ingress`)
            // before it had the UNSUB: requests another broker could have answered.
            Event::AfterUnsubscribe { dropped } => {
                let id = self.metrics.nats_ingress_dropped;
                self.metrics.registry.add(id, "", dropped as f64);
            }
            event @ (Event::InvalidMessages { .. } | Event::ServerError(_) | Event::LameDuck) => {
                self.nats_event(conn, event, now)
            }
            _ => {}
        }
    }

    fn complete(
        &mut self,
        conn: &mut Connection,
        pending: Pending,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        match pending {
            Pending::Send {
                session,
                re,
                charged,
                topic,
            } => {
                let ack = reply
                    .map_err(|e| match e {
                        RequestError::NoResponders => JsError::NoResponders,
                        e => JsError::Transport(e.to_string()),
                    })
                    .and_then(|msg| pub_ack_seq(msg.status(), &msg.payload));
                match ack {
                    Ok((seq, duplicate)) => {
                        let answer = FrameWriter::ok_in(Some(&re), self.frame_buffer(64))
                            .uint("seq", seq)
                            .bool("dup", duplicate);
                        self.ok(session, &re, answer)
                    }
                    Err(e) => {
                        if e.stored_nothing() {
                            self.refund_rate(session, charged);
                        }
                        match e {
                            // No stream holds the subject: the namespace's stream is gone.
                            JsError::NoResponders => {
                                let ns = self
                                    .sessions
                                    .get(&session)
                                    .and_then(|s| s.state.participant())
                                    .map(|(ns, _)| ns.to_string());
                                let Some(ns) = ns else {
                                    return self.fail(session, &re, store_refused(&e));
                                };
                                let stream = if topic {
                                    binding::topics_stream(&ns)
                                } else {
                                    binding::inbox_stream(&ns)
                                };
                                self.stream_gone(conn, &ns, &stream, now);
                                self.fail(session, &re, remake::gone(&stream))
                            }
                            JsError::Transport(e) => self.fail(session, &re, unavailable(e)),
                            e => self.fail(session, &re, store_refused(&e)),
                        }
                    }
                }
            }
            Pending::AckSync { session, re, keep } => match reply {
                Ok(_) => self.ok(session, &re, FrameWriter::ok(Some(&re))),
                Err(e) => {
                    self.keep_delivery(session, keep);
                    self.fail(session, &re, unavailable(e))
                }
            },
            Pending::InboxConsumer { participant } => {
                self.inbox_creates.done();
                match reply.map(|m| crate::jetstream::api::check_error(&m.payload)) {
                    Ok(Ok(())) => self.start_inbox(conn, &participant, now),
                    // There under another start (an earlier version of the broker made it
                    // again from a sequence): used as it is.
                    Ok(Err(e)) if consumer_exists(&e) => self.start_inbox(conn, &participant, now),
                    // A domain that just came back may not have its streams yet, or the
                    // stream was deleted: made again, the consumer after it.
                    Ok(Err(e))
                        if e.err_code() == Some(crate::jetstream::error::ERR_STREAM_NOT_FOUND) =>
                    {
                        log::warn!(participant:% = participant; "inbox consumer refused: {e}");
                        if let Some((ns, _)) = participant.split_once('/') {
                            let ns = ns.to_string();
                            self.stream_gone(conn, &ns, &binding::inbox_stream(&ns), now);
                        }
                        self.retry_inbox_consumer(participant, now);
                    }
                    Ok(Err(e)) => {
                        self.inbox_consumer_refused(participant, &naming_the_field(e), now)
                    }
                    Err(e) => {
                        log::warn!(participant:% = participant; "inbox consumer request failed: {e}"
                        );
                        self.retry_inbox_consumer(participant, now);
                    }
                }
                self.send_inbox_creates(conn, now);
            }
            Pending::RegistryWrite { participant } => {
                if let Err(RequestError::NoResponders) = &reply
                    && let Some((ns, _)) = participant.split_once('/')
                {
                    let ns = ns.to_string();
                    let bucket = ["KV_", &binding::registry_bucket(&ns)].concat();
                    self.stream_gone(conn, &ns, &bucket, now);
                }
                let ack = reply
                    .map_err(|e| JsError::Transport(e.to_string()))
                    .and_then(|m| parse_pub_ack(m.status(), &m.payload));
                self.registry_written(conn, participant, ack.map(|a| a.seq), now)
            }
            Pending::RegistryRead { participant } => {
                self.registry_read(conn, participant, reply, now)
            }
            Pending::SubLookup { to, config } => self.sub_lookup_done(conn, to, config, reply, now),
            Pending::SubConsumer(to) => self.sub_consumer_done(conn, to, reply, now),
            Pending::SubReset {
                session,
                sub,
                serial,
                consumer,
            } => {
                // A durable made again with `create` finds it there when another broker
                // made it first: as good.
                let ok = reply.is_ok_and(|m| match check_error(&m.payload) {
                    Ok(()) => true,
                    Err(e) => consumer_exists(&e),
                });
                self.sub_reset_done(conn, (session, sub, serial, consumer), ok, now);
            }
            Pending::StreamState { ns } => self.stream_state_done(conn, ns, reply, now),
            Pending::SubDeleted { session, re } => {
                self.deleted(Some(session));
                self.sub_deleted(session, re, reply)
            }
            Pending::ConsumerGone { owner } => {
                self.deleted(None);
                if let Some(owner) = owner
                    && let Some(n) = self.participant_deleting.get_mut(&owner)
                {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.participant_deleting.remove(&owner);
                    }
                }
                if let Ok(Err(e)) = reply.map(|m| check_error(&m.payload))
                    && e.err_code() != Some(10014)
                {
                    log::warn!("subscription consumer delete refused: {e}");
                }
            }
            Pending::DurableCount(count) => self.durable_count_done(conn, count, reply, now),
            Pending::Remake(key) => self.remake_done(conn, key, reply, now),
            Pending::WindowRaise {
                key,
                what,
                updates,
                recheck,
            } => self.window_raised(conn, key, (what, updates, recheck), reply, now),
            Pending::HandBack {
                stream,
                consumer,
                acks,
                looks,
            } => self.hand_back_done(conn, (stream, consumer, acks, looks), reply, now),
            Pending::Budget { op } => {
                // Neither a direct get nor a put finds a stream: the bucket is gone.
                if let Err(RequestError::NoResponders) = &reply {
                    let ns = op.key.split('.').next().unwrap_or_default().to_string();
                    let bucket = ["KV_", crate::broker::budget::BUDGET_BUCKET].concat();
                    self.stream_gone(conn, &ns, &bucket, now);
                }
                let reply = match (&reply, &op.kind) {
                    (Ok(m), KvOpKind::Get) => {
                        KvReply::from_get(m.status(), m.headers.as_ref(), &m.payload)
                    }
                    (Ok(m), KvOpKind::Write { .. }) => {
                        KvReply::from_pub_ack(m.status(), &m.payload)
                    }
                    (Err(_), _) => KvReply::Failed,
                };
                let settled = self.budgets.on_reply(op.id, reply);
                self.drive_budgets(conn, now);
                self.budget_settled(conn, settled, now);
            }
            Pending::Watch { ns, kind } => {
                if let Some((registry, _)) = self.registries.get_mut(&ns) {
                    let reply = match &reply {
                        Ok(msg) => Ok(msg.payload.as_slice()),
                        Err(RequestError::Timeout) => Err(JsError::Timeout),
                        Err(e) => Err(JsError::Transport(e.to_string())),
                    };
                    registry.watcher().on_reply(kind, reply, now);
                }
                self.drive_registry(conn, &ns, now);
            }
        }
    }

    /// Timers due at `now`.
    fn handle_timeout(&mut self, conn: &mut Connection, now: Instant) {
        loop {
            self.file_timers();
            let Some((at, wake)) = self.timers.pop_due(now) else {
                break;
            };
            match wake {
                Wake::Core(Alarm(timer)) => self.core_alarm(conn, timer, now),
                Wake::Jobs(alarm) => self.jobs.on_alarm(conn, alarm, at, now),
                Wake::Mig(alarm) => self.mig_alarm(conn, alarm, now),
            }
        }
        self.drain_jobs(conn, now);
    }

    fn core_alarm(&mut self, conn: &mut Connection, timer: Timer, now: Instant) {
        match timer {
            Timer::HelloTimeout(session) => {
                if matches!(
                    self.sessions.get(&session).map(|s| &s.state),
                    Some(SessionState::AwaitingHello { .. })
                ) {
                    self.close(session, close::POLICY, "hello timeout");
                }
            }
            Timer::RegistryRefresh(key) => {
                match self.presence.get_mut(&key) {
                    Some(p) => p.registry.refreshing = false,
                    None => {
                        self.registry_kept.refreshing.remove(&key);
                    }
                }
                if let Some((ns, name)) = key
                    .split_once('/')
                    .filter(|_| self.presence.contains_key(&key))
                {
                    let (ns, name) = (ns.to_string(), name.to_string());
                    self.registry_put(conn, &ns, &name, now);
                }
            }
            Timer::RegistryFlush(key) => {
                let due = self
                    .presence
                    .get_mut(&key)
                    .is_some_and(|p| std::mem::replace(&mut p.registry_due, false));
                if let Some((ns, name)) = key.split_once('/').filter(|_| due) {
                    let (ns, name) = (ns.to_string(), name.to_string());
                    self.registry_write(conn, &ns, &name, now);
                }
            }
            Timer::InboxConsumerRetry(key) => {
                // Only the retry armed last counts; one it replaced does nothing.
                let due = self.inbox_retrying.get(&key).is_some_and(|&at| at <= now);
                if due {
                    self.inbox_retrying.remove(&key);
                }
                let unread = due
                    && self
                        .presence
                        .get(&key)
                        .is_some_and(|p| p.inbox.sid().is_none());
                if let Some((ns, name)) = key.split_once('/').filter(|_| unread) {
                    let (ns, name) = (ns.to_string(), name.to_string());
                    self.ensure_inbox_consumer(conn, &ns, &name, now);
                }
            }
            Timer::RegistryWatch { ns, generation } => {
                let live = self
                    .registries
                    .get_mut(&ns)
                    .is_some_and(|(r, _)| r.on_deadline(generation, now));
                if live {
                    self.drive_registry(conn, &ns, now);
                }
            }
            Timer::ResumeWait(session, sub, serial) => {
                self.resume_wait_over(conn, session, &sub, serial, now)
            }
            Timer::SubRetry(session, sub, serial) => {
                self.retry_subscription(conn, session, &sub, serial, now)
            }
            Timer::Remake(key) => {
                if self.remakes.due(&key) {
                    self.send_remake(conn, key, now);
                }
            }
            Timer::WindowRecheck(key, updates) => {
                self.send_window_raise(conn, key, None, updates, true, now)
            }
            Timer::PullCheck(owner, generation) => {
                let at = match &owner {
                    PullOwner::Inbox(key) => self
                        .presence
                        .get_mut(key)
                        .and_then(|p| p.inbox.check(conn, generation, now)),
                    PullOwner::Sub(session, sub) => self
                        .subscription_mut(*session, sub)
                        .and_then(|t| t.pull.check(conn, generation, now)),
                };
                self.check_pull_at(at, owner);
            }
        }
    }

    /// Delivers what the jobs engine queued: answers, offers and revocations, and registry
    /// rewrites when what a participant serves changed.
    fn drain_jobs(&mut self, conn: &mut Connection, now: Instant) {
        let m = &mut self.metrics;
        self.jobs.drain_round_trips(|op, seconds| {
            m.registry.observe(m.js_request_seconds, seconds);
            m.registry
                .observe_at(m.nats_request_seconds, op.index(), seconds);
        });
        while let Some(out) = self.jobs.poll_output() {
            match out {
                JobsOutput::Reply { session, text, .. } if super::mig::is_mig_session(session) => {
                    self.mig_jobs_reply(conn, session, &text, now);
                }
                JobsOutput::Frame { session, .. } if super::mig::is_mig_session(session) => {}
                JobsOutput::Reply { session, re, text } => {
                    self.answered(session, &re);
                    // Past the session's room the answer could only close it: a `status`
                    // holds a task's result (up to the server's max_payload), and a
                    // `dead_letters` page at least one whole letter.
                    let room = self.config.limits.session_room();
                    if text.len() >= room {
                        let what = format!("the answer is {} bytes", text.len());
                        let e = past_session_room(&what, room, "");
                        self.error(session, Some(&re), &e);
                    } else {
                        self.frame(session, text);
                    }
                }
                JobsOutput::Frame { session, text } => self.frame(session, text),
                JobsOutput::Each { mut sessions, text } => {
                    sessions.retain(|&s| !super::mig::is_mig_session(s));
                    self.frame_to_each(sessions, text);
                }
                JobsOutput::ServeChanged { ns, name } => {
                    self.registry_changed(conn, &ns, &name, now);
                }
                JobsOutput::Refund { session, re } => self.refund_unmade(session, &re, now),
                JobsOutput::StreamGone { ns, stream } => self.stream_gone(conn, &ns, &stream, now),
            }
        }
    }

    // ---- output helpers ------------------------------------------------------------

    fn count_in(&mut self, decoded: &Result<ClientFrame, Rejected>) {
        let op = match decoded {
            Ok(frame) => Some(frame.op()),
            Err(r) => r.op,
        };
        let registry = &mut self.metrics.registry;
        match op {
            Some(op) => self.frames_in.add(registry, op as usize, op.as_str(), 1.0),
            None => registry.inc(self.metrics.frames_in, "unknown"),
        }
    }

    /// A reply or message nobody waits for: normal in small numbers (a message already in
    /// flight when its subscription ended), a bug when it grows, so never dropped unseen.
    fn unmatched(&mut self, kind: &str, subject: &str) {
        log::debug!(kind = kind, subject = subject; "NATS {kind} nothing was waiting for (counted in amp_nats_unmatched_total)");
        self.metrics.registry.inc(self.metrics.nats_unmatched, kind);
    }

    /// Where a session's JetStream API requests wait: in its participant's turns.
    fn lane(&self, session: SessionId) -> Lane<String> {
        let participant = self
            .sessions
            .get(&session)
            .and_then(|s| s.state.participant());
        // Only sessions past their hello make requests; the empty key is nobody's.
        let key = participant.map_or_else(String::new, |(ns, name)| participant_key(ns, name));
        Lane::Session(key, session)
    }

    /// Queues a JetStream API request made for a session's topic subscriptions (see
    /// `api_queue.rs`); its outcome comes to [`complete`](Self::complete) as any other.
    fn api_request(
        &mut self,
        conn: &mut Connection,
        lane: Lane<String>,
        req: Result<Request, JsError>,
        pending: Pending,
        now: Instant,
    ) {
        // Its answer gives its place back only if it is one of these.
        debug_assert!(pending.queued());
        match &pending {
            Pending::SubDeleted { .. } => self.topic_deleting += 1,
            Pending::ConsumerGone { owner } => {
                self.topic_deleting += 1;
                if let Some(owner) = owner {
                    *self.participant_deleting.entry(owner.clone()).or_insert(0) += 1;
                }
            }
            _ => {}
        }
        if let Some(session) = pending.deleting_for()
            && let Some(s) = self.sessions.get_mut(&session)
        {
            s.deleting += 1;
        }
        match req {
            Ok(req) => {
                self.api.push(lane, (req, pending, now));
                self.send_api_requests(conn, now);
            }
            Err(e) => {
                let e = crate::nats::Error::InvalidSubject(e.to_string());
                self.complete(conn, pending, Err(RequestError::Send(e)), now);
            }
        }
    }

    fn send_api_requests(&mut self, conn: &mut Connection, now: Instant) {
        if std::mem::replace(&mut self.api_sending, true) {
            return;
        }
        while let Some(((req, pending, queued), cleanup)) = self.api.admit_from() {
            // Nothing waits for a connection that is not there: a request would only sit
            // in the reconnect buffer until its timeout, holding its place meanwhile, and
            // what waits behind it would be answered in waves of 16 timeouts. And the
            // time a request waited for its turn is taken from its timeout, so a slow
            // server answers what waits within about `JS_TIMEOUT` too.
            let left = match JS_TIMEOUT.checked_sub(now.saturating_duration_since(queued)) {
                _ if !conn.is_connected() => Err(RequestError::Disconnected),
                Some(left) if !left.is_zero() => Ok(left),
                _ => Err(RequestError::Timeout),
            };
            let left = match left {
                Ok(left) => left,
                Err(e) => {
                    self.api.done();
                    self.complete(conn, pending, Err(e), now);
                    continue;
                }
            };
            // A session's request on a silent link would only wait out its timeout: it
            // hears `unavailable` now (as a send and an ack with an `id` do). Those
            // written wait on: they may have landed. Work of sessions that ended (a
            // consumer's delete) has nobody to answer and no retry: it waits its turn.
            let heard = if cleanup {
                Ok(())
            } else {
                conn.check_heard(now)
            };
            let sent = heard.and_then(|()| {
                conn.request(&req.subject, req.headers.as_ref(), &req.payload, left, now)
            });
            match sent {
                Ok(id) => self.await_reply(id, now, pending),
                Err(e) => {
                    self.api.done();
                    self.complete(conn, pending, Err(RequestError::Send(e)), now);
                }
            }
        }
        self.api_sending = false;
    }

    /// A consumer's delete is over; `session` asked for it.
    fn deleted(&mut self, session: Option<SessionId>) {
        self.topic_deleting = self.topic_deleting.saturating_sub(1);
        if let Some(s) = session.and_then(|session| self.sessions.get_mut(&session)) {
            s.deleting = s.deleting.saturating_sub(1);
        }
    }

    fn await_reply(&mut self, req: RequestId, now: Instant, pending: Pending) {
        self.continuations
            .insert(req, Continuation::Core(Awaiting(pending)), now);
    }

    fn set_timer(&mut self, at: Instant, timer: Timer) {
        self.timers.schedule(at, Wake::Core(Alarm(timer)));
    }

    /// Files the deadlines the capabilities set (see [`Later`]).
    ///
    /// [`Later`]: super::timers::Later
    fn file_timers(&mut self) {
        self.timers.file(&mut self.jobs.later, Wake::Jobs);
        self.timers.file(&mut self.mig.later, Wake::Mig);
        if self.timers.due_for_pruning() {
            self.prune_timers();
        }
    }

    /// Drops the timers that no longer matter: every pull loop's checks but its latest
    /// (a pull re-arms its check on every answer, so an idle inbox leaves one behind each
    /// time), and what the capabilities say of theirs.
    fn prune_timers(&mut self) {
        let (jobs, mig, presence, sessions) =
            (&self.jobs, &self.mig, &self.presence, &self.sessions);
        self.timers.prune(|at, wake| match wake {
            Wake::Core(Alarm(Timer::PullCheck(PullOwner::Inbox(key), generation))) => presence
                .get(key)
                .is_some_and(|p| p.inbox.checks(*generation)),
            Wake::Core(Alarm(Timer::PullCheck(PullOwner::Sub(session, sub), generation))) => {
                sessions
                    .get(session)
                    .and_then(|s| s.subs.get(sub))
                    .is_some_and(|t| t.pull.checks(*generation))
            }
            Wake::Core(_) => true,
            Wake::Jobs(alarm) => jobs.alarm_matters(alarm, at),
            Wake::Mig(alarm) => mig.alarm_matters(alarm),
        });
    }

    /// Files the round trips the capabilities started (see [`Staged`]).
    ///
    /// [`Staged`]: super::continuations::Staged
    fn file_continuations(&mut self) {
        self.continuations
            .file(&mut self.jobs.staged, Continuation::Jobs);
        self.continuations
            .file(&mut self.mig.staged, Continuation::Mig);
    }

    /// A reply, or the failure of a request, handed to the capability that asked.
    fn reply(
        &mut self,
        conn: &mut Connection,
        id: RequestId,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        self.file_continuations();
        match self.continuations.take(id) {
            Some((Continuation::Core(Awaiting(p)), sent)) => {
                self.observe_round_trip(&p, sent, now);
                let queued = p.queued();
                if queued {
                    self.api.done();
                }
                self.complete(conn, p, reply, now);
                if queued {
                    self.send_api_requests(conn, now);
                }
            }
            Some((Continuation::Jobs(p), sent)) => self.jobs.on_reply(conn, p, sent, reply, now),
            Some((Continuation::Mig(p), _)) => self.mig_reply(conn, p, reply, now),
            None => self.unmatched("reply", ""),
        }
    }

    fn observe_round_trip(&mut self, p: &Pending, sent: Instant, now: Instant) {
        let seconds = now.saturating_duration_since(sent).as_secs_f64();
        let m = &mut self.metrics;
        m.registry.observe(m.js_request_seconds, seconds);
        m.registry
            .observe_at(m.nats_request_seconds, p.op().index(), seconds);
    }

    /// Appends the broker's metrics in Prometheus text format.
    pub fn render_metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        self.metrics.registry.render(out);
        let _ = writeln!(
            out,
            "# HELP amp_nats_requests_in_flight NATS requests waiting for their reply, of every capability.\n# TYPE amp_nats_requests_in_flight gauge\namp_nats_requests_in_flight {}",
            self.continuations.in_flight()
        );
        let _ = writeln!(
            out,
            "# HELP amp_inbox_consumers_waiting Participants here whose inbox consumer is being created or waits its turn to be.\n# TYPE amp_inbox_consumers_waiting gauge\namp_inbox_consumers_waiting {}",
            self.inbox_creates.backlog()
        );
        let _ = writeln!(
            out,
            "# HELP amp_topic_requests_waiting JetStream API requests for topic subscriptions (consumer creations, lookups, deletes) out or waiting their turn.\n# TYPE amp_topic_requests_waiting gauge\namp_topic_requests_waiting {}",
            self.api.backlog()
        );
        let _ = writeln!(
            out,
            "# HELP amp_registry_resyncs_total Registry watches that read every entry of their namespace's bucket (each start, and each start over after an outage too long to resume from).\n# TYPE amp_registry_resyncs_total counter\namp_registry_resyncs_total {}",
            self.registries
                .values()
                .map(|(r, _)| r.resyncs())
                .sum::<u64>()
        );
        let (names, full) = self
            .registries
            .values()
            .map(|(r, _)| r.refused())
            .fold((0, 0), |(a, b), (n, f)| (a + n, b + f));
        let _ = writeln!(
            out,
            "# HELP amp_registry_keys_refused_total Registry bucket entries the mirror left out: no participant's name (name), or a new name admitted by `open` past the cap (full).\n# TYPE amp_registry_keys_refused_total counter\namp_registry_keys_refused_total{{reason=\"name\"}} {names}\namp_registry_keys_refused_total{{reason=\"full\"}} {full}"
        );
        self.jobs.render_metrics(out);
        self.mig.render_metrics(out);
    }

    /// A request found `stream` of namespace `ns` gone: it is made again as start-up
    /// made it, unless that is under way (or it is no stream start-up makes).
    fn stream_gone(&mut self, conn: &mut Connection, ns: &str, stream: &str, now: Instant) {
        let ours = setup::desired_stream(&self.config, ns, stream, self.stream_settings).is_some();
        if ours && self.remakes.begin(ns, stream) {
            log::warn!("stream {stream} is gone (deleted while the broker runs?): making it again");
            self.send_remake(conn, (ns.to_string(), stream.to_string()), now);
        }
    }

    fn send_remake(&mut self, conn: &mut Connection, key: remake::Key, now: Instant) {
        let (ns, stream) = (&key.0, &key.1);
        // A reload may have taken it out of the configuration meanwhile.
        let Some((api, desired)) =
            setup::desired_stream(&self.config, ns, stream, self.stream_settings)
        else {
            return self.remakes.done(&key);
        };
        match js_request(conn, api.stream_create(&desired), now) {
            Ok(id) => self.await_reply(id, now, Pending::Remake(key)),
            Err(e) => self.remake_missed(key, e, true, now),
        }
    }

    /// Reads the stream of `key` (`update` none) to raise its duplicate window, or sends
    /// the `update` that does, the `updates`th. One that fails is logged: a restart
    /// raises it.
    fn send_window_raise(
        &mut self,
        conn: &mut Connection,
        key: remake::Key,
        update: Option<(crate::jetstream::StreamConfig, String)>,
        updates: u8,
        recheck: bool,
        now: Instant,
    ) {
        let Some((api, _)) =
            setup::desired_stream(&self.config, &key.0, &key.1, self.stream_settings)
        else {
            return;
        };
        let (req, what) = match update {
            None => (api.stream_info(&key.1), None),
            Some((updated, what)) => (api.stream_update(&updated), Some(what)),
        };
        match js_request(conn, req, now) {
            Ok(id) => {
                let pending = Pending::WindowRaise {
                    key,
                    what,
                    updates,
                    recheck,
                };
                self.await_reply(id, now, pending)
            }
            Err(e) => window_not_raised(&key.1, &e),
        }
    }

    /// An update answered is followed by a read, and a read that finds the window short
    /// (another update took it back, `setup::WINDOW_UPDATES`) by an update; one that
    /// finds it long enough after an update of ours by a read [`WINDOW_RECHECK`] later.
    fn window_raised(
        &mut self,
        conn: &mut Connection,
        key: remake::Key,
        (what, updates, recheck): (Option<String>, u8, bool),
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let answer = reply.map_err(|e| e.to_string()).and_then(|m| {
            check_error(&m.payload).map_err(|e| e.to_string())?;
            Ok(m.payload)
        });
        let stream = key.1.clone();
        match (answer, what) {
            (Err(e), _) => window_not_raised(&stream, &e),
            (Ok(_), Some(what)) => {
                log::info!("stream {stream}: {what}");
                self.send_window_raise(conn, key, None, updates, false, now);
            }
            (Ok(info), None) => {
                let existing = serde_json::from_slice::<serde_json::Value>(&info)
                    .map(|v| v["config"].clone())
                    .unwrap_or_default();
                let desired =
                    setup::desired_stream(&self.config, &key.0, &stream, self.stream_settings);
                match desired.and_then(|(_, d)| setup::duplicate_window_update(&d, &existing)) {
                    Some((_, what, _)) if updates == setup::WINDOW_UPDATES => {
                        setup::window_changed_back(&stream, &what)
                    }
                    Some((updated, what, _)) => {
                        let update = Some((updated, what));
                        self.send_window_raise(conn, key, update, updates + 1, false, now)
                    }
                    // Read back after an update of ours: once more a little later.
                    None if updates > 0 && !recheck => {
                        let timer = Timer::WindowRecheck(key, updates);
                        self.set_timer(after(now, WINDOW_RECHECK), timer)
                    }
                    None => {}
                }
            }
        }
    }

    fn remake_done(
        &mut self,
        conn: &mut Connection,
        key: remake::Key,
        reply: Result<Message, RequestError>,
        now: Instant,
    ) {
        let stream = key.1.clone();
        let ns = key.0.clone();
        let seen_bucket = stream == ["KV_", super::mig::seen::BUCKET].concat();
        // Which bucket this is, when the answer says (another broker's, found in use,
        // is asked for).
        let mut created = None;
        match reply.map(|m| (check_error(&m.payload), m)) {
            Ok((Ok(()), m)) => {
                log::info!("stream {stream} made again");
                if seen_bucket {
                    created = super::mig::created(&m.payload).ok();
                }
                if stream == binding::topics_stream(&ns) {
                    let last = serde_json::from_slice::<serde_json::Value>(&m.payload)
                        .ok()
                        .and_then(|v| v["state"]["last_seq"].as_u64())
                        .unwrap_or(0);
                    self.topics_made_again(&ns, last);
                }
            }
            // There again, made by another broker (its settings may differ from ours,
            // as an adopted stream's may).
            Ok((Err(e), _)) if e.err_code() == Some(setup::ERR_STREAM_NAME_IN_USE) => {
                log::info!("stream {stream} is there again")
            }
            Ok((Err(e), _)) => return self.remake_missed(key, e.to_string(), false, now),
            Err(e) => return self.remake_missed(key, e.to_string(), true, now),
        }
        self.remakes.done(&key);
        // Other brokers hear of it by JetStream's advisory; this one may not (a broker
        // user without subscribe rights on `$JS.EVENT.>`), so it claims again here too,
        // once: the advisory's check then finds the bucket known.
        if seen_bucket {
            self.mig_seen_made(conn, created.as_deref(), now);
        }
        // The registry watch's consumer went with its bucket and says nothing of it (a
        // push consumer): it would start over only after three missed heartbeats.
        if stream == ["KV_", &binding::registry_bucket(&ns)].concat()
            && let Some((registry, _)) = self.registries.get_mut(&ns)
        {
            registry.restart("its bucket was made again", now);
            self.drive_registry(conn, &ns, now);
        }
    }

    fn remake_missed(&mut self, key: remake::Key, why: String, away: bool, now: Instant) {
        let stream = key.1.clone();
        if let Some(wait) = self.remakes.missed(&key, why.clone(), away) {
            log::warn!(
                "stream {stream} could not be made again: {why}; trying again in {} s",
                wait.as_secs()
            );
            self.set_timer(after(now, wait), Timer::Remake(key));
        }
    }

    fn frame(&mut self, session: SessionId, text: String) {
        self.out.push_back(Output::Frame { session, text }.into());
    }

    /// Sends `text` to each of `sessions`: queued once, each one's copy made as it is
    /// taken ([`Queued::Each`]).
    fn frame_to_each(&mut self, sessions: Vec<SessionId>, text: String) {
        if sessions.is_empty() {
            return;
        }
        self.out.push_back(Queued::Each {
            to: sessions.into_iter(),
            text,
        });
    }

    /// Counts a frame of `text`'s op: every frame starts with it (`{"op":"..."`); an
    /// `error` also by its code, the first `,"code":"` of its text ([`reply::error`]):
    /// only `re`, a JSON string, comes before it, and a quote in one follows a backslash.
    fn count_frame(&mut self, text: &str) {
        // The string value that starts at byte `at`, up to its closing quote (op and code
        // values are the broker's own names: nothing in them is escaped).
        let value_at = |at: usize| {
            let t = text.get(at..)?;
            t.get(..memchr::memchr(b'"', t.as_bytes())?)
        };
        let op = value_at(7).unwrap_or("unknown");
        // An op not among the server's counts as before, its number past the set.
        let index = amp_frame::server_op::index(op).unwrap_or(usize::MAX);
        self.frames_out
            .add(&mut self.metrics.registry, index, op, 1.0);
        if op == amp_frame::server_op::ERROR {
            const CODE: &[u8] = b",\"code\":\"";
            let code = memchr::memmem::find(text.as_bytes(), CODE)
                .and_then(|at| value_at(at + CODE.len()))
                .unwrap_or("unknown");
            self.metrics.registry.inc(self.metrics.errors, code);
        }
    }

    /// Sends an error reply (`re` when the frame had an id); counted by code once its
    /// session takes it ([`Broker::frame_done`]).
    fn error(&mut self, session: SessionId, re: Option<&str>, e: &AmpError) {
        self.frame(session, reply::error(re, e));
    }

    /// Sends an error with no `re` to each of `sessions`, queued once
    /// ([`frame_to_each`](Self::frame_to_each)).
    fn error_to_each(&mut self, sessions: Vec<SessionId>, e: &AmpError) {
        self.frame_to_each(sessions, reply::error(None, e));
    }

    fn close(&mut self, session: SessionId, code: u16, reason: &str) {
        if let Some(s) = self.sessions.get_mut(&session) {
            let participant = match &s.state {
                SessionState::Active { ns, name } => Some((ns.clone(), name.clone())),
                SessionState::Closing { participant } => participant.clone(),
                SessionState::AwaitingHello { .. } => None,
            };
            let ns = participant.as_ref().map(|(ns, _)| ns.clone());
            s.state = SessionState::Closing { participant };
            if let Some(ns) = ns {
                self.unwatch(&ns, session);
            }
        }
        self.out.push_back(
            Output::Close {
                session,
                code,
                reason: reason.to_string(),
            }
            .into(),
        );
    }

    /// The session hears of presence changes no more.
    fn unwatch(&mut self, ns: &str, session: SessionId) {
        self.snapshots.remove(&session);
        if let Some(w) = self.watchers.get_mut(ns) {
            w.remove(&session);
            if w.is_empty() {
                self.watchers.remove(ns);
            }
        }
    }

    fn answered(&mut self, session: SessionId, re: &str) {
        if let Some(s) = self.sessions.get_mut(&session)
            && s.outstanding.remove(re)
        {
            if !s.charged.is_empty() {
                s.charged.remove(re);
            }
            let all = &s.participant_outstanding;
            all.set(all.get().saturating_sub(1));
        }
    }

    fn ok(&mut self, session: SessionId, re: &str, answer: FrameWriter) {
        self.answered(session, re);
        self.frame(session, answer.finish());
    }

    fn fail(&mut self, session: SessionId, re: &str, e: AmpError) {
        self.answered(session, re);
        self.error(session, Some(re), &e);
    }
}

/// Not retried: what it costs is rare (a lost ack past the window the stream has). A
/// restart tries again, and one the server refuses then too (its
/// `jetstream.limits.duplicate_window`) starts with the window the stream has.
fn window_not_raised(stream: &str, e: &str) {
    log::warn!(
        "stream {stream}: duplicate_window not raised for the reloaded lease_s ({e}); a task result or letter published again after a lost ack past the window it has is stored a second time (a restart tries the raise again)"
    );
}

/// Sends a request of the typed JetStream builders; a name they refuse and a connection
/// that cannot take the request both come back as why it was not sent.
fn js_request(
    conn: &mut Connection,
    req: Result<Request, JsError>,
    now: Instant,
) -> Result<RequestId, String> {
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

/// Consumer fields nats-server 2.15 never updates, by the words of its 10012 answer
/// (`checkNewConsumerConfig`). The first three are where a consumer starts.
const FIXED_CONSUMER_FIELDS: [(&str, &str); 12] = [
    ("deliver policy can not be updated", "deliver_policy"),
    ("start sequence can not be updated", "opt_start_seq"),
    ("start time can not be updated", "opt_start_time"),
    ("ack policy can not be updated", "ack_policy"),
    ("replay policy can not be updated", "replay_policy"),
    ("storage type can not be updated", "mem_storage"),
    ("heart beats can not be updated", "idle_heartbeat"),
    ("flow control can not be updated", "flow_control"),
    ("max waiting can not be updated", "max_waiting"),
    (
        "can not update pull consumer to push based",
        "deliver_subject",
    ),
    (
        "can not update push consumer to pull based",
        "deliver_subject",
    ),
    ("direct can not be updated", "direct"),
];

/// The field an existing consumer has otherwise than asked for and JetStream will not
/// update, from a 10012 answer.
fn fixed_consumer_field(e: &JsError) -> Option<&'static str> {
    let api = e.api_error()?;
    (api.err_code == crate::jetstream::error::ERR_CONSUMER_CREATE)
        .then(|| {
            FIXED_CONSUMER_FIELDS
                .iter()
                .find(|(text, _)| api.description.contains(text))
        })
        .flatten()
        .map(|(_, field)| *field)
}

/// JetStream's answer when the consumer asked for is there with another start: a
/// `create` of a name in use (10148), or an update that may not move the start (10012,
/// "deliver policy can not be updated" and the start's sequence or time; a consumer made
/// again after its loss starts at a sequence, and a later first login's `create or
/// update` asks for all). Any other field JetStream will not update (an ack policy of
/// `none`, a push consumer) is a consumer that would not do what the broker needs:
/// [`naming_the_field`] says which.
pub(super) fn consumer_exists(e: &JsError) -> bool {
    e.err_code() == Some(crate::jetstream::error::ERR_CONSUMER_EXISTS)
        || fixed_consumer_field(e)
            .is_some_and(|f| ["deliver_policy", "opt_start_seq", "opt_start_time"].contains(&f))
}

/// A consumer refused for a field JetStream does not update, with the field named.
pub(super) fn naming_the_field(e: JsError) -> JsError {
    match (fixed_consumer_field(&e), e.api_error()) {
        (Some(field), Some(api)) => JsError::Api(crate::jetstream::error::ApiError {
            description: format!(
                "the consumer there has another `{field}`, which JetStream does not update ({})",
                api.description
            ),
            ..api.clone()
        }),
        _ => e,
    }
}

/// Why JetStream did not store a message. Limits or storage that are full (a stream's
/// `max_bytes` with discard `new`, the account's or the server's storage) and a stream
/// nobody answers for are JetStream's state, not a failure of the broker: `unavailable`,
/// safe to retry later with the same `idem`. Anything else is `internal`.
fn store_refused(e: &JsError) -> AmpError {
    if e.store_unavailable() {
        return AmpError::new(
            ErrorCode::Unavailable,
            format!("JetStream cannot store the message now: {e}"),
        );
    }
    AmpError::new(
        ErrorCode::Internal,
        format!("JetStream refused the message: {e}"),
    )
}

fn unavailable(e: impl std::fmt::Display) -> AmpError {
    AmpError::new(
        ErrorCode::Unavailable,
        format!("JetStream is unavailable: {e}"),
    )
}

fn presence_frame(change: &Change) -> String {
    let (state, entry) = match change {
        Change::Up(_, e) => ("up", Some(e)),
        Change::Update(_, e) => ("update", Some(e)),
        Change::Down(_) => ("down", None),
    };
    let mut frame = FrameWriter::new(amp_frame::server_op::PRESENCE)
        .str("name", change.name())
        .str("state", state);
    if let Some(entry) = entry {
        frame = frame.value("entry", entry);
    }
    frame.finish()
}

fn delivery(msg: &Message) -> Delivery<'_> {
    Delivery {
        subject: &msg.subject,
        reply: msg.reply.as_deref(),
        headers: msg.headers.as_ref(),
        payload: &msg.payload,
    }
}

/// `too_large` for an answer (`what` it is) past `room`, what a session may be sent at
/// once ([`Limits::session_room`](super::config::Limits::session_room)); `hint` says how
/// to ask for less.
fn past_session_room(what: &str, room: usize, hint: &str) -> AmpError {
    let why = format!(
        "{what}, more than the {room} bytes a session may be sent at once (its outbound \
         bound, or the memory budget of all connections if lower){hint}"
    );
    AmpError::new(ErrorCode::TooLarge, why)
}

fn participant_key(ns: &str, name: &str) -> String {
    // Built for several frames of every message: plainly, not through `format!`.
    let mut key = String::with_capacity(ns.len() + 1 + name.len());
    key.push_str(ns);
    key.push('/');
    key.push_str(name);
    key
}

/// A participant key's namespace and name: `split_once('/')` as a byte loop, as a key is
/// a few bytes and the searcher `split_once` sets up cost 110 instructions a delivery.
fn split_key(key: &str) -> Option<(&str, &str)> {
    let at = key.bytes().position(|b| b == b'/')?;
    Some((key.get(..at)?, key.get(at + 1..)?))
}

fn base64_url(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

#[cfg(test)]
mod tests {
    //! The core on an injected clock and a fixed seed: no OS clock, no OS randomness.

    use serde_json::{Value, json};

    use super::*;
    use crate::nats::Options;

    const TOKEN: &str = "test-token";
    const WALL_MS: i64 = 1_800_000_000_000; // 2027-01-15T08:00:00.000Z

    /// `split_once('/')`, which it replaced, as the oracle.
    #[test]
    fn a_key_splits_as_split_once_splits_it() {
        for key in [
            "",
            "/",
            "acme/alice",
            "acme/",
            "/alice",
            "a/b/c",
            "acme",
            "é/ü",
            "ns/ñame/",
            "//",
            "x//y",
        ] {
            assert_eq!(split_key(key), key.split_once('/'), "{key:?}");
        }
    }

    fn broker(t0: Instant, seed: [u8; 32]) -> Broker {
        let config = Config::development(crate::keygen::token_sha256(TOKEN));
        Broker::new(config, "b1".into(), Clock::new(t0, WALL_MS), seed).expect("broker")
    }

    fn frames(b: &mut Broker) -> Vec<Value> {
        std::iter::from_fn(|| b.poll_output())
            .filter_map(|o| match o {
                Output::Frame { text, .. } => serde_json::from_str(&text).ok(),
                _ => None,
            })
            .collect()
    }

    fn challenge_nonce(b: &mut Broker, session: SessionId, now: Instant) -> String {
        let peer: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
        b.session_opened(session, peer, now);
        let f = frames(b);
        assert_eq!(f[0]["op"], "challenge", "{f:?}");
        f[0]["nonce"].as_str().expect("nonce").to_string()
    }

    /// A NATS connection through its handshake, on the same virtual clock.
    fn connected(now: Instant) -> Connection {
        connected_with(Options::new("nats://127.0.0.1:4222"), now)
    }

    /// [`connected`], with `options`.
    fn connected_with(options: Options, now: Instant) -> Connection {
        let mut conn = Connection::new(options, now);
        conn.poll_connect(now).expect("a server to dial");
        conn.on_transport_open(now);
        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n",
            now,
        );
        conn.receive(b"PONG\r\n", now);
        assert!(conn.is_connected());
        take_wire(&mut conn);
        conn
    }

    /// What the core wrote to NATS since the last look, taken out of the connection.
    fn take_wire(conn: &mut Connection) -> String {
        let wire = String::from_utf8_lossy(conn.output()).into_owned();
        let n = conn.output().len();
        conn.consume_output(n);
        wire
    }

    #[test]
    fn jwts_and_callout_answers_follow_a_step_of_the_wall_clock() {
        // The wall clock was anchored once, at start. After the host's clock stepped an
        // hour ahead (as nats-server's did), every JWT the broker issued had expired when
        // issued and every callout request "expires more than 300 s ahead".
        use crate::broker::callout::AUTH_REQUEST_AUDIENCE;
        use crate::nkeys::{KeyKind, KeyPair};
        let t0 = Instant::now();
        let issuer = KeyPair::generate(KeyKind::Account).expect("key");
        let server = KeyPair::generate(KeyKind::Server).expect("key");
        let user = KeyPair::generate(KeyKind::User).expect("key");
        // The callout admits listed participants only.
        let mut config = Config::development(crate::keygen::token_sha256(TOKEN));
        if let Some(dev) = config.namespaces.get_mut("dev")
            && let Some(open) = dev.open.clone()
        {
            dev.participants.insert("alice".into(), open);
        }
        let clock = Clock::new(t0, WALL_MS);
        let mut b = Broker::new(config, "b1".into(), clock, [6; 32])
            .expect("broker")
            .with_issuer(issuer, &[server.public_key()]);
        let mut conn = connected(t0);
        b.start(&mut conn, t0).expect("start");
        let wire = take_wire(&mut conn);
        let sid = wire
            .lines()
            .find_map(|l| l.strip_prefix(&format!("SUB {AUTH_CALLOUT_SUBJECT} ")))
            .and_then(|rest| rest.split(' ').next_back())
            .expect("the callout subscription")
            .to_string();

        let t1 = t0 + Duration::from_secs(5);
        let stepped_s = (WALL_MS + 5_000) / 1000 + 3600;
        b.observe_wall_clock(t1, stepped_s * 1000);

        challenge_nonce(&mut b, 1, t1);
        let hello = json!({"op":"hello","id":"h","ns":"dev","name":"alice",
            "auth":{"type":"token","token":TOKEN}});
        b.session_frame(&mut conn, 1, &hello.to_string(), t1);
        let ok = frames(&mut b).into_iter().find(|f| f["op"] == "ok");
        let jwt = ok.as_ref().and_then(|f| f["jwt"].as_str()).expect("a JWT");
        let claims = crate::jwt::decode(jwt).expect("JWT").claims;
        assert_eq!(claims["iat"], json!(stepped_s), "{claims:?}");

        let request = json!({
            "sub": "ACALLOUT", "aud": AUTH_REQUEST_AUDIENCE,
            "iat": stepped_s, "exp": stepped_s + 2,
            "nats": {
                "server_id": {"name": "A", "host": "0.0.0.0", "id": "NSERVERID", "version": "2.15.1"},
                "user_nkey": user.public_key(),
                "client_info": {"host": "127.0.0.1", "id": 7, "kind": "Client", "type": "nats"},
                "connect_opts": {"user": "dev/alice", "pass": TOKEN},
                "type": "authorization_request", "version": 2,
            },
        });
        let Value::Object(request) = request else {
            unreachable!("a JSON object literal")
        };
        let request = crate::jwt::encode(&request, &server).expect("request");
        let msg = format!(
            "MSG {AUTH_CALLOUT_SUBJECT} {sid} _INBOX.callout {}\r\n{request}\r\n",
            request.len()
        );
        conn.receive(msg.as_bytes(), t1);
        while let Some(event) = conn.poll_event() {
            b.handle(&mut conn, Input::Nats(event), t1);
        }
        let wire = take_wire(&mut conn);
        let answer = wire
            .lines()
            .skip_while(|l| !l.starts_with("PUB _INBOX.callout "))
            .nth(1)
            .expect("an answer");
        // An empty answer is a refusal too.
        let nats = crate::jwt::decode(answer).map(|d| d.claims["nats"].clone());
        assert!(
            nats.as_ref().is_ok_and(|n| n["jwt"].is_string()),
            "not authorized: {nats:?}"
        );
    }

    #[test]
    fn what_untrusted_parties_send_comes_on_the_ingress_and_is_answered_on_the_main_connection() {
        // MIG requests and callout requests came on the connection of every session's
        // JetStream replies, where a flood of them queued ahead of those replies.
        let t0 = Instant::now();
        let mut b = broker_with_ingress(t0);
        assert_eq!(
            b.ingresses(),
            [Ingress::Callout, Ingress::Requests, Ingress::Events]
        );
        let mut conns = [connected(t0), connected(t0), connected(t0), connected(t0)];
        let [conn, callout, ingress, events] = &mut conns;
        b.start(conn, t0).expect("start");
        let [callout_wire, ingress_wire, events_wire] =
            tend(&mut b, conn, callout, ingress, events);
        let main_wire = take_wire(conn);
        for subject in ["mig.v0_1.dev.hello", "mig.v0_1.dev.invoke.>"] {
            let sub = format!("SUB {subject} ");
            assert!(ingress_wire.contains(&sub), "{subject}: {ingress_wire}");
            for other in [&main_wire, &callout_wire, &events_wire] {
                assert!(!other.contains(&sub), "{subject}: {other}");
            }
        }
        // The callout's requests on a connection of their own, and the live events, with
        // PUBLISH requests, on another.
        for (wire, subject) in [
            (&callout_wire, AUTH_CALLOUT_SUBJECT),
            (&events_wire, "mig.v0_1.dev.events.>"),
        ] {
            assert_eq!(subscribed(wire).into_keys().collect::<Vec<_>>(), [subject]);
        }
        let sid = ingress_wire
            .lines()
            .find_map(|l| l.strip_prefix("SUB mig.v0_1.dev.hello "))
            .and_then(|rest| rest.split(' ').next_back())
            .expect("the hello subscription")
            .to_string();
        // The main connection numbers its subscriptions from 1 too: the sid is the
        // ingress connection's.
        assert!(main_wire.contains(&format!(" {sid}\r\n")), "{main_wire}");

        let msg = hello_on(&sid);
        ingress.receive(msg.as_bytes(), t0);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t0);
        assert!(take_wire(ingress).is_empty(), "nothing goes out there");
        let wire = take_wire(conn);
        let answer = wire
            .split("\r\n")
            .skip_while(|l| !l.starts_with("HPUB _INBOX_dev_alice.1 "))
            .find(|l| l.starts_with('{'))
            .expect("an answer on the main connection");
        let answer: Value = serde_json::from_str(answer).expect("JSON");
        assert_eq!(answer["selected_version"], "0.1", "{answer}");

        // With the main connection down the answer could not go out: a request read
        // before the ingress's subscriptions were ended is dropped and counted, not
        // answered into the reconnect buffer.
        conn.on_transport_closed(t0, "test");
        while let Some(event) = conn.poll_event() {
            b.handle(conn, Input::Nats(event), t0);
        }
        let buffered = conn.reconnect_buffered();
        ingress.receive(msg.as_bytes(), t0);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t0);
        assert_eq!(conn.reconnect_buffered(), buffered);
        let dropped = b
            .metrics
            .registry
            .value("amp_nats_ingress_dropped_total", "");
        assert_eq!(dropped, Some(1.0));
    }

    /// A broker with MIG and the callout, taking their requests on an ingress connection.
    fn broker_with_ingress(t0: Instant) -> Broker {
        use crate::nkeys::{KeyKind, KeyPair};
        let mut config = Config::development(crate::keygen::token_sha256(TOKEN));
        config.mig.enabled = true;
        if let Some(dev) = config.namespaces.get_mut("dev")
            && let Some(open) = dev.open.clone()
        {
            dev.participants.insert("alice".into(), open);
        }
        let issuer = KeyPair::generate(KeyKind::Account).expect("key");
        let mut b = Broker::new(config, "b1".into(), Clock::new(t0, WALL_MS), [8; 32])
            .expect("broker")
            .with_issuer(issuer, &[]);
        b.start_ingress();
        b
    }

    /// Hands the core what ingress `which` reported, lending it `conn`.
    fn feed_ingress(
        b: &mut Broker,
        conn: &mut Connection,
        which: Ingress,
        ingress: &mut Connection,
        now: Instant,
    ) {
        while let Some(event) = ingress.poll_event() {
            let server_id = ingress.server_info().map(|i| i.server_id.clone());
            let server_id = server_id.as_deref();
            b.handle(
                conn,
                Input::Ingress {
                    which,
                    event,
                    server_id,
                },
                now,
            );
        }
    }

    /// [`Broker::tend_ingress`] of the three ingress connections; what it wrote on each.
    fn tend(
        b: &mut Broker,
        conn: &Connection,
        callout: &mut Connection,
        ingress: &mut Connection,
        events: &mut Connection,
    ) -> [String; 3] {
        b.tend_ingress(conn, Ingress::Callout, callout);
        b.tend_ingress(conn, Ingress::Requests, ingress);
        b.tend_ingress(conn, Ingress::Events, events);
        [take_wire(callout), take_wire(ingress), take_wire(events)]
    }

    /// A connection dialed and given its transport, waiting for the server's INFO.
    fn dialed(now: Instant) -> Connection {
        let mut conn = Connection::new(Options::new("nats://127.0.0.1:4222"), now);
        conn.poll_connect(now).expect("a server to dial");
        conn.on_transport_open(now);
        conn
    }

    /// The sids of the `SUB`s on `wire`, by subject.
    fn subscribed(wire: &str) -> BTreeMap<String, String> {
        wire.lines()
            .filter_map(|l| l.strip_prefix("SUB "))
            .filter_map(|rest| {
                let words: Vec<&str> = rest.split(' ').collect();
                Some((words.first()?.to_string(), words.last()?.to_string()))
            })
            .collect()
    }

    #[test]
    fn the_ingress_is_subscribed_only_while_the_main_connection_is_up() {
        // What the ingress brings is answered on the main connection. Its queue group
        // subscriptions stayed while that one was down (and were made before it was
        // first up): the server kept handing this broker its share of the callout's and
        // MIG's requests (more than a share, as nats-server prefers members on the
        // requester's server), which it dropped while another broker could answer them.
        let t0 = Instant::now();
        let mut b = broker_with_ingress(t0);
        let mut conns = [dialed(t0), connected(t0), connected(t0), connected(t0)];
        let [conn, callout, ingress, events] = &mut conns;
        b.start(conn, t0).expect("start");
        let wires = tend(&mut b, conn, callout, ingress, events);
        assert_eq!(
            wires,
            <[String; 3]>::default(),
            "subscribed before the main connection is up"
        );

        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\nPONG\r\n",
            t0,
        );
        while let Some(event) = conn.poll_event() {
            b.handle(conn, Input::Nats(event), t0);
        }
        let first = tend(&mut b, conn, callout, ingress, events).map(|w| subscribed(&w));
        let one_each = [
            AUTH_CALLOUT_SUBJECT,
            "mig.v0_1.dev.hello",
            "mig.v0_1.dev.events.>",
        ];
        for (subject, subscribed) in one_each.iter().zip(&first) {
            assert!(subscribed.contains_key(*subject), "{subject}: {first:?}");
        }

        main_down(&mut b, conn, t0);
        let wires = tend(&mut b, conn, callout, ingress, events);
        for (wire, first) in wires.iter().zip(&first) {
            for (subject, sid) in first {
                assert!(
                    wire.contains(&format!("UNSUB {sid}\r\n")),
                    "{subject} ({sid}) still subscribed with the main connection down: {wire}"
                );
            }
        }
        let wires = tend(&mut b, conn, callout, ingress, events);
        assert_eq!(wires, <[String; 3]>::default(), "ended once");

        // Back: subscribed again, and what comes is answered.
        let t1 = t0 + Duration::from_secs(60);
        main_back(&mut b, conn, t1);
        let again = tend(&mut b, conn, callout, ingress, events).map(|w| subscribed(&w));
        for (again, first) in again.iter().zip(&first) {
            assert_eq!(
                again.keys().collect::<Vec<_>>(),
                first.keys().collect::<Vec<_>>()
            );
        }
        let sid = &again[1]["mig.v0_1.dev.hello"];
        let msg = hello_on(sid);
        ingress.receive(msg.as_bytes(), t1);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t1);
        assert!(
            take_wire(conn).contains("HPUB _INBOX_dev_alice.1 "),
            "answered on the main connection"
        );
    }

    #[test]
    fn the_ingress_is_subscribed_only_while_the_main_connection_answers() {
        // A main connection that dies without a word stays connected until its keepalive
        // gives up, 60 to 90 s on: the ingress kept its subscriptions all that time, and
        // what the server handed this broker was answered into the dead link.
        let t0 = Instant::now();
        let probe = Duration::from_millis(1500);
        let mut b = broker_with_ingress(t0);
        let mut main = Options::new("nats://127.0.0.1:4222");
        main.silence_probe = Some(probe);
        let mut conns = [
            connected_with(main, t0),
            connected(t0),
            connected(t0),
            connected(t0),
        ];
        let [conn, callout, ingress, events] = &mut conns;
        b.start(conn, t0).expect("start");
        take_wire(conn);
        let first = tend(&mut b, conn, callout, ingress, events).map(|w| subscribed(&w));

        // A hello answered on the main connection, which reads nothing from then on.
        ingress.receive(hello_on(&first[1]["mig.v0_1.dev.hello"]).as_bytes(), t0);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t0);
        assert!(take_wire(conn).contains("HPUB _INBOX_dev_alice.1 "));
        let t1 = t0 + probe;
        conn.handle_timeout(t1);
        assert!(take_wire(conn).ends_with("PING\r\n"), "probed");
        let wires = tend(&mut b, conn, callout, ingress, events);
        assert_eq!(wires, <[String; 3]>::default(), "subscribed while probed");
        let t2 = t1 + probe;
        conn.handle_timeout(t2);
        assert!(conn.is_silent() && conn.is_connected());
        let wires = tend(&mut b, conn, callout, ingress, events);
        for (wire, first) in wires.iter().zip(&first) {
            for (subject, sid) in first {
                assert!(
                    wire.contains(&format!("UNSUB {sid}\r\n")),
                    "{subject} ({sid}) still subscribed with the main connection silent: {wire}"
                );
            }
        }

        // It answers again: subscribed again, and what comes is answered.
        let t3 = t2 + Duration::from_secs(1);
        conn.receive(b"PONG\r\n", t3);
        let again = tend(&mut b, conn, callout, ingress, events).map(|w| subscribed(&w));
        for (again, first) in again.iter().zip(&first) {
            assert_eq!(
                again.keys().collect::<Vec<_>>(),
                first.keys().collect::<Vec<_>>()
            );
        }
        ingress.receive(hello_on(&again[1]["mig.v0_1.dev.hello"]).as_bytes(), t3);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t3);
        assert!(take_wire(conn).contains("HPUB _INBOX_dev_alice.1 "));
    }

    /// The main connection `conn` lost, the core told.
    fn main_down(b: &mut Broker, conn: &mut Connection, now: Instant) {
        conn.on_transport_closed(now, "test");
        while let Some(event) = conn.poll_event() {
            b.handle(conn, Input::Nats(event), now);
        }
    }

    /// The main connection `conn` back after [`main_down`] (its reconnect due by `now`),
    /// the core told; what it wrote is taken.
    fn main_back(b: &mut Broker, conn: &mut Connection, now: Instant) {
        conn.handle_timeout(now);
        conn.poll_connect(now).expect("dialed again");
        conn.on_transport_open(now);
        conn.receive(
            b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\nPONG\r\n",
            now,
        );
        while let Some(event) = conn.poll_event() {
            b.handle(conn, Input::Nats(event), now);
        }
        take_wire(conn);
    }

    /// A MIG `hello` of alice the server delivers on subscription `sid`.
    fn hello_on(sid: &str) -> String {
        let headers = format!("NATS/1.0\r\nAuthorization: Bearer {TOKEN}\r\n\r\n");
        let body = r#"{"header":{"tenant_id":"dev"}}"#;
        format!(
            "HMSG mig.v0_1.dev.hello {sid} _INBOX_dev_alice.1 {} {}\r\n{headers}{body}\r\n",
            headers.len(),
            headers.len() + body.len()
        )
    }

    #[test]
    fn what_the_server_sent_before_it_had_the_ingress_unsubs_is_dropped_and_counted() {
        // With the main connection down the ingress's subscriptions end at once, and
        // what the server handed them before it read the UNSUBs still comes: requests
        // another broker could have answered. The connection dropped them as messages of
        // no subscription, and amp_nats_ingress_dropped_total counted only those read
        // before the UNSUBs were written.
        let t0 = Instant::now();
        let mut b = broker_with_ingress(t0);
        let mut small = Options::new("nats://127.0.0.1:4222");
        small.max_write_buffer = 4096;
        let mut conns = [
            connected(t0),
            connected(t0),
            connected_with(small, t0),
            connected(t0),
        ];
        let [conn, callout, ingress, events] = &mut conns;
        b.start(conn, t0).expect("start");
        take_wire(conn);
        let sid = |wires: [String; 3]| subscribed(&wires[1])["mig.v0_1.dev.hello"].clone();
        let first = sid(tend(&mut b, conn, callout, ingress, events));
        let dropped = |b: &Broker| {
            let registry = &b.metrics.registry;
            registry.value("amp_nats_ingress_dropped_total", "")
        };

        main_down(&mut b, conn, t0);
        let wires = tend(&mut b, conn, callout, ingress, events);
        assert!(
            wires[1].contains(&format!("UNSUB {first}\r\n")),
            "{wires:?}"
        );
        ingress.receive(hello_on(&first).as_bytes(), t0);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t0);
        assert_eq!(
            dropped(&b),
            Some(1.0),
            "sent before the server had the UNSUB"
        );

        // The UNSUBs are owed only when the ingress's write buffer has no room for them:
        // its server has read none of what the ingress wrote, up to `max_write_buffer`
        // (64 MiB in the broker), and an ingress writes nothing but its SUBs, UNSUBs and
        // keepalive. Then the server goes on handing it requests until it reads again,
        // or until the ingress, finding its PINGs unanswered, reconnects without them.
        let t1 = t0 + Duration::from_secs(60);
        main_back(&mut b, conn, t1);
        let again = sid(tend(&mut b, conn, callout, ingress, events));
        // Room for less than an UNSUB line is left.
        let filler = 4096 - ingress.output().len() - 30 - "PUB filler 4000\r\n\r\n".len();
        let filler = vec![b'x'; filler];
        ingress
            .publish("filler", None, None, &filler)
            .expect("room");
        let full = ingress.output().len();
        main_down(&mut b, conn, t1);
        b.tend_ingress(conn, Ingress::Requests, ingress);
        assert_eq!(ingress.output().len(), full, "the UNSUBs are owed");
        ingress.receive(hello_on(&again).as_bytes(), t1);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t1);
        assert_eq!(dropped(&b), Some(2.0), "sent while the UNSUBs were owed");
        // Back before they are written: no SUB goes out ahead of them.
        let t2 = t1 + Duration::from_secs(60);
        main_back(&mut b, conn, t2);
        b.tend_ingress(conn, Ingress::Requests, ingress);
        assert_eq!(
            ingress.output().len(),
            full,
            "a SUB ahead of the owed UNSUBs"
        );
        take_wire(ingress);
        let owed = take_wire(ingress);
        assert!(owed.contains(&format!("UNSUB {again}\r\n")), "{owed}");
        assert!(!owed.contains("SUB mig."), "{owed}");
        let third = sid(tend(&mut b, conn, callout, ingress, events));
        assert_ne!(third, again);
        ingress.receive(hello_on(&third).as_bytes(), t2);
        feed_ingress(&mut b, conn, Ingress::Requests, ingress, t2);
        assert!(
            take_wire(conn).contains("HPUB _INBOX_dev_alice.1 "),
            "answered"
        );
        assert_eq!(dropped(&b), Some(2.0));
    }

    #[test]
    fn a_callout_request_from_the_ingress_server_is_trusted_unpinned() {
        // With no server key pinned, the callout trusted only the servers the main
        // connection had met. In a cluster the ingress may be on another server, and the
        // requests it is handed mostly come from there (nats-server prefers queue group
        // members on the requester's server): each was refused as "signed by untrusted
        // server", with an empty answer.
        use crate::broker::callout::AUTH_REQUEST_AUDIENCE;
        use crate::nkeys::{KeyKind, KeyPair};
        let t0 = Instant::now();
        let (s1, s2) = (
            KeyPair::generate(KeyKind::Server).expect("key"),
            KeyPair::generate(KeyKind::Server).expect("key"),
        );
        let on = |server: &KeyPair| {
            let mut conn = dialed(t0);
            let info = format!(
                "INFO {{\"server_id\":\"{}\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}}\r\nPONG\r\n",
                server.public_key()
            );
            conn.receive(info.as_bytes(), t0);
            take_wire(&mut conn);
            conn
        };
        let (mut conn, mut ingress) = (on(&s1), on(&s2));
        let mut b = broker_with_ingress(t0);
        b.start(&mut conn, t0).expect("start");
        while let Some(event) = conn.poll_event() {
            b.handle(&mut conn, Input::Nats(event), t0);
        }
        b.tend_ingress(&conn, Ingress::Callout, &mut ingress);
        feed_ingress(&mut b, &mut conn, Ingress::Callout, &mut ingress, t0);
        let sid = subscribed(&take_wire(&mut ingress))
            .remove(AUTH_CALLOUT_SUBJECT)
            .expect("the callout subscription");
        take_wire(&mut conn);

        let now_s = WALL_MS / 1000;
        let user = KeyPair::generate(KeyKind::User).expect("key");
        let request = json!({
            "sub": "ACALLOUT", "aud": AUTH_REQUEST_AUDIENCE, "iat": now_s, "exp": now_s + 2,
            "nats": {
                "server_id": {"name": "S2", "host": "0.0.0.0", "id": s2.public_key(), "version": "2.15.1"},
                "user_nkey": user.public_key(),
                "client_info": {"host": "127.0.0.1", "id": 7, "kind": "Client", "type": "nats"},
                "connect_opts": {"user": "dev/alice", "pass": TOKEN},
                "type": "authorization_request", "version": 2,
            },
        });
        let Value::Object(request) = request else {
            unreachable!("a JSON object literal")
        };
        let request = crate::jwt::encode(&request, &s2).expect("request");
        let msg = format!(
            "MSG {AUTH_CALLOUT_SUBJECT} {sid} _INBOX.callout {}\r\n{request}\r\n",
            request.len()
        );
        ingress.receive(msg.as_bytes(), t0);
        feed_ingress(&mut b, &mut conn, Ingress::Callout, &mut ingress, t0);
        let wire = take_wire(&mut conn);
        let answer = wire
            .lines()
            .skip_while(|l| !l.starts_with("PUB _INBOX.callout "))
            .nth(1)
            .unwrap_or_default();
        // An empty answer is a refusal.
        let nats = crate::jwt::decode(answer).map(|d| d.claims["nats"].clone());
        assert!(
            nats.as_ref().is_ok_and(|n| n["jwt"].is_string()),
            "not authorized: {nats:?}; {wire}"
        );
    }

    #[test]
    fn a_session_the_broker_closed_releases_its_presence_when_it_ends() {
        // Found by the simulator: `bye` (like any close the broker starts) forgot the
        // participant, so the end of the session left its presence, inbox reader and
        // registry entry behind for good.
        let t0 = Instant::now();
        let mut b = broker(t0, [5; 32]);
        let mut conn = connected(t0);
        challenge_nonce(&mut b, 1, t0);
        let hello = json!({"op":"hello","id":"h","ns":"dev","name":"alice",
            "auth":{"type":"token","token":TOKEN}});
        b.session_frame(&mut conn, 1, &hello.to_string(), t0);
        frames(&mut b);
        assert_eq!(b.footprint().present_participants, 1);
        b.session_frame(&mut conn, 1, r#"{"op":"bye","id":"b"}"#, t0);
        let closes = std::iter::from_fn(|| b.poll_output())
            .filter(|o| matches!(o, Output::Close { .. }))
            .count();
        assert_eq!(closes, 1, "bye closes the session");
        b.handle(&mut conn, Input::closed(1), t0);
        let f = b.footprint();
        assert_eq!((f.sessions, f.present_participants), (0, 0), "{f:?}");
    }

    #[test]
    fn an_event_in_flight_when_its_durable_session_ended_is_handed_back_in_order() {
        // Found by the simulator (seeds 0x5a6, 0x6bf): an event the server had sent to
        // the ended session's pull inbox reached the broker after the UNSUB and was
        // dropped, so it came back only after its ack wait (30 s) and a session resuming
        // the durable sooner started past it.
        let t0 = Instant::now();
        let mut b = broker(t0, [4; 32]);
        let mut conn = connected(t0);
        let (stream, consumer) = ("AMP_TOPICS_dev", "dsub_5_alice_d1");
        let ack =
            |seq: u64| format!("$JS.ACK.{stream}.{consumer}.1.{seq}.{seq}.1800000000000000000.0");
        let late = |seq: u64| Message {
            subject: "amp.dev.topic.t.a".into(),
            reply: Some(ack(seq)),
            headers: None,
            payload: b"{}".to_vec(),
        };
        let naks = |conn: &mut Connection| {
            take_wire(conn)
                .lines()
                .filter_map(|l| l.strip_prefix("PUB "))
                .filter_map(|l| l.split(' ').next())
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        // No hand-back of that consumer under way: handed back at once.
        let unread = |seq| Event::Unread {
            sid: crate::nats::Sid(77),
            msg: late(seq),
        };
        b.handle(&mut conn, Input::Nats(unread(3)), t0);
        assert_eq!(naks(&mut conn), [ack(3)]);
        // While one is, it waits and goes out with it in stream order, behind the
        // session's own unacknowledged event 4 (before: 6 first, then 4, which the
        // resumed session took for a redelivery of an event it had and skipped).
        b.hand_backs
            .insert((stream.into(), consumer.into()), Default::default());
        b.handle(&mut conn, Input::Nats(unread(6)), t0);
        assert!(naks(&mut conn).is_empty());
        let info = Message {
            subject: "_INBOX.x".into(),
            reply: None,
            headers: None,
            payload: br#"{"num_waiting":0}"#.to_vec(),
        };
        b.hand_back_done(
            &mut conn,
            (stream.into(), consumer.into(), vec![ack(4)], 0),
            Ok(info),
            t0,
        );
        assert_eq!(naks(&mut conn), [ack(4), ack(6)]);
        assert!(b.hand_backs.is_empty());
    }

    #[test]
    fn an_inbox_or_job_message_on_a_pull_the_broker_left_goes_back_at_once() {
        let t0 = Instant::now();
        let mut b = broker(t0, [5; 32]);
        let mut conn = connected(t0);
        let unread = |stream: &str, consumer: &str| Event::Unread {
            sid: crate::nats::Sid(78),
            msg: Message {
                subject: "amp.dev.inbox.bob".into(),
                reply: Some(format!(
                    "$JS.ACK.{stream}.{consumer}.1.9.9.1800000000000000000.0"
                )),
                headers: None,
                payload: b"{}".to_vec(),
            },
        };
        b.handle(
            &mut conn,
            Input::Nats(unread("AMP_INBOX_dev", "inbox_bob")),
            t0,
        );
        let wire = take_wire(&mut conn);
        assert!(
            wire.starts_with("PUB $JS.ACK.AMP_INBOX_dev.inbox_bob.1.9.9.") && wire.contains("-NAK"),
            "{wire}"
        );
        // A task nobody here holds (one of the pulls a reconnect left behind brought it)
        // goes back at once as well, not after its lease's worth of AckWait.
        b.handle(&mut conn, Input::Nats(unread("AMP_TASKS_dev", "job_x")), t0);
        let wire = take_wire(&mut conn);
        assert!(
            wire.starts_with("PUB $JS.ACK.AMP_TASKS_dev.job_x.1.9.9.") && wire.contains("-NAK"),
            "{wire}"
        );
    }

    #[test]
    fn a_server_error_is_counted_and_logged_at_most_once_a_minute() {
        // A `-ERR` the server keeps the connection after (a publish the broker's account
        // may not make) went unseen: no log line, no metric.
        let t0 = Instant::now();
        let mut b = broker(t0, [6; 32]);
        let mut conn = connected(t0);
        let denied = || {
            Input::Nats(Event::ServerError(
                "Permissions Violation for Publish to \"amp.dev.inbox.bob\"".into(),
            ))
        };
        let count = |b: &Broker| b.metrics.registry.value("amp_nats_server_errors_total", "");
        for _ in 0..3 {
            b.handle(&mut conn, denied(), t0);
        }
        assert_eq!(count(&b), Some(3.0));
        // The first was logged, the next two wait for the next line.
        assert_eq!(
            (b.server_error_logged, b.server_errors_unlogged),
            (Some(t0), 2)
        );
        b.handle(&mut conn, Input::Nats(Event::LameDuck), t0);
        let t1 = t0 + Duration::from_secs(61);
        b.handle(&mut conn, denied(), t1);
        assert_eq!(count(&b), Some(4.0));
        assert_eq!(
            (b.server_error_logged, b.server_errors_unlogged),
            (Some(t1), 0)
        );
    }

    #[test]
    fn a_restarted_broker_names_its_plain_consumers_apart_from_its_last_process() {
        // Found by the simulator: a broker restarted with the same id numbered its plain
        // subscription consumers from 1 again, so a new `from:"all"` subscription adopted
        // the consumer its previous process had left (still within its inactive
        // threshold) and started after the events that one had delivered.
        let t0 = Instant::now();
        let consumer = |seed: [u8; 32]| {
            let mut b = broker(t0, seed);
            let mut conn = connected(t0);
            challenge_nonce(&mut b, 1, t0);
            let hello = json!({"op":"hello","id":"h","ns":"dev","name":"alice",
                "auth":{"type":"token","token":TOKEN}});
            b.session_frame(&mut conn, 1, &hello.to_string(), t0);
            take_wire(&mut conn);
            let sub = json!({"op":"subscribe","id":"u","topic":"t.a","from":"all"});
            b.session_frame(&mut conn, 1, &sub.to_string(), t0);
            let wire = String::from_utf8_lossy(conn.output()).into_owned();
            let at = wire
                .find("CONSUMER.CREATE.AMP_TOPICS_dev.")
                .expect("a create")
                + 31;
            wire[at..]
                .split([' ', '.'])
                .next()
                .unwrap_or_default()
                .to_string()
        };
        let (first, restarted) = (consumer([1; 32]), consumer([2; 32]));
        assert!(first.starts_with("eph_b1_"), "{first}");
        assert_ne!(first, restarted);
    }

    #[test]
    fn the_same_seed_gives_the_same_challenges_and_another_seed_others() {
        let t0 = Instant::now();
        let (mut a, mut b, mut c) = (
            broker(t0, [9; 32]),
            broker(t0, [9; 32]),
            broker(t0, [8; 32]),
        );
        let a1 = challenge_nonce(&mut a, 1, t0);
        let a2 = challenge_nonce(&mut a, 2, t0);
        assert_ne!(a1, a2, "every session its own challenge");
        assert_eq!(a1, challenge_nonce(&mut b, 1, t0));
        assert_eq!(a2, challenge_nonce(&mut b, 2, t0));
        assert_ne!(a1, challenge_nonce(&mut c, 1, t0));
    }

    #[test]
    fn a_stored_message_is_stamped_from_the_injected_clock() {
        let t0 = Instant::now();
        let mut b = broker(t0, [3; 32]);
        let mut conn = connected(t0);
        challenge_nonce(&mut b, 1, t0);
        let hello = json!({"op":"hello","id":"h","ns":"dev","name":"alice",
            "auth":{"type":"token","token":TOKEN}});
        b.session_frame(&mut conn, 1, &hello.to_string(), t0);
        let ok = frames(&mut b);
        assert!(ok.iter().any(|f| f["op"] == "ok"), "{ok:?}");
        // Ninety virtual seconds later, however long the test really took.
        let later = t0 + Duration::from_millis(90_250);
        take_wire(&mut conn);
        let send = json!({"op":"send","id":"s","to":"bob","body":{"x":1}});
        b.session_frame(&mut conn, 1, &send.to_string(), later);
        let wire = String::from_utf8_lossy(conn.output()).into_owned();
        assert!(
            wire.contains(r#""ts":"2027-01-15T08:01:30.250Z""#),
            "the envelope's ts follows the injected wall clock: {wire}"
        );
        // The message id comes from the seed too: a second broker with it makes the same.
        let id = |w: &str| {
            let at = w.find(r#"{"id":""#).expect("envelope") + 7;
            w[at..at + super::super::ids::ID_LEN].to_string()
        };
        let mut twin = broker(t0, [3; 32]);
        let mut conn2 = connected(t0);
        challenge_nonce(&mut twin, 1, t0);
        twin.session_frame(&mut conn2, 1, &hello.to_string(), t0);
        take_wire(&mut conn2);
        twin.session_frame(&mut conn2, 1, &send.to_string(), later);
        assert_eq!(id(&wire), id(&String::from_utf8_lossy(conn2.output())));
    }
}
