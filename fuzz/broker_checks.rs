// The whole-broker check of the `broker` fuzz target (fuzz/fuzz_targets/broker.rs), shared
// with the replay in tests/fuzz_broker_regressions.rs: the broker core with WebSocket
// sessions fed arbitrary client bytes and its NATS connection fed arbitrary server bytes,
// on a virtual clock. Nothing may panic, and what is queued for each peer stays bounded.
//
// The input is a program of one-byte operations with their arguments, so the fuzzer
// reaches authenticated sessions and the replies the core waits for instead of spending
// itself on the upgrade and the hello:
//   0 s        open session s (upgrade included)
//   1 s n ..   n raw client bytes to session s
//   2 s k ..   a canned AMP frame k (hello, send, subscribe, serve, submit, claim, ...)
//              with fuzzer text spliced in, masked and framed, to session s
//   3 n ..     n raw server bytes to the NATS connection
//   4 n ..     a reply with an n-byte payload to the newest request the core made
//   5 n ..     a message with an n-byte payload on the newest subscription
//   6 t        time passes: t * 37 ms
//   7 s        session s ends
//   8          the NATS connection drops and comes back

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use amp_broker::broker::clock::Clock;
use amp_broker::broker::config::Config;
use amp_broker::broker::{Broker, Input, Output};
use amp_broker::keygen::token_sha256;
use amp_broker::nats::{Connection as Nats, Options};
use amp_broker::ws::{ConnEvent, Connection as Ws, HttpHost, WsConfig};

struct Host;

impl HttpHost for Host {
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn metrics(&self, out: &mut String) {
        out.push_str("amp_x 1\n");
    }
}

const SESSIONS: usize = 4;
const UPGRADE: &[u8] =
    b"GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";
const INFO: &[u8] = b"INFO {\"server_id\":\"S1\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":65536}\r\n";
/// What a session's transport may hold for its peer: its configured bound plus one frame
/// (the one that found the queue full is refused, not cut).
const WS_OUT_BOUND: usize = 2 << 20;
/// The NATS connection's output while the server reads nothing (the test never stops
/// reading, so this is the most a burst of inputs can queue in one step).
const NATS_OUT_BOUND: usize = 64 << 20;

fn config() -> Config {
    let all = serde_json::json!([">"]);
    let p = |t: &str| {
        serde_json::json!({"token_sha256": token_sha256(t),
        "permissions": {"send": all, "publish": all, "subscribe": all, "submit": all, "serve": all}})
    };
    let c = serde_json::json!({"namespaces": {"acme": {
        "participants": {"alice": p("a-token"), "bob": p("b-token")},
        "jobs": {"render": {"lease_s": 5, "offer_ms": 500, "max_attempts": 2}}}}});
    Config::parse(c.to_string().as_bytes()).expect("fuzz configuration")
}

/// Canned frames, `{}` replaced by fuzzer text (JSON-escaped, so the frame stays JSON
/// and the schema and handlers see odd values rather than only parse errors).
const FRAMES: &[&str] = &[
    r#"{"op":"hello","id":"h","ns":"acme","name":"alice","auth":{"type":"token","token":"a-token"},"serve":[{"job":"render","slots":2}]}"#,
    r#"{"op":"hello","id":"h","ns":"acme","name":"bob","auth":{"type":"token","token":"b-token"}}"#,
    r#"{"op":"send","id":"s{}","to":"bob","body":{"t":"{}"}}"#,
    r#"{"op":"send","id":"s{}","to":"alice","body":"{}","idem":"{}"}"#,
    r#"{"op":"ack","seq":{}}"#,
    r#"{"op":"nak","seq":1}"#,
    r#"{"op":"subscribe","id":"u{}","topic":"orders.{}","durable":"d{}"}"#,
    r#"{"op":"subscribe","id":"u","topic":"orders.>"}"#,
    r#"{"op":"publish","id":"p{}","topic":"orders.{}","body":1}"#,
    r#"{"op":"unsubscribe","id":"x","sub":"{}"}"#,
    r#"{"op":"submit","id":"t{}","job":"render","body":{"n":"{}"}}"#,
    r#"{"op":"submit","id":"t","job":"render","task":"{}","body":null}"#,
    r#"{"op":"claim","id":"c","task":"{}"}"#,
    r#"{"op":"heartbeat","id":"b","task":"{}"}"#,
    r#"{"op":"complete","id":"k","task":"{}","result":{}}"#,
    r#"{"op":"fail","id":"f","task":"{}","error":{"code":"x","message":"{}"},"retry":true}"#,
    r#"{"op":"cancel","id":"z","task":"{}"}"#,
    r#"{"op":"status","id":"q","task":"{}"}"#,
    r#"{"op":"who","id":"w","name":"{}"}"#,
    r#"{"op":"watch","id":"w2"}"#,
    r#"{"op":"dead_letters","id":"l","job":"render"}"#,
    r#"{"op":"ping","id":"{}"}"#,
];

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a
    }
}

