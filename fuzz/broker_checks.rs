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
//   9          a JetStream server (the in-process model, streams provisioned) takes the
//              NATS connection over from the fuzzer-played one: the core reconnects to
//              it, and from then on what the core writes reaches the model and what the
//              model answers reaches the core (consumers made, pulls answered, messages
//              stored and delivered); once it is there, 9 restarts it
//  10 k p ..   a JetStream delivery on a pull the core wrote (k picks one; a `MSG.NEXT`'s
//              reply subject and sid), its `$JS.ACK.<stream>.<consumer>....` reply built
//              from the pull, its headers and payload those of a message the core
//              published (p picks one) or, with none yet, p's bytes
//  11 k s ..   a status on a pull (100 Idle Heartbeat, 404, 408, 409 variants, 503, ...)
//  12 k n ..   a delivery on a pull whose ack subject is not the pull's (another stream
//              or consumer, or fuzzer text), n payload bytes
//  13 k n ..   a message on the subscription k picks (not only the newest), n payload
//              bytes, with or without a `$JS.ACK` reply
//  14 k e ..   an answer to the request k picks: a JetStream API error, a 503 no
//              responders or an empty body
//  15 t        time passes: t s (ack waits, leases, heartbeats)
//
// Ops 0-8 mean what they meant before 9-15 were added (their op bytes are below 9 in
// every seed), so older inputs replay as they were.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use amp_broker::broker::clock::Clock;
use amp_broker::broker::config::Config;
use amp_broker::broker::{Broker, Input, Output};
use amp_broker::keygen::token_sha256;
use amp_broker::nats::{Connection as Nats, Options};
use amp_broker::proto::{Op, Parsed, Parser, Role};
use amp_broker::testing::harness::provision;
use amp_broker::testing::nats_model::{ClientId, ModelOptions, Server};
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

pub struct Cursor<'a>(pub &'a [u8]);

impl<'a> Cursor<'a> {
    pub fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    pub fn take(&mut self, n: usize) -> &'a [u8] {
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

pub fn splice(frame: &str, text: &[u8]) -> Vec<u8> {
    let s = String::from_utf8_lossy(text);
    let escaped = serde_json::to_string(&s).unwrap_or_default();
    let inner = escaped
        .get(1..escaped.len().saturating_sub(1))
        .unwrap_or("");
    frame.replace("{}", inner).into_bytes()
}

pub struct World {
    pub now: Instant,
    /// What the broker and the model run on.
    config: Config,
    pub broker: Broker,
    pub nats: Nats,
    ws: Vec<Option<Ws>>,
    /// Reply subjects of the requests the core made, newest last.
    pub replies: Vec<String>,
    /// (subject, sid) of the core's subscriptions, newest last.
    pub subs: Vec<(String, String)>,
    /// Bytes the core wrote to NATS, not yet scanned for requests and subscriptions.
    wire: Vec<u8>,
    /// The ops of the frames the core sent, `<session>:<op>` (for tests of the harness).
    sent: Vec<String>,
    /// Sessions whose snapshot waits for their queue to be written.
    drain_waiters: Vec<u64>,
    /// The parser of what the core wrote (it must always be valid client protocol).
    parser: Parser,
    /// (stream, consumer, reply subject) of the pulls the core wrote, newest last.
    pulls: Vec<(String, String, String)>,
    /// (header block, payload) of messages the core published to `amp.` subjects.
    published: Vec<(Option<Vec<u8>>, Vec<u8>)>,
    /// The JetStream model, once op 9 brought it, and the core's link to it.
    model: Option<Model>,
    /// The answers to MIG callers (`_INBOX_<tenant>_...` subjects) the core wrote, the
    /// newest 64; each, and every stream frame and live event on `mig.` subjects, was
    /// checked to be JSON within the server's `max_payload`.
    pub mig_answers: Vec<serde_json::Value>,
}

struct Model {
    server: Server,
    link: Option<ClientId>,
}

/// The model's wall clock: the core's.
const WALL_START_S: u64 = 1_800_000_000;

const STATUSES: &[&str] = &[
    "NATS/1.0 100 Idle Heartbeat\r\nNats-Last-Consumer: 0\r\nNats-Last-Stream: 0\r\n\r\n",
    "NATS/1.0 404 No Messages\r\n\r\n",
    "NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 1\r\nNats-Pending-Bytes: 0\r\n\r\n",
    "NATS/1.0 409 Exceeded MaxWaiting\r\n\r\n",
    "NATS/1.0 409 Batch Completed\r\nNats-Pending-Messages: 0\r\nNats-Pending-Bytes: 0\r\n\r\n",
    "NATS/1.0 409 Message Size Exceeds MaxBytes\r\nNats-Pending-Messages: 3\r\nNats-Pending-Bytes: 99999\r\n\r\n",
    "NATS/1.0 409 Consumer Deleted\r\n\r\n",
    "NATS/1.0 409 Leadership Change\r\n\r\n",
    "NATS/1.0 503\r\n\r\n",
    "NATS/1.0 400 Bad Request\r\n\r\n",
    "NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 18446744073709551615\r\nNats-Pending-Bytes: x\r\n\r\n",
    "NATS/1.0 100 FlowControl Request\r\n\r\n",
];

/// Answers to a request: JetStream API errors nats-server gives, and nothing.
const API_ERRORS: &[&str] = &[
    r#"{"type":"io.nats.jetstream.api.v1.consumer_create_response","error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#,
    r#"{"error":{"code":404,"err_code":10059,"description":"stream not found"}}"#,
    r#"{"error":{"code":404,"err_code":10014,"description":"consumer not found"}}"#,
    r#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 7"}}"#,
    r#"{"error":{"code":500,"err_code":10077,"description":"insufficient resources"}}"#,
    r#"{"stream":"AMP_INBOX_acme","seq":18446744073709551615,"duplicate":true}"#,
    "",
];

impl World {
    fn new() -> World {
        World::with_config(config())
    }

