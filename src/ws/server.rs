//! The `mio` shell around [`Connection`]s: a listener and a connection table on the
//! embedder's `Poll`, a deadline heap for the connections' timers, and the byte moving
//! between sockets and machines.
//!
//! The server does not own the event loop, so the broker can run it next to its NATS
//! connection on one `Poll`:
//!
//! ```text
//! let mut ws = WsServer::bind(addr, cfg, poll.registry(), Token(0), 1_000)?;
//! loop {
//!     poll.poll(&mut events, timeout_until(min(ws.next_deadline(), nats deadline)))?;
//!     let now = Instant::now();
//!     for e in &events {
//!         if ws.owns(e.token()) { ws.handle_event(poll.registry(), e, now, &host) } else { .. }
//!     }
//!     ws.handle_timeouts(poll.registry(), now, &host);   // also resumes reads cut short
//!     loop {
//!         while let Some((session, event)) = ws.poll_event() { .. ws.send_text(session, ..) .. }
//!         ws.flush(poll.registry(), now, &host);   // writes what the handlers queued
//!         if !ws.has_events() { break }
//!     }
//! }
//! ```
//!
//! [`WsServer::run`] is that loop for a server alone (tests, tools). Tokens: the listener
//! has its own; connection `i` has `first_conn_token + i`, for `i < max_connections`.
//!
//! Fairness: one readiness event reads at most `MAX_READS_PER_TURN` chunks (each decoding
//! at most a few dozen frames) from a connection, and a connection is read once per loop
//! turn; the rest waits for the next turn's `handle_timeouts`, so the embedder's other
//! sockets and timers are served in between. No connection is read while the memory
//! budget is full, messages decoded and not yet taken included; those waiting then are
//! read in turn. `flush` only writes; it never reads.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Registry, Token};

use super::connect_rate::ConnectRate;
use super::connection::{ConnEvent, Connection, HttpHost, SendError, WsConfig, close_code};
use super::metrics::{CounterId, GaugeId, Registry as Metrics};
use super::origin::OriginPolicy;
use super::pending::{Group, Waiting};
use crate::broker::throttle::AddressKey;
use crate::tls::{Received, TlsSession};

/// Bytes read from one socket per pass before other connections get their turn.
const READ_CHUNK: usize = 64 << 10;
const MAX_READS_PER_TURN: usize = 8;
/// How soon a listener whose accept failed for want of resources is tried again.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// Connections taken from a listener per loop turn (served or refused); the rest wait for
/// the next turn, so a connection flood cannot keep the loop from sessions, NATS and
/// timers.
const MAX_ACCEPTS_PER_TURN: usize = 64;
/// The timer heap keeps a stale entry for each connection closed before its deadline; it
/// is rebuilt from the live ones once it holds this many more than twice the connections.
const TIMER_SLACK: usize = 1024;
/// Decrypted bytes per step on their way from a TLS session to its connection.
const PLAIN_CHUNK: usize = 16 << 10;
/// The first byte of a TLS record carrying a handshake.
const TLS_HANDSHAKE: u8 = 0x16;
/// Emptied output buffers kept for the next sessions with output, and the largest kept:
/// at most 512 KiB in all, whatever the sessions send.
const MAX_SPARE_OUTPUT: usize = 32;
const MAX_SPARE_CAPACITY: usize = 16 << 10;

/// The level of a line about one connection's fate: a warning for a logged-in session;
/// debug for a connection that has not logged in, as anyone can cause one of those per
/// connection, at the connect rate (the metrics count every one).
fn peer_level(admitted: bool) -> log::Level {
    if admitted {
        log::Level::Warn
    } else {
        log::Level::Debug
    }
}

/// A session (one connection) as the embedder sees it; never reused for another one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(u64);

