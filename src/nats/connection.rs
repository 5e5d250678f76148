//! The sans-IO client connection: bytes and `now` in; bytes to write, events and the next
//! deadline out. No socket and no clock in here.
//!
//! The shell's duty, after every call into the connection (in this order):
//! 1. `poll_close()`: when true, drop the current socket (the connection already gave up on
//!    it: stale, fatal `-ERR`, lame duck move, handshake timeout, `close()`);
//! 2. `poll_connect(now)`: when it names a server and no socket is open, dial it, then call
//!    `on_transport_open` or `on_transport_closed`;
//! 3. write `output()` and report it with `consume_output(n)`;
//! 4. wake at `poll_timeout()` and call `handle_timeout(now)`;
//! 5. feed read bytes to `receive`, and a closed/failed socket to `on_transport_closed`.

use super::backoff::{self, Rng};
use super::error::{ErrKind, Error, RequestError, classify_err};
use super::options::{Auth, Options, ServerAddr, ServerUrl};
use super::requests::{RequestId, RequestTable};
use super::subscriptions::{Delivery, Sid, SubscriptionTable};
use crate::deadline::after;
use crate::ids::IdSource;
use crate::proto::encode;
use crate::proto::headers::HeaderMap;
use crate::proto::info::{ConnectOptions, ServerInfo};
use crate::proto::subject::{validate_pattern, validate_subject};
use crate::proto::{Op, Parsed, Parser, Role};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Until the server's INFO says otherwise.
const DEFAULT_MAX_PAYLOAD: usize = 1024 * 1024;
/// The most any nats-server allows (`max_payload` cannot be set higher): an INFO asking
/// for more is a peer that wants the broker to buffer gigabytes for one message.
const MAX_PAYLOAD_CEILING: usize = 64 * 1024 * 1024;
/// The largest message the connection takes from a server whose `max_payload` is
/// `max_payload`. The server holds only clients to it, not itself: a `STREAM.MSG.GET`
/// answer carries a stored message base64-encoded in JSON (4/3 of it, plus its subject
/// and headers), and a direct get adds headers of its own, so an answer about a message
/// the server took can be a third larger. Refusing those dropped the connection whenever
/// such a message was read back (a large task's dead letter, a full task record).
pub fn inbound_limit(max_payload: usize) -> usize {
    max_payload
        .saturating_add(max_payload / 2)
        .saturating_add(64 * 1024)
}
/// A connection dropped sooner than this after its handshake counts as a failed attempt:
/// a server (or a path) that accepts and then drops at once is dialed with backoff, not
/// again and again at round-trip speed.
const STABLE_CONNECTION: Duration = Duration::from_secs(1);
/// How long a server that announced lame duck mode is avoided: nats-server's default
/// `lame_duck_duration`, after which it has shut down (and may be back, healthy).
const LAME_DUCK_PERIOD: Duration = Duration::from_secs(120);
/// Outstanding user pings (`ping()`) at once.
const MAX_USER_PINGS: usize = 1024;
/// After `output()` is drained this far, the buffer is compacted.
const COMPACT_AT: usize = 64 * 1024;
/// The longest `UNSUB <sid>\r\n` (a sid is a u64): what an owed UNSUB needs room for.
const UNSUB_LINE_MAX: usize = 6 + 20 + 2;

/// A message delivered to a subscription or as a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub subject: String,
    pub reply: Option<String>,
    pub headers: Option<HeaderMap>,
    pub payload: Vec<u8>,
}

impl Message {
    /// The inline status of the header block (`NATS/1.0 503`), if any.
    pub fn status(&self) -> Option<u16> {
        self.headers.as_ref().and_then(HeaderMap::status)
    }

    /// The status description (`NATS/1.0 408 Request Timeout`), if any.
    pub fn description(&self) -> Option<&str> {
        self.headers.as_ref().and_then(HeaderMap::description)
    }

    /// The first value of header `name` (exact case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.as_ref().and_then(|h| h.get(name))
    }

    /// What nats-server counts of this delivery against a pull's `max_bytes`: subject,
    /// reply, header block and payload.
    pub fn pulled_size(&self) -> usize {
        self.subject.len()
            + self.reply.as_ref().map_or(0, String::len)
            + self.headers.as_ref().map_or(0, HeaderMap::wire_len)
            + self.payload.len()
    }
}

/// Names one `ping()`; its `Event::Pong` says the server has processed everything sent
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PingId(pub u64);

/// What happened, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The first handshake completed.
    Connected {
        server: ServerAddr,
    },
    /// An established connection was lost; reconnecting follows unless `Closed` does.
    Disconnected {
        reason: String,
    },
    /// A later handshake completed; subscriptions were restored and the reconnect buffer
    /// written.
    Reconnected {
        server: ServerAddr,
    },
    Message {
        sid: Sid,
        msg: Message,
    },
    /// A JetStream delivery (its reply an ack subject) on a subscription this connection
    /// had already ended: the server sent it before it had the UNSUB, or it was read
    /// before the UNSUB and not yet polled when the subscription ended. Nobody reads it,
    /// and unacknowledged it would wait out its consumer's ack wait before anyone else
    /// got it; its owner can hand it back (`-NAK`) at once.
    Unread {
        sid: Sid,
        msg: Message,
    },
    /// The first reply to a request.
    Response {
        id: RequestId,
        msg: Message,
    },
    RequestFailed {
        id: RequestId,
        error: RequestError,
    },
    /// A `-ERR` after which the server keeps the connection (permissions, invalid subject).
    ServerError(String),
    /// The server announced lame duck mode; the connection moves to another server when
    /// there is one.
    LameDuck,
    /// The answer to `ping()`.
    Pong(PingId),
    /// Messages were dropped because `max_pending_messages` events were waiting.
    SlowConsumer {
        dropped: u64,
    },
    /// Messages were dropped because their subject or reply subject is not a valid
    /// subject (a CR, a control byte, not UTF-8: nats-server delivers whatever another
    /// client published). At most one per `receive`.
    InvalidMessages {
        dropped: u64,
    },
    /// Messages were dropped because they came for no subscription of this connection:
    /// one it had ended, the server sending them before it had the UNSUB (a JetStream
    /// delivery comes as `Unread` instead). At most one per `receive`.
    AfterUnsubscribe {
        dropped: u64,
    },
    /// For good: `close()`, refused credentials on first connect, reconnect attempts used
    /// up, or no server reachable at first connect.
    Closed {
        reason: Error,
    },
}

/// Counters for monitoring.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub in_msgs: u64,
    pub in_bytes: u64,
    pub out_msgs: u64,
    pub out_bytes: u64,
    pub reconnects: u64,
    pub dropped_msgs: u64,
    /// Messages dropped for an invalid subject or reply subject.
    pub invalid_msgs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting to dial `server` at `at`.
    Waiting {
        server: usize,
        at: Instant,
    },
    /// `poll_connect` handed out `server`; the shell is dialing.
    Dialing {
        server: usize,
        deadline: Instant,
    },
    AwaitInfo {
        server: usize,
        deadline: Instant,
    },
    AwaitPong {
        server: usize,
        deadline: Instant,
    },
    Connected {
        server: usize,
    },
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PingKind {
    Keepalive,
    User(u64),
    /// [`Options::silence_probe`]'s.
    Probe,
}

/// What [`Options::silence_probe`] follows of the current transport.
#[derive(Debug, Clone, Copy)]
struct Silence {
    /// When it last brought bytes, or had them waiting unread ([`Connection::input_held`]).
    heard_at: Instant,
    /// When something was first written since `heard_at`.
    wrote_at: Option<Instant>,
    /// When the probe PING out was queued.
    probe_at: Option<Instant>,
    /// Bytes of output up to and including the probe PING not written yet.
    unsent: usize,
    /// When the last of those was written: a PING still on its way is not unanswered,
    /// and a link that takes the backlog ahead of it carries what it is given.
    moved_at: Instant,
    /// When the PING out was due to be answered, while nothing has been read since.
    silent_at: Option<Instant>,
}

impl Silence {
    fn new(now: Instant) -> Silence {
        Silence {
            heard_at: now,
            wrote_at: None,
            probe_at: None,
            unsent: 0,
            moved_at: now,
            silent_at: None,
        }
    }