/// A masked client text frame (clients must mask).
fn client_text(text: &[u8]) -> Vec<u8> {
    let mut f = vec![0x81];
    match text.len() {
        n if n < 126 => f.push(0x80 | n as u8),
        n if n < 65_536 => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    let mask = [0x11, 0x22, 0x33, 0x44];
    f.extend_from_slice(&mask);
    f.extend(text.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

fn splice(frame: &str, text: &[u8]) -> Vec<u8> {
    let s = String::from_utf8_lossy(text);
    let escaped = serde_json::to_string(&s).unwrap_or_default();
    let inner = escaped
        .get(1..escaped.len().saturating_sub(1))
        .unwrap_or("");
    frame.replace("{}", inner).into_bytes()
}

struct World {
    now: Instant,
    broker: Broker,
    nats: Nats,
    ws: Vec<Option<Ws>>,
    /// Reply subjects of the requests the core made, newest last.
    replies: Vec<String>,
    /// (subject, sid) of the core's subscriptions, newest last.
    subs: Vec<(String, String)>,
    /// Bytes the core wrote to NATS, not yet scanned for requests and subscriptions.
    wire: Vec<u8>,
    /// The ops of the frames the core sent, `<session>:<op>` (for tests of the harness).
    sent: Vec<String>,
    /// Sessions whose snapshot waits for their queue to be written.
    drain_waiters: Vec<u64>,
}

impl World {
    fn new() -> World {
        let now = Instant::now();
        let broker = Broker::new(
            config(),
            "b1".into(),
            Clock::new(now, 1_800_000_000_000),
            [7; 32],
        )
        .expect("broker");
        // A fixed seed: the server order, backoff jitter and subject tokens the same in
        // every run, so a crash found replays.
        let mut options = Options::new("nats://127.0.0.1:4222");
        options.rng_seed = Some(7);
        let mut w = World {
            now,
            broker,
            nats: Nats::new(options, now),
            ws: (0..SESSIONS).map(|_| None).collect(),
            replies: Vec::new(),
            subs: Vec::new(),
            wire: Vec::new(),
            sent: Vec::new(),
            drain_waiters: Vec::new(),
        };
        w.connect();
        let _ = w.broker.start(&mut w.nats, now);
        w.settle();
        w
    }

    fn connect(&mut self) {
        if self.nats.poll_connect(self.now).is_some() {
            self.nats.on_transport_open(self.now);
            self.nats.receive(INFO, self.now);
            self.nats.receive(b"PONG\r\n", self.now);
        }
    }

    fn input(&mut self, input: Input<'_>) {
        self.broker.handle(&mut self.nats, input, self.now);
    }

    /// Moves events between the machines until they are quiet (bounded rounds).
    fn settle(&mut self) {
        for _ in 0..32 {
            let mut busy = false;
            while let Some(event) = self.nats.poll_event() {
                busy = true;
                self.input(Input::Nats(event));
            }
            for s in 0..SESSIONS {
                let events: Vec<ConnEvent> = match self.ws[s].as_mut() {
                    Some(ws) => std::iter::from_fn(|| ws.poll_event()).collect(),
                    None => Vec::new(),
                };
                for e in events {
                    busy = true;
                    let session = s as u64;
                    match e {
                        ConnEvent::Opened { .. } => {
                            let peer: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
                            self.input(Input::SessionOpened { session, peer });
                        }
                        ConnEvent::Text(t) => self.input(Input::Frame {
                            session,
                            text: t.as_str(),
                        }),
                        ConnEvent::Closed { .. } => {
                            self.input(Input::SessionClosed { session });
                            self.ws[s] = None;
                        }
                        ConnEvent::Http { .. } => {}
                    }
                }
            }
            while let Some(out) = self.broker.poll_output() {
                busy = true;
                match out {
                    Output::Frame { session, text } => {
                        if self.sent.len() < 1024 {
                            let op = serde_json::from_str::<serde_json::Value>(&text)
                                .ok()
                                .and_then(|v| v["op"].as_str().map(str::to_string))
                                .unwrap_or_default();
                            self.sent.push(format!("{session}:{op}"));
                        }
                        if let Some(Some(ws)) = self.ws.get_mut(session as usize) {
                            let _ = ws.send_text(&text, self.now);
                        }
                    }
                    Output::Close {
                        session,
                        code,
                        reason,
                    } => {
                        if let Some(Some(ws)) = self.ws.get_mut(session as usize) {
                            ws.close(code, &reason, self.now);
                        }
                    }
                    Output::LoggedIn { session } => {
                        if let Some(Some(ws)) = self.ws.get_mut(session as usize) {
                            ws.admit();
                        }
                    }
                    Output::WhenDrained { session } => self.drain_waiters.push(session),
                }
            }
            self.drain_wire();
            // As the runtime does: the rest of a snapshot once the queue is written.
            for session in std::mem::take(&mut self.drain_waiters) {
                if let Some(Some(ws)) = self.ws.get(session as usize) {
                    if ws.queued_bytes() == 0 {
                        busy = true;
                        self.input(Input::Drained { session });
                    } else {
                        self.drain_waiters.push(session);
                    }
                }
            }
            if !busy {
                break;
            }
        }
        for ws in self.ws.iter_mut().flatten() {
            assert!(
                ws.queued_bytes() <= WS_OUT_BOUND,
                "a session's queue grew to {} bytes",
                ws.queued_bytes()
            );
            let n = ws.output().len();
            ws.consume_output(n);
        }
    }

    /// Takes what the core wrote to NATS and notes its requests and subscriptions.
    fn drain_wire(&mut self) {
        let out = self.nats.output();
        assert!(
            out.len() <= NATS_OUT_BOUND,
            "NATS output grew to {}",
            out.len()
        );
        self.wire.extend_from_slice(out);
        let n = out.len();
        self.nats.consume_output(n);
        let text = String::from_utf8_lossy(&self.wire).into_owned();
        for line in text.split("\r\n") {
            let mut parts = line.split(' ');
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("PUB" | "HPUB"), Some(_), Some(reply), Some(_)) if reply.starts_with('_') => {
                    self.replies.push(reply.to_string())
                }
                (Some("SUB"), Some(subject), Some(sid), None) => {
                    self.subs.push((subject.to_string(), sid.to_string()))
                }
                (Some("SUB"), Some(subject), Some(_queue), Some(sid)) => {
                    self.subs.push((subject.to_string(), sid.to_string()))
                }
                _ => {}
            }
        }
        // Keep the tail of a line cut in the middle.
        let keep = self.wire.len() - text.rfind("\r\n").map_or(0, |i| i + 2).min(self.wire.len());
        self.wire.drain(..self.wire.len() - keep);
        let extra = self.subs.len().saturating_sub(64);
        self.subs.drain(..extra);
        let extra = self.replies.len().saturating_sub(64);
        self.replies.drain(..extra);
        if self.wire.len() > 1 << 16 {
            self.wire.clear();
        }
    }

    /// A message from the server: on `sid`'s subject, or a reply subject.
    fn deliver(&mut self, subject: &str, sid: &str, payload: &[u8]) {
        let mut msg = format!("MSG {subject} {sid} {}\r\n", payload.len()).into_bytes();
        msg.extend_from_slice(payload);
        msg.extend_from_slice(b"\r\n");
        self.nats.receive(&msg, self.now);
    }

    fn reply_sid(&self, reply: &str) -> Option<String> {
        self.subs.iter().rev().find_map(|(subject, sid)| {
            let prefix = subject.strip_suffix('*').or(subject.strip_suffix('>'))?;
            reply.starts_with(prefix).then(|| sid.clone())
        })
    }

    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        loop {
            let next = [self.broker.poll_timeout(), self.nats.poll_timeout()]
                .into_iter()
                .flatten()
                .chain(self.ws.iter().flatten().filter_map(|w| w.next_deadline()))
                .min()
                .filter(|&t| t <= until);
            let Some(t) = next else { break };
            self.now = self.now.max(t);
            self.nats.handle_timeout(self.now);
            for ws in self.ws.iter_mut().flatten() {
                ws.handle_timeout(self.now);
            }
            self.input(Input::Timeout);
            self.connect();
            self.settle();
            if t < self.now {
                // A deadline already past that nothing took: step on, or loop forever.
                self.now += Duration::from_millis(1);
            }
        }
        self.now = until;
    }
}