impl SessionId {
    fn new(index: usize, generation: u32) -> Self {
        SessionId((u64::from(generation) << 32) | index as u64)
    }
    fn index(self) -> usize {
        (self.0 & 0xFFFF_FFFF) as usize
    }
    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEvent {
    Opened {
        subprotocol: Option<&'static str>,
        peer: SocketAddr,
    },
    Text(String),
    /// The session is over (see [`ConnEvent::Closed`]); the id is dead from here on.
    Closed {
        code: u16,
        reason: String,
        by_peer: bool,
    },
}

#[derive(Debug)]
struct Slot {
    conn: Connection,
    /// The TLS session under `conn`, for a connection on the TLS listener. Boxed: it is
    /// 1.2 KiB, which a plain session should not carry.
    tls: Option<Box<TlsSession>>,
    stream: TcpStream,
    peer: SocketAddr,
    /// The deadline this slot has in the heap, if any.
    scheduled: Option<Instant>,
    ip: AddressKey,
    /// Reads stopped because the connection held input back (frame allowance); the socket
    /// is read again once it has caught up.
    stalled: bool,
    /// This connection's share of [`WsServer::buffered`] as last counted.
    accounted: usize,
    /// This connection's share of [`WsServer::queued`] as last counted.
    queued: usize,
    /// The state it is counted under in `amp_ws_connections_by_state`.
    state: &'static str,
    /// Counted in [`WsServer::waiting`] under this group until it logs in or closes;
    /// `None` once logged in, and for the plain listener's (internal) connections.
    waiting: Option<Group>,
    /// Closed for the memory budget: another pass before its slot goes must not count,
    /// log and close it again.
    shed: bool,
    /// The loop turn ([`WsServer::turn`]) it was last read in: once per turn.
    read_in: u64,
}

#[derive(Debug)]
struct TransportMetrics {
    registry: Metrics,
    accepted: CounterId,
    refused: CounterId,
    evicted: CounterId,
    waiting: GaugeId,
    connections: GaugeId,
    buffered: GaugeId,
    shed: CounterId,
    ws_sessions: GaugeId,
    http_responses: CounterId,
    closes: CounterId,
    slow_consumers: CounterId,
    bytes: CounterId,
    by_state: GaugeId,
    queued: GaugeId,
    tls_failures: CounterId,
}

impl TransportMetrics {
    fn new() -> Self {
        let mut r = Metrics::new();
        TransportMetrics {
            accepted: r.counter(
                "amp_ws_connections_accepted_total",
                "TCP connections accepted.",
                None,
            ),
            refused: r.counter(
                "amp_ws_connections_refused_total",
                "TCP connections closed at once, by reason (table_full, rate, per_ip, memory).",
                Some("reason"),
            ),
            evicted: r.counter(
                "amp_ws_connections_evicted_total",
                "Connections not logged in yet dropped to make room for a new one (the table or its share for connections waiting for a hello was full).",
                None,
            ),
            waiting: r.gauge(
                "amp_ws_connections_waiting",
                "Connections of the main listener not logged in yet (limits.max_waiting_connections).",
                None,
            ),
            connections: r.gauge("amp_ws_connections", "TCP connections open.", None),
            buffered: r.gauge(
                "amp_ws_buffered_bytes",
                "Input held, output queued and decoded messages not yet taken by the broker, over all connections.",
                None,
            ),
            shed: r.counter(
                "amp_ws_memory_sheds_total",
                "Connections closed (1008 memory budget) because the buffered bytes passed max_buffered_bytes.",
                None,
            ),
            ws_sessions: r.gauge("amp_ws_sessions", "WebSocket sessions open.", None),
            http_responses: r.counter(
                "amp_http_responses_total",
                "Plain HTTP responses, by status.",
                Some("status"),
            ),
            closes: r.counter(
                "amp_ws_closes_total",
                "WebSocket sessions ended, by close code.",
                Some("code"),
            ),
            slow_consumers: r.counter(
                "amp_ws_slow_consumers_total",
                "Sessions closed because their outbound queue passed its bound.",
                None,
            ),
            bytes: r.counter(
                "amp_ws_bytes_total",
                "Bytes read from (in) and written to (out) client sockets.",
                Some("direction"),
            ),
            by_state: r.gauge(
                "amp_ws_connections_by_state",
                "Connections open, by state (http, open, closing).",
                Some("state"),
            ),
            queued: r.gauge(
                "amp_ws_outbound_queued_bytes",
                "Bytes queued for clients over all connections, not yet written.",
                None,
            ),
            tls_failures: r.counter(
                "amp_tls_handshake_failures_total",
                "Connections closed because TLS failed (handshake, bad record, plaintext on the TLS port, TLS on a plain port).",
                None,
            ),
            registry: r,
        }
    }
}

/// The embedder's endpoints plus the transport's own metrics.
struct WithTransport<'a> {
    host: &'a dyn HttpHost,
    metrics: &'a Metrics,
    origins: &'a OriginPolicy,
}

impl HttpHost for WithTransport<'_> {
    fn health(&self) -> Result<(), String> {
        self.host.health()
    }
    fn live(&self) -> Result<(), String> {
        self.host.live()
    }
    fn metrics(&self, out: &mut String) {
        self.host.metrics(out);
        self.metrics.render(out);
    }
    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        self.origins.allows(origin, host) && self.host.origin_allowed(origin, host)
    }
}

pub struct WsServer {
    cfg: Arc<WsConfig>,
    listener: Option<TcpListener>,
    local_addr: SocketAddr,
    listener_token: Token,
    first_token: usize,
    /// Boxed: a vacant slot (the table keeps the room of its peak) then costs a pointer,
    /// not a whole connection's state.
    slots: Vec<Option<Box<Slot>>>,
    generations: Vec<u32>,
    free: Vec<usize>,
    open: usize,
    timers: BinaryHeap<Reverse<(Instant, usize, u32)>>,
    events: VecDeque<(SessionId, SessionEvent)>,
    dirty: Vec<usize>,
    /// Output buffers of connections that had nothing left to write.
    spare_output: Vec<Vec<u8>>,
    /// Connections that still had input when their read turn ended.
    backlog: Vec<usize>,
    /// Where the next pass over `backlog` starts: where the memory budget stopped the
    /// last one, so under pressure every connection gets its turn.
    backlog_from: usize,
    /// The memory budget stopped reading with connections left in `backlog`: new input
    /// waits its turn there too, rather than going ahead of them.
    reads_paused: bool,
    /// Loop turns so far (`handle_timeouts` ends one), starting at 1.
    turn: u64,
    /// Bytes of the text messages in `events`, decoded and not taken yet: they count
    /// against the memory budget when reading, so one turn cannot read past it.
    decoded: usize,
    /// Open connections per source address (IPv6: per /64).
    per_ip: HashMap<AddressKey, usize>,
    /// Connections of the main listener not logged in yet.
    waiting: Waiting,
    connect_rate: ConnectRate,
    /// Input held and output queued over all connections.
    buffered: usize,
    scratch: Vec<u8>,
    /// Output queued over all connections.
    queued: usize,
    metrics: TransportMetrics,
    draining: bool,
    /// The configuration new TLS handshakes on the listener use; `None`: plain.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// A second, plain listener (internal use: metrics on loopback) beside a TLS one.
    plain_listener: Option<(TcpListener, Token)>,
    /// Listeners whose accept failed for want of resources (descriptors, buffers), the
    /// main one first: the connections waiting there get no readiness event of their
    /// own, so accepting is tried again at `accept_retry_at`.
    accept_stalled: [bool; 2],
    accept_retry_at: Option<Instant>,
    origins: OriginPolicy,
    /// Where decrypted bytes land on their way to a connection (allocated with TLS).
    plain: Vec<u8>,
}