    fn heard(&mut self, now: Instant) {
        self.heard_at = self.heard_at.max(now);
        self.wrote_at = None;
        self.silent_at = None;
    }

    fn wrote(&mut self, n: usize, now: Instant) {
        if n == 0 {
            return;
        }
        self.wrote_at.get_or_insert(now);
        if self.unsent > 0 {
            // The PING is not out yet, and the link takes what is ahead of it: nothing
            // is unanswered. Silent only `probe` after the link last moved.
            self.unsent = self.unsent.saturating_sub(n);
            self.moved_at = now;
            self.silent_at = None;
        }
    }

    /// When the next PING is due, the one out makes the connection silent, or, `limit`
    /// on, a silent connection is given up.
    fn deadline(&self, probe: Duration, limit: Option<Duration>) -> Option<Instant> {
        match (self.probe_at, self.silent_at) {
            // Never before the write: a deadline already past when it is set reads as a
            // loop that woke late (`/livez` answered 503 "stalled" after each quiet spell).
            (None, _) => self
                .wrote_at
                .map(|wrote| after(self.heard_at, probe).max(wrote)),
            // Measured from the last read too: bytes ahead of its PONG show the server
            // is there, and a link that dies after them is silent `probe` later. And
            // from the last write of what is ahead of the PING and the PING itself: a
            // PING not sent yet is not unanswered.
            (Some(at), None) => Some(after(at.max(self.heard_at).max(self.moved_at), probe)),
            (Some(_), Some(silent)) => limit.map(|l| after(silent.max(self.moved_at), l)),
        }
    }
}

#[derive(Debug)]
struct PoolEntry {
    url: ServerUrl,
    discovered: bool,
    /// Failed attempts in a row on this server.
    failures: u32,
    /// Not before this instant (backoff).
    retry_at: Option<Instant>,
    /// Announced lame duck mode: avoided until then, while another server is known and
    /// the others have not all failed since.
    lame_duck_until: Option<Instant>,
}

impl PoolEntry {
    fn in_lame_duck(&self, now: Instant) -> bool {
        self.lame_duck_until.is_some_and(|t| now < t)
    }
}

/// The sans-IO NATS client connection. See the module docs for how a shell drives it.
#[derive(Debug)]
pub struct Connection {
    options: Options,
    state: State,
    pool: Vec<PoolEntry>,
    rng: Rng,
    parser: Parser,
    info: Option<ServerInfo>,
    max_payload: usize,
    ever_connected: bool,
    /// Failed attempts in a row over all servers (reset by a completed handshake).
    failures_in_a_row: u32,
    /// Servers tried since the first connect began (first connect gives up after one round).
    initial_attempts: usize,
    last_error: Option<Error>,
    close_transport: bool,

    rbuf: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
    /// Publishes made while not connected, written after the next handshake.
    pending: Vec<u8>,

    subs: SubscriptionTable,
    requests: RequestTable,
    inbox_prefix: String,
    /// `<inbox_prefix>.<random>.` that request replies arrive under.
    resp_prefix: String,
    /// Where reply and pull subjects get their unguessable tokens (`crate::ids`).
    names: IdSource,
    /// The last request's reply subject, rewritten by the next.
    reply_scratch: String,
    resp_sid: Option<Sid>,

    events: VecDeque<Event>,
    queued_messages: usize,
    /// What the messages and responses among `events` hold (`Message::pulled_size`).
    queued_bytes: usize,
    dropped_since_report: u64,
    /// Messages of ended subscriptions dropped in this `receive` (`AfterUnsubscribe`).
    ended_since_report: u64,
    /// Subscriptions ended while events were queued, each with the count of events
    /// pushed by then: a delivery of theirs among those is polled as `Unread`. Each is
    /// forgotten once those events are polled (`ended_order`, in that count's order).
    pub(super) ended_while_queued: HashMap<Sid, u64>,
    ended_order: VecDeque<(u64, Sid)>,
    /// Subscriptions ended while the write buffer had no room for their UNSUB: written,
    /// in order and ahead of any SUB, as `output()` drains; forgotten with the transport
    /// (the next server never hears of them). Each counts against `max_subscriptions`
    /// until written, so they are bounded as the subscriptions were.
    unsub_owed: VecDeque<Sid>,
    /// Events polled since the start.
    polled: u64,
    invalid_since_report: u64,

    pings: VecDeque<PingKind>,
    keepalive_out: u32,
    silence: Silence,
    next_ping: Option<Instant>,
    next_user_ping: u64,
    lame_duck_move: bool,
    /// When the current connection's handshake completed.
    connected_at: Instant,
    stats: Stats,
    /// The latest `now` passed in, for the few calls that take none.
    last_now: Instant,
    /// Every transport must be TLS (all-or-nothing over the pool, so servers learned from
    /// `connect_urls` keep it).
    tls_required: bool,
    /// The current transport is (or is becoming) TLS.
    tls_active: bool,
    /// The shell must put TLS under the transport now, verifying this server name,
    /// before it writes `output()`.
    start_tls: Option<String>,
}

impl Connection {
    pub fn new(options: Options, now: Instant) -> Connection {
        let mut rng = options.rng_seed.map_or_else(Rng::from_os, Rng::with_seed);
        let mut pool: Vec<PoolEntry> = options
            .servers
            .iter()
            .map(|url| PoolEntry {
                url: url.clone(),
                discovered: false,
                failures: 0,
                retry_at: None,
                lame_duck_until: None,
            })
            .collect();
        if !options.no_randomize {
            for i in (1..pool.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                pool.swap(i, j);
            }
        }
        let mut parser = Parser::new(Role::Client);
        parser.max_control_line = options.max_control_line;
        parser.max_payload = inbound_limit(DEFAULT_MAX_PAYLOAD);
        let inbox_prefix = options.inbox_prefix.clone();
        let mut names = subject_names(options.rng_seed);
        let resp_prefix = format!("{}.{}.", inbox_prefix, names.next_id());
        let mut conn = Connection {
            state: State::Closed,
            pool,
            rng,
            parser,
            info: None,
            max_payload: DEFAULT_MAX_PAYLOAD,
            ever_connected: false,
            failures_in_a_row: 0,
            initial_attempts: 0,
            last_error: None,
            close_transport: false,
            rbuf: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            pending: Vec::new(),
            subs: SubscriptionTable::default(),
            requests: RequestTable::default(),
            inbox_prefix,
            resp_prefix,
            names,
            reply_scratch: String::new(),
            resp_sid: None,
            events: VecDeque::new(),
            queued_messages: 0,
            queued_bytes: 0,
            dropped_since_report: 0,
            ended_since_report: 0,
            ended_while_queued: HashMap::new(),
            ended_order: VecDeque::new(),
            unsub_owed: VecDeque::new(),
            polled: 0,
            invalid_since_report: 0,
            pings: VecDeque::new(),
            keepalive_out: 0,
            silence: Silence::new(now),
            next_ping: None,
            next_user_ping: 0,
            lame_duck_move: false,
            connected_at: now,
            stats: Stats::default(),
            last_now: now,
            tls_required: options.tls_required(),
            tls_active: false,
            start_tls: None,
            options,
        };
        if conn.pool.is_empty() {
            let reason = conn
                .options
                .invalid_urls
                .first()
                .cloned()
                .unwrap_or(Error::NoServers);
            conn.close_for_good(reason);
        } else {
            conn.state = State::Waiting { server: 0, at: now };
        }
        conn
    }

    // ----- shell side -----

    /// A server to dial now, when one is due. Hand out once per attempt.
    pub fn poll_connect(&mut self, now: Instant) -> Option<ServerAddr> {
        self.last_now = self.last_now.max(now);
        let State::Waiting { server, at } = self.state else {
            return None;
        };
        if now < at {
            return None;
        }
        let entry = self.pool.get_mut(server)?;
        entry.retry_at = None;
        let addr = entry.url.addr.clone();
        if !self.ever_connected {
            self.initial_attempts += 1;
        }
        self.state = State::Dialing {
            server,
            deadline: after(now, self.options.connect_timeout),
        };
        Some(addr)
    }

