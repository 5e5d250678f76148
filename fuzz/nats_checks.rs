// The check of the `nats_connection` fuzz target (fuzz/fuzz_targets/nats_connection.rs),
// shared with the replay in tests/fuzz_nats_regressions.rs: the sans-IO NATS client
// connection from the first byte a server sends (INFO, CONNECT, TLS, credentials, the pool
// of servers, reconnects, lame duck mode), driven the way the runtime's shell drives it,
// on a virtual clock. The broker target starts after a fixed handshake; this one lets a
// hostile or broken server choose every byte of every connection.
//
// The first two bytes choose the options (servers, TLS mode, credentials, reconnect
// policy, buffer sizes); the rest is a program of one-byte operations with arguments:
//   0 n ..      n raw server bytes
//   1 k n ..    a canned server line k (INFO variants, PING, PONG, -ERR, ...) with n bytes
//               of fuzzer text spliced in
//   2 k c n ..  the same line cut after c bytes (a partial line; the rest may follow)
//   3 t         time passes (t < 128: t * 20 ms; else (t - 128) s)
//   4           the socket closes (a dial is refused, or the peer hangs up)
//   5           the dial completes
//   6 e         the server reads up to 2^e bytes of what the client wrote
//   7 k n ..    a message: on a subscription the client wrote (k picks one), a reply
//               to a request it wrote, a status, a JetStream delivery
//   8 k n ..    the user publishes (subject variant k, n bytes of text, a payload size)
//   9 k n ..    the user subscribes
//   10 k m      the user unsubscribes (now or after m messages)
//   11 k t      the user makes a request, or cancels one
//   12          the user pings
//   13 k        a huge INFO (server_id 2^k bytes)
//   14 0xc1     the user closes the connection
//
// What must always hold, besides no panic:
// - the shell is never told to dial while a socket is open, to drop a socket it does not
//   have, or to start TLS twice or for another server than the one dialed;
// - on every connection the first thing written is CONNECT, and only once; nothing but
//   PING and PONG goes with it before the server's PONG completes the handshake (no PUB,
//   HPUB, SUB or UNSUB); under TLS (asked for), not one byte is written in plaintext;
// - what the client writes always parses as client protocol;
// - output, the reconnect buffer and the pool stay within their bounds;
// - events come in a lawful order: Connected once, then Disconnected / Reconnected in
//   turn, nothing after Closed; every request ends exactly once; each Pong answers a
//   ping made and not yet answered; messages only for subscriptions the user made.

#![allow(dead_code)]

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use amp_broker::nats::{
    Auth, Connection, Event, HeaderMap, Options, PingId, RequestId, ServerAddr, Sid,
};
use amp_broker::nkeys::{KeyKind, KeyPair};
use amp_broker::proto::{Op, Parsed, Parser, Role};

const HOSTS: [&str; 3] = ["nats://127.0.0.1:4222", "127.0.0.2:4223", "127.0.0.3:4224"];
const MAX_SUBS: usize = 16;
const MAX_REQUESTS: usize = 16;
const MAX_PENDING_MESSAGES: usize = 8;
const MAX_DISCOVERED: usize = 4;
/// What `ping()` may queue beyond the write buffer (`MAX_USER_PINGS` PINGs), the
/// handshake (CONNECT with a JWT-sized signature, PING) and the keepalives.
const SLACK: usize = 1024 * 6 + 4096;

