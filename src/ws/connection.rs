//! One client connection as a sans-IO state machine: bytes and `now` in; bytes to write,
//! events and the next deadline out. It starts as an HTTP/1.1 request, answers the plain
//! endpoints or upgrades to a WebSocket session, and ends through a close handshake.
//!
//! Client frames are read by the [`Decoder`]; every frame the broker writes (text,
//! ping, pong, close) is encoded here, straight into this connection's output.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::decoder::{self, Decoder, Item};
use super::http::{self, Parsed, Request, Status};

/// Limits and timers of the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WsConfig {
    /// Largest message (after reassembly of fragments); larger closes with 1009.
    pub max_frame: usize,
    /// A ping is sent this often; a session silent for 3x this long is closed (1001).
    pub heartbeat: Duration,
    /// Most bytes queued for one client; past it the session is closed (1008).
    pub max_outbound_bytes: usize,
    /// Largest HTTP request head; larger answers 431.
    pub max_head_bytes: usize,
    /// A request head must be complete within this long after the connection opened.
    pub request_timeout: Duration,
    /// How long a closing connection may take to finish its close handshake and flush.
    pub close_timeout: Duration,
    /// Most connections open at once; further ones are accepted and closed at once.
    pub max_connections: usize,
    /// Most connections open at once from one address (IPv6: one /64); further ones are
    /// accepted and closed at once.
    pub max_connections_per_ip: usize,
    /// Most connections open at once that have not logged in yet (see
    /// [`WsServer::admit`](super::WsServer::admit)). A connection arriving past it, or
    /// past `max_connections`, pushes out the oldest such connection of the address
    /// (IPv6: /48) holding the most of them; logged-in ones are never pushed out.
    pub max_waiting_connections: usize,
    /// Connections one address (IPv6: one /64) may open per second, sustained, and at
    /// once after a quiet spell; further ones are accepted and closed at once.
    pub connects_per_ip_per_s: u32,
    pub connect_burst_per_ip: u32,
    /// Frames (messages and control frames) a session may send per second, sustained;
    /// past it its socket is not read until the allowance refills.
    pub max_frames_per_s: u32,
    /// Frames a session may send at once after a quiet spell.
    pub frame_burst: u32,
    /// Input held (request heads, partial messages, input waiting for the frame
    /// allowance) and output queued, summed over every connection. Past it the connection
    /// holding the most input is closed (1008) and new connections are refused. Complete
    /// messages not taken by the embedder yet count too, for reading: no connection is
    /// read while they fill it.
    pub max_buffered_bytes: usize,
}

impl Default for WsConfig {
    fn default() -> Self {
        WsConfig {
            max_frame: 1 << 20,
            heartbeat: Duration::from_secs(10),
            max_outbound_bytes: 4 << 20,
            max_head_bytes: 8 << 10,
            request_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(5),
            max_connections: 10_000,
            max_connections_per_ip: 256,
            max_waiting_connections: 2048,
            connects_per_ip_per_s: 256,
            connect_burst_per_ip: 1024,
            max_frames_per_s: 1_000,
            frame_burst: 2_000,
            max_buffered_bytes: 256 << 20,
        }
    }
}

/// What the embedder supplies for the plain HTTP endpoints.
pub trait HttpHost {
    /// `Ok` while the broker can serve (NATS up, JetStream answering), else the reason.
    fn health(&self) -> Result<(), String>;
    /// `Ok` while the event loop keeps its timers; an embedder without a loop of its own
    /// is always live.
    fn live(&self) -> Result<(), String> {
        Ok(())
    }
    /// Appends the Prometheus text exposition.
    fn metrics(&self, out: &mut String);
    /// Whether a WebSocket upgrade carrying this `Origin` header (sent to this `Host`) is
    /// served (else 403). Upgrades without the header are not asked about.
    fn origin_allowed(&self, _origin: &str, _host: Option<&str>) -> bool {
        true
    }
}