    /// The socket handed out by `poll_connect` is connected.
    pub fn on_transport_open(&mut self, now: Instant) {
        if let State::Dialing { server, deadline } = self.state {
            self.rbuf.clear();
            self.out.clear();
            self.out_pos = 0;
            self.last_now = now;
            self.state = State::AwaitInfo { server, deadline };
            self.tls_active = false;
            self.start_tls = None;
            if self.tls_required && self.options.tls_handshake_first {
                self.begin_tls(server);
            }
        }
    }

    /// Once per transport that must become TLS: the server name to verify. The shell puts
    /// a TLS session under the socket before it writes `output()` again; every byte it
    /// reads from then on is ciphertext.
    pub fn poll_start_tls(&mut self) -> Option<String> {
        self.start_tls.take()
    }

    /// Whether the current transport is TLS.
    pub fn is_tls(&self) -> bool {
        self.tls_active
    }

    fn begin_tls(&mut self, server: usize) {
        self.tls_active = true;
        self.start_tls = self.pool.get(server).map(|e| e.url.addr.host.clone());
    }

    /// The socket failed to connect, or was closed by the peer or by an error.
    pub fn on_transport_closed(&mut self, now: Instant, reason: &str) {
        self.last_now = self.last_now.max(now);
        match self.state {
            State::Dialing { .. } | State::AwaitInfo { .. } | State::AwaitPong { .. } => {
                self.attempt_failed(now, Error::ConnectFailed(reason.to_string()));
            }
            State::Connected { .. } => self.lost(now, reason),
            State::Waiting { .. } | State::Closed => {}
        }
    }

    /// True once after the connection abandoned its transport: the shell drops the socket
    /// (without calling `on_transport_closed`).
    pub fn poll_close(&mut self) -> bool {
        std::mem::take(&mut self.close_transport)
    }

    /// Bytes read from the socket.
    pub fn receive(&mut self, bytes: &[u8], now: Instant) {
        self.last_now = self.last_now.max(now);
        if !matches!(
            self.state,
            State::AwaitInfo { .. } | State::AwaitPong { .. } | State::Connected { .. }
        ) {
            return;
        }
        if !bytes.is_empty() {
            self.silence.heard(now);
        }
        if self.rbuf.is_empty() {
            // Parse straight from the caller's bytes; keep only an incomplete tail.
            let used = self.parse_all(bytes, now);
            if self.transport_is_current()
                && let Some(rest) = bytes.get(used..)
            {
                self.rbuf.extend_from_slice(rest);
            }
        } else {
            self.rbuf.extend_from_slice(bytes);
            let buf = std::mem::take(&mut self.rbuf);
            let used = self.parse_all(&buf, now);
            if self.transport_is_current() {
                self.rbuf = buf;
                self.rbuf.drain(..used.min(self.rbuf.len()));
            }
        }
        if self.invalid_since_report > 0 {
            let dropped = std::mem::take(&mut self.invalid_since_report);
            self.events.push_back(Event::InvalidMessages { dropped });
        }
        if self.ended_since_report > 0 {
            let dropped = std::mem::take(&mut self.ended_since_report);
            self.events.push_back(Event::AfterUnsubscribe { dropped });
        }
    }

    /// Gives back the room a burst left in its tables (see [`crate::heap::Compact`]):
    /// 10,000 logins' requests and the events their answers made.
    pub fn compact(&mut self) {
        use crate::heap::Compact;
        self.subs.compact();
        self.requests.compact();
        self.events.compact();
        self.ended_while_queued.compact();
        self.ended_order.compact();
        self.unsub_owed.compact();
        crate::heap::compact_buffer(&mut self.rbuf);
        crate::heap::compact_buffer(&mut self.out);
    }

    /// Bytes waiting to be written.
    pub fn output(&self) -> &[u8] {
        self.out.get(self.out_pos..).unwrap_or(&[])
    }

    /// [`Connection::consume_output`] at `now`, for a caller that knows the time.
    pub fn consume_output_at(&mut self, n: usize, now: Instant) {
        self.last_now = self.last_now.max(now);
        self.consume_output(n);
    }