/// Server lines, `{}` replaced by fuzzer text (JSON-escaped where inside a JSON string).
const LINES: &[&str] = &[
    "INFO {\"server_id\":\"S\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576,\"nonce\":\"{}\"}\r\n",
    "INFO {\"server_id\":\"S\",\"tls_required\":true,\"nonce\":\"{}\"}\r\n",
    "INFO {\"server_id\":\"S\",\"tls_available\":true,\"auth_required\":true,\"nonce\":\"{}\"}\r\n",
    "INFO {\"server_id\":\"S\",\"connect_urls\":[\"{}:4222\",\"127.0.0.9:4222\"]}\r\n",
    "INFO {\"connect_urls\":[\"10.0.0.1:4222\",\"10.0.0.2:4222\",\"10.0.0.3:4222\",\"[::1]:{}\",\"{}\"]}\r\n",
    "INFO {\"server_id\":\"S\",\"ldm\":true,\"connect_urls\":[\"{}\"]}\r\n",
    "INFO {\"ldm\":true}\r\n",
    "INFO {\"max_payload\":{}}\r\n",
    "INFO {}\r\n",
    "PING\r\n",
    "PONG\r\n",
    "+OK\r\n",
    "-ERR 'Authorization Violation'\r\n",
    "-ERR 'Stale Connection'\r\n",
    "-ERR 'Permissions Violation for Publish to \"{}\"'\r\n",
    "-ERR '{}'\r\n",
    "-ERR 'Maximum Subscriptions Exceeded'\r\n",
    "-ERR 'User Authentication Expired'\r\n",
];
/// Lines whose `{}` is spliced raw (numbers, whole JSON, quoted error text).
const RAW_SPLICE: &[usize] = &[7, 8, 15];

const SUBJECTS: &[&str] = &["orders.{}", "{}", "a.{}.b", "_INBOX.{}", "$JS.API.{}"];
const PATTERNS: &[&str] = &["orders.*", "orders.>", "{}", "a.{}.>", "_INBOX.x.*"];

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }
    fn text(&mut self) -> String {
        let n = usize::from(self.byte() % 32);
        String::from_utf8_lossy(self.take(n)).into_owned()
    }
}

fn json_escaped(text: &str) -> String {
    let quoted = serde_json::to_string(text).unwrap_or_default();
    quoted
        .get(1..quoted.len().saturating_sub(1))
        .unwrap_or("")
        .to_string()
}

/// The socket as the shell sees it.
enum Socket {
    None,
    Dialing(ServerAddr),
    Open(Transport),
}

struct Transport {
    addr: ServerAddr,
    tls: bool,
    /// The connection said it was connected since this socket opened.
    handshaken: bool,
    connects: u32,
    /// Written and not yet parsed (a cut operation).
    written: Vec<u8>,
}

struct World {
    now: Instant,
    conn: Connection,
    options: Options,
    socket: Socket,
    parser: Parser,
    /// Sids the user got from `subscribe`, and those still open.
    ever_subscribed: HashSet<Sid>,
    subs: Vec<Sid>,
    requests: BTreeSet<RequestId>,
    pings: BTreeSet<PingId>,
    /// (subject, sid) of the SUBs the client wrote, newest last.
    wire_subs: Vec<(String, String)>,
    /// Reply subjects of the PUBs the client wrote, newest last.
    wire_replies: Vec<String>,
    connected_once: bool,
    established: bool,
    closed: bool,
    bound: usize,
}

fn options(a: u8, b: u8) -> Options {
    let servers = 1 + usize::from(a & 3) % 3;
    let tls = (a >> 3) & 3;
    let mut urls: Vec<String> = HOSTS[..servers].iter().map(|s| s.to_string()).collect();
    if tls == 1 {
        urls[0] = urls[0].replace("nats://", "tls://");
    }
    if b & 3 == 1 {
        urls[0] = urls[0].replace("nats://", "nats://alice:s3cret@");
    }
    let mut o = Options::new(&urls.join(","));
    o.no_randomize = a & 4 != 0;
    o.tls_handshake_first = tls == 2;
    o.allow_reconnect = a & 0x20 == 0;
    o.retry_on_failed_connect = a & 0x40 != 0;
    o.ignore_discovered_servers = a & 0x80 != 0;
    match b & 3 {
        2 => o = o.with_token("t0ken"),
        3 => {
            o.auth = Auth::NKey(KeyPair::from_raw_seed(KeyKind::User, &[9; 32]));
        }
        _ => {}
    }
    o.max_reconnect_attempts = match (b >> 2) & 7 {
        0 => None,
        n => Some(u32::from(n)),
    };
    let scale = (b >> 5) & 7;
    o.max_write_buffer = 2048 << scale;
    o.reconnect_buffer_size = 1024 << scale;
    o.max_pending_messages = MAX_PENDING_MESSAGES;
    o.max_subscriptions = MAX_SUBS;
    o.max_pending_requests = MAX_REQUESTS;
    o.max_discovered_servers = MAX_DISCOVERED;
    o.ping_interval = Duration::from_secs(2);
    o.rng_seed = Some(7);
    o
}