/// Close codes the transport uses (RFC 6455 section 7.4.1).
pub mod close_code {
    pub const NORMAL: u16 = 1000;
    pub const GOING_AWAY: u16 = 1001;
    pub const PROTOCOL: u16 = 1002;
    pub const UNSUPPORTED_DATA: u16 = 1003;
    pub const NO_STATUS: u16 = 1005;
    pub const ABNORMAL: u16 = 1006;
    pub const INVALID_DATA: u16 = 1007;
    pub const POLICY: u16 = 1008;
    pub const TOO_BIG: u16 = 1009;
    pub const INTERNAL: u16 = 1011;
    pub const TRY_AGAIN_LATER: u16 = 1013;
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConnEvent {
    /// A plain HTTP response was queued (the connection closes after it).
    Http { status: u16 },
    /// The WebSocket session is established.
    Opened { subprotocol: Option<&'static str> },
    /// One complete text message.
    Text(String),
    /// The session ended; no events follow. `by_peer` is true when the client sent the
    /// close (or vanished: 1006).
    Closed {
        code: u16,
        reason: String,
        by_peer: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// The session is not open (not upgraded yet, or closing).
    NotOpen,
    /// The outbound queue would pass `max_outbound_bytes`; the session is being closed
    /// with 1008 `slow consumer`.
    SlowConsumer,
}

#[derive(Debug)]
enum Phase {
    /// Reading the request head.
    Http {
        head: Vec<u8>,
    },
    Open,
    /// We sent a close frame and wait for the client's.
    Closing,
    /// Nothing more is read; the output is flushed, then the write side is shut.
    Flushing,
    /// Write side shut; waiting for the client's EOF so unread input cannot turn our
    /// last bytes into a reset.
    Lingering,
    Closed,
}

/// A partly written output buffer is compacted once this much of it is written.
const KEEP_OUTPUT_CAPACITY: usize = 16 << 10;

/// Output room kept free of text frames and pongs, so what can follow the last check
/// always fits within the bound: the pong that crossed it and the close frame, each at
/// most 127 bytes.
const CONTROL_ROOM: usize = 512;
/// Output bound of a connection not logged in yet: its upgrade response, pongs and the
/// answer to a hello. Smaller than a session's so that connections waiting for their
/// hello, which cost nobody a credential, cannot hold much of the memory budget with
/// pongs they never read.
pub const WAITING_OUTBOUND: usize = 64 << 10;
/// Smallest effective `max_outbound_bytes`, so an upgrade response and the control room
/// always fit.
const MIN_OUTBOUND: usize = 1024;
/// Largest HTTP response (or `max_outbound_bytes`, if smaller): a connection that has
/// not logged in is sent one, so the session's bound is not the one, yet a `/metrics`
/// body (every family full: a few hundred KiB) must fit.
pub const MAX_HTTP_RESPONSE: usize = 1 << 20;
/// Frames decoded per call before the connection yields to others.
const MAX_FRAMES_PER_CALL: usize = 32;
/// Events an emptied queue keeps room for: one call's frames. Freed past eight, a busy
/// session's queue grew again from nothing at every read of more than eight frames (an
/// allocation and two or three reallocations each time); an idle session's queue is
/// still given back at the next trim ([`Connection::compact`]).
const KEEP_EVENTS: usize = MAX_FRAMES_PER_CALL;
/// A throttled session resumes once this many frames (or its burst) are allowed again,
/// rather than waking for each single frame.
const RESUME_FRAMES: f64 = 16.0;

#[derive(Debug)]
pub struct Connection {
    phase: Phase,
    decoder: Decoder,
    out: Vec<u8>,
    out_pos: usize,
    events: VecDeque<ConnEvent>,
    /// Deadline of the HTTP, closing, flushing and lingering phases.
    deadline: Instant,
    last_activity: Instant,
    next_ping: Instant,
    peer_eof: bool,
    /// Input handed in but not decoded yet: the frame allowance or the per-call frame
    /// budget ran out. At most one read's worth (plus an upgrade request's tail).
    pending: Vec<u8>,
    /// Decoding stopped early; `pending` holds the input not decoded yet.
    held: bool,
    /// Frame allowance (token bucket) as of `tokens_at`.
    tokens: f64,
    tokens_at: Instant,
    /// Its participant logged in: the configured output bound applies, not
    /// [`WAITING_OUTBOUND`].
    admitted: bool,
    /// The server has an internal listener and this connection came through the public
    /// one: `/metrics` and the probes' reasons are kept for the internal one.
    internal_elsewhere: bool,
    /// Bytes of the text messages in `events`: decoded, not taken yet.
    decoded: usize,
    /// Output the layer under this connection (TLS) still holds for the peer: it counts
    /// against the bound like this connection's own queue, or moving bytes down would
    /// free room for as many again.
    queued_below: usize,
    /// Shared by every connection of the server: 136 bytes a connection otherwise.
    cfg: Arc<WsConfig>,
}

impl Connection {
    pub fn new(now: Instant, cfg: impl Into<Arc<WsConfig>>) -> Self {
        let cfg = cfg.into();
        Connection {
            phase: Phase::Http { head: Vec::new() },
            decoder: Decoder::new(cfg.max_frame),
            out: Vec::new(),
            out_pos: 0,
            events: VecDeque::new(),
            deadline: after(now, cfg.request_timeout),
            last_activity: now,
            next_ping: now,
            peer_eof: false,
            pending: Vec::new(),
            held: false,
            tokens: f64::from(cfg.frame_burst.max(1)),
            tokens_at: now,
            admitted: false,
            internal_elsewhere: false,
            decoded: 0,
            queued_below: 0,
            cfg,
        }
    }

    /// Came through the public listener of a server with an internal one: `/metrics`
    /// names tenants' capabilities and counts, a probe's reason names namespaces and the
    /// NATS link, and neither asks for a credential.
    pub fn keep_internal_elsewhere(&mut self) {
        self.internal_elsewhere = true;
    }

    /// Its participant logged in: from now on the configured output bound applies.
    pub fn admit(&mut self) {
        self.admitted = true;
    }

    pub fn is_admitted(&self) -> bool {
        self.admitted
    }

    /// Feeds bytes read from the socket.
    pub fn handle_input(&mut self, data: &[u8], now: Instant, host: &dyn HttpHost) {
        match &mut self.phase {
            Phase::Http { head } => {
                let room = self.cfg.max_head_bytes.saturating_sub(head.len());
                let take = room.min(data.len());
                head.extend_from_slice(data.get(..take).unwrap_or_default());
                let rest = data.get(take..).unwrap_or_default();
                match http::parse_request(head, self.cfg.max_head_bytes) {
                    Parsed::Partial => {}
                    Parsed::Error(status) => self.respond_error(status, now),
                    Parsed::Complete { request, len } => {
                        let head = std::mem::take(head);
                        self.serve(request, now, host);
                        // Frames the client sent right behind its request; the first
                        // piece may end the session (ws_input reads only while it lasts).
                        let early = head.get(len..).unwrap_or_default();
                        for piece in [early, rest] {
                            if !piece.is_empty() {
                                self.ws_input(piece, now);
                            }
                        }
                    }
                }
            }
            Phase::Open | Phase::Closing => {
                self.last_activity = now;
                self.ws_input(data, now);
            }
            Phase::Flushing | Phase::Lingering | Phase::Closed => {}
        }
    }

    /// The peer closed its side of the connection.
    pub fn handle_eof(&mut self, now: Instant) {
        self.peer_eof = true;
        match self.phase {
            Phase::Http { .. } | Phase::Closing | Phase::Lingering => self.phase = Phase::Closed,
            Phase::Open => {
                self.emit_closed(close_code::ABNORMAL, "connection lost", true);
                self.phase = Phase::Closed;
            }
            Phase::Flushing => {
                // A half-closing HTTP client still reads its response.
                self.deadline = self.deadline.min(after(now, self.cfg.close_timeout));
            }
            Phase::Closed => {}
        }
    }

    /// Runs the timers due at `now`: request and close deadlines, pings, idle timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        match self.phase {
            Phase::Open => {
                if self.held {
                    self.resume_input(now);
                }
                if !matches!(self.phase, Phase::Open) {
                    return;
                }
                if now >= self.idle_deadline() {
                    self.close(close_code::GOING_AWAY, "idle timeout", now);
                } else if now >= self.next_ping {
                    if self.held_for_peer() + 2 > self.data_limit() {
                        self.close(close_code::POLICY, "slow consumer", now);
                    } else {
                        push_frame_header(&mut self.out, 0x9, 0);
                        self.next_ping = after(now, self.cfg.heartbeat);
                    }
                }
            }
            Phase::Closing if self.held && now < self.deadline => {
                self.resume_input(now);
            }
            Phase::Http { .. } | Phase::Closing | Phase::Flushing | Phase::Lingering => {
                if now >= self.deadline {
                    self.phase = Phase::Closed;
                }
            }
            Phase::Closed => {}
        }
    }

    /// When [`handle_timeout`](Self::handle_timeout) has work next.
    pub fn next_deadline(&self) -> Option<Instant> {
        let resume = self.held.then(|| self.resume_at());
        let own = match self.phase {
            Phase::Open => Some(self.next_ping.min(self.idle_deadline())),
            Phase::Closed => None,
            _ => Some(self.deadline),
        };
        match (own, resume) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Decoding stopped early (frame allowance or per-call budget); the shell must not
    /// read the socket until [`resume_input`](Self::resume_input) has caught up.
    pub fn input_held(&self) -> bool {
        self.held
    }

    /// When held input may be decoded again.
    pub fn resume_at(&self) -> Instant {
        let rate = f64::from(self.cfg.max_frames_per_s.max(1));
        let want = RESUME_FRAMES.min(f64::from(self.cfg.frame_burst.max(1)));
        let missing = (want - self.tokens).max(0.0);
        if missing == 0.0 {
            return self.tokens_at;
        }
        // A microsecond past the exact moment, so rounding cannot leave the allowance a
        // hair short of a frame at the resume time (a resume that decodes nothing).
        let wait = Duration::try_from_secs_f64(missing / rate)
            .unwrap_or(Duration::MAX)
            .saturating_add(Duration::from_micros(1));
        after(self.tokens_at, wait)
    }

    /// Decodes held input if the frame allowance permits at `now`; false when it does
    /// not yet (the input stays held until [`resume_at`](Self::resume_at)).
    pub fn resume_input(&mut self, now: Instant) -> bool {
        if !self.held {
            return true;
        }
        self.refill(now);
        if self.tokens < 1.0 {
            return false;
        }
        self.held = false;
        let mut pending = std::mem::take(&mut self.pending);
        let used = self.ws_input_from(&pending, now);
        if self.held {
            pending.drain(..used.min(pending.len()));
            self.pending = pending;
        }
        true
    }

    /// Input held by this connection: request head, partial frame or message inside the
    /// decoder, input waiting for the frame allowance.
    pub fn input_bytes(&self) -> usize {
        let head = match &self.phase {
            Phase::Http { head } => head.len(),
            _ => 0,
        };
        head.saturating_add(self.decoder.held_bytes())
            .saturating_add(self.pending.len())
    }

    /// Bytes of the complete text messages decoded and not taken by
    /// [`poll_event`](Self::poll_event) yet. Not in [`buffered_bytes`](Self::buffered_bytes):
    /// they are the embedder's within the loop turn, and closing the connection would not
    /// free them.
    pub fn decoded_bytes(&self) -> usize {
        self.decoded
    }

    /// Input held plus output queued.
    pub fn buffered_bytes(&self) -> usize {
        self.input_bytes().saturating_add(self.queued_bytes())
    }

    /// Closes the session (1008 `memory budget`) and releases what it holds at once,
    /// queued output included (a peer that does not read would never take it); used when
    /// the transport's memory budget is exhausted. Only the close frame is still sent.
    pub fn shed(&mut self, now: Instant) {
        self.out = Vec::new();
        self.out_pos = 0;
        match self.phase {
            Phase::Open => self.fail(close_code::POLICY, "memory budget", now),
            _ => self.phase = Phase::Closed,
        }
        self.pending = Vec::new();
        self.held = false;
        self.decoder = Decoder::new(self.cfg.max_frame);
    }

    /// Drops the connection at once to make room for another (it had not logged in):
    /// no close frame, since it must not hold its slot while one is flushed.
    pub fn push_out(&mut self) {
        if matches!(self.phase, Phase::Open) {
            self.emit_closed(
                close_code::TRY_AGAIN_LATER,
                "pushed out waiting for its hello",
                false,
            );
        }
        self.abort_quietly();
    }

    /// Most bytes text frames and pongs may fill; the rest of the bound is the control room.
    fn data_limit(&self) -> usize {
        let bound = if self.admitted {
            self.cfg.max_outbound_bytes
        } else {
            self.cfg.max_outbound_bytes.min(WAITING_OUTBOUND)
        };
        bound.max(MIN_OUTBOUND) - CONTROL_ROOM
    }

    fn refill(&mut self, now: Instant) {
        if now <= self.tokens_at {
            return;
        }
        let rate = f64::from(self.cfg.max_frames_per_s.max(1));
        let burst = f64::from(self.cfg.frame_burst.max(1));
        let elapsed = now.saturating_duration_since(self.tokens_at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.tokens_at = now;
    }

    fn idle_deadline(&self) -> Instant {
        after(self.last_activity, self.cfg.heartbeat.saturating_mul(3))
    }

    /// Queues one text message.
    pub fn send_text(&mut self, text: &str, now: Instant) -> Result<(), SendError> {
        if !matches!(self.phase, Phase::Open) {
            return Err(SendError::NotOpen);
        }
        let frame_len = text.len().saturating_add(frame_header_len(text.len()));
        if self.held_for_peer().saturating_add(frame_len) > self.data_limit() {
            self.close(close_code::POLICY, "slow consumer", now);
            return Err(SendError::SlowConsumer);
        }
        // One growth for the whole frame: pushing the header byte by byte into an empty
        // or full buffer would grow it twice, copying what is queued each time.
        self.out.reserve(frame_len);
        push_frame_header(&mut self.out, 0x1, text.len());
        self.out.extend_from_slice(text.as_bytes());
        Ok(())
    }

    /// Starts the close handshake with `code`; queued messages are sent first. Emits
    /// `Closed` at once. Does nothing unless the session is open.
    pub fn close(&mut self, code: u16, reason: &str, now: Instant) {
        if !matches!(self.phase, Phase::Open) {
            return;
        }
        self.emit_closed(code, reason, false);
        self.send_close(code, reason);
        self.phase = Phase::Closing;
        self.deadline = after(now, self.cfg.close_timeout);
    }

    /// Bytes waiting to be written to the socket.
    pub fn output(&self) -> &[u8] {
        self.out.get(self.out_pos..).unwrap_or_default()
    }

    /// `n` bytes of [`output`](Self::output) were written. An emptied buffer stays until
    /// [`take_spare_output`](Self::take_spare_output) takes it.
    pub fn consume_output(&mut self, n: usize) {
        self.out_pos = (self.out_pos + n).min(self.out.len());
        if self.out_pos == self.out.len() {
            self.out.clear();
            self.out_pos = 0;
        } else if self.out_pos >= KEEP_OUTPUT_CAPACITY && self.out_pos * 2 >= self.out.len() {
            self.out.drain(..self.out_pos);
            self.out_pos = 0;
        }
    }

    /// The output buffer once everything queued is written, for the server to keep for
    /// the next session with output: most sessions are idle most of the time, so none
    /// holds a buffer between flushes, and a busy one does not allocate and grow one for
    /// every flush either.
    pub fn take_spare_output(&mut self) -> Option<Vec<u8>> {
        (self.queued_bytes() == 0 && self.out.capacity() > 0).then(|| {
            self.out_pos = 0;
            std::mem::take(&mut self.out)
        })
    }

    /// Gives back the room of an event queue and a control frame buffer that are empty:
    /// an idle session keeps the room of its first burst (its upgrade, its hello) for
    /// good otherwise, about 130 bytes each at 10,000 sessions.
    pub fn compact(&mut self) {
        if self.events.is_empty() {
            self.events = VecDeque::new();
        }
        self.decoder.compact();
    }

    /// Lends this connection an empty buffer from `spare` when it has none.
    pub fn lend_output(&mut self, spare: &mut Vec<Vec<u8>>) {
        if self.out.capacity() == 0
            && let Some(buf) = spare.pop()
        {
            self.out = buf;
            self.out.clear();
            self.out_pos = 0;
        }
    }

    pub fn queued_bytes(&self) -> usize {
        self.out.len() - self.out_pos
    }

    /// The layer under this connection (TLS) holds `bytes` for the peer now.
    pub fn set_queued_below(&mut self, bytes: usize) {
        self.queued_below = bytes;
    }

    /// Output waiting for the peer, here and in the layer below: what the bound limits.
    fn held_for_peer(&self) -> usize {
        self.queued_bytes().saturating_add(self.queued_below)
    }

    pub fn poll_event(&mut self) -> Option<ConnEvent> {
        let event = self.events.pop_front();
        if let Some(ConnEvent::Text(text)) = &event {
            self.decoded = self.decoded.saturating_sub(text.len());
        }
        if self.events.is_empty() && self.events.capacity() > KEEP_EVENTS {
            self.events = VecDeque::new();
        }
        event
    }

    /// The output is flushed and the write side should now be shut down.
    pub fn wants_shutdown_write(&self) -> bool {
        matches!(self.phase, Phase::Flushing) && self.queued_bytes() == 0
    }

    /// The write side was shut down after [`wants_shutdown_write`](Self::wants_shutdown_write).
    pub fn write_shut_down(&mut self, now: Instant) {
        if matches!(self.phase, Phase::Flushing) {
            if self.peer_eof {
                self.phase = Phase::Closed;
            } else {
                self.phase = Phase::Lingering;
                self.deadline = after(now, self.cfg.close_timeout);
            }
        }
    }

    /// The socket failed (reset, broken pipe): nothing more can be read or written.
    pub fn abort(&mut self) {
        if matches!(self.phase, Phase::Open) {
            self.emit_closed(close_code::ABNORMAL, "connection lost", true);
        }
        self.abort_quietly();
    }

    fn abort_quietly(&mut self) {
        self.out = Vec::new();
        self.out_pos = 0;
        self.pending = Vec::new();
        self.held = false;
        self.phase = Phase::Closed;
    }

    /// Nothing more to do: drop the socket.
    pub fn is_closed(&self) -> bool {
        matches!(self.phase, Phase::Closed)
    }

    /// The WebSocket session is established and not closing.
    pub fn is_open(&self) -> bool {
        matches!(self.phase, Phase::Open)
    }

    /// The `state` label of `amp_ws_connections_by_state`: `http` (request head or a plain
    /// HTTP answer), `open` (WebSocket), `closing` (close handshake, flush, linger).
    pub fn state_label(&self) -> &'static str {
        match self.phase {
            Phase::Http { .. } => "http",
            Phase::Open => "open",
            Phase::Closing | Phase::Flushing | Phase::Lingering | Phase::Closed => "closing",
        }
    }

    /// Whether input is still of interest (the shell may stop reading otherwise).
    pub fn wants_input(&self) -> bool {
        !matches!(self.phase, Phase::Closed)
    }

    /// A probe's answer: 200 `ok`, or 503 with the reason.
    fn respond_check(&mut self, check: Result<(), String>, now: Instant) {
        match check {
            Ok(()) => self.respond(Status::Ok, "text/plain; charset=utf-8", b"ok\n", now),
            Err(_) if self.internal_elsewhere => self.respond(
                Status::Unavailable,
                "text/plain; charset=utf-8",
                b"unavailable: the internal listener says why\n",
                now,
            ),
            Err(reason) => {
                let body = format!("{reason}\n");
                self.respond(
                    Status::Unavailable,
                    "text/plain; charset=utf-8",
                    body.as_bytes(),
                    now,
                )
            }
        }
    }

    fn serve(&mut self, request: Request, now: Instant, host: &dyn HttpHost) {
        match request {
            Request::Health => self.respond_check(host.health(), now),
            Request::Live => self.respond_check(host.live(), now),
            Request::Metrics if self.internal_elsewhere => self.respond(
                Status::NotFound,
                "text/plain; charset=utf-8",
                b"metrics are served on the internal listener\n",
                now,
            ),
            Request::Metrics => {
                let mut body = String::new();
                host.metrics(&mut body);
                self.respond(
                    Status::Ok,
                    "text/plain; version=0.0.4; charset=utf-8",
                    body.as_bytes(),
                    now,
                );
            }
            Request::Schema => self.respond(
                Status::Ok,
                "application/schema+json",
                crate::amp::SCHEMA_JSON.as_bytes(),
                now,
            ),
            Request::Reject(status, text) => {
                self.respond(status, "text/plain; charset=utf-8", text.as_bytes(), now)
            }
            Request::Upgrade(upgrade)
                if upgrade
                    .origin
                    .as_deref()
                    .is_some_and(|o| !host.origin_allowed(o, upgrade.host.as_deref())) =>
            {
                self.respond(
                    Status::Forbidden,
                    "text/plain; charset=utf-8",
                    b"origin not allowed\n",
                    now,
                )
            }
            Request::Upgrade(upgrade) => {
                http::switching_protocols(&mut self.out, &upgrade);
                self.phase = Phase::Open;
                self.last_activity = now;
                self.next_ping = after(now, self.cfg.heartbeat);
                self.events.push_back(ConnEvent::Opened {
                    subprotocol: upgrade.subprotocol,
                });
            }
        }
    }

    fn respond_error(&mut self, status: Status, now: Instant) {
        let text: &[u8] = match status {
            Status::HeadersTooLarge => b"request header fields too large\n",
            _ => b"bad request\n",
        };
        self.respond(status, "text/plain; charset=utf-8", text, now);
    }

    fn respond(&mut self, status: Status, content_type: &str, body: &[u8], now: Instant) {
        let mut status = status;
        http::response(&mut self.out, status, content_type, body);
        let bound = self
            .cfg
            .max_outbound_bytes
            .clamp(MIN_OUTBOUND, MAX_HTTP_RESPONSE);
        if self.queued_bytes() > bound {
            // A response over the connection's output bound (a huge /metrics) is not sent.
            self.out.clear();
            self.out_pos = 0;
            status = Status::Unavailable;
            http::response(
                &mut self.out,
                status,
                "text/plain; charset=utf-8",
                b"response too large\n",
            );
        }
        self.events.push_back(ConnEvent::Http {
            status: status.code(),
        });
        self.phase = Phase::Flushing;
        self.deadline = after(now, self.cfg.close_timeout);
    }

    fn ws_input(&mut self, data: &[u8], now: Instant) {
        if self.held {
            // Behind held input (only the upgrade read hands in two pieces); the shell
            // reads nothing more until it is decoded.
            self.pending.extend_from_slice(data);
            return;
        }
        let used = self.ws_input_from(data, now);
        if self.held {
            self.pending = data.get(used..).unwrap_or_default().to_vec();
        }
    }

    /// Decodes from `data`; how many of its bytes the decoder took.
    fn ws_input_from(&mut self, data: &[u8], now: Instant) -> usize {
        self.last_activity = now;
        let used = self.ws_read(data, now);
        if !matches!(self.phase, Phase::Open | Phase::Closing) {
            self.held = false;
            self.pending = Vec::new();
            // Nothing more is read: whatever a partial frame or message held goes.
            self.decoder = Decoder::new(self.cfg.max_frame);
        }
        used
    }

    /// Decodes frames from `data` until it runs out, the frame allowance or per-call
    /// budget is spent (`held` is set), or reading ends; returns the bytes taken.
    fn ws_read(&mut self, data: &[u8], now: Instant) -> usize {
        if !matches!(self.phase, Phase::Open | Phase::Closing) {
            return data.len();
        }
        self.refill(now);
        let mut rest = data;
        let mut decoded = 0;
        while !rest.is_empty() && matches!(self.phase, Phase::Open | Phase::Closing) {
            if self.tokens < 1.0 || decoded == MAX_FRAMES_PER_CALL {
                self.held = true;
                break;
            }
            let (n, result) = self.decoder.decode(rest);
            rest = rest.get(n..).unwrap_or_default();
            match result {
                Ok(None) => {}
                Ok(Some(item)) => {
                    decoded += 1;
                    self.tokens -= 1.0;
                    self.take(item, now);
                }
                Err(e) => {
                    let (code, reason) = match e {
                        decoder::Error::Protocol => (close_code::PROTOCOL, "protocol error"),
                        decoder::Error::Binary => (
                            close_code::UNSUPPORTED_DATA,
                            "binary frames are not accepted",
                        ),
                        decoder::Error::InvalidUtf8 => (close_code::INVALID_DATA, "invalid UTF-8"),
                        decoder::Error::TooBig => (close_code::TOO_BIG, "message too big"),
                    };
                    self.fail(code, reason, now);
                }
            }
        }
        data.len() - rest.len()
    }

    /// Acts on one decoded frame.
    fn take(&mut self, item: Item, now: Instant) {
        match item {
            Item::Text(text) => {
                // Text the client sent before it saw our close is not delivered.
                if matches!(self.phase, Phase::Open) {
                    self.decoded = self.decoded.saturating_add(text.len());
                    self.events.push_back(ConnEvent::Text(text));
                }
            }
            Item::Fragment | Item::Pong => {}
            Item::Ping(payload) => {
                // No pong once our close is sent (RFC 6455 section 5.5.1).
                if matches!(self.phase, Phase::Open) {
                    push_frame_header(&mut self.out, 0xA, payload.len());
                    self.out.extend_from_slice(&payload);
                    // The pong that crossed the bound fits in the control room; the
                    // client sends but does not read.
                    if self.held_for_peer() > self.data_limit() {
                        self.fail(close_code::POLICY, "slow consumer", now);
                    }
                }
            }
            Item::Close(frame) => {
                if matches!(self.phase, Phase::Open) {
                    // The reply echoes the client's code and reason (none for none).
                    match &frame {
                        Some((code, reason)) => self.send_close(*code, reason),
                        None => push_frame_header(&mut self.out, 0x8, 0),
                    }
                    let (code, reason) = frame.unwrap_or((close_code::NO_STATUS, String::new()));
                    self.events.push_back(ConnEvent::Closed {
                        code,
                        reason,
                        by_peer: true,
                    });
                }
                // Our close is answered, or theirs is: nothing more is read.
                self.phase = Phase::Flushing;
                self.deadline = after(now, self.cfg.close_timeout);
            }
        }
    }

    /// Fails the session: close frame with `code`, then no more input is read.
    fn fail(&mut self, code: u16, reason: &str, now: Instant) {
        if matches!(self.phase, Phase::Open) {
            self.emit_closed(code, reason, false);
            self.send_close(code, reason);
        }
        self.phase = Phase::Flushing;
        self.deadline = after(now, self.cfg.close_timeout);
    }

    /// Queues a close frame; a reason is cut to the 123 bytes a control frame has room
    /// for, at a character boundary.
    fn send_close(&mut self, code: u16, reason: &str) {
        let mut end = reason.len().min(123);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        let reason = reason.get(..end).unwrap_or_default();
        push_frame_header(&mut self.out, 0x8, 2 + reason.len());
        self.out.extend_from_slice(&code.to_be_bytes());
        self.out.extend_from_slice(reason.as_bytes());
    }

    fn emit_closed(&mut self, code: u16, reason: &str, by_peer: bool) {
        self.events.push_back(ConnEvent::Closed {
            code,
            reason: reason.to_owned(),
            by_peer,
        });
    }
}

/// `at + d`, saturating at a year ahead so an absurd configured duration cannot overflow.
fn after(at: Instant, d: Duration) -> Instant {
    at.checked_add(d.min(Duration::from_secs(365 * 24 * 3600)))
        .unwrap_or(at)
}

fn frame_header_len(len: usize) -> usize {
    if len < 126 {
        2
    } else if len <= 0xFFFF {
        4
    } else {
        10
    }
}

/// A final, unmasked frame header (server to client).
fn push_frame_header(out: &mut Vec<u8>, opcode: u8, len: usize) {
    out.push(0x80 | opcode);
    if len < 126 {
        out.push(len as u8);
    } else if len <= 0xFFFF {
        out.push(126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Host {
        healthy: bool,
    }

    impl HttpHost for Host {
        fn health(&self) -> Result<(), String> {
            if self.healthy {
                Ok(())
            } else {
                Err("nats disconnected".into())
            }
        }
        fn metrics(&self, out: &mut String) {
            out.push_str("amp_sessions 0\n");
        }
    }

    const HOST: Host = Host { healthy: true };
    const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

    fn upgrade_request(protocols: Option<&str>) -> String {
        let proto = protocols
            .map(|p| format!("Sec-WebSocket-Protocol: {p}\r\n"))
            .unwrap_or_default();
        format!(
            "GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n{proto}\r\n"
        )
    }

    /// A masked client frame.
    fn frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let first = if fin { 0x80 } else { 0 } | opcode;
        crate::ws::decoder::client_frame(first, payload, [0x11, 0x22, 0x33, 0x44])
    }

    fn text(s: &str) -> Vec<u8> {
        frame(0x1, true, s.as_bytes())
    }

    fn close_frame(code: u16, reason: &str) -> Vec<u8> {
        let mut p = code.to_be_bytes().to_vec();
        p.extend_from_slice(reason.as_bytes());
        frame(0x8, true, &p)
    }

    /// Server frames in `bytes`: (opcode, payload).
    fn server_frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let mut frames = Vec::new();
        while bytes.len() >= 2 {
            let opcode = bytes[0] & 0x0F;
            assert_eq!(bytes[1] & 0x80, 0, "server frames are unmasked");
            let (len, at) = match bytes[1] & 0x7F {
                126 => (u16::from_be_bytes([bytes[2], bytes[3]]) as usize, 4),
                127 => (
                    u64::from_be_bytes(bytes[2..10].try_into().unwrap()) as usize,
                    10,
                ),
                n => (n as usize, 2),
            };
            frames.push((opcode, bytes[at..at + len].to_vec()));
            bytes = &bytes[at + len..];
        }
        assert!(bytes.is_empty(), "trailing partial frame");
        frames
    }

    fn drain_output(c: &mut Connection) -> Vec<u8> {
        let out = c.output().to_vec();
        c.consume_output(out.len());
        out
    }

    fn events(c: &mut Connection) -> Vec<ConnEvent> {
        std::iter::from_fn(|| c.poll_event()).collect()
    }

    fn http(request: &str) -> (Connection, String, Vec<ConnEvent>) {
        let t0 = Instant::now();
        let mut c = Connection::new(t0, WsConfig::default());
        c.handle_input(request.as_bytes(), t0, &HOST);
        let out = String::from_utf8(drain_output(&mut c)).unwrap();
        let ev = events(&mut c);
        (c, out, ev)
    }

    /// An open session at `t0` with the upgrade response and `Opened` consumed.
    fn open(cfg: WsConfig) -> (Connection, Instant) {
        let t0 = Instant::now();
        let mut c = Connection::new(t0, cfg);
        c.handle_input(upgrade_request(Some("amp.v1")).as_bytes(), t0, &HOST);
        let head = String::from_utf8(drain_output(&mut c)).unwrap();
        assert!(
            head.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
            "{head}"
        );
        assert_eq!(
            events(&mut c),
            vec![ConnEvent::Opened {
                subprotocol: Some("amp.v1")
            }]
        );
        (c, t0)
    }

    fn closed(code: u16, reason: &str, by_peer: bool) -> ConnEvent {
        ConnEvent::Closed {
            code,
            reason: reason.into(),
            by_peer,
        }
    }

    fn close_payload(code: u16, reason: &str) -> (u8, Vec<u8>) {
        let mut p = code.to_be_bytes().to_vec();
        p.extend_from_slice(reason.as_bytes());
        (0x8, p)
    }

    #[test]
    fn upgrade_answers_101_with_accept_and_subprotocol() {
        let (_, out, ev) = http(&upgrade_request(Some("x, amp.v1")));
        assert!(
            out.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n"),
            "{out}"
        );
        assert!(out.contains("Sec-WebSocket-Protocol: amp.v1\r\n"));
        assert_eq!(
            ev,
            vec![ConnEvent::Opened {
                subprotocol: Some("amp.v1")
            }]
        );
        let (_, out, ev) = http(&upgrade_request(None));
        assert!(out.starts_with("HTTP/1.1 101 ") && !out.contains("Sec-WebSocket-Protocol"));
        assert_eq!(ev, vec![ConnEvent::Opened { subprotocol: None }]);
    }

    #[test]
    fn upgrade_offering_only_other_subprotocols_gets_400_and_closes() {
        let (c, out, ev) = http(&upgrade_request(Some("chat, amp.v2")));
        assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{out}");
        assert!(out.contains("Connection: close\r\n"));
        assert_eq!(ev, vec![ConnEvent::Http { status: 400 }]);
        assert!(c.wants_shutdown_write());
    }

    /// The head buffer takes at most `max_head_bytes`, so one large read reaches the
    /// decoder in two pieces. When the first fails the session (here a frame over
    /// `max_frame`), the second is not read.
    #[test]
    fn input_behind_a_frame_that_failed_the_session_in_the_upgrade_read_is_ignored() {
        let t0 = Instant::now();
        let cfg = WsConfig::default();
        let mut c = Connection::new(t0, cfg);
        let mut bytes = upgrade_request(None).into_bytes();
        bytes.extend([0x81, 0x80 | 127]);
        bytes.extend((cfg.max_frame as u64 * 2).to_be_bytes());
        bytes.extend([1, 2, 3, 4]);
        bytes.resize(cfg.max_head_bytes + (8 << 10), b'x');
        c.handle_input(&bytes, t0, &HOST);
        assert_eq!(
            events(&mut c),
            vec![
                ConnEvent::Opened { subprotocol: None },
                closed(1009, "message too big", false)
            ]
        );
        let out = drain_output(&mut c);
        let body_at = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        assert_eq!(
            server_frames(&out[body_at..]),
            vec![close_payload(1009, "message too big")]
        );
        assert!(c.wants_shutdown_write());
        assert_eq!(c.input_bytes(), 0, "nothing of the refused frame is kept");
    }

    #[test]
    fn request_head_arriving_byte_by_byte_upgrades() {
        let t0 = Instant::now();
        let mut c = Connection::new(t0, WsConfig::default());
        let mut bytes = upgrade_request(None).into_bytes();
        bytes.extend(text("{\"op\":\"ping\",\"id\":\"1\"}"));
        for b in &bytes {
            c.handle_input(std::slice::from_ref(b), t0, &HOST);
        }
        let ev = events(&mut c);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!(
            ev[1],
            ConnEvent::Text("{\"op\":\"ping\",\"id\":\"1\"}".into())
        );
    }

    #[test]
    fn frames_sent_right_behind_the_request_are_read() {
        let t0 = Instant::now();
        let mut c = Connection::new(t0, WsConfig::default());
        let mut bytes = upgrade_request(None).into_bytes();
        bytes.extend(text("a"));
        bytes.extend(text("b"));
        c.handle_input(&bytes, t0, &HOST);
        let ev = events(&mut c);
        assert_eq!(
            &ev[1..],
            &[ConnEvent::Text("a".into()), ConnEvent::Text("b".into())]
        );
    }

    #[test]
    fn plain_endpoints_answer_and_close() {
        let (c, out, ev) = http("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            out.starts_with("HTTP/1.1 200 OK\r\n") && out.ends_with("\r\n\r\nok\n"),
            "{out}"
        );
        assert_eq!(ev, vec![ConnEvent::Http { status: 200 }]);
        assert!(c.wants_shutdown_write());

        let t0 = Instant::now();
        let mut c = Connection::new(t0, WsConfig::default());
        c.handle_input(
            b"GET /healthz HTTP/1.1\r\n\r\n",
            t0,
            &Host { healthy: false },
        );
        let out = String::from_utf8(drain_output(&mut c)).unwrap();
        assert!(
            out.starts_with("HTTP/1.1 503 ") && out.ends_with("nats disconnected\n"),
            "{out}"
        );

        let (_, out, _) = http("GET /metrics HTTP/1.1\r\n\r\n");
        assert!(out.contains("text/plain; version=0.0.4") && out.ends_with("amp_sessions 0\n"));
        let (_, out, _) = http("GET /amp/schema HTTP/1.1\r\n\r\n");
        assert!(out.contains("application/schema+json") && out.ends_with(crate::amp::SCHEMA_JSON));
        let (_, out, ev) = http("GET /nope HTTP/1.1\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 404 Not Found\r\n"));
        assert_eq!(ev, vec![ConnEvent::Http { status: 404 }]);
    }

    #[test]
    fn a_public_connection_beside_an_internal_listener_keeps_what_is_internal() {
        // The reasons a probe gives name namespaces (`AMP_INBOX_<ns>` being made again)
        // and the broker's NATS link; the series of `/metrics` name tenants' capabilities.
        let t0 = Instant::now();
        let ask = |request: &[u8], host: &Host| {
            let mut c = Connection::new(t0, WsConfig::default());
            c.keep_internal_elsewhere();
            c.handle_input(request, t0, host);
            String::from_utf8(drain_output(&mut c)).unwrap()
        };
        let down = Host { healthy: false };
        let out = ask(b"GET /readyz HTTP/1.1\r\n\r\n", &down);
        assert!(
            out.starts_with("HTTP/1.1 503 ")
                && out.ends_with("\r\n\r\nunavailable: the internal listener says why\n"),
            "{out}"
        );
        let out = ask(b"GET /readyz HTTP/1.1\r\n\r\n", &Host { healthy: true });
        assert!(out.ends_with("\r\n\r\nok\n"), "{out}");
        let out = ask(b"GET /metrics HTTP/1.1\r\n\r\n", &down);
        assert!(
            out.starts_with("HTTP/1.1 404 ")
                && out.ends_with("metrics are served on the internal listener\n"),
            "{out}"
        );
    }

    #[test]
    fn oversized_or_too_many_headers_get_431_and_garbage_gets_400() {
        let many: String = (0..40).map(|i| format!("X-{i}: v\r\n")).collect();
        let (_, out, ev) = http(&format!("GET /healthz HTTP/1.1\r\n{many}\r\n"));
        assert!(out.starts_with("HTTP/1.1 431 "), "{out}");
        assert_eq!(ev, vec![ConnEvent::Http { status: 431 }]);
        let (_, out, _) = http(&format!(
            "GET /healthz HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(9000)
        ));
        assert!(out.starts_with("HTTP/1.1 431 "), "{out}");
        let (c, out, ev) = http("NOT HTTP AT ALL\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 400 "), "{out}");
        assert_eq!(ev, vec![ConnEvent::Http { status: 400 }]);
        assert!(c.wants_shutdown_write());
    }