    /// `n` bytes of `output()` were written.
    pub fn consume_output(&mut self, n: usize) {
        self.silence.wrote(n, self.last_now);
        self.out_pos = (self.out_pos + n).min(self.out.len());
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
            if self.lame_duck_move {
                // Everything written: now move to another server.
                self.lame_duck_move = false;
                self.close_transport = true;
                self.lost_at_unknown_time("server entered lame duck mode");
            }
        } else if self.out_pos >= COMPACT_AT && self.out_pos * 2 >= self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
        if self.is_connected() {
            self.write_owed_unsubs();
        }
    }

    fn write_owed_unsubs(&mut self) {
        while let Some(&sid) = self.unsub_owed.front()
            && self.has_room(UNSUB_LINE_MAX)
        {
            self.unsub_owed.pop_front();
            encode::unsubscribe(&mut self.out, sid.0.to_string(), None);
        }
    }

    /// The next instant `handle_timeout` has work (dial, handshake timeout, keepalive,
    /// request deadline).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let state = match self.state {
            State::Waiting { at, .. } => Some(at),
            State::Dialing { deadline, .. }
            | State::AwaitInfo { deadline, .. }
            | State::AwaitPong { deadline, .. } => Some(deadline),
            State::Connected { .. } => {
                let probe = self.options.silence_probe;
                let limit = self.options.silence_limit;
                let probe = probe.and_then(|p| self.silence.deadline(p, limit));
                match (self.next_ping, probe) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            }
            State::Closed => None,
        };
        match (state, self.requests.next_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = self.last_now.max(now);
        match self.state {
            State::Dialing {
                server, deadline, ..
            }
            | State::AwaitInfo { server, deadline }
            | State::AwaitPong { server, deadline }
                if now >= deadline =>
            {
                self.close_transport = true;
                let addr = self.addr_of(server);
                self.attempt_failed(
                    now,
                    Error::ConnectFailed(format!("timed out connecting to {addr}")),
                );
            }
            State::Connected { .. } if self.next_ping.is_some_and(|t| now >= t) => {
                if self.keepalive_out >= self.options.max_pings_outstanding {
                    self.give_up(now, "stale connection: PINGs unanswered");
                } else {
                    // Past the write bound too: a server that reads nothing leaves at most
                    // `max_pings_outstanding` of these unwritten before it is dropped, and
                    // one left out would keep such a server looking alive.
                    self.keepalive_out += 1;
                    self.pings.push_back(PingKind::Keepalive);
                    encode::ping(&mut self.out);
                    self.next_ping = Some(after(now, self.options.ping_interval));
                }
            }
            _ => {}
        }
        self.probe_silence(now);
        for id in self.requests.expire(now) {
            self.events.push_back(Event::RequestFailed {
                id,
                error: RequestError::Timeout,
            });
        }
    }

    /// [`Options::silence_probe`]: a PING once something written has waited with nothing
    /// read, silent once that has waited too, and given up ([`Options::silence_limit`])
    /// once silent that long.
    fn probe_silence(&mut self, now: Instant) {
        let Some(probe) = self.options.silence_probe.filter(|_| self.is_connected()) else {
            return;
        };
        let limit = self.options.silence_limit;
        let Some(due) = self.silence.deadline(probe, limit).filter(|t| now >= *t) else {
            return;
        };
        match (self.silence.probe_at, self.silence.silent_at) {
            (None, _) => {
                // Past the write bound, as the keepalive's: one at a time, and a server
                // that reads nothing is what it asks about.
                self.pings.push_back(PingKind::Probe);
                encode::ping(&mut self.out);
                self.silence.probe_at = Some(now);
                self.silence.unsent = self.output().len();
                self.silence.moved_at = now;
            }
            (Some(_), None) => {
                self.silence.silent_at = Some(due);
                // Called late enough, past the limit too: no deadline left behind in the
                // past, which the loop would take for a stall.
                self.probe_silence(now);
            }
            (Some(_), Some(_)) => {
                let quiet = now.saturating_duration_since(self.silence.heard_at);
                let reason = format!(
                    "stale connection: nothing read for {} ms, a PING unanswered",
                    quiet.as_millis()
                );
                self.give_up(now, &reason);
            }
        }
    }

    /// Gives the transport up as stale (keepalive PINGs unanswered, or silent past
    /// [`Options::silence_limit`]): the shell drops the socket, requests on the wire fail
    /// `Disconnected`, and the reconnect begins.
    fn give_up(&mut self, now: Instant, reason: &str) {
        self.close_transport = true;
        self.lost(now, reason);
    }

    /// The shell has input of this connection it does not read yet (its caller holds
    /// reads): the server is heard, and the silence it would find is its own.
    pub fn input_held(&mut self, now: Instant) {
        self.last_now = self.last_now.max(now);
        if self.is_connected() {
            self.silence.heard(now);
        }
    }

    /// Connected, but nothing read for a while although a PING asked
    /// ([`Options::silence_probe`]): the link or the server may be gone without a word,
    /// which the keepalive, much later, or [`Options::silence_limit`] takes for a lost
    /// connection.
    pub fn is_silent(&self) -> bool {
        self.silent_since().is_some()
    }

    /// `Err(Error::Silent)` while [`Connection::is_silent`], for a caller that would
    /// rather refuse a request at once than have it wait out its timeout on a link that
    /// carries nothing. `request` itself does not refuse: its other callers have retry
    /// paths built around a timeout, and the first byte read ends the silence.
    pub fn check_heard(&self, now: Instant) -> Result<(), Error> {
        match self.silent_since() {
            Some(since) => Err(Error::Silent {
                quiet: now.saturating_duration_since(since),
            }),
            None => Ok(()),
        }
    }

    /// While [`Connection::is_silent`]: when it last read.
    pub fn silent_since(&self) -> Option<Instant> {
        let silent = self.silence.silent_at.is_some() && self.is_connected();
        silent.then_some(self.silence.heard_at)
    }

    /// Whether events wait to be polled.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Bytes of the messages and responses waiting to be polled: subjects, header
    /// blocks and payloads.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        let event = match self.events.pop_front()? {
            Event::Message { sid, msg }
                if self.ended_while_queued.contains_key(&sid)
                    && msg
                        .reply
                        .as_deref()
                        .is_some_and(|r| r.starts_with("$JS.ACK.")) =>
            {
                Event::Unread { sid, msg }
            }
            event => event,
        };
        self.polled += 1;
        while let Some(&(pushed, sid)) = self.ended_order.front()
            && pushed <= self.polled
        {
            self.ended_order.pop_front();
            self.ended_while_queued.remove(&sid);
        }
        if let Event::Message { msg, .. }
        | Event::Unread { msg, .. }
        | Event::Response { msg, .. } = &event
        {
            self.queued_bytes = self.queued_bytes.saturating_sub(msg.pulled_size());
            self.queued_messages = self.queued_messages.saturating_sub(1);
            if self.dropped_since_report > 0 && self.queued_messages == 0 {
                let dropped = std::mem::take(&mut self.dropped_since_report);
                self.events.push_back(Event::SlowConsumer { dropped });
            }
        }
        Some(event)
    }

    // ----- user side -----

    pub fn is_connected(&self) -> bool {
        matches!(self.state, State::Connected { .. })
    }

    /// Publishes go to the server now: connected, and not moving away from a server in
    /// lame duck mode (then they wait in the reconnect buffer for the next one).
    pub fn sends_now(&self) -> bool {
        self.is_connected() && !self.lame_duck_move
    }

    pub fn is_closed(&self) -> bool {
        self.state == State::Closed
    }

    /// The INFO of the current (or last) server.
    pub fn server_info(&self) -> Option<&ServerInfo> {
        self.info.as_ref()
    }

    /// The server currently connected to.
    pub fn connected_server(&self) -> Option<&ServerAddr> {
        match self.state {
            State::Connected { server } => self.pool.get(server).map(|e| &e.url.addr),
            _ => None,
        }
    }

    /// Every server known: configured and discovered.
    pub fn servers(&self) -> Vec<ServerAddr> {
        self.pool.iter().map(|e| e.url.addr.clone()).collect()
    }

    /// Servers learned from `connect_urls`.
    pub fn discovered_servers(&self) -> Vec<ServerAddr> {
        self.pool
            .iter()
            .filter(|e| e.discovered)
            .map(|e| e.url.addr.clone())
            .collect()
    }

    /// Largest headers-plus-payload the server accepts.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Bytes of publishes waiting for a reconnect.
    pub fn reconnect_buffered(&self) -> usize {
        self.pending.len()
    }

    /// A fresh unique subject under the inbox prefix.
    pub fn new_inbox(&mut self) -> String {
        format!("{}.{}", self.inbox_prefix, self.names.next_id())
    }

    pub fn publish(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<&HeaderMap>,
        payload: &[u8],
    ) -> Result<(), Error> {
        validate_subject(subject.as_bytes())
            .map_err(|_| Error::InvalidSubject(subject.to_string()))?;
        if let Some(r) = reply {
            validate_subject(r.as_bytes()).map_err(|_| Error::InvalidSubject(r.to_string()))?;
        }
        self.publish_unchecked(
            subject.as_bytes(),
            reply.map(str::as_bytes),
            headers,
            payload,
        )
    }

    /// [`publish`](Self::publish) to the reply subject of a message this connection
    /// handed on (an ack), not checked again: [`deliverable`] held it to the subject
    /// rules and more when it came in, and every ack of a stored message comes this way.
    pub(crate) fn publish_to_reply(
        &mut self,
        delivered_reply: &str,
        payload: &[u8],
    ) -> Result<(), Error> {
        self.publish_unchecked(delivered_reply.as_bytes(), None, None, payload)
    }

    fn publish_unchecked(
        &mut self,
        subject: &[u8],
        reply: Option<&[u8]>,
        headers: Option<&HeaderMap>,
        payload: &[u8],
    ) -> Result<(), Error> {
        let header_len = headers.map_or(0, HeaderMap::encoded_len);
        let size = header_len + payload.len();
        if size > self.max_payload {
            return Err(Error::MaxPayloadExceeded {
                size,
                max: self.max_payload,
            });
        }
        let op_len = match headers {
            None => encode::publish_len(subject, reply, size),
            Some(_) => {
                5 + subject.len()
                    + 1
                    + reply.map_or(0, |r| r.len() + 1)
                    + decimal_len(header_len)
                    + 1
                    + decimal_len(size)
                    + 2
                    + size
                    + 2
            }
        };
        let connected = self.sends_now();
        let buf = if connected {
            if !self.has_room(op_len) {
                return Err(self.write_buffer_full());
            }
            &mut self.out
        } else {
            if self.state == State::Closed {
                return Err(self.closed_error());
            }
            if self.pending.len() + op_len > self.options.reconnect_buffer_size {
                return Err(Error::ReconnectBufferFull {
                    capacity: self.options.reconnect_buffer_size,
                });
            }
            &mut self.pending
        };
        match headers {
            None => encode::publish(buf, subject, reply, payload),
            Some(h) => {
                buf.extend_from_slice(b"HPUB ");
                buf.extend_from_slice(subject);
                buf.push(b' ');
                if let Some(r) = reply {
                    buf.extend_from_slice(r);
                    buf.push(b' ');
                }
                encode::write_decimal(buf, header_len as u64);
                buf.push(b' ');
                encode::write_decimal(buf, size as u64);
                buf.extend_from_slice(b"\r\n");
                h.encode_into(buf);
                buf.extend_from_slice(payload);
                buf.extend_from_slice(b"\r\n");
            }
        }
        self.stats.out_msgs += 1;
        self.stats.out_bytes += size as u64;
        Ok(())
    }

    /// Messages of `sid` carry only the inline status and description of their header
    /// block, its fields neither checked nor kept: for a reader that needs nothing else
    /// (the broker's inbox and topic pulls, whose deliveries are built from the stored
    /// envelope), sparing the check and copy of every delivery's fields. A status keeps
    /// its fields (they are what it says, e.g. `Nats-Pending-Bytes`; statuses are few and
    /// small). A block whose version line is fine but whose fields are not then still
    /// gives its status; such a block can only come from someone allowed to publish on
    /// the subject itself.
    pub fn status_only_headers(&mut self, sid: Sid) {
        if let Some(sub) = self.subs.get_mut(sid) {
            sub.status_only = true;
        }
    }

    /// Subscribes to `subject` (wildcards allowed), in queue group `queue` when given.
    /// While disconnected the subscription is made on the next connection.
    pub fn subscribe(&mut self, subject: &str, queue: Option<&str>) -> Result<Sid, Error> {
        validate_pattern(subject.as_bytes())
            .map_err(|_| Error::InvalidSubject(subject.to_string()))?;
        if let Some(q) = queue {
            validate_subject(q.as_bytes()).map_err(|_| Error::InvalidSubject(q.to_string()))?;
        }
        if self.state == State::Closed {
            return Err(self.closed_error());
        }
        if self.subs.len() + self.unsub_owed.len() >= self.options.max_subscriptions {
            return Err(Error::TooManySubscriptions {
                max: self.options.max_subscriptions,
            });
        }
        if self.is_connected() {
            let op_len = 4 + subject.len() + 1 + queue.map_or(0, |q| q.len() + 1) + 20 + 2;
            // An owed UNSUB goes first: a SUB would take the room it waits for, and a
            // server that never reads would see SUBs pile up behind it.
            if !self.unsub_owed.is_empty() || !self.has_room(op_len) {
                return Err(self.write_buffer_full());
            }
        }
        let sid = self.subs.insert(subject, queue);
        if self.is_connected() {
            encode::subscribe(
                &mut self.out,
                subject,
                queue.map(str::as_bytes),
                sid.0.to_string(),
            );
        }
        Ok(sid)
    }

    /// Unsubscribes now (`max_msgs: None`), or after `max_msgs` deliveries in total.
    pub fn unsubscribe(&mut self, sid: Sid, max_msgs: Option<u64>) -> Result<(), Error> {
        if Some(sid) == self.resp_sid {
            return Err(Error::UnknownSubscription(sid.0));
        }
        let connected = self.is_connected();
        let room = self.unsub_owed.is_empty() && self.has_room(UNSUB_LINE_MAX + 21);
        let full = self.write_buffer_full();
        let sub = self
            .subs
            .get_mut(sid)
            .ok_or(Error::UnknownSubscription(sid.0))?;
        match max_msgs {
            Some(max) if sub.delivered < max => {
                // The subscription goes on: without its line the limit would hold here
                // and not at the server, so the caller hears of it instead.
                if connected && !room {
                    return Err(full);
                }
                sub.max = Some(max);
                let remaining = sub.remaining_on_this_connection();
                if connected {
                    encode::unsubscribe(&mut self.out, sid.0.to_string(), remaining);
                }
            }
            _ => {
                self.subs.remove(sid);
                if !self.events.is_empty() {
                    let pushed = self.polled + self.events.len() as u64;
                    self.ended_while_queued.insert(sid, pushed);
                    self.ended_order.push_back((pushed, sid));
                }
                // Ended here either way (what still comes for it is `Unread`); the
                // server hears of it once there is room.
                if connected && room {
                    encode::unsubscribe(&mut self.out, sid.0.to_string(), None);
                } else if connected {
                    self.unsub_owed.push_back(sid);
                }
            }
        }
        Ok(())
    }

    /// Publishes a request with a reply subject under the connection's one wildcard inbox
    /// subscription. The outcome comes as `Event::Response` or `Event::RequestFailed`.
    pub fn request(
        &mut self,
        subject: &str,
        headers: Option<&HeaderMap>,
        payload: &[u8],
        timeout: Duration,
        now: Instant,
    ) -> Result<RequestId, Error> {
        validate_subject(subject.as_bytes())
            .map_err(|_| Error::InvalidSubject(subject.to_string()))?;
        self.request_unchecked(subject.as_bytes(), headers, payload, timeout, now)
    }

    /// [`request`](Self::request) to the reply subject of a message this connection
    /// handed on (an ack awaiting its confirmation), not checked again, as in
    /// [`publish_to_reply`](Self::publish_to_reply).
    pub(crate) fn request_to_reply(
        &mut self,
        delivered_reply: &str,
        payload: &[u8],
        timeout: Duration,
        now: Instant,
    ) -> Result<RequestId, Error> {
        self.request_unchecked(delivered_reply.as_bytes(), None, payload, timeout, now)
    }

    fn request_unchecked(
        &mut self,
        subject: &[u8],
        headers: Option<&HeaderMap>,
        payload: &[u8],
        timeout: Duration,
        now: Instant,
    ) -> Result<RequestId, Error> {
        if self.requests.len() >= self.options.max_pending_requests {
            return Err(Error::TooManyRequests {
                max: self.options.max_pending_requests,
            });
        }
        if self.resp_sid.is_none() {
            let pattern = format!("{}*", self.resp_prefix);
            self.resp_sid = Some(self.subscribe(&pattern, None)?);
        }
        let id = self.requests.next_id();
        // The reply subject is written into the buffer the last request used.
        let mut reply = std::mem::take(&mut self.reply_scratch);
        reply.clear();
        reply.push_str(&self.resp_prefix);
        crate::proto::encode::push_decimal(&mut reply, id.0);
        let published = self.publish_unchecked(subject, Some(reply.as_bytes()), headers, payload);
        self.reply_scratch = reply;
        published?;
        let on_wire = self.is_connected() && !self.lame_duck_move;
        Ok(self.requests.insert(after(now, timeout), on_wire))
    }

    /// Forgets a request; a late reply is dropped. False when it already ended.
    pub fn cancel_request(&mut self, id: RequestId) -> bool {
        self.requests.remove(id)
    }

    /// Requests waiting for a reply.
    pub fn pending_requests(&self) -> usize {
        self.requests.len()
    }

    /// Sends a PING; `Event::Pong` with the returned id follows when the server has
    /// processed everything written before it.
    pub fn ping(&mut self) -> Result<PingId, Error> {
        if !self.is_connected() {
            return Err(match self.state {
                State::Closed => self.closed_error(),
                _ => Error::ConnectFailed("not connected".into()),
            });
        }
        let users = self
            .pings
            .iter()
            .filter(|p| matches!(p, PingKind::User(_)))
            .count();
        if users >= MAX_USER_PINGS {
            return Err(Error::WriteBufferFull {
                capacity: MAX_USER_PINGS,
            });
        }
        if !self.has_room(6) {
            return Err(self.write_buffer_full());
        }
        self.next_user_ping += 1;
        self.pings.push_back(PingKind::User(self.next_user_ping));
        encode::ping(&mut self.out);
        Ok(PingId(self.next_user_ping))
    }

    /// Closes for good. Output not yet written is dropped; flush first to keep it.
    pub fn close(&mut self) {
        if self.state == State::Closed {
            return;
        }
        if !matches!(self.state, State::Waiting { .. }) {
            self.close_transport = true;
        }
        self.close_for_good(Error::Closed("closed by the client".into()));
    }

    // ----- internals -----

    fn transport_is_current(&self) -> bool {
        !self.close_transport
            && matches!(
                self.state,
                State::AwaitInfo { .. } | State::AwaitPong { .. } | State::Connected { .. }
            )
    }

    /// Whether `op_len` more bytes fit under `max_write_buffer`.
    fn has_room(&self, op_len: usize) -> bool {
        self.out.len() - self.out_pos + op_len <= self.options.max_write_buffer
    }

    fn write_buffer_full(&self) -> Error {
        Error::WriteBufferFull {
            capacity: self.options.max_write_buffer,
        }
    }

    fn closed_error(&self) -> Error {
        match &self.last_error {
            Some(Error::Closed(r)) => Error::Closed(r.clone()),
            Some(e) => Error::Closed(e.to_string()),
            None => Error::Closed("closed".into()),
        }
    }

    fn addr_of(&self, server: usize) -> String {
        self.pool
            .get(server)
            .map(|e| e.url.addr.to_string())
            .unwrap_or_default()
    }

    /// Parses and handles complete operations; returns the bytes used. Stops when the
    /// transport was abandoned on the way.
    fn parse_all(&mut self, buf: &[u8], now: Instant) -> usize {
        let mut start = 0;
        while start < buf.len() && self.transport_is_current() {
            let Some(rest) = buf.get(start..) else { break };
            match self.parser.parse(rest) {
                Ok(Parsed::Complete(op, used)) => {
                    start += used.max(1);
                    self.handle_op(op, now);
                    if self.start_tls.is_some() {
                        // The server must wait for our ClientHello: plaintext after the
                        // INFO that starts TLS is an injection, not the server talking.
                        if start < buf.len() {
                            self.close_transport = true;
                            self.start_tls = None;
                            self.attempt_failed(
                                now,
                                Error::Tls("plaintext after the INFO that starts TLS".into()),
                            );
                        }
                        break;
                    }
                }
                Ok(Parsed::Partial { .. }) => break,
                Err(e) => {
                    self.close_transport = true;
                    let reason = format!("protocol error from server: {e}");
                    self.protocol_failure(now, reason);
                    break;
                }
            }
        }
        start
    }

    fn protocol_failure(&mut self, now: Instant, reason: String) {
        match self.state {
            State::Connected { .. } => self.lost(now, &reason),
            _ => self.attempt_failed(now, Error::Server(reason)),
        }
    }

    fn handle_op(&mut self, op: Op<'_>, now: Instant) {
        if matches!(self.state, State::AwaitInfo { .. }) && !matches!(op, Op::Info(_) | Op::Err(_))
        {
            // A server's first bytes are its INFO (nats.go refuses anything else).
            // Answering a PING here put a PONG ahead of CONNECT, which a server with auth
            // refuses, and in plaintext on a connection that must be TLS.
            self.close_transport = true;
            self.protocol_failure(
                now,
                "protocol error: the server did not start with INFO".into(),
            );
            return;
        }
        match op {
            Op::Info(json) => self.on_info(json, now),
            Op::Msg {
                subject,
                sid,
                reply,
                payload,
            } => self.on_msg(subject, sid, reply, None, payload),
            Op::Hmsg {
                subject,
                sid,
                reply,
                headers,
                payload,
            } => self.on_msg(subject, sid, reply, Some(headers), payload),
            Op::Ping => {
                // Each PING asks for bytes: a server that sends them and never reads
                // would have them pile up without end.
                if self.out.len() - self.out_pos >= self.options.max_write_buffer {
                    // During the handshake too: then the attempt fails (`lost` alone left
                    // it waiting for the handshake deadline, its socket already dropped).
                    self.close_transport = true;
                    self.protocol_failure(
                        now,
                        "stale connection: the server does not read what it asks for".into(),
                    );
                } else {
                    encode::pong(&mut self.out);
                }
            }
            Op::Pong => self.on_pong(now),
            Op::Ok => {}
            Op::Err(text) => self.on_err(&String::from_utf8_lossy(text), now),
            Op::Connect(_)
            | Op::Pub { .. }
            | Op::Hpub { .. }
            | Op::Sub { .. }
            | Op::Unsub { .. } => {
                self.close_transport = true;
                self.protocol_failure(now, "protocol error: client operation from server".into());
            }
        }
    }

    fn on_info(&mut self, json: &[u8], now: Instant) {
        let info = match ServerInfo::from_json(json) {
            Ok(info) => info,
            Err(e) => {
                self.close_transport = true;
                self.protocol_failure(now, format!("protocol error: bad INFO: {e}"));
                return;
            }
        };
        // An INFO read in plaintext ahead of TLS may have been rewritten on the way: the
        // servers it names are not learned (the next connection, credentials and all,
        // could go to one of them); INFOs that come under TLS teach them.
        if self.tls_active || !self.tls_required {
            self.learn_servers(&info.connect_urls);
        }
        if info.max_payload > 0 {
            self.max_payload = usize::try_from(info.max_payload)
                .unwrap_or(usize::MAX)
                .min(MAX_PAYLOAD_CEILING);
            self.parser.max_payload = inbound_limit(self.max_payload);
        }
        match self.state {
            State::AwaitInfo { server, deadline } => {
                if !self.tls_active {
                    let offered = info.tls_required
                        || info
                            .extra
                            .get("tls_available")
                            .and_then(serde_json::Value::as_bool)
                            .unwrap_or(false);
                    let refusal = match (self.tls_required, offered) {
                        (true, true) => {
                            self.begin_tls(server);
                            None
                        }
                        (true, false) => Some(format!(
                            "{} offers no TLS but TLS was asked for: not connecting in plaintext",
                            self.addr_of(server)
                        )),
                        (false, _) if info.tls_required => Some(format!(
                            "{} requires TLS: use a tls:// URL (and a CA with --nats-tls-ca)",
                            self.addr_of(server)
                        )),
                        (false, _) => None,
                    };
                    if let Some(reason) = refusal {
                        self.info = Some(info);
                        self.close_transport = true;
                        self.attempt_failed(now, Error::Tls(reason));
                        return;
                    }
                }
                let connect = self.connect_options(&info, server);
                self.info = Some(info);
                if encode::connect(&mut self.out, &connect).is_err() {
                    self.close_transport = true;
                    self.attempt_failed(now, Error::Credentials("cannot encode CONNECT".into()));
                    return;
                }
                encode::ping(&mut self.out);
                self.state = State::AwaitPong { server, deadline };
            }
            State::Connected { server } => {
                let ldm = info.ldm;
                self.info = Some(info);
                if ldm {
                    self.on_lame_duck(server, now);
                }
            }
            _ => self.info = Some(info),
        }
    }

    fn on_lame_duck(&mut self, server: usize, now: Instant) {
        if let Some(entry) = self.pool.get_mut(server) {
            if entry.lame_duck_until.is_some_and(|t| now < t) {
                return;
            }
            entry.lame_duck_until = Some(after(now, LAME_DUCK_PERIOD));
        }
        self.events.push_back(Event::LameDuck);
        let elsewhere = self
            .pool
            .iter()
            .enumerate()
            .any(|(i, e)| i != server && !e.in_lame_duck(now));
        if elsewhere && self.options.allow_reconnect {
            // Let what is written reach this server, then move; new publishes meanwhile
            // wait in the reconnect buffer.
            if self.output().is_empty() {
                self.close_transport = true;
                self.lost_at_unknown_time("server entered lame duck mode");
            } else {
                self.lame_duck_move = true;
            }
        }
    }

    /// The servers an INFO's `connect_urls` names become the discovered ones: those it no
    /// longer names are forgotten (as nats.go does), except the one in use; configured
    /// servers stay. An INFO naming none leaves them as they are. Before, every server
    /// ever named stayed for good: dead pod addresses piled up, each dialed in turn, and
    /// once `max_discovered_servers` were known no new one was learned.
    fn learn_servers(&mut self, urls: &[String]) {
        if self.options.ignore_discovered_servers || urls.is_empty() {
            return;
        }
        let named: Vec<ServerAddr> = urls
            .iter()
            .filter_map(|u| ServerUrl::parse(u).ok())
            .map(|u| u.addr)
            .collect();
        let current = self.current_server();
        let mut kept = 0;
        let mut moved = None;
        for (i, entry) in std::mem::take(&mut self.pool).into_iter().enumerate() {
            if entry.discovered && Some(i) != current && !named.contains(&entry.url.addr) {
                continue;
            }
            if Some(i) == current {
                moved = Some(kept);
            }
            self.pool.push(entry);
            kept += 1;
        }
        if let Some(server) = moved {
            self.set_current_server(server);
        }
        for url in urls {
            let discovered = self.pool.iter().filter(|e| e.discovered).count();
            if discovered >= self.options.max_discovered_servers {
                break;
            }
            let Ok(parsed) = ServerUrl::parse(url) else {
                continue;
            };
            if self.pool.iter().any(|e| e.url.addr == parsed.addr) {
                continue;
            }
            self.pool.push(PoolEntry {
                url: parsed,
                discovered: true,
                failures: 0,
                retry_at: None,
                lame_duck_until: None,
            });
        }
    }

    /// The pool index the state names (waiting for, dialing, or connected to).
    fn current_server(&self) -> Option<usize> {
        match self.state {
            State::Waiting { server, .. }
            | State::Dialing { server, .. }
            | State::AwaitInfo { server, .. }
            | State::AwaitPong { server, .. }
            | State::Connected { server } => Some(server),
            State::Closed => None,
        }
    }

    /// The server the state names is now at pool index `index`.
    fn set_current_server(&mut self, index: usize) {
        match &mut self.state {
            State::Waiting { server, .. }
            | State::Dialing { server, .. }
            | State::AwaitInfo { server, .. }
            | State::AwaitPong { server, .. }
            | State::Connected { server } => *server = index,
            State::Closed => {}
        }
    }

    fn connect_options(&self, info: &ServerInfo, server: usize) -> ConnectOptions {
        let mut c = ConnectOptions {
            name: self.options.name.clone(),
            echo: self.options.echo,
            tls_required: self.tls_active,
            ..ConnectOptions::default()
        };
        let sign = |key: &crate::nkeys::KeyPair| {
            info.nonce
                .as_ref()
                .map(|n| URL_SAFE_NO_PAD.encode(key.sign(n.as_bytes())))
        };
        match &self.options.auth {
            Auth::UserPassword { user, pass } => {
                c.user = Some(user.clone());
                c.pass = Some(pass.clone());
            }
            Auth::Token(t) => c.auth_token = Some(t.clone()),
            Auth::NKey(key) => {
                c.nkey = Some(key.public_key());
                c.sig = sign(key);
            }
            Auth::Jwt { jwt, key } => {
                c.jwt = Some(jwt.clone());
                c.sig = sign(key);
            }
            Auth::None => {
                // Credentials from this server's URL, else from the first URL that has
                // some (discovered servers come without).
                let url = self
                    .pool
                    .get(server)
                    .map(|e| &e.url)
                    .filter(|u| u.user.is_some())
                    .or_else(|| self.pool.iter().map(|e| &e.url).find(|u| u.user.is_some()));
                if let Some(url) = url {
                    match (&url.user, &url.pass) {
                        (Some(u), Some(p)) => {
                            c.user = Some(u.clone());
                            c.pass = Some(p.clone());
                        }
                        (Some(t), None) => c.auth_token = Some(t.clone()),
                        _ => {}
                    }
                }
            }
        }
        c
    }

    fn on_pong(&mut self, now: Instant) {
        match self.state {
            State::AwaitPong { server, .. } => self.handshake_done(server, now),
            State::Connected { .. } => {
                // Only the answer to a PING: unasked PONGs would keep a server that no
                // longer reads looking alive.
                match self.pings.pop_front() {
                    Some(PingKind::User(id)) => self.events.push_back(Event::Pong(PingId(id))),
                    Some(PingKind::Keepalive) => {
                        self.keepalive_out = self.keepalive_out.saturating_sub(1);
                    }
                    Some(PingKind::Probe) => self.silence.probe_at = None,
                    None => {}
                }
            }
            _ => {}
        }
    }

    fn handshake_done(&mut self, server: usize, now: Instant) {
        self.state = State::Connected { server };
        self.connected_at = now;
        self.failures_in_a_row = 0;
        self.last_error = None;
        // Its failures are forgotten once the connection has lasted (`lost`).
        if let Some(e) = self.pool.get_mut(server) {
            e.retry_at = None;
            e.lame_duck_until = None;
        }
        self.keepalive_out = 0;
        self.pings.clear();
        self.silence = Silence::new(now);
        self.next_ping = Some(after(now, self.options.ping_interval));
        // Restore subscriptions, then what was published while away.
        for (sid, sub) in self.subs.all_mut() {
            sub.delivered_at_sub = sub.delivered;
            encode::subscribe(
                &mut self.out,
                &sub.subject,
                sub.queue.as_deref().map(str::as_bytes),
                sid.0.to_string(),
            );
            if sub.max.is_some() {
                let remaining = sub.remaining_on_this_connection();
                encode::unsubscribe(&mut self.out, sid.0.to_string(), remaining);
            }
        }
        self.out.append(&mut self.pending);
        self.pending = Vec::new();
        self.requests.mark_all_on_wire();
        let addr = self.pool.get(server).map(|e| e.url.addr.clone());
        let addr = addr.unwrap_or(ServerAddr {
            host: String::new(),
            port: 0,
        });
        if self.ever_connected {
            self.stats.reconnects += 1;
            self.events.push_back(Event::Reconnected { server: addr });
        } else {
            self.ever_connected = true;
            self.events.push_back(Event::Connected { server: addr });
        }
    }

    fn on_err(&mut self, text: &str, now: Instant) {
        let kind = classify_err(text);
        match self.state {
            State::Connected { .. } => match kind {
                ErrKind::Recoverable => self.events.push_back(Event::ServerError(text.into())),
                ErrKind::Authorization | ErrKind::Fatal => {
                    self.close_transport = true;
                    self.lost(now, &format!("server error: {text}"));
                }
            },
            State::AwaitInfo { .. } | State::AwaitPong { .. } => match kind {
                ErrKind::Recoverable => self.events.push_back(Event::ServerError(text.into())),
                ErrKind::Authorization => {
                    self.close_transport = true;
                    self.attempt_failed(now, Error::Authorization(text.into()));
                }
                ErrKind::Fatal => {
                    self.close_transport = true;
                    self.attempt_failed(now, Error::Server(text.into()));
                }
            },
            _ => {}
        }
    }

    fn on_msg(
        &mut self,
        subject: &[u8],
        sid: &[u8],
        reply: Option<&[u8]>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        if !self.is_connected() {
            return;
        }
        let Some(sid) = parse_u64(sid).map(Sid) else {
            return;
        };
        if !deliverable(subject) || reply.is_some_and(|r| !deliverable(r)) {
            self.stats.invalid_msgs += 1;
            self.invalid_since_report += 1;
            // A JetStream delivery (JetStream stores such subjects too) would come again
            // after every ack wait and hold a slot of its consumer's window: end it. Only
            // one to this connection's own inbox subjects, though: anywhere else, whoever
            // published the message chose its reply, and any message's ack subject names
            // it by stream and sequence alone.
            let own = self
                .subs
                .get(sid)
                .and_then(|s| s.subject.strip_prefix(self.inbox_prefix.as_str()))
                .is_some_and(|rest| rest.starts_with('.'));
            if let Some(ack) = reply.filter(|r| own && r.starts_with(b"$JS.ACK.") && deliverable(r))
            {
                let _ = self.publish_unchecked(ack, None, None, b"+TERM");
            }
            return;
        }
        self.stats.in_msgs += 1;
        self.stats.in_bytes += (payload.len() + headers.map_or(0, <[u8]>::len)) as u64;
        if Some(sid) == self.resp_sid {
            self.on_response(subject, reply, headers, payload);
            return;
        }
        let (delivery, status_only) = self.subs.deliver(sid);
        let known = delivery != Delivery::Unknown;
        if !known && !reply.is_some_and(|r| r.starts_with(b"$JS.ACK.")) {
            self.ended_since_report += 1;
            return;
        }
        if self.queued_messages >= self.options.max_pending_messages {
            self.dropped_since_report += 1;
            self.stats.dropped_msgs += 1;
            return;
        }
        let msg = make_message(subject, reply, headers, payload, status_only);
        self.queued_messages += 1;
        self.queued_bytes += msg.pulled_size();
        self.events.push_back(if known {
            Event::Message { sid, msg }
        } else {
            Event::Unread { sid, msg }
        });
    }

    fn on_response(
        &mut self,
        subject: &[u8],
        reply: Option<&[u8]>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        let Some(token) = subject.strip_prefix(self.resp_prefix.as_bytes()) else {
            return;
        };
        let Some(id) = parse_u64(token).map(RequestId) else {
            return;
        };
        if !self.requests.remove(id) {
            return; // late or duplicate reply
        }
        let msg = make_message(subject, reply, headers, payload, false);
        if msg.status() == Some(503) && msg.payload.is_empty() {
            self.events.push_back(Event::RequestFailed {
                id,
                error: RequestError::NoResponders,
            });
        } else {
            self.queued_messages += 1;
            self.queued_bytes += msg.pulled_size();
            self.events.push_back(Event::Response { id, msg });
        }
    }

    /// An established connection is gone.
    fn lost(&mut self, now: Instant, reason: &str) {
        let State::Connected { server } = self.state else {
            return;
        };
        self.reset_transport();
        if now.saturating_duration_since(self.connected_at) >= STABLE_CONNECTION {
            if let Some(e) = self.pool.get_mut(server) {
                e.failures = 0;
            }
        } else {
            self.back_off(server, now);
        }
        self.events.push_back(Event::Disconnected {
            reason: reason.to_string(),
        });
        for id in self.requests.take_on_wire() {
            self.events.push_back(Event::RequestFailed {
                id,
                error: RequestError::Disconnected,
            });
        }
        if !self.options.allow_reconnect {
            self.close_for_good(Error::Closed(reason.to_string()));
            return;
        }
        self.schedule(server, now);
    }

    /// `lost` where no `now` is at hand (from `consume_output`): the latest `now` seen.
    fn lost_at_unknown_time(&mut self, reason: &str) {
        self.lost(self.last_now, reason);
    }

    /// A dial or handshake failed.
    fn attempt_failed(&mut self, now: Instant, error: Error) {
        let server = match self.state {
            State::Dialing { server, .. }
            | State::AwaitInfo { server, .. }
            | State::AwaitPong { server, .. } => server,
            _ => return,
        };
        self.reset_transport();
        self.failures_in_a_row += 1;
        self.back_off(server, now);
        let first_connect = !self.ever_connected && !self.options.retry_on_failed_connect;
        if first_connect
            && (matches!(error, Error::Authorization(_))
                || self.initial_attempts >= self.pool.len())
        {
            self.close_for_good(error);
            return;
        }
        if self.ever_connected && !self.options.allow_reconnect {
            self.close_for_good(error);
            return;
        }
        if self
            .options
            .max_reconnect_attempts
            .is_some_and(|max| self.failures_in_a_row >= max)
        {
            self.close_for_good(Error::ConnectFailed(format!(
                "gave up after {} attempts: {error}",
                self.failures_in_a_row
            )));
            return;
        }
        self.last_error = Some(error);
        self.schedule(server, now);
    }

    /// One more failure of `server`: not dialed again before its backoff.
    fn back_off(&mut self, server: usize, now: Instant) {
        if let Some(e) = self.pool.get_mut(server) {
            e.failures = e.failures.saturating_add(1);
            e.retry_at = Some(after(
                now,
                backoff::delay(
                    self.options.reconnect_delay,
                    self.options.reconnect_delay_max,
                    e.failures,
                    &mut self.rng,
                ),
            ));
        }
    }

    /// Picks the server after `after` in rotation and waits for its backoff. Servers in
    /// lame duck mode are passed over only until every other server has failed once in a
    /// row: a mark guides the move it caused, and never keeps a server from being dialed
    /// (one INFO naming an address that never answers had the connection dial that alone,
    /// for good, the configured server passed over).
    fn schedule(&mut self, after: usize, now: Instant) {
        let n = self.pool.len();
        if n == 0 {
            self.close_for_good(Error::NoServers);
            return;
        }
        let others = self.pool.iter().filter(|e| !e.in_lame_duck(now)).count();
        let avoid = self.failures_in_a_row < others as u32;
        let candidates = (1..=n).map(|k| (after + k) % n);
        let pick = candidates
            .clone()
            .find(|&i| {
                self.pool
                    .get(i)
                    .is_some_and(|e| !(avoid && e.in_lame_duck(now)))
            })
            .unwrap_or((after + 1) % n);
        let at = self
            .pool
            .get(pick)
            .and_then(|e| e.retry_at)
            .map_or(now, |t| t.max(now));
        self.state = State::Waiting { server: pick, at };
    }

    fn reset_transport(&mut self) {
        self.tls_active = false;
        self.start_tls = None;
        self.rbuf = Vec::new();
        self.out.clear();
        self.out_pos = 0;
        self.unsub_owed.clear();
        self.pings.clear();
        self.keepalive_out = 0;
        self.silence = Silence::new(self.last_now);
        self.next_ping = None;
        self.lame_duck_move = false;
        self.parser.max_payload = inbound_limit(self.max_payload);
    }

    fn close_for_good(&mut self, reason: Error) {
        self.reset_transport();
        self.pending = Vec::new();
        self.state = State::Closed;
        for id in self.requests.take_all() {
            self.events.push_back(Event::RequestFailed {
                id,
                error: RequestError::Closed,
            });
        }
        self.last_error = Some(reason.clone());
        self.events.push_back(Event::Closed { reason });
    }
}