impl World {
    fn new(a: u8, b: u8) -> World {
        let now = Instant::now();
        let options = options(a, b);
        let mut parser = Parser::new(Role::Server);
        parser.max_payload = 64 << 20;
        parser.max_control_line = 1 << 20;
        let bound = options.max_write_buffer + options.reconnect_buffer_size + SLACK;
        let mut w = World {
            now,
            conn: Connection::new(options.clone(), now),
            options,
            socket: Socket::None,
            parser,
            ever_subscribed: HashSet::new(),
            subs: Vec::new(),
            requests: BTreeSet::new(),
            pings: BTreeSet::new(),
            wire_subs: Vec::new(),
            wire_replies: Vec::new(),
            connected_once: false,
            established: false,
            closed: false,
            bound,
        };
        w.duties();
        w
    }

    fn tls_required(&self) -> bool {
        self.options.tls_required()
    }

    /// The shell's duties after every call into the connection, and the checks.
    fn duties(&mut self) {
        if self.conn.poll_close() {
            assert!(
                !matches!(self.socket, Socket::None),
                "told to drop a socket while none is open or dialing"
            );
            self.socket = Socket::None;
        }
        if let Some(name) = self.conn.poll_start_tls() {
            let Socket::Open(t) = &mut self.socket else {
                panic!("told to start TLS without an open socket");
            };
            assert!(!t.tls, "told to start TLS twice on one socket");
            assert_eq!(
                name, t.addr.host,
                "TLS for another server than the one dialed"
            );
            assert!(
                self.options.tls_required(),
                "TLS started though not asked for"
            );
            t.tls = true;
        }
        if let Some(addr) = self.conn.poll_connect(self.now) {
            assert!(
                matches!(self.socket, Socket::None),
                "told to dial {addr:?} while a socket is open"
            );
            assert!(!self.closed, "told to dial after Closed");
            self.socket = Socket::Dialing(addr);
        }
        self.events();
        if self.conn.is_connected()
            && let Socket::Open(t) = &mut self.socket
        {
            t.handshaken = true;
        }
        self.check_output();
    }

    fn events(&mut self) {
        let mut messages = 0;
        while let Some(event) = self.conn.poll_event() {
            if self.closed {
                assert!(
                    matches!(
                        event,
                        Event::InvalidMessages { .. } | Event::SlowConsumer { .. }
                    ),
                    "{event:?} after Closed"
                );
            }
            match event {
                Event::Connected { .. } => {
                    assert!(!self.connected_once, "Connected twice");
                    self.connected_once = true;
                    self.established = true;
                }
                Event::Reconnected { .. } => {
                    assert!(
                        self.connected_once && !self.established,
                        "Reconnected without a Disconnected before it"
                    );
                    self.established = true;
                }
                Event::Disconnected { .. } => {
                    assert!(self.established, "Disconnected while not connected");
                    self.established = false;
                }
                Event::Message { sid, .. } => {
                    messages += 1;
                    assert!(
                        self.ever_subscribed.contains(&sid),
                        "a message for sid {sid:?}, never subscribed"
                    );
                }
                // A JetStream delivery on any sid the connection does not know, so that
                // its owner can hand it back.
                Event::Unread { .. } => messages += 1,
                Event::Response { id, .. } => {
                    messages += 1;
                    assert!(self.requests.remove(&id), "a second outcome of {id:?}");
                }
                Event::RequestFailed { id, .. } => {
                    assert!(self.requests.remove(&id), "a second outcome of {id:?}");
                }
                Event::Pong(id) => {
                    assert!(self.pings.remove(&id), "a Pong for {id:?} not asked for");
                }
                Event::Closed { .. } => self.closed = true,
                Event::ServerError(_)
                | Event::LameDuck
                | Event::SlowConsumer { .. }
                | Event::InvalidMessages { .. }
                | Event::AfterUnsubscribe { .. } => {}
            }
        }
        assert!(
            messages <= MAX_PENDING_MESSAGES + MAX_REQUESTS,
            "{messages} messages queued at once"
        );
    }