    #[test]
    fn slow_request_is_closed_at_its_deadline() {
        let t0 = Instant::now();
        let cfg = WsConfig::default();
        let mut c = Connection::new(t0, cfg);
        c.handle_input(b"GET /healthz HTTP/1.1\r\n", t0, &HOST);
        assert_eq!(c.next_deadline(), Some(t0 + cfg.request_timeout));
        c.handle_timeout(t0 + cfg.request_timeout - Duration::from_millis(1));
        assert!(!c.is_closed());
        c.handle_timeout(t0 + cfg.request_timeout);
        assert!(c.is_closed());
        assert!(c.output().is_empty());
    }

    #[test]
    fn response_is_flushed_then_write_shut_then_lingers_until_eof() {
        let (mut c, _, _) = http("GET /healthz HTTP/1.1\r\n\r\n");
        let t = Instant::now();
        assert!(c.wants_shutdown_write());
        c.write_shut_down(t);
        assert!(!c.is_closed() && !c.wants_shutdown_write());
        c.handle_input(b"ignored trailing bytes", t, &HOST);
        c.handle_eof(t);
        assert!(c.is_closed());
    }

    #[test]
    fn before_login_the_output_bound_is_64_kib() {
        let (mut c, t0) = open(WsConfig::default());
        assert_eq!(
            c.send_text(&"x".repeat(70_000), t0),
            Err(SendError::SlowConsumer)
        );
        let (mut c, t0) = open(WsConfig::default());
        c.admit();
        assert_eq!(c.send_text(&"x".repeat(70_000), t0), Ok(()));
    }