impl std::fmt::Debug for WsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WsServer")
            .field("local_addr", &self.local_addr)
            .field("connections", &self.open)
            .field("draining", &self.draining)
            .finish()
    }
}

impl WsServer {
    /// Binds the listener and registers it under `listener_token`.
    pub fn bind(
        addr: SocketAddr,
        cfg: WsConfig,
        registry: &Registry,
        listener_token: Token,
        first_conn_token: usize,
    ) -> io::Result<Self> {
        let mut listener = TcpListener::bind(addr)?;
        let local_addr = listener.local_addr()?;
        registry.register(&mut listener, listener_token, Interest::READABLE)?;
        Ok(WsServer {
            cfg: Arc::new(cfg),
            listener: Some(listener),
            local_addr,
            listener_token,
            first_token: first_conn_token,
            slots: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            open: 0,
            timers: BinaryHeap::new(),
            events: VecDeque::new(),
            dirty: Vec::new(),
            spare_output: Vec::new(),
            backlog: Vec::new(),
            backlog_from: 0,
            reads_paused: false,
            turn: 1,
            decoded: 0,
            per_ip: HashMap::new(),
            waiting: Waiting::default(),
            connect_rate: ConnectRate::new(cfg.connects_per_ip_per_s, cfg.connect_burst_per_ip),
            buffered: 0,
            scratch: vec![0; READ_CHUNK],
            queued: 0,
            metrics: TransportMetrics::new(),
            draining: false,
            tls: None,
            plain_listener: None,
            accept_stalled: [false; 2],
            accept_retry_at: None,
            origins: OriginPolicy::default(),
            plain: Vec::new(),
        })
    }