    fn check_output(&mut self) {
        let out = self.conn.output();
        assert!(
            out.len() <= self.bound,
            "output grew to {} bytes (bound {})",
            out.len(),
            self.bound
        );
        assert!(
            self.conn.reconnect_buffered() <= self.options.reconnect_buffer_size,
            "reconnect buffer at {}",
            self.conn.reconnect_buffered()
        );
        assert!(
            self.conn.servers().len() <= self.options.servers.len() + MAX_DISCOVERED,
            "the pool grew to {} servers",
            self.conn.servers().len()
        );
        let Socket::Open(t) = &self.socket else {
            assert!(out.is_empty(), "output queued without an open socket");
            return;
        };
        if self.options.tls_required() && !t.tls {
            assert!(
                out.is_empty(),
                "plaintext queued on a connection that must be TLS: {:?}",
                String::from_utf8_lossy(out)
            );
        }
        if !t.handshaken {
            let mut rest = out;
            while let Ok(Parsed::Complete(op, used)) = self.parser.parse(rest) {
                assert!(
                    matches!(op, Op::Connect(_) | Op::Ping | Op::Pong),
                    "{op:?} queued before the handshake completed"
                );
                rest = rest.get(used..).unwrap_or_default();
            }
        }
    }

    /// The server reads `n` bytes of what the client wrote.
    fn write(&mut self, n: usize) {
        let Socket::Open(t) = &mut self.socket else {
            return;
        };
        let out = self.conn.output();
        let n = n.min(out.len());
        t.written.extend_from_slice(&out[..n]);
        self.conn.consume_output(n);
        let mut start = 0;
        loop {
            let rest = t.written.get(start..).unwrap_or_default();
            match self.parser.parse(rest) {
                Ok(Parsed::Complete(op, used)) => {
                    start += used;
                    if t.connects == 0 {
                        assert!(
                            matches!(op, Op::Connect(_)),
                            "{op:?} written before CONNECT"
                        );
                    }
                    match op {
                        Op::Connect(json) => {
                            t.connects += 1;
                            assert_eq!(t.connects, 1, "a second CONNECT on one connection");
                            let v: serde_json::Value =
                                serde_json::from_slice(json).expect("CONNECT is JSON");
                            assert_eq!(
                                v["tls_required"].as_bool().unwrap_or(false),
                                t.tls,
                                "CONNECT's tls_required says otherwise"
                            );
                        }
                        Op::Pub { reply, .. } | Op::Hpub { reply, .. } => {
                            assert!(t.handshaken, "PUB written before the handshake");
                            if let Some(r) = reply {
                                self.wire_replies
                                    .push(String::from_utf8_lossy(r).into_owned());
                            }
                        }
                        Op::Sub { subject, sid, .. } => {
                            assert!(t.handshaken, "SUB written before the handshake");
                            self.wire_subs.push((
                                String::from_utf8_lossy(subject).into_owned(),
                                String::from_utf8_lossy(sid).into_owned(),
                            ));
                        }
                        Op::Unsub { .. } => {
                            assert!(t.handshaken, "UNSUB written before the handshake");
                        }
                        _ => {}
                    }
                }
                Ok(Parsed::Partial { .. }) => break,
                Err(e) => panic!(
                    "the client wrote what does not parse ({e:?}): {:?}",
                    String::from_utf8_lossy(rest)
                ),
            }
        }
        t.written.drain(..start);
        let extra = self.wire_subs.len().saturating_sub(32);
        self.wire_subs.drain(..extra);
        let extra = self.wire_replies.len().saturating_sub(32);
        self.wire_replies.drain(..extra);
    }