    #[test]
    fn text_in_and_out() {
        let (mut c, t0) = open(WsConfig::default());
        c.handle_input(&text("{\"op\":\"ping\",\"id\":\"p\"}"), t0, &HOST);
        assert_eq!(
            events(&mut c),
            vec![ConnEvent::Text("{\"op\":\"ping\",\"id\":\"p\"}".into())]
        );
        c.send_text("{\"op\":\"ok\",\"re\":\"p\"}", t0).unwrap();
        c.admit();
        let big = "x".repeat(70_000);
        c.send_text(&big, t0).unwrap();
        let frames = server_frames(&drain_output(&mut c));
        assert_eq!(frames[0], (0x1, b"{\"op\":\"ok\",\"re\":\"p\"}".to_vec()));
        assert_eq!(frames[1], (0x1, big.into_bytes()));
    }

    #[test]
    fn fragmented_message_is_reassembled() {
        let (mut c, t0) = open(WsConfig::default());
        let mut bytes = frame(0x1, false, b"{\"op\":");
        bytes.extend(frame(0x9, true, b"hi")); // a ping between fragments
        bytes.extend(frame(0x0, false, b"\"ping\","));
        bytes.extend(frame(0x0, true, b"\"id\":\"1\"}"));
        c.handle_input(&bytes, t0, &HOST);
        assert_eq!(
            events(&mut c),
            vec![ConnEvent::Text("{\"op\":\"ping\",\"id\":\"1\"}".into())]
        );
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![(0xA, b"hi".to_vec())]
        );
    }

    #[test]
    fn client_ping_is_answered_with_pong() {
        let (mut c, t0) = open(WsConfig::default());
        c.handle_input(&frame(0x9, true, b"abc"), t0, &HOST);
        assert!(events(&mut c).is_empty());
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![(0xA, b"abc".to_vec())]
        );
    }

    fn assert_failed_with(input: Vec<u8>, cfg: WsConfig, code: u16, reason: &str) {
        let (mut c, t0) = open(cfg);
        c.handle_input(&input, t0, &HOST);
        assert_eq!(events(&mut c), vec![closed(code, reason, false)]);
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![close_payload(code, reason)]
        );
        assert!(c.wants_shutdown_write());
        // Nothing after the failure is read.
        c.handle_input(&text("late"), t0, &HOST);
        assert!(events(&mut c).is_empty());
    }

    #[test]
    fn binary_frame_closes_1003() {
        assert_failed_with(
            frame(0x2, true, b"\x00\x01"),
            WsConfig::default(),
            1003,
            "binary frames are not accepted",
        );
    }

    #[test]
    fn message_over_max_frame_closes_1009_single_or_fragmented() {
        let cfg = WsConfig {
            max_frame: 1000,
            ..WsConfig::default()
        };
        assert_failed_with(text(&"x".repeat(1001)), cfg, 1009, "message too big");
        let mut parts = frame(0x1, false, &[b'x'; 600]);
        parts.extend(frame(0x0, true, &[b'x'; 600]));
        assert_failed_with(parts, cfg, 1009, "message too big");
        // Exactly at the limit passes.
        let (mut c, t0) = open(cfg);
        c.handle_input(&text(&"y".repeat(1000)), t0, &HOST);
        assert_eq!(events(&mut c).len(), 1);
    }

    #[test]
    fn invalid_utf8_closes_1007() {
        assert_failed_with(
            frame(0x1, true, b"\xff\xfe"),
            WsConfig::default(),
            1007,
            "invalid UTF-8",
        );
        let mut parts = frame(0x1, false, b"ok");
        parts.extend(frame(0x0, true, b"\xc3\x28"));
        assert_failed_with(parts, WsConfig::default(), 1007, "invalid UTF-8");
    }

    #[test]
    fn unmasked_client_frame_is_a_protocol_error() {
        assert_failed_with(
            vec![0x81, 0x01, b'x'],
            WsConfig::default(),
            1002,
            "protocol error",
        );
    }

    #[test]
    fn ping_every_heartbeat_and_idle_session_closed_after_three() {
        let cfg = WsConfig::default();
        let hb = cfg.heartbeat;
        let (mut c, t0) = open(cfg);
        assert_eq!(c.next_deadline(), Some(t0 + hb));
        c.handle_timeout(t0 + hb);
        assert_eq!(server_frames(&drain_output(&mut c)), vec![(0x9, vec![])]);
        c.handle_timeout(t0 + hb * 2);
        assert_eq!(server_frames(&drain_output(&mut c)), vec![(0x9, vec![])]);
        assert_eq!(c.next_deadline(), Some(t0 + hb * 3));
        c.handle_timeout(t0 + hb * 3);
        assert_eq!(events(&mut c), vec![closed(1001, "idle timeout", false)]);
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![close_payload(1001, "idle timeout")]
        );
        assert!(!c.is_open());
    }

    #[test]
    fn pong_counts_as_activity() {
        let cfg = WsConfig::default();
        let hb = cfg.heartbeat;
        let (mut c, t0) = open(cfg);
        c.handle_timeout(t0 + hb);
        c.handle_timeout(t0 + hb * 2);
        c.handle_input(&frame(0xA, true, b""), t0 + hb * 2, &HOST);
        c.handle_timeout(t0 + hb * 3);
        assert!(c.is_open(), "a pong 1 heartbeat ago keeps the session");
        assert_eq!(c.next_deadline(), Some(t0 + hb * 4));
        c.handle_timeout(t0 + hb * 5 - Duration::from_millis(1));
        assert!(c.is_open());
        c.handle_timeout(t0 + hb * 5);
        assert!(!c.is_open());
    }

    #[test]
    fn client_close_is_echoed_and_reported() {
        let (mut c, t0) = open(WsConfig::default());
        c.handle_input(&close_frame(1000, "bye"), t0, &HOST);
        assert_eq!(events(&mut c), vec![closed(1000, "bye", true)]);
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![close_payload(1000, "bye")]
        );
        assert!(c.wants_shutdown_write());
        assert_eq!(c.send_text("late", t0), Err(SendError::NotOpen));
    }

    #[test]
    fn server_close_waits_for_the_reply_then_shuts_down() {
        let cfg = WsConfig::default();
        let (mut c, t0) = open(cfg);
        c.send_text("last", t0).unwrap();
        c.close(1001, "going away", t0);
        assert_eq!(events(&mut c), vec![closed(1001, "going away", false)]);
        let frames = server_frames(&drain_output(&mut c));
        assert_eq!(
            frames,
            vec![(0x1, b"last".to_vec()), close_payload(1001, "going away")]
        );
        assert!(!c.wants_shutdown_write());
        // Text the client sent before it saw the close is not delivered.
        c.handle_input(&text("racing"), t0, &HOST);
        assert!(events(&mut c).is_empty());
        c.handle_input(&close_frame(1001, ""), t0, &HOST);
        assert!(events(&mut c).is_empty());
        assert!(c.wants_shutdown_write());
        c.write_shut_down(t0);
        c.handle_eof(t0);
        assert!(c.is_closed());
    }

    #[test]
    fn close_handshake_that_never_completes_ends_at_the_close_timeout() {
        let cfg = WsConfig::default();
        let (mut c, t0) = open(cfg);
        c.close(1000, "", t0);
        assert_eq!(c.next_deadline(), Some(t0 + cfg.close_timeout));
        c.handle_timeout(t0 + cfg.close_timeout);
        assert!(c.is_closed());
    }

    #[test]
    fn peer_vanishing_reports_1006() {
        let (mut c, t0) = open(WsConfig::default());
        c.handle_eof(t0);
        assert_eq!(events(&mut c), vec![closed(1006, "connection lost", true)]);
        assert!(c.is_closed());
    }

    #[test]
    fn slow_consumer_is_closed_1008_once_the_queue_would_pass_its_bound() {
        // Text may fill the bound less its control room.
        let cfg = WsConfig {
            max_outbound_bytes: 1000 + CONTROL_ROOM,
            ..WsConfig::default()
        };
        let (mut c, t0) = open(cfg);
        let msg = "m".repeat(98); // 100 bytes framed
        for _ in 0..10 {
            c.send_text(&msg, t0).unwrap();
        }
        assert_eq!(c.queued_bytes(), 1000);
        assert_eq!(c.send_text("x", t0), Err(SendError::SlowConsumer));
        assert_eq!(events(&mut c), vec![closed(1008, "slow consumer", false)]);
        assert_eq!(c.send_text("x", t0), Err(SendError::NotOpen));
        assert!(events(&mut c).is_empty(), "reported once");
        let frames = server_frames(&drain_output(&mut c));
        assert_eq!(frames.len(), 11);
        assert_eq!(frames[10], close_payload(1008, "slow consumer"));
        // Writing some of it frees room for nothing: the session is closing.
        assert_eq!(c.send_text("x", t0), Err(SendError::NotOpen));
    }

    #[test]
    fn the_event_queue_keeps_one_calls_room_and_gives_it_back_when_compacted() {
        let (mut c, t0) = open(WsConfig::default());
        let burst: Vec<u8> = (0..MAX_FRAMES_PER_CALL).flat_map(|_| text("m")).collect();
        c.handle_input(&burst, t0, &HOST);
        assert_eq!(events(&mut c).len(), MAX_FRAMES_PER_CALL);
        // Kept for the next burst rather than grown again from nothing.
        let room = c.events.capacity();
        assert!(
            (MAX_FRAMES_PER_CALL..=KEEP_EVENTS).contains(&room),
            "{room}"
        );
        c.handle_input(&burst, t0, &HOST);
        assert_eq!(events(&mut c).len(), MAX_FRAMES_PER_CALL);
        assert_eq!(c.events.capacity(), room);
        // More than one call's worth taken at once: not kept.
        c.handle_input(&burst, t0, &HOST);
        c.handle_input(&burst, t0, &HOST);
        assert_eq!(events(&mut c).len(), 2 * MAX_FRAMES_PER_CALL);
        assert_eq!(c.events.capacity(), 0);
        c.handle_input(&burst, t0, &HOST);
        assert_eq!(events(&mut c).len(), MAX_FRAMES_PER_CALL);
        c.compact();
        assert_eq!(c.events.capacity(), 0, "an idle session holds no room");
    }

    #[test]
    fn a_large_message_leaves_nothing_held_behind() {
        let (mut c, t0) = open(WsConfig::default());
        let big = "q".repeat(500_000);
        let bytes = text(&big);
        let (first, second) = bytes.split_at(100_000);
        c.handle_input(first, t0, &HOST);
        c.handle_input(second, t0, &HOST);
        assert_eq!(events(&mut c), vec![ConnEvent::Text(big)]);
        assert!(c.decoder.between_messages() && c.input_bytes() == 0);
        // Reading goes on, fragments and control frames included.
        let mut more = frame(0x1, false, b"a");
        more.extend(frame(0x9, true, b"p"));
        more.extend(frame(0x0, true, b"b"));
        c.handle_input(&more, t0, &HOST);
        assert_eq!(events(&mut c), vec![ConnEvent::Text("ab".into())]);
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![(0xA, b"p".to_vec())]
        );
    }

    #[test]
    fn partially_written_output_is_resumed_and_given_back_when_empty() {
        let (mut c, t0) = open(WsConfig::default());
        c.admit();
        let big = "z".repeat(100_000);
        c.send_text(&big, t0).unwrap();
        let total = c.queued_bytes();
        c.consume_output(30_000);
        assert_eq!(c.queued_bytes(), total - 30_000);
        c.consume_output(total - 30_000);
        assert_eq!(c.queued_bytes(), 0);
        assert!(c.take_spare_output().is_some());
        assert_eq!(c.out.capacity(), 0, "an idle connection holds no buffer");
        assert!(c.take_spare_output().is_none());
    }

    /// Decodes everything handed in, resuming held input with a virtual clock that
    /// advances to each resume time; returns the events and the final time.
    fn feed_all(c: &mut Connection, input: &[u8], t0: Instant) -> (Vec<ConnEvent>, Instant) {
        let mut now = t0;
        c.handle_input(input, now, &HOST);
        let mut ev = events(c);
        while c.input_held() {
            now = now.max(c.resume_at());
            assert!(c.resume_input(now));
            ev.extend(events(c));
        }
        (ev, now)
    }

    #[test]
    fn ping_flood_from_a_peer_that_never_reads_stays_within_the_bound_and_closes_1008() {
        let cfg = WsConfig {
            max_outbound_bytes: 8 << 10,
            max_frames_per_s: u32::MAX,
            frame_burst: u32::MAX,
            ..WsConfig::default()
        };
        let (mut c, t0) = open(cfg);
        let ping = frame(0x9, true, &[b'p'; 125]);
        let mut most = 0;
        for _ in 0..1000 {
            c.handle_input(&ping, t0, &HOST);
            while c.input_held() {
                assert!(c.resume_input(t0));
            }
            most = most.max(c.queued_bytes());
            assert!(
                c.queued_bytes() <= cfg.max_outbound_bytes,
                "{}",
                c.queued_bytes()
            );
        }
        assert!(most > cfg.max_outbound_bytes - 2 * CONTROL_ROOM, "{most}");
        assert_eq!(events(&mut c), vec![closed(1008, "slow consumer", false)]);
        let frames = server_frames(c.output());
        assert!(frames.iter().all(|(op, _)| *op == 0xA || *op == 0x8));
        assert_eq!(frames.last(), Some(&close_payload(1008, "slow consumer")));
        assert_eq!(c.input_bytes(), 0, "nothing is kept once failed");
    }

    #[test]
    fn a_heartbeat_ping_that_does_not_fit_closes_1008() {
        let cfg = WsConfig {
            max_outbound_bytes: 2048,
            ..WsConfig::default()
        };
        let (mut c, t0) = open(cfg);
        let fill = "f".repeat(2048 - CONTROL_ROOM - 4 - 1);
        c.send_text(&fill, t0).unwrap();
        c.handle_timeout(t0 + cfg.heartbeat);
        assert_eq!(events(&mut c), vec![closed(1008, "slow consumer", false)]);
        assert!(c.queued_bytes() <= cfg.max_outbound_bytes);
    }

    #[test]
    fn frames_past_the_allowance_wait_for_it_to_refill_and_none_is_lost() {
        let cfg = WsConfig {
            max_frames_per_s: 100,
            frame_burst: 20,
            ..WsConfig::default()
        };
        let (mut c, t0) = open(cfg);
        let mut input = Vec::new();
        for i in 0..120 {
            if i % 10 == 0 {
                input.extend(frame(0x9, true, b"x"));
            }
            input.extend(text(&format!("m{i}")));
        }
        c.handle_input(&input, t0, &HOST);
        assert_eq!(events(&mut c).len(), 18, "the burst: 18 texts and 2 pings");
        assert!(c.input_held());
        assert!(!c.resume_input(t0 + Duration::from_millis(5)), "not yet");
        let (ev, end) = feed_all(&mut c, &[], t0);
        let texts: Vec<_> = ev
            .iter()
            .map(|e| match e {
                ConnEvent::Text(t) => t.to_string(),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(texts.len(), 102);
        assert_eq!(texts.first().map(String::as_str), Some("m18"));
        assert_eq!(texts.last().map(String::as_str), Some("m119"));
        // 132 frames, 20 at once, the rest at 100/s.
        let took = end - t0;
        assert!(
            took >= Duration::from_millis(1100) && took <= Duration::from_millis(1300),
            "{took:?}"
        );
        assert!(c.is_open());
        assert_eq!(
            server_frames(&drain_output(&mut c)).len(),
            12,
            "every ping answered"
        );
    }

    #[test]
    fn one_call_decodes_a_bounded_number_of_frames() {
        let cfg = WsConfig {
            max_frames_per_s: u32::MAX,
            frame_burst: u32::MAX,
            ..WsConfig::default()
        };
        let (mut c, t0) = open(cfg);
        let input: Vec<u8> = (0..100).flat_map(|i| text(&format!("{i}"))).collect();
        c.handle_input(&input, t0, &HOST);
        assert_eq!(events(&mut c).len(), MAX_FRAMES_PER_CALL);
        assert!(c.input_held());
        assert_eq!(c.next_deadline(), Some(t0), "due at once");
        let (ev, _) = feed_all(&mut c, &[], t0);
        assert_eq!(ev.len(), 100 - MAX_FRAMES_PER_CALL);
        assert_eq!(c.input_bytes(), 0);
    }

    #[test]
    fn a_half_sent_message_counts_as_held_input_until_shed() {
        let (mut c, t0) = open(WsConfig::default());
        let big = text(&"h".repeat(300_000));
        c.handle_input(&big[..200_000], t0, &HOST);
        // The payload so far; the 14 bytes of its header are not kept.
        assert_eq!(c.input_bytes(), 200_000 - 14);
        c.shed(t0);
        assert_eq!(events(&mut c), vec![closed(1008, "memory budget", false)]);
        assert_eq!(c.input_bytes(), 0);
        c.handle_input(&big[200_000..], t0, &HOST);
        assert!(events(&mut c).is_empty());
        assert_eq!(
            server_frames(&drain_output(&mut c)),
            vec![close_payload(1008, "memory budget")]
        );
        // A complete message leaves nothing held.
        let (mut c, t0) = open(WsConfig::default());
        c.handle_input(&big, t0, &HOST);
        assert_eq!(events(&mut c).len(), 1);
        assert_eq!(c.input_bytes(), 0);
    }

    #[test]
    fn an_http_response_over_the_bound_is_replaced_by_503() {
        struct Big;
        impl HttpHost for Big {
            fn health(&self) -> Result<(), String> {
                Ok(())
            }
            fn metrics(&self, out: &mut String) {
                out.push_str(&"x".repeat(10_000));
            }
        }
        let t0 = Instant::now();
        let cfg = WsConfig {
            max_outbound_bytes: 4096,
            ..WsConfig::default()
        };
        let mut c = Connection::new(t0, cfg);
        c.handle_input(b"GET /metrics HTTP/1.1\r\n\r\n", t0, &Big);
        assert!(c.queued_bytes() <= 4096);
        let out = String::from_utf8(drain_output(&mut c)).unwrap();
        assert!(out.starts_with("HTTP/1.1 503 "), "{out}");
        assert_eq!(events(&mut c), vec![ConnEvent::Http { status: 503 }]);
    }

    /// HTTP responses have a bound of their own, whatever `max_outbound_bytes` allows a
    /// session: a `/metrics` body larger than the 64 KiB of a connection waiting for its
    /// hello is served, one past 1 MiB is not.
    #[test]
    fn an_http_response_is_served_up_to_1_mib_whatever_max_outbound_bytes_allows() {
        struct Sized(usize);
        impl HttpHost for Sized {
            fn health(&self) -> Result<(), String> {
                Ok(())
            }
            fn metrics(&self, out: &mut String) {
                out.push_str(&"x".repeat(self.0));
            }
        }
        let t0 = Instant::now();
        let cfg = WsConfig {
            max_outbound_bytes: 64 << 20,
            ..WsConfig::default()
        };
        for (body, status) in [(600_000, 200), ((1 << 20) + 1, 503)] {
            let mut c = Connection::new(t0, cfg);
            c.handle_input(b"GET /metrics HTTP/1.1\r\n\r\n", t0, &Sized(body));
            assert!(
                c.queued_bytes() <= MAX_HTTP_RESPONSE,
                "{}",
                c.queued_bytes()
            );
            assert_eq!(events(&mut c), vec![ConnEvent::Http { status }], "{body}");
        }
    }

    /// The allowance is fractional: resuming at `resume_at` must always make progress,
    /// whatever rounding the rate leaves (a resume time equal to the last refill would
    /// spin without decoding anything).
    #[test]
    fn resuming_at_the_resume_time_always_decodes_something() {
        for rate in (1..=1001).step_by(40).chain([3, 7, 999_999, u32::MAX]) {
            for burst in (1..=97).step_by(12).chain([16, 17]) {
                let cfg = WsConfig {
                    max_frames_per_s: rate,
                    frame_burst: burst,
                    ..WsConfig::default()
                };
                let (mut c, t0) = open(cfg);
                let input: Vec<u8> = (0..300).flat_map(|_| frame(0x9, true, b"")).collect();
                c.handle_input(&input, t0, &HOST);
                let mut now = t0;
                let mut turns = 0;
                while c.input_held() {
                    turns += 1;
                    assert!(turns < 1000, "no progress at rate {rate}, burst {burst}");
                    now = now.max(c.resume_at());
                    assert!(c.resume_input(now), "refused at its resume time");
                }
                assert_eq!(server_frames(&drain_output(&mut c)).len(), 300);
            }
        }
    }
}