    /// Serves TLS (wss://, https://) on the listener from now on; `None` goes back to
    /// plain. Connections already open keep what they have, so a new certificate reaches
    /// only new handshakes and no session is dropped.
    pub fn set_tls(&mut self, config: Option<Arc<rustls::ServerConfig>>) {
        if config.is_some() && self.plain.is_empty() {
            self.plain = vec![0; PLAIN_CHUNK];
        }
        self.tls = config;
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Which `Origin` may open WebSocket sessions.
    pub fn set_origin_policy(&mut self, policy: OriginPolicy) {
        self.origins = policy;
    }

    /// Opens a second listener that serves plain HTTP/WebSocket whatever the first one
    /// does; it shares the connection table and every bound with it.
    pub fn bind_plain(
        &mut self,
        addr: SocketAddr,
        registry: &Registry,
        token: Token,
    ) -> io::Result<SocketAddr> {
        let mut listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        registry.register(&mut listener, token, Interest::READABLE)?;
        self.plain_listener = Some((listener, token));
        Ok(local)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn config(&self) -> &WsConfig {
        &self.cfg
    }

    /// Whether `token` is the listener's or one of the connections'.
    pub fn owns(&self, token: Token) -> bool {
        token == self.listener_token
            || self
                .plain_listener
                .as_ref()
                .is_some_and(|(_, t)| *t == token)
            || (token.0 >= self.first_token
                && token.0 - self.first_token < self.cfg.max_connections)
    }

    /// Connections open (HTTP, WebSocket and closing ones).
    pub fn connection_count(&self) -> usize {
        self.open
    }

    /// Input held and output queued over all connections, as last counted.
    pub fn buffered_bytes(&self) -> usize {
        self.buffered
    }

    /// Renders the transport's own `amp_ws_*`/`amp_http_*` metrics.
    pub fn render_metrics(&self, out: &mut String) {
        self.metrics.registry.render(out);
    }

    pub fn handle_event(
        &mut self,
        registry: &Registry,
        event: &mio::event::Event,
        now: Instant,
        host: &dyn HttpHost,
    ) {
        let token = event.token();
        if token == self.listener_token {
            self.accept(registry, now, false);
            return;
        }
        if self
            .plain_listener
            .as_ref()
            .is_some_and(|(_, t)| *t == token)
        {
            self.accept(registry, now, true);
            return;
        }
        let Some(index) = token.0.checked_sub(self.first_token) else {
            return;
        };
        if !matches!(self.slots.get(index), Some(Some(_))) {
            return;
        }
        if self.reads_paused {
            // In line behind those the budget held back; read this turn if it allows.
            self.backlog.push(index);
        } else if event.is_readable() || event.is_read_closed() || event.is_error() {
            let short_read_drains = !event.is_read_closed() && !event.is_error();
            self.read(index, now, host, short_read_drains);
        }
        self.settle(registry, index, now);
    }

    /// Runs the connection timers due at `now` and continues the reads that were cut
    /// short for fairness. Call it once per loop turn.
    pub fn handle_timeouts(&mut self, registry: &Registry, now: Instant, host: &dyn HttpHost) {
        if self.accept_retry_at.is_some_and(|at| at <= now) {
            self.accept_retry_at = None;
            for plain in [false, true] {
                if std::mem::take(&mut self.accept_stalled[usize::from(plain)]) {
                    self.accept(registry, now, plain);
                }
            }
        }
        let mut backlog = std::mem::take(&mut self.backlog);
        backlog.sort_unstable();
        backlog.dedup();
        let first = backlog.partition_point(|&index| index < self.backlog_from);
        backlog.rotate_left(first);
        self.reads_paused = false;
        for (n, &index) in backlog.iter().enumerate() {
            if self.reads_full() {
                // The rest go first next turn.
                self.reads_paused = true;
                self.backlog_from = index;
                self.backlog
                    .extend_from_slice(backlog.get(n..).unwrap_or_default());
                break;
            }
            if matches!(self.slots.get(index), Some(Some(_))) {
                self.read(index, now, host, false);
                self.settle(registry, index, now);
            }
        }
        backlog.clear();
        if self.backlog.is_empty() {
            self.backlog = backlog;
        }
        while let Some(Reverse((at, index, generation))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            if self.generations.get(index) != Some(&generation) {
                continue;
            }
            let Some(Some(slot)) = self.slots.get_mut(index) else {
                continue;
            };
            if slot.scheduled != Some(at) {
                continue;
            }
            slot.scheduled = None;
            slot.conn.handle_timeout(now);
            self.settle(registry, index, now);
        }
        self.turn += 1;
    }

    /// The earliest moment [`handle_timeouts`](Self::handle_timeouts) or
    /// [`flush`](Self::flush) has work; `Some(past)` means "poll without waiting".
    pub fn next_deadline(&self) -> Option<Instant> {
        if !self.backlog.is_empty() || !self.dirty.is_empty() || !self.events.is_empty() {
            return Some(Instant::now());
        }
        let timer = self.timers.peek().map(|Reverse((at, ..))| *at);
        match (timer, self.accept_retry_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn poll_event(&mut self) -> Option<(SessionId, SessionEvent)> {
        let event = self.events.pop_front();
        if let Some((_, SessionEvent::Text(text))) = &event {
            self.decoded = self.decoded.saturating_sub(text.len());
        }
        event
    }

    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// Queues a text message; it is written by the next [`flush`](Self::flush).
    pub fn send_text(&mut self, id: SessionId, text: &str, now: Instant) -> Result<(), SendError> {
        let mut spare = std::mem::take(&mut self.spare_output);
        let result = match self.slot_mut(id) {
            Some(slot) => {
                slot.conn.lend_output(&mut spare);
                let result = slot.conn.send_text(text, now);
                // Also after a refusal: a slow consumer's close is flushed and reported.
                self.dirty.push(id.index());
                // Counted at once, so one burst of fan-out sees the budget it fills
                // (`over_budget`); the gauge follows at the flush.
                self.reckon(id.index());
                result
            }
            None => Err(SendError::NotOpen),
        };
        self.spare_output = spare;
        result
    }

    /// Gives back the room its tables and idle connections keep beyond their needs (see
    /// [`crate::heap::Compact`]); called before a trim, which then finds it free.
    pub fn compact(&mut self) {
        use crate::heap::Compact;
        for slot in self.slots.iter_mut().flatten() {
            slot.conn.compact();
        }
        self.timers.compact();
        self.events.compact();
        self.dirty.compact();
        self.backlog.compact();
        self.free.compact();
        self.per_ip.compact();
    }

    /// Whether input held and output queued are past the memory budget: the caller holds
    /// back what would queue more until [`WsServer::flush`] has written what sockets take
    /// and shed the connections still holding the most.
    pub fn over_budget(&self) -> bool {
        self.buffered > self.cfg.max_buffered_bytes
    }

    /// Closes a session with `code` after what is queued for it.
    pub fn close(&mut self, id: SessionId, code: u16, reason: &str, now: Instant) {
        if let Some(slot) = self.slot_mut(id) {
            slot.conn.close(code, reason, now);
            self.dirty.push(id.index());
        }
    }

    /// The session's participant logged in: it no longer counts as waiting for its hello
    /// (it is never pushed out for room) and gets its full output bound.
    pub fn admit(&mut self, id: SessionId) {
        let index = id.index();
        if let Some(slot) = self.slot_mut(id) {
            slot.conn.admit();
            if let Some(group) = slot.waiting.take() {
                self.waiting.remove(group, index);
                self.count_waiting();
            }
        }
    }

    fn count_waiting(&mut self) {
        let m = &mut self.metrics;
        m.registry.set(m.waiting, "", self.waiting.len() as f64);
    }

    /// Room for a new connection from `newcomer`: drops the oldest connection not logged
    /// in of the group holding the most (see [`super::pending`]); false when there is
    /// none, or the newcomer's own group holds as many.
    fn push_out_one(&mut self, newcomer: Group, registry: &Registry, now: Instant) -> bool {
        let Some(index) = self.waiting.take_victim(newcomer) else {
            return false;
        };
        if let Some(Some(slot)) = self.slots.get_mut(index) {
            slot.waiting = None;
            slot.conn.push_out();
            log::debug!(peer:% = slot.peer; "ws: pushed out waiting for its hello, to make room");
        }
        self.metrics.registry.inc(self.metrics.evicted, "");
        self.count_waiting();
        self.settle(registry, index, now);
        true
    }

    /// Bytes queued for a session (0 for an unknown one).
    pub fn queued_bytes(&self, id: SessionId) -> usize {
        self.slot(id).map_or(0, |s| s.conn.queued_bytes())
    }

    pub fn is_open(&self, id: SessionId) -> bool {
        self.slot(id).is_some_and(|s| s.conn.is_open())
    }

    /// Writes what handlers queued and surfaces the events that produced. It reads
    /// nothing, so a loop that flushes until the server is quiet ends.
    pub fn flush(&mut self, registry: &Registry, now: Instant, _host: &dyn HttpHost) {
        self.settle_dirty(registry, now);
        // Output counts against the budget as much as input does.
        if self.buffered > self.cfg.max_buffered_bytes {
            self.shed(now);
            self.settle_dirty(registry, now);
        }
    }

    fn settle_dirty(&mut self, registry: &Registry, now: Instant) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for &index in &dirty {
            self.settle(registry, index, now);
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    /// Stops accepting and closes every open session with 1001 `going away` once what is
    /// queued for it is sent.
    pub fn begin_drain(&mut self, registry: &Registry, now: Instant) {
        self.draining = true;
        self.stop_accepting(registry);
        for index in 0..self.slots.len() {
            if let Some(Some(slot)) = self.slots.get_mut(index) {
                slot.conn.close(close_code::GOING_AWAY, "going away", now);
                self.dirty.push(index);
            }
        }
    }

    /// Closes the listening socket, so new connections are refused while the open ones
    /// carry on (lame duck).
    pub fn stop_accepting(&mut self, registry: &Registry) {
        if let Some(mut listener) = self.listener.take() {
            let _ = registry.deregister(&mut listener);
        }
        if let Some((mut listener, _)) = self.plain_listener.take() {
            let _ = registry.deregister(&mut listener);
        }
    }

    /// Draining and every connection is gone.
    pub fn is_drained(&self) -> bool {
        self.draining && self.open == 0
    }

    /// Runs the loop for this server alone until `tick` returns false. `tick` runs once
    /// per turn; events for tokens the server does not own (a `Waker`) are ignored.
    pub fn run(
        &mut self,
        poll: &mut Poll,
        host: &dyn HttpHost,
        mut on_event: impl FnMut(&mut WsServer, SessionId, SessionEvent, Instant),
        mut tick: impl FnMut(&mut WsServer, &Registry, Instant) -> bool,
    ) -> io::Result<()> {
        let mut events = Events::with_capacity(256);
        loop {
            let timeout = self
                .next_deadline()
                .map(|d| d.saturating_duration_since(Instant::now()));
            match poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            let now = Instant::now();
            for event in events.iter() {
                if self.owns(event.token()) {
                    self.handle_event(poll.registry(), event, now, host);
                }
            }
            self.handle_timeouts(poll.registry(), now, host);
            loop {
                while let Some((id, event)) = self.poll_event() {
                    on_event(self, id, event, now);
                }
                self.flush(poll.registry(), now, host);
                if !self.has_events() {
                    break;
                }
            }
            if !tick(self, poll.registry(), now) {
                return Ok(());
            }
        }
    }

    fn slot(&self, id: SessionId) -> Option<&Slot> {
        if self.generations.get(id.index()) != Some(&id.generation()) {
            return None;
        }
        self.slots.get(id.index()).and_then(Option::as_deref)
    }

    fn slot_mut(&mut self, id: SessionId) -> Option<&mut Slot> {
        if self.generations.get(id.index()) != Some(&id.generation()) {
            return None;
        }
        self.slots
            .get_mut(id.index())
            .and_then(Option::as_deref_mut)
    }

    /// Accepts what waits on the listener, or on the plain one when `plain`, up to its
    /// share of the turn.
    fn accept(&mut self, registry: &Registry, now: Instant, plain: bool) {
        for taken in 0.. {
            if taken == MAX_ACCEPTS_PER_TURN {
                // Edge triggered: no new event comes for those still waiting.
                self.accept_stalled[usize::from(plain)] = true;
                self.accept_retry_at = Some(self.accept_retry_at.map_or(now, |at| at.min(now)));
                return;
            }
            let listener = if plain {
                self.plain_listener.as_ref().map(|(l, _)| l)
            } else {
                self.listener.as_ref()
            };
            let Some(listener) = listener else {
                return;
            };
            let (mut stream, peer) = match listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors and the like. The listener's readiness is edge
                    // triggered: the connections already waiting would wait for the
                    // next one to arrive, so try again shortly; said once per stall.
                    let stalled = &mut self.accept_stalled[usize::from(plain)];
                    if !*stalled {
                        log::warn!("ws: accept failed, trying again every 100 ms: {e}");
                    }
                    *stalled = true;
                    self.accept_retry_at.get_or_insert(now + ACCEPT_RETRY);
                    return;
                }
            };
            self.metrics.registry.inc(self.metrics.accepted, "");
            let ip = AddressKey::of(peer.ip());
            let group = Group::of(peer.ip());
            let refused = if !self.connect_rate.allow(ip, now) {
                Some("rate")
            } else if self.per_ip.get(&ip).copied().unwrap_or(0) >= self.cfg.max_connections_per_ip
            {
                Some("per_ip")
            } else if self.buffered >= self.cfg.max_buffered_bytes {
                Some("memory")
            } else if (self.open >= self.cfg.max_connections
                || (!plain && self.waiting.len() >= self.cfg.max_waiting_connections))
                && !self.push_out_one(group, registry, now)
            {
                Some("table_full")
            } else {
                None
            };
            if let Some(reason) = refused {
                // Dropping the stream closes it: no bytes are spent on a refused peer.
                self.metrics.registry.inc(self.metrics.refused, reason);
                continue;
            }
            let index = match self.free.pop() {
                Some(index) => index,
                None => {
                    self.slots.push(None);
                    self.generations.push(0);
                    self.slots.len() - 1
                }
            };
            let tls = match self.tls.as_ref().filter(|_| !plain) {
                None => None,
                Some(config) => match TlsSession::server(config.clone()) {
                    Ok(session) => Some(session),
                    Err(e) => {
                        log::warn!(peer:% = peer; "ws: cannot start TLS: {e}");
                        self.free.push(index);
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let token = Token(self.first_token + index);
            if let Err(e) =
                registry.register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)
            {
                log::warn!(peer:% = peer; "ws: cannot register the connection: {e}");
                self.free.push(index);
                continue;
            }
            let mut conn = Connection::new(now, Arc::clone(&self.cfg));
            if !plain && self.plain_listener.is_some() {
                conn.keep_internal_elsewhere();
            }
            if let Some(entry) = self.slots.get_mut(index) {
                *entry = Some(Box::new(Slot {
                    conn,
                    tls: tls.map(Box::new),
                    stream,
                    peer,
                    scheduled: None,
                    ip,
                    stalled: false,
                    accounted: 0,
                    queued: 0,
                    state: "http",
                    waiting: (!plain).then_some(group),
                    shed: false,
                    read_in: 0,
                }));
                if !plain {
                    self.waiting.add(group, index);
                    self.count_waiting();
                }
                self.metrics
                    .registry
                    .gauge_add(self.metrics.by_state, "http", 1.0);
            }
            *self.per_ip.entry(ip).or_insert(0) += 1;
            self.open += 1;
            self.metrics
                .registry
                .set(self.metrics.connections, "", self.open as f64);
            self.schedule(index);
        }
    }

    /// Reads the connection until `WouldBlock`, its per-turn allowance or its frame
    /// allowance. With `short_read_drains` (a readiness event that did not report the
    /// peer's end), a read shorter than the buffer ends it too: it emptied the socket's
    /// receive queue, and the next byte to arrive raises a new edge, so the read that
    /// would only answer `WouldBlock` (one system call in every two per frame under
    /// load) is not made. An end of stream reported with the event raises no new edge,
    /// so then the read goes on until it is seen.
    fn read(&mut self, index: usize, now: Instant, host: &dyn HttpHost, short_read_drains: bool) {
        let Some(Some(slot)) = self.slots.get_mut(index) else {
            return;
        };
        if slot.read_in == self.turn {
            self.backlog.push(index);
            return;
        }
        slot.read_in = self.turn;
        let host = WithTransport {
            host,
            metrics: &self.metrics.registry,
            origins: &self.origins,
        };
        let mut read_bytes = 0u64;
        let mut tls_failure: Option<String> = None;
        for turn in 0.. {
            if turn == MAX_READS_PER_TURN {
                self.backlog.push(index);
                break;
            }
            if slot.conn.input_held() {
                if slot.conn.resume_input(now) {
                    continue;
                }
                // Over its frame allowance: its timer resumes it.
                slot.stalled = true;
                break;
            }
            if !slot.conn.wants_input() {
                break;
            }
            // What this read may add counts with what is held and decoded so far, this
            // connection's included: past the budget it waits, in line, for a later turn
            // (the broker takes the decoded messages in this one).
            let held = self
                .buffered
                .saturating_sub(slot.accounted)
                .saturating_add(slot.conn.buffered_bytes())
                .saturating_add(slot.conn.decoded_bytes())
                .saturating_add(slot.tls.as_deref().map_or(0, TlsSession::queued))
                .saturating_add(self.decoded);
            if held > self.cfg.max_buffered_bytes {
                self.reads_paused = true;
                self.backlog.push(index);
                break;
            }
            match slot.stream.read(&mut self.scratch) {
                Ok(0) => {
                    slot.conn.handle_eof(now);
                    break;
                }
                Ok(n) => {
                    read_bytes = read_bytes.saturating_add(n as u64);
                    let bytes = self.scratch.get(..n).unwrap_or_default();
                    let conn = &mut slot.conn;
                    match slot.tls.as_mut() {
                        None if read_bytes == n as u64
                            && bytes.first() == Some(&TLS_HANDSHAKE)
                            && conn.state_label() == "http"
                            && conn.input_bytes() == 0 =>
                        {
                            tls_failure = Some("a TLS handshake on a plain listener".into());
                            conn.abort();
                            break;
                        }
                        None => conn.handle_input(bytes, now, &host),
                        Some(tls) => {
                            match tls.receive(bytes, &mut self.plain, |p| {
                                conn.handle_input(p, now, &host)
                            }) {
                                Ok(Received::Open) => {}
                                Ok(Received::Closed) => conn.handle_eof(now),
                                Err(e) => {
                                    let _ = tls.write_to(&mut slot.stream);
                                    tls_failure = Some(e);
                                    conn.abort();
                                    break;
                                }
                            }
                        }
                    }
                    if short_read_drains && n < self.scratch.len() {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    slot.conn.abort();
                    break;
                }
            }
        }
        if let Some(reason) = tls_failure {
            let handshaking = slot.tls.as_deref().is_none_or(TlsSession::is_handshaking);
            let during = if handshaking { "handshake" } else { "session" };
            // Debug, not info: one line per connection that sends junk (any scanner; 256
            // a second from one address) would fill an edge node's disk; the counter
            // below counts every one.
            log::debug!(peer:% = slot.peer; "ws: TLS {during} failed, connection closed: {reason}");
            self.metrics.registry.inc(self.metrics.tls_failures, "");
        }
        self.metrics
            .registry
            .add(self.metrics.bytes, "in", read_bytes as f64);
        self.account(index);
        if self.buffered > self.cfg.max_buffered_bytes {
            self.shed(now);
        }
    }

    /// Whether held input, queued output and decoded messages not taken yet fill the
    /// memory budget: no connection is read meanwhile.
    fn reads_full(&self) -> bool {
        self.buffered.saturating_add(self.decoded) > self.cfg.max_buffered_bytes
    }

    /// Brings `buffered` and its gauge up to date with one connection's holdings.
    fn account(&mut self, index: usize) {
        self.reckon(index);
        self.show_buffered();
    }

    /// Sets the gauge to what counts against `max_buffered_bytes`, as last counted.
    fn show_buffered(&mut self) {
        let held = self.buffered.saturating_add(self.decoded);
        self.metrics
            .registry
            .set(self.metrics.buffered, "", held as f64);
    }

    /// Brings `buffered` up to date with one connection's holdings.
    fn reckon(&mut self, index: usize) {
        let Some(Some(slot)) = self.slots.get_mut(index) else {
            return;
        };
        let now_held =
            slot.conn.buffered_bytes() + slot.tls.as_deref().map_or(0, TlsSession::queued);
        self.buffered = self
            .buffered
            .saturating_sub(slot.accounted)
            .saturating_add(now_held);
        slot.accounted = now_held;
    }

    /// Over the memory budget: closes the connections holding the most (partial messages,
    /// request heads, throttled input, and output a peer does not read) until the total
    /// is within it again. Each is closed once: those not logged in first, largest first.
    fn shed(&mut self, now: Instant) {
        if self.buffered <= self.cfg.max_buffered_bytes {
            return;
        }
        // Connections not logged in go first: what they hold costs nobody a credential,
        // and they must not get a logged-in session closed in their place.
        let mut largest: Vec<(bool, Reverse<usize>, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| !s.shed)
                    .map(|s| (s.conn.is_admitted(), Reverse(s.accounted), i))
            })
            .filter(|&(_, Reverse(held), _)| held > 0)
            .collect();
        largest.sort_unstable();
        for (_, Reverse(held), index) in largest {
            if self.buffered <= self.cfg.max_buffered_bytes {
                return;
            }
            if let Some(Some(slot)) = self.slots.get_mut(index) {
                log::log!(
                    peer_level(slot.conn.is_admitted()), peer:% = slot.peer;
                    "ws: closed 1008 memory budget: it held {held} bytes, {} buffered in all, limit {}",
                    self.buffered, self.cfg.max_buffered_bytes
                );
                slot.conn.shed(now);
                slot.shed = true;
                if let Some(tls) = slot.tls.as_deref_mut().filter(|t| t.queued() > 0) {
                    // Its close frame would wait behind ciphertext that still counts
                    // here: both gone now, so the pass sees the room it made at once
                    // (counted until the slot went, the ciphertext got every connection
                    // not logged in shed, then logged-in sessions in its place).
                    tls.discard_output();
                    slot.conn.abort();
                }
            }
            self.metrics.registry.inc(self.metrics.shed, "");
            self.account(index);
            self.dirty.push(index);
        }
    }

    /// Writes a connection's output, shuts it down or removes it as its machine says,
    /// surfaces its events and keeps its timer in the heap.
    fn settle(&mut self, registry: &Registry, index: usize, now: Instant) {
        let Some(Some(slot)) = self.slots.get_mut(index) else {
            return;
        };
        let mut written = 0u64;
        while let Some(tls) = slot.tls.as_mut() {
            let taken = tls.send(slot.conn.output());
            slot.conn.consume_output(taken);
            match tls.write_to(&mut slot.stream) {
                Ok(n) => written = written.saturating_add(n as u64),
                Err(_) => {
                    slot.conn.abort();
                    break;
                }
            }
            if taken == 0 || !tls.output().is_empty() {
                break;
            }
        }
        if let Some(tls) = slot.tls.as_deref() {
            slot.conn.set_queued_below(tls.queued());
        }
        while slot.tls.is_none() && !slot.conn.output().is_empty() {
            match slot.stream.write(slot.conn.output()) {
                Ok(0) => {
                    slot.conn.abort();
                    break;
                }
                Ok(n) => {
                    written = written.saturating_add(n as u64);
                    slot.conn.consume_output(n)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    slot.conn.abort();
                    break;
                }
            }
        }
        if let Some(buf) = slot.conn.take_spare_output()
            && self.spare_output.len() < MAX_SPARE_OUTPUT
            && buf.capacity() <= MAX_SPARE_CAPACITY
        {
            self.spare_output.push(buf);
        }
        let tls_flushed = slot.tls.as_ref().is_none_or(|t| t.output().is_empty());
        if slot.conn.wants_shutdown_write() && tls_flushed {
            if let Some(tls) = slot.tls.as_mut() {
                tls.close();
                let _ = tls.write_to(&mut slot.stream);
            }
            let _ = slot.stream.shutdown(Shutdown::Write);
            slot.conn.write_shut_down(now);
        }
        let id = SessionId::new(index, self.generations.get(index).copied().unwrap_or(0));
        let peer = slot.peer;
        let queued = slot.conn.queued_bytes();
        let admitted = slot.conn.is_admitted();
        while let Some(event) = slot.conn.poll_event() {
            let m = &mut self.metrics;
            let event = match event {
                ConnEvent::Http { status } => {
                    m.registry.inc(m.http_responses, &status.to_string());
                    continue;
                }
                ConnEvent::Opened { subprotocol } => {
                    m.registry.gauge_add(m.ws_sessions, "", 1.0);
                    SessionEvent::Opened { subprotocol, peer }
                }
                ConnEvent::Text(text) => {
                    self.decoded = self.decoded.saturating_add(text.len());
                    SessionEvent::Text(text)
                }
                ConnEvent::Closed {
                    code,
                    reason,
                    by_peer,
                } => {
                    m.registry.gauge_add(m.ws_sessions, "", -1.0);
                    // A peer picks any code of 3000-4999: one label for all of them, so
                    // 64 made-up codes do not take every label the family may have.
                    let label = if (3000..5000).contains(&code) {
                        "application".to_string()
                    } else {
                        code.to_string()
                    };
                    m.registry.inc(m.closes, &label);
                    if code == close_code::POLICY && reason == "slow consumer" {
                        m.registry.inc(m.slow_consumers, "");
                        log::log!(
                            peer_level(admitted), connection:% = id, peer:% = peer;
                            "ws: closed 1008 slow consumer: {queued} bytes queued, limit {}",
                            self.cfg.max_outbound_bytes
                        );
                    }
                    SessionEvent::Closed {
                        code,
                        reason,
                        by_peer,
                    }
                }
            };
            self.events.push_back((id, event));
        }
        if slot.stalled && !slot.conn.input_held() {
            slot.stalled = false;
            self.backlog.push(index);
        }
        let m = &mut self.metrics;
        if written > 0 {
            m.registry.add(m.bytes, "out", written as f64);
        }
        let state = slot.conn.state_label();
        if state != slot.state {
            m.registry.gauge_add(m.by_state, slot.state, -1.0);
            m.registry.gauge_add(m.by_state, state, 1.0);
            slot.state = state;
        }
        let queued = slot.conn.queued_bytes();
        if queued != slot.queued {
            self.queued = self
                .queued
                .saturating_sub(slot.queued)
                .saturating_add(queued);
            slot.queued = queued;
            m.registry.set(m.queued, "", self.queued as f64);
        }
        if slot.conn.is_closed() {
            if let Some(Some(mut slot)) = self.slots.get_mut(index).map(Option::take) {
                let _ = registry.deregister(&mut slot.stream);
                let m = &mut self.metrics;
                m.registry.gauge_add(m.by_state, slot.state, -1.0);
                self.queued = self.queued.saturating_sub(slot.queued);
                m.registry.set(m.queued, "", self.queued as f64);
                self.buffered = self.buffered.saturating_sub(slot.accounted);
                self.show_buffered();
                if let Some(group) = slot.waiting {
                    self.waiting.remove(group, index);
                    self.count_waiting();
                }
                if let Some(count) = self.per_ip.get_mut(&slot.ip) {
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        self.per_ip.remove(&slot.ip);
                    }
                }
            }
            if let Some(generation) = self.generations.get_mut(index) {
                *generation = generation.wrapping_add(1);
            }
            self.free.push(index);
            self.open -= 1;
            self.metrics
                .registry
                .set(self.metrics.connections, "", self.open as f64);
            return;
        }
        self.account(index);
        self.schedule(index);
    }

    /// Puts the connection's next deadline in the heap unless an earlier-or-equal entry
    /// is already there: a timer firing early only recomputes.
    fn schedule(&mut self, index: usize) {
        let generation = self.generations.get(index).copied().unwrap_or(0);
        let Some(Some(slot)) = self.slots.get_mut(index) else {
            return;
        };
        let Some(deadline) = slot.conn.next_deadline() else {
            return;
        };
        if slot.scheduled.is_some_and(|at| at <= deadline) {
            return;
        }
        slot.scheduled = Some(deadline);
        self.timers.push(Reverse((deadline, index, generation)));
        if self.timers.len() > 2 * self.open + TIMER_SLACK {
            let (slots, generations) = (&self.slots, &self.generations);
            self.timers.retain(|Reverse((at, index, generation))| {
                generations.get(*index) == Some(generation)
                    && slots
                        .get(*index)
                        .and_then(Option::as_ref)
                        .is_some_and(|s| s.scheduled == Some(*at))
            });
        }
    }
}