    fn receive(&mut self, bytes: &[u8]) {
        if !matches!(self.socket, Socket::Open(_)) {
            return;
        }
        let before = self.conn.discovered_servers();
        let plaintext =
            matches!(&self.socket, Socket::Open(t) if self.options.tls_required() && !t.tls);
        self.conn.receive(bytes, self.now);
        if plaintext {
            assert_eq!(
                before,
                self.conn.discovered_servers(),
                "servers learned from a plaintext INFO on a connection that must be TLS"
            );
        }
    }

    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        for _ in 0..256 {
            let Some(t) = self.conn.poll_timeout().filter(|&t| t <= until) else {
                break;
            };
            self.now = self.now.max(t);
            self.conn.handle_timeout(self.now);
            self.duties();
            assert!(
                self.conn.poll_timeout().is_none_or(|next| next > self.now),
                "a deadline still past after handle_timeout: the event loop would spin"
            );
        }
        self.now = until;
        self.conn.handle_timeout(self.now);
    }

    fn message(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte();
        let n = usize::from(c.byte() % 64);
        let payload = c.take(n).to_vec();
        let pick = usize::from(c.byte());
        let (subject, sid) = match (k % 4, self.wire_replies.is_empty()) {
            (0 | 1, true) | (2 | 3, _) if !self.wire_subs.is_empty() => {
                let (s, sid) = &self.wire_subs[pick % self.wire_subs.len()];
                (s.replace('*', "x").replace('>', "x.y"), sid.clone())
            }
            (0 | 1, false) => {
                let reply = &self.wire_replies[pick % self.wire_replies.len()];
                let sid = self
                    .wire_subs
                    .iter()
                    .rev()
                    .find(|(s, _)| s.strip_suffix('*').is_some_and(|p| reply.starts_with(p)))
                    .map_or_else(|| "1".to_string(), |(_, sid)| sid.clone());
                (reply.clone(), sid)
            }
            _ => (format!("x.{pick}"), (pick % 20).to_string()),
        };
        let reply = match (k >> 2) % 4 {
            0 => String::new(),
            1 => format!(" $JS.ACK.S.C.1.{pick}.{pick}.1700000000000000000.0"),
            2 => " _INBOX.r".to_string(),
            _ => " bad\u{1}reply".to_string(),
        };
        let headers = match (k >> 4) % 5 {
            0 => None,
            1 => Some("NATS/1.0 503\r\n\r\n".to_string()),
            2 => Some("NATS/1.0 100 Idle Heartbeat\r\n\r\n".to_string()),
            3 => Some("NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\n\r\n".into()),
            _ => Some("NATS/1.0\r\nA: b\r\n\r\n".to_string()),
        };
        let payload = if headers
            .as_deref()
            .is_some_and(|h| h.starts_with("NATS/1.0 5"))
        {
            Vec::new()
        } else {
            payload
        };
        let mut bytes = match &headers {
            None => format!("MSG {subject} {sid}{reply} {}\r\n", payload.len()).into_bytes(),
            Some(h) => format!(
                "HMSG {subject} {sid}{reply} {} {}\r\n{h}",
                h.len(),
                h.len() + payload.len()
            )
            .into_bytes(),
        };
        bytes.extend_from_slice(&payload);
        bytes.extend_from_slice(b"\r\n");
        self.receive(&bytes);
    }
}

fn line(c: &mut Cursor<'_>) -> Vec<u8> {
    let k = usize::from(c.byte()) % LINES.len();
    let text = c.text();
    let text = if RAW_SPLICE.contains(&k) {
        text
    } else {
        json_escaped(&text)
    };
    LINES[k].replace("{}", &text).into_bytes()
}

fn subject(c: &mut Cursor<'_>, variants: &[&str]) -> String {
    let k = usize::from(c.byte()) % variants.len();
    let text = c.text();
    variants[k].replace("{}", &text)
}

pub fn check_nats_connection(data: &[u8]) {
    run(data);
}

/// What a program reached, for tests of the harness.
#[derive(Debug, Default)]
pub struct Reached {
    pub connected: bool,
    pub reconnects: u64,
    pub discovered: usize,
}