    pub fn with_config(config: Config) -> World {
        let now = Instant::now();
        let broker = Broker::new(
            config.clone(),
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
            config,
            broker,
            nats: Nats::new(options, now),
            ws: (0..SESSIONS).map(|_| None).collect(),
            replies: Vec::new(),
            subs: Vec::new(),
            wire: Vec::new(),
            sent: Vec::new(),
            drain_waiters: Vec::new(),
            parser: {
                let mut p = Parser::new(Role::Server);
                p.max_payload = 64 << 20;
                p.max_control_line = 1 << 20;
                p
            },
            pulls: Vec::new(),
            published: Vec::new(),
            model: None,
            mig_answers: Vec::new(),
        };
        w.connect();
        let _ = w.broker.start(&mut w.nats, now);
        w.settle();
        w
    }

    fn connect(&mut self) {
        if let Some(m) = self.model.as_mut() {
            if self.nats.poll_close()
                && let Some(c) = m.link.take()
            {
                m.server.disconnect(c, self.now);
            }
            if m.link.is_none() && self.nats.poll_connect(self.now).is_some() {
                m.link = Some(m.server.accept(self.now));
                self.nats.on_transport_open(self.now);
            }
            return;
        }
        if self.nats.poll_connect(self.now).is_some() {
            self.nats.on_transport_open(self.now);
            self.nats.receive(INFO, self.now);
            self.nats.receive(b"PONG\r\n", self.now);
        }
    }

    /// Op 9: the model takes over (the core reconnects to it), or restarts.
    pub fn model_takes_over(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.server.restart(self.now);
            return;
        }
        let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(WALL_START_S);
        let mut options = ModelOptions::new(wall);
        options.max_pending_output = 8 << 20;
        let mut server = Server::new(options, self.now);
        provision(&mut server, &self.config, self.now);
        self.model = Some(Model { server, link: None });
        self.nats
            .on_transport_closed(self.now, "fuzz: a JetStream server takes over");
    }