fn decimal_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 10 {
        n /= 10;
        len += 1;
    }
    len
}

fn parse_u64(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || bytes.len() > 19 {
        return None;
    }
    bytes.iter().try_fold(0u64, |acc, &b| {
        b.is_ascii_digit().then(|| acc * 10 + u64::from(b - b'0'))
    })
}

/// A subject the parser took as data is handed on only when it is a valid literal subject
/// in UTF-8 without control bytes; anything else came from a publisher nats-server did not
/// check (it is not pedantic) and means nothing to a subscriber.
///
/// One pass, as it runs for every message: no byte at or below space or DEL (which also
/// rules out the whitespace `validate_subject` refuses), no empty token and no `*` or `>`
/// token, then UTF-8.
pub(crate) fn deliverable(subject: &[u8]) -> bool {
    // Most subjects have no `*` or `>` anywhere: then one scan for bad bytes, dots in a
    // row and non-ASCII bytes, and a look at both ends, say it.
    if let Some((double_dot, ascii)) = crate::scan::plain_subject(subject) {
        let ends = subject.first().is_some_and(|&b| b != b'.') && subject.last() != Some(&b'.');
        return ends && !double_dot && (ascii || std::str::from_utf8(subject).is_ok());
    }
    let literal = |token: &[u8]| !matches!(token, b"" | b"*" | b">");
    let mut start = 0;
    for (i, &b) in subject.iter().enumerate() {
        if b <= b' ' || b == 0x7f {
            return false;
        }
        if b == b'.' {
            if !literal(subject.get(start..i).unwrap_or_default()) {
                return false;
            }
            start = i + 1;
        }
    }
    literal(subject.get(start..).unwrap_or_default())
        && (subject.is_ascii() || std::str::from_utf8(subject).is_ok())
}