/// Runs a program.
pub fn run(data: &[u8]) -> Reached {
    let mut c = Cursor(data);
    let (a, b) = (c.byte(), c.byte());
    let mut w = World::new(a, b);
    let mut steps = 0;
    while !c.0.is_empty() && steps < 512 {
        steps += 1;
        match c.byte() % 15 {
            0 => {
                let n = usize::from(c.byte());
                let bytes = c.take(n);
                w.receive(bytes);
            }
            1 => {
                let bytes = line(&mut c);
                w.receive(&bytes);
            }
            2 => {
                let bytes = line(&mut c);
                let cut = usize::from(c.byte()) % bytes.len().max(1);
                w.receive(&bytes[..cut]);
            }
            3 => {
                let t = u64::from(c.byte());
                let by = if t < 128 {
                    Duration::from_millis(t * 20)
                } else {
                    Duration::from_secs(t - 128)
                };
                w.advance(by);
            }
            4 => {
                if !matches!(w.socket, Socket::None) {
                    w.socket = Socket::None;
                    w.conn.on_transport_closed(w.now, "fuzz: socket closed");
                }
            }
            5 => {
                if let Socket::Dialing(addr) = &w.socket {
                    w.socket = Socket::Open(Transport {
                        addr: addr.clone(),
                        tls: false,
                        handshaken: false,
                        connects: 0,
                        written: Vec::new(),
                    });
                    w.conn.on_transport_open(w.now);
                }
            }
            6 => {
                let e = u32::from(c.byte() % 24);
                w.write(1 << e);
            }
            7 => w.message(&mut c),
            8 => {
                let subject = subject(&mut c, SUBJECTS);
                let size = (1usize << (c.byte() % 16)) - 1;
                let flags = c.byte();
                let reply = (flags & 1 != 0).then_some("_INBOX.me");
                let mut headers = HeaderMap::new();
                let _ = headers.insert("K", "v");
                let headers = (flags & 2 != 0).then_some(&headers);
                let _ = w.conn.publish(&subject, reply, headers, &vec![b'x'; size]);
            }
            9 => {
                let pattern = subject(&mut c, PATTERNS);
                let queue = (c.byte() & 1 != 0).then_some("q");
                if let Ok(sid) = w.conn.subscribe(&pattern, queue) {
                    w.ever_subscribed.insert(sid);
                    w.subs.push(sid);
                    if c.byte() & 1 != 0 {
                        w.conn.status_only_headers(sid);
                    }
                }
            }
            10 => {
                let k = usize::from(c.byte());
                let m = c.byte();
                if !w.subs.is_empty() {
                    let sid = w.subs[k % w.subs.len()];
                    let max = (m > 0).then_some(u64::from(m % 4));
                    let _ = w.conn.unsubscribe(sid, max);
                    if max.is_none() {
                        w.subs.retain(|&s| s != sid);
                    }
                }
            }
            11 => {
                let k = c.byte();
                let t = u64::from(c.byte());
                if k & 1 == 0 || w.requests.is_empty() {
                    let subject = subject(&mut c, SUBJECTS);
                    let timeout = Duration::from_millis(50 + t * 40);
                    if let Ok(id) = w.conn.request(&subject, None, b"q", timeout, w.now) {
                        assert!(w.requests.insert(id), "request id {id:?} given twice");
                    }
                } else {
                    let id = *w
                        .requests
                        .iter()
                        .nth(usize::from(k >> 1) % w.requests.len())
                        .expect("a request");
                    assert!(
                        w.conn.cancel_request(id),
                        "{id:?} not pending, yet it had no outcome"
                    );
                    w.requests.remove(&id);
                }
            }
            12 => {
                if let Ok(id) = w.conn.ping() {
                    assert!(w.pings.insert(id), "ping id {id:?} given twice");
                }
            }
            13 => {
                let k = u32::from(c.byte() % 14);
                let text = c.text();
                let id = text.repeat((1usize << k) / text.len().max(1));
                let info = format!("INFO {{\"server_id\":\"{}\"}}\r\n", json_escaped(&id));
                w.receive(info.as_bytes());
            }
            _ => {
                // Rare: nothing happens after it.
                if c.byte() == 0xc1 {
                    w.conn.close();
                }
            }
        }
        w.duties();
    }
    let reached = Reached {
        connected: w.connected_once,
        reconnects: w.conn.stats().reconnects,
        discovered: w.conn.discovered_servers().len(),
    };
    // Every deadline may pass, then the user closes: every request must have had its one
    // outcome and nothing may be left queued.
    w.advance(Duration::from_secs(300));
    w.duties();
    w.conn.close();
    w.duties();
    assert!(w.conn.is_closed(), "close() left the connection open");
    assert!(w.closed, "no Closed event after close()");
    assert!(
        w.requests.is_empty(),
        "requests without an outcome: {:?}",
        w.requests
    );
    assert!(w.conn.output().is_empty() && w.conn.reconnect_buffered() == 0);
    reached
}