    /// Moves bytes between the core's connection and the model; true when any moved.
    fn pump_model(&mut self) -> bool {
        if self.model.is_none() {
            return false;
        }
        self.connect();
        let Some(m) = self.model.as_mut() else {
            return false;
        };
        let Some(c) = m.link else {
            return false;
        };
        if m.server.is_closed(c) {
            m.server.disconnect(c, self.now);
            m.link = None;
            self.nats
                .on_transport_closed(self.now, "closed by the server");
            return true;
        }
        let out = m.server.take_output(c);
        if out.is_empty() {
            return false;
        }
        self.nats.receive(&out, self.now);
        true
    }

    fn input(&mut self, input: Input<'_>) {
        self.broker.handle(&mut self.nats, input, self.now);
    }

    /// Moves events between the machines until they are quiet (bounded rounds).
    pub fn settle(&mut self) {
        for _ in 0..32 {
            let mut busy = self.pump_model();
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
                            self.input(Input::closed(session));
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
            busy |= self.drain_wire();
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

    /// Takes what the core wrote to NATS (to the model, when there is one) and notes its
    /// requests, subscriptions, pulls and published messages; true when it wrote any.
    fn drain_wire(&mut self) -> bool {
        let out = self.nats.output();
        assert!(
            out.len() <= NATS_OUT_BOUND,
            "NATS output grew to {}",
            out.len()
        );
        if out.is_empty() {
            return false;
        }
        if let Some(m) = self.model.as_mut()
            && let Some(c) = m.link
        {
            m.server.receive(c, out, self.now);
        }
        self.wire.extend_from_slice(out);
        let n = out.len();
        self.nats.consume_output(n);
        let mut wire = std::mem::take(&mut self.wire);
        let mut start = 0;
        loop {
            let rest = wire.get(start..).unwrap_or_default();
            let (op, used) = match self.parser.parse(rest) {
                Ok(Parsed::Complete(op, used)) => (op, used),
                Ok(Parsed::Partial { .. }) => break,
                Err(e) => panic!(
                    "the core wrote what is not client protocol ({e:?}): {:?}",
                    String::from_utf8_lossy(&rest[..rest.len().min(200)])
                ),
            };
            start += used;
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            match op {
                Op::Pub {
                    subject,
                    reply,
                    payload,
                } => self.note_publish(subject, reply, None, payload),
                Op::Hpub {
                    subject,
                    reply,
                    headers,
                    payload,
                } => self.note_publish(subject, reply, Some(headers), payload),
                Op::Sub { subject, sid, .. } => self.subs.push((text(subject), text(sid))),
                _ => {}
            }
        }
        wire.drain(..start);
        self.wire = wire;
        let extra = self.subs.len().saturating_sub(64);
        self.subs.drain(..extra);
        let extra = self.replies.len().saturating_sub(64);
        self.replies.drain(..extra);
        let extra = self.pulls.len().saturating_sub(32);
        self.pulls.drain(..extra);
        let extra = self.published.len().saturating_sub(16);
        self.published.drain(..extra);
        true
    }

    fn note_publish(
        &mut self,
        subject: &[u8],
        reply: Option<&[u8]>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        // MIG answers, stream frames and live events.
        if subject.starts_with(b"_INBOX_") || subject.starts_with(b"mig.") {
            self.check_mig_answer(subject, headers, payload);
        }
        let Some(reply) = reply.map(text) else {
            if subject.starts_with(b"amp.") {
                self.published
                    .push((headers.map(<[u8]>::to_vec), payload.to_vec()));
            }
            return;
        };
        if let Some(rest) = subject.strip_prefix(b"$JS.API.CONSUMER.MSG.NEXT.")
            && let Some((stream, consumer)) = text(rest).split_once('.')
        {
            self.pulls
                .push((stream.to_string(), consumer.to_string(), reply.clone()));
        }
        if subject.starts_with(b"amp.") && payload.len() < 4096 {
            self.published
                .push((headers.map(<[u8]>::to_vec), payload.to_vec()));
        }
        if reply.starts_with('_') {
            self.replies.push(reply);
        }
    }

    /// What the core publishes for MIG callers and subscribers must be JSON (an envelope,
    /// whatever the request was) that the server takes: within its `max_payload`, headers
    /// included.
    fn check_mig_answer(&mut self, subject: &[u8], headers: Option<&[u8]>, payload: &[u8]) {
        let size = headers.map_or(0, <[u8]>::len) + payload.len();
        assert!(
            size <= self.nats.max_payload(),
            "a MIG answer of {size} bytes on {} (max_payload {})",
            String::from_utf8_lossy(subject),
            self.nats.max_payload()
        );
        let value = serde_json::from_slice::<serde_json::Value>(payload).unwrap_or_else(|e| {
            panic!(
                "a MIG answer that is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&payload[..payload.len().min(200)])
            )
        });
        if subject.starts_with(b"_INBOX_") {
            self.mig_answers.push(value);
        }
        let extra = self.mig_answers.len().saturating_sub(64);
        self.mig_answers.drain(..extra);
    }

    /// A message from the server: on `sid`'s subject, or a reply subject.
    fn deliver(&mut self, subject: &str, sid: &str, payload: &[u8]) {
        self.deliver_full(subject, sid, None, None, payload);
    }

    pub fn deliver_full(
        &mut self,
        subject: &str,
        sid: &str,
        reply: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        let reply = reply.map_or(String::new(), |r| format!(" {r}"));
        let mut msg = match headers {
            None => format!("MSG {subject} {sid}{reply} {}\r\n", payload.len()).into_bytes(),
            Some(h) => format!(
                "HMSG {subject} {sid}{reply} {} {}\r\n",
                h.len(),
                h.len() + payload.len()
            )
            .into_bytes(),
        };
        msg.extend_from_slice(headers.unwrap_or_default());
        msg.extend_from_slice(payload);
        msg.extend_from_slice(b"\r\n");
        self.nats.receive(&msg, self.now);
    }

    pub fn reply_sid(&self, reply: &str) -> Option<String> {
        self.subs.iter().rev().find_map(|(subject, sid)| {
            let matches = match subject.strip_suffix('*').or(subject.strip_suffix('>')) {
                Some(prefix) => reply.starts_with(prefix),
                None => subject == reply,
            };
            matches.then(|| sid.clone())
        })
    }

    /// The pull `k` picks: (stream, consumer, reply subject, sid).
    fn pull(&self, k: u8) -> Option<(String, String, String, String)> {
        let (stream, consumer, reply) = self.pulls.get(usize::from(k) % self.pulls.len().max(1))?;
        let sid = self.reply_sid(reply)?;
        Some((stream.clone(), consumer.clone(), reply.clone(), sid))
    }

    /// Op 10: a delivery on a pull, as JetStream makes it.
    fn pull_delivery(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte().unwrap_or(0);
        let p = c.byte().unwrap_or(0);
        let seq = u64::from(c.byte().unwrap_or(1));
        let delivered = 1 + u64::from(c.byte().unwrap_or(0) % 4);
        let Some((stream, consumer, reply, sid)) = self.pull(k) else {
            return;
        };
        let (headers, payload) = match self.published.len() {
            0 => (None, c.take(usize::from(p % 64)).to_vec()),
            n => self.published[usize::from(p) % n].clone(),
        };
        let ack = format!(
            "$JS.ACK.{stream}.{consumer}.{delivered}.{seq}.{seq}.{}.{}",
            (WALL_START_S + seq) * 1_000_000_000,
            p % 8
        );
        self.deliver_full(&reply, &sid, Some(&ack), headers.as_deref(), &payload);
    }

    /// Op 11: a status on a pull.
    fn pull_status(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte().unwrap_or(0);
        let s = usize::from(c.byte().unwrap_or(0)) % STATUSES.len();
        let Some((_, _, reply, sid)) = self.pull(k) else {
            return;
        };
        self.deliver_full(&reply, &sid, None, Some(STATUSES[s].as_bytes()), b"");
    }

    /// Op 12: a delivery on a pull with an ack subject that is not the pull's.
    fn foreign_delivery(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte().unwrap_or(0);
        let n = usize::from(c.byte().unwrap_or(0) % 64);
        let payload = c.take(n).to_vec();
        let Some((stream, consumer, reply, sid)) = self.pull(k) else {
            return;
        };
        let ack = match k % 4 {
            0 => format!("$JS.ACK.OTHER.{consumer}.1.1.1.1.0"),
            1 => format!("$JS.ACK.{stream}.other.1.1.1.1.0"),
            2 => format!("$JS.ACK.{stream}.{consumer}.1.1"),
            _ => format!(
                "$JS.ACK.{stream}.{consumer}.x.{}.1.1.0",
                String::from_utf8_lossy(&payload)
                    .chars()
                    .filter(char::is_ascii_alphanumeric)
                    .collect::<String>()
            ),
        };
        self.deliver_full(&reply, &sid, Some(&ack), None, &payload);
    }

    /// Op 13: a message on the subscription `k` picks.
    fn message_on(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte().unwrap_or(0);
        let n = usize::from(c.byte().unwrap_or(0));
        let payload = c.take(n).to_vec();
        let Some((subject, sid)) = self
            .subs
            .get(usize::from(k) % self.subs.len().max(1))
            .cloned()
        else {
            return;
        };
        let subject = subject.replace('*', "x").replace('>', "x.y");
        let reply = (k & 1 != 0).then(|| format!("$JS.ACK.S.C.1.{k}.{k}.1.0"));
        self.deliver_full(&subject, &sid, reply.as_deref(), None, &payload);
    }

    /// Op 14: an API error (or no responders, or nothing) to the request `k` picks.
    pub fn request_error(&mut self, c: &mut Cursor<'_>) {
        let k = c.byte().unwrap_or(0);
        let e = usize::from(c.byte().unwrap_or(0));
        if self.replies.is_empty() {
            return;
        }
        let reply = self.replies[usize::from(k) % self.replies.len()].clone();
        let Some(sid) = self.reply_sid(&reply) else {
            return;
        };
        if e % (API_ERRORS.len() + 1) == API_ERRORS.len() {
            self.deliver_full(&reply, &sid, None, Some(b"NATS/1.0 503\r\n\r\n"), b"");
        } else {
            let body = API_ERRORS[e % (API_ERRORS.len() + 1)];
            self.deliver(&reply, &sid, body.as_bytes());
        }
    }

    pub fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        loop {
            let model = self.model.as_ref().and_then(|m| m.server.poll_timeout());
            let next = [self.broker.poll_timeout(), self.nats.poll_timeout(), model]
                .into_iter()
                .flatten()
                .chain(self.ws.iter().flatten().filter_map(|w| w.next_deadline()))
                .min()
                .filter(|&t| t <= until);
            let Some(t) = next else { break };
            self.now = self.now.max(t);
            self.nats.handle_timeout(self.now);
            if let Some(m) = self.model.as_mut() {
                m.server.handle_timeout(self.now);
            }
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
        match op % 16 {
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
            8 => {
                if let Some(m) = w.model.as_mut()
                    && let Some(c) = m.link.take()
                {
                    m.server.disconnect(c, w.now);
                }
                w.nats
                    .on_transport_closed(w.now, "fuzz: connection dropped");
                w.settle();
                w.advance(Duration::from_secs(3));
                w.connect();
            }
            9 => w.model_takes_over(),
            10 => w.pull_delivery(&mut c),
            11 => w.pull_status(&mut c),
            12 => w.foreign_delivery(&mut c),
            13 => w.message_on(&mut c),
            14 => w.request_error(&mut c),
            _ => {
                let t = u64::from(c.byte().unwrap_or(0));
                w.advance(Duration::from_secs(t));
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