pub fn check_broker(data: &[u8]) {
    run(data);
}

/// Runs a program; the ops of the frames sessions were sent, `<session>:<op>`.
pub fn run(data: &[u8]) -> Vec<String> {
    let mut w = World::new();
    let mut c = Cursor(data);
    let mut steps = 0;
    while let Some(op) = c.byte() {
        steps += 1;
        if steps > 400 {
            break;
        }
        match op % 9 {
            0 => {
                let s = usize::from(c.byte().unwrap_or(0)) % SESSIONS;
                if w.ws[s].is_none() {
                    let mut ws = Ws::new(w.now, WsConfig::default());
                    ws.handle_input(UPGRADE, w.now, &Host);
                    w.ws[s] = Some(ws);
                }
            }
            1 => {
                let s = usize::from(c.byte().unwrap_or(0)) % SESSIONS;
                let n = usize::from(c.byte().unwrap_or(0));
                let bytes = c.take(n);
                if let Some(ws) = w.ws[s].as_mut() {
                    ws.handle_input(bytes, w.now, &Host);
                }
            }
            2 => {
                let s = usize::from(c.byte().unwrap_or(0)) % SESSIONS;
                let k = usize::from(c.byte().unwrap_or(0)) % FRAMES.len();
                let n = usize::from(c.byte().unwrap_or(0) % 32);
                let text = splice(FRAMES[k], c.take(n));
                if let Some(ws) = w.ws[s].as_mut() {
                    ws.handle_input(&client_text(&text), w.now, &Host);
                }
            }
            3 => {
                let n = usize::from(c.byte().unwrap_or(0));
                let bytes = c.take(n);
                w.nats.receive(bytes, w.now);
            }
            4 => {
                let n = usize::from(c.byte().unwrap_or(0));
                let payload = c.take(n).to_vec();
                if let Some(reply) = w.replies.pop()
                    && let Some(sid) = w.reply_sid(&reply)
                {
                    w.deliver(&reply, &sid, &payload);
                }
            }
            5 => {
                let n = usize::from(c.byte().unwrap_or(0));
                let payload = c.take(n).to_vec();
                if let Some((subject, sid)) = w.subs.last().cloned() {
                    let subject = subject.replace('*', "x").replace('>', "x.y");
                    w.deliver(&subject, &sid, &payload);
                }
            }
            6 => {
                let t = u64::from(c.byte().unwrap_or(0));
                w.advance(Duration::from_millis(t * 37));
            }
            7 => {
                let s = usize::from(c.byte().unwrap_or(0)) % SESSIONS;
                if let Some(ws) = w.ws[s].as_mut() {
                    ws.handle_eof(w.now);
                }
            }
            _ => {
                w.nats
                    .on_transport_closed(w.now, "fuzz: connection dropped");
                w.settle();
                w.advance(Duration::from_secs(3));
                w.connect();
            }
        }
        w.settle();
    }
    // Every timer may fire, whatever state the program left.
    w.advance(Duration::from_secs(120));
    assert!(
        w.broker.session_count() <= SESSIONS,
        "sessions outlived their transports"
    );
    w.sent
}