/// The bytes as a `String`: copied as they are when UTF-8, with replacement characters
/// otherwise. Checked in the copy, not in the read buffer: the heap copy starts on a
/// word boundary, from which `from_utf8` reads ASCII two words a step, where a subject
/// anywhere in the read buffer went a byte at a time up to the first boundary.
pub(crate) fn owned_text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec())
        .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn make_message(
    subject: &[u8],
    reply: Option<&[u8]>,
    headers: Option<&[u8]>,
    payload: &[u8],
    status_only: bool,
) -> Message {
    Message {
        subject: owned_text(subject),
        reply: reply.map(owned_text),
        // A header block another client got wrong is delivered without headers rather
        // than taking the connection down.
        headers: headers.and_then(|h| {
            if status_only {
                let map = HeaderMap::parse_status(h).ok()?;
                match map.status() {
                    Some(_) => HeaderMap::parse(h).ok().or(Some(map)),
                    None => Some(map),
                }
            } else {
                HeaderMap::parse(h).ok()
            }
        }),
        payload: payload.to_vec(),
    }
}

/// The source of the connection's subject tokens: the operating system's randomness, or
/// a fixed seed's stream for a reproducible run.
fn subject_names(seed: Option<u64>) -> IdSource {
    let mut bytes = [0u8; 32];
    match seed {
        Some(seed) => bytes[..8].copy_from_slice(&seed.to_le_bytes()),
        None => {
            if getrandom::fill(&mut bytes).is_err() {
                // No OS source: the clock's nanoseconds, unique if not secret.
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                bytes[..16].copy_from_slice(&nanos.to_le_bytes());
            }
        }
    }
    IdSource::from_seed(bytes).derive("nats subjects")
}
