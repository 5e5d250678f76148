//! A scripted bench for the broker core: one or more `Broker`s on the in-process NATS/
//! JetStream model, one virtual clock, and sessions a test drives frame by frame. It is
//! what the simulator is without the randomness, so a unit test can say "subscribe, let
//! the lease run out, reconnect" and check each answer, in milliseconds of real time.
//!
//! ```no_run
//! use amp_broker::testing::harness::Harness;
//! use serde_json::json;
//! let mut h = Harness::development(1);
//! let alice = h.join(0, "alice", json!({}));
//! let bob = h.join(0, "bob", json!({}));
//! h.request(alice, json!({"op":"send","to":"dev/bob","body":{"n":1}}));
//! let m = h.wait_for(bob, |f| f["op"] == "message");
//! assert_eq!(m["body"]["n"], 1);
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use serde_json::{Value, json};

use crate::broker::binding::StreamSettings;
use crate::broker::clock::Clock;
use crate::broker::config::Config;
use crate::broker::{Broker, Input, Output, SessionId, setup};
use crate::keygen;
use crate::nats::{Connection, Options};
use crate::testing::nats_model::{ClientId, ModelOptions, Server};

/// Unix time in milliseconds at the start of every bench.
pub const WALL_MS: i64 = 1_800_000_000_000;
/// The token of every participant of [`Harness::development`].
pub const TOKEN: &str = "harness-token";
/// How long [`Harness::wait_for`] lets virtual time run before it gives up.
pub const PATIENCE: Duration = Duration::from_secs(120);

/// A session: which broker, and the broker's session id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Session {
    pub node: usize,
    pub id: SessionId,
}

struct Node {
    broker: Broker,
    conn: Connection,
    link: Option<ClientId>,
    /// Set ([`Harness::deafen`]): what the server sends it is lost on the way.
    deaf: bool,
    /// Set ([`Harness::mute`]): what it sends the server is lost on the way.
    mute: bool,
    /// Set ([`Harness::lose_write`]): its next write holding these bytes is lost.
    lose: Option<Vec<u8>>,
    /// Set ([`Harness::lose_read`]): the next read holding these bytes is lost.
    lose_in: Option<Vec<u8>>,
    /// Set ([`Harness::hold_writes`]): from the write holding these bytes on, what it
    /// sends the server waits in `held`.
    hold: Option<Vec<u8>>,
    /// What it sent since its write holding `hold`, in order ([`Harness::release_writes`]).
    held: Option<Vec<u8>>,
}

/// Whether `bytes` hold the needle a `lose` field waits for; the needle is spent then.
fn spends(needle: &mut Option<Vec<u8>>, bytes: &[u8]) -> bool {
    let found = needle
        .as_deref()
        .is_some_and(|n| bytes.windows(n.len()).any(|w| w == n));
    if found {
        *needle = None;
    }
    found
}

/// What a session has received and not yet been read by the test.
#[derive(Default)]
struct Mailbox {
    frames: VecDeque<Value>,
    closed: Option<(u16, String)>,
}

pub struct Harness {
    pub now: Instant,
    pub server: Server,
    config: Config,
    nodes: Vec<Node>,
    mailboxes: BTreeMap<Session, Mailbox>,
    next_session: SessionId,
    next_request: u64,
    seed: u64,
    /// Processes started per broker, so a restarted one gets a seed of its own.
    incarnations: Vec<u8>,
    /// Set: `Output::WhenDrained` waits for [`Harness::release_drains`] (a client that
    /// has not read yet); else the broker hears at once that the session's output is
    /// written.
    pub hold_drains: bool,
    held_drains: Vec<Session>,
    /// Set: the broker hears of a session it closed only at [`Harness::release_closes`]
    /// (the runtime tells it later in the same turn, after other NATS events).
    pub hold_closes: bool,
    held_closes: Vec<Session>,
    /// Set: every frame a session is sent is also logged here, in the order the brokers
    /// sent them, across sessions (mailboxes keep each session's order only).
    pub sent_log: Option<Vec<(Session, Value)>>,
    /// Set: the brokers' output stays in them, as while the runtime's memory budget is
    /// full, for a test to count what an input queued (`Footprint::queued_outputs`);
    /// taken by the first settle after it is cleared.
    pub hold_output: bool,
}

impl Harness {
    /// `brokers` brokers on the development configuration with token auth ([`TOKEN`]).
    pub fn development(brokers: usize) -> Harness {
        Harness::new(development_config(), brokers, 1)
    }

    /// `brokers` brokers sharing `config`, their streams created on a fresh model as
    /// start-up creates them; `seed` decides every id and nonce.
    pub fn new(config: Config, brokers: usize, seed: u64) -> Harness {
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_millis(WALL_MS as u64);
        let mut options = ModelOptions::new(wall);
        options.seed = seed;
        let mut server = Server::new(options, t0);
        provision(&mut server, &config, t0);
        let mut h = Harness {
            now: t0,
            server,
            config,
            nodes: Vec::new(),
            mailboxes: BTreeMap::new(),
            next_session: 0,
            next_request: 0,
            seed,
            incarnations: vec![0; brokers],
            hold_drains: false,
            held_drains: Vec::new(),
            hold_closes: false,
            held_closes: Vec::new(),
            sent_log: None,
            hold_output: false,
        };
        for _ in 0..brokers {
            let node = h.start_node(h.nodes.len());
            h.nodes.push(node);
        }
        h.settle();
        h
    }

    fn start_node(&self, index: usize) -> Node {
        let mut options = Options::new("nats://127.0.0.1:4222");
        options.rng_seed = Some(self.seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9));
        options.retry_on_failed_connect = true;
        options.reconnect_delay = Duration::from_millis(50);
        options.name = Some(format!("b{index}"));
        let mut conn = Connection::new(options, self.now);
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&self.seed.to_le_bytes());
        seed[8] = index as u8;
        seed[9] = self.incarnations[index];
        // The OS clock a new process reads: the model's, stepped or not.
        let clock = Clock::new(self.now, self.server.wall_clock_millis(self.now));
        let mut broker = Broker::new(self.config.clone(), format!("b{index}"), clock, seed)
            .unwrap_or_else(|e| panic!("harness: broker b{index} does not build: {e}"));
        broker
            .start(&mut conn, self.now)
            .unwrap_or_else(|e| panic!("harness: broker b{index} does not start: {e}"));
        Node {
            broker,
            conn,
            link: None,
            deaf: false,
            mute: false,
            lose: None,
            lose_in: None,
            hold: None,
            held: None,
        }
    }

    /// The broker behind `node`, to read its metrics or footprint.
    pub fn broker(&self, node: usize) -> &Broker {
        &self.nodes[node].broker
    }

    /// Opens a session on `node` (the challenge arrives in its mailbox).
    pub fn open(&mut self, node: usize) -> Session {
        self.next_session += 1;
        let s = Session {
            node,
            id: self.next_session,
        };
        self.mailboxes.insert(s, Mailbox::default());
        let peer = SocketAddr::from(([10, 0, 0, 1], 40_000 + (s.id % 20_000) as u16));
        let n = &mut self.nodes[node];
        n.broker.handle(
            &mut n.conn,
            Input::SessionOpened {
                session: s.id,
                peer,
            },
            self.now,
        );
        self.settle();
        s
    }

    /// A session of `dev/<name>` on `node`, through challenge and hello; `extra` is merged
    /// into the hello (e.g. `{"serve":[...]}`). Panics with the answer if it is not `ok`.
    pub fn join(&mut self, node: usize, name: &str, extra: Value) -> Session {
        let s = self.open(node);
        self.wait_for(s, |f| f["op"] == "challenge");
        let mut hello = json!({"op":"hello","ns":"dev","name":name,
            "auth":{"type":"token","token":TOKEN}});
        if let (Some(h), Some(e)) = (hello.as_object_mut(), extra.as_object()) {
            h.extend(e.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        let ok = self.request(s, hello);
        assert_eq!(ok["op"], "ok", "hello of {name} refused: {ok}");
        s
    }

    /// Sends a frame as it is.
    pub fn send(&mut self, s: Session, frame: Value) {
        self.send_together(&[(s, frame)]);
    }

    /// Sends frames of several sessions as one turn of the runtime reads them: each is
    /// handed to its broker before anything moves to or from NATS.
    pub fn send_together(&mut self, frames: &[(Session, Value)]) {
        for (s, frame) in frames {
            self.hand_over(*s, &frame.to_string());
        }
        self.settle();
    }

    /// Sends `text`, a frame whose `id` is `id`, exactly as written, and returns its
    /// answer: its numbers keep their spelling (`9E15`), which a `Value` writes its own
    /// way (`9000000000000000.0`).
    pub fn request_text(&mut self, s: Session, id: &str, text: &str) -> Value {
        self.hand_over(s, text);
        self.settle();
        self.wait_for(s, |f| f["re"] == id)
    }

    /// Hands frame `text` of `s` to its broker.
    fn hand_over(&mut self, s: Session, text: &str) {
        let n = &mut self.nodes[s.node];
        let input = Input::Frame {
            session: s.id,
            text,
        };
        n.broker.handle(&mut n.conn, input, self.now);
    }

    /// Sends `frame` with a fresh `id` and returns its answer (`ok` or `error`), letting
    /// virtual time run while it is awaited. Frames that arrive meanwhile stay queued.
    pub fn request(&mut self, s: Session, mut frame: Value) -> Value {
        self.next_request += 1;
        let id = format!("r{}", self.next_request);
        frame["id"] = json!(id);
        self.send(s, frame);
        self.wait_for(s, |f| f["re"] == id.as_str())
    }

    /// The first queued or arriving frame of `s` that `pred` accepts (taken out of the
    /// mailbox; the others stay), letting virtual time run up to [`PATIENCE`].
    pub fn wait_for(&mut self, s: Session, pred: impl Fn(&Value) -> bool) -> Value {
        let until = self.now + PATIENCE;
        loop {
            let mb = self.mailboxes.entry(s).or_default();
            if let Some(i) = mb.frames.iter().position(&pred)
                && let Some(f) = mb.frames.remove(i)
            {
                return f;
            }
            if let Some(c) = &mb.closed {
                panic!("session {s:?} closed ({c:?}) before the awaited frame came");
            }
            if self.now >= until {
                panic!(
                    "no awaited frame for {s:?} within {PATIENCE:?} of virtual time; queued: {:?}",
                    mb.frames
                );
            }
            self.step(until);
        }
    }

    /// Every frame queued for `s`, in arrival order.
    pub fn take(&mut self, s: Session) -> Vec<Value> {
        self.mailboxes
            .get_mut(&s)
            .map(|m| m.frames.drain(..).collect())
            .unwrap_or_default()
    }

    /// How the broker closed `s`, once it did.
    pub fn closed(&self, s: Session) -> Option<(u16, String)> {
        self.mailboxes.get(&s).and_then(|m| m.closed.clone())
    }

    /// The client side closes `s`.
    pub fn close(&mut self, s: Session) {
        if let Some(mb) = self.mailboxes.get_mut(&s) {
            mb.closed
                .get_or_insert((1000, "closed by the client".into()));
        }
        let n = &mut self.nodes[s.node];
        n.broker.handle(&mut n.conn, Input::closed(s.id), self.now);
        self.settle();
    }

    /// Tells the brokers that the sessions whose drains were held are written; how many.
    pub fn release_drains(&mut self) -> usize {
        let held = std::mem::take(&mut self.held_drains);
        for s in &held {
            let n = &mut self.nodes[s.node];
            n.broker
                .handle(&mut n.conn, Input::Drained { session: s.id }, self.now);
        }
        self.settle();
        held.len()
    }

    /// Tells the brokers that the sessions they closed meanwhile are gone.
    pub fn release_closes(&mut self) {
        for s in std::mem::take(&mut self.held_closes) {
            let n = &mut self.nodes[s.node];
            n.broker.handle(&mut n.conn, Input::closed(s.id), self.now);
        }
        self.settle();
    }

    /// Tells the broker that `s`'s output is written, if its drain was held; whether it was.
    pub fn release_drain(&mut self, s: Session) -> bool {
        let Some(i) = self.held_drains.iter().position(|&h| h == s) else {
            return false;
        };
        self.held_drains.swap_remove(i);
        let n = &mut self.nodes[s.node];
        n.broker
            .handle(&mut n.conn, Input::Drained { session: s.id }, self.now);
        self.settle();
        true
    }

    /// Lets `d` of virtual time pass, running every deadline on the way.
    pub fn advance(&mut self, d: Duration) {
        let until = self.now + d;
        while self.now < until {
            self.step(until);
        }
        self.settle();
    }

    /// The host's wall clock steps (NTP, an operator): the model's stream timestamps and
    /// the brokers' OS clock, which the runtime reads every turn, read `by` more (or less).
    pub fn step_wall_clock(&mut self, by: Duration, forward: bool) {
        self.server.set_wall_clock_offset(by, forward);
        let wall = self.server.wall_clock_millis(self.now);
        for n in &mut self.nodes {
            n.broker.observe_wall_clock(self.now, wall);
        }
    }

    /// A request on `subject` from a client of the test's own (an operator's tool, or a
    /// publisher the broker does not know): the JSON of its reply, `Null` when none came.
    /// `headers` go as an `HPUB` (a JetStream publish with `Nats-Msg-Id`, say).
    pub fn nats_request(&mut self, subject: &str, headers: &[(&str, &str)], body: &[u8]) -> Value {
        let now = self.now;
        let c = self.server.accept(now);
        let mut wire =
            b"CONNECT {\"headers\":true,\"verbose\":false}\r\nSUB _TEST.R 1\r\n".to_vec();
        if headers.is_empty() {
            wire.extend_from_slice(format!("PUB {subject} _TEST.R {}\r\n", body.len()).as_bytes());
        } else {
            let mut head = String::from("NATS/1.0\r\n");
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            let total = head.len() + body.len();
            wire.extend_from_slice(
                format!("HPUB {subject} _TEST.R {} {total}\r\n{head}", head.len()).as_bytes(),
            );
        }
        wire.extend_from_slice(body);
        wire.extend_from_slice(b"\r\n");
        self.server.receive(c, &wire, now);
        let out = String::from_utf8_lossy(&self.server.take_output(c)).into_owned();
        self.server.disconnect(c, now);
        self.settle();
        // `MSG _TEST.R 1 <n>\r\n<json>\r\n`: the reply is the line after the MSG line.
        out.split("\r\n")
            .skip_while(|l| !l.starts_with("MSG _TEST.R"))
            .nth(1)
            .and_then(|json| serde_json::from_str(json).ok())
            .unwrap_or(Value::Null)
    }

    /// SIGHUP with `config`: every broker re-reads it.
    pub fn reload(&mut self, config: Config) {
        self.reload_each(&vec![config.clone(); self.nodes.len()]);
        self.config = config;
    }

    /// SIGHUP at once on every broker, broker `i` re-reading `configs[i]`: a fleet whose
    /// files differ. A broker restarted later ([`Harness::crash`]) reads the file the
    /// bench started with, or the last [`Harness::reload`]'s.
    pub fn reload_each(&mut self, configs: &[Config]) {
        for (n, config) in self.nodes.iter_mut().zip(configs) {
            if let Err(e) = n.broker.reload(config.clone()) {
                panic!("harness: reload refused: {e}");
            }
            // The runtime's next turn: what the reload queued goes out.
            n.broker.handle(&mut n.conn, Input::Timeout, self.now);
        }
        self.settle();
    }

    /// From now on (`deaf`) or no more, whatever the server sends `node` is lost on the
    /// way, whole messages at a time (its deliveries counted as delivered all the same),
    /// while what the broker sends still arrives: a link that is going down.
    pub fn deafen(&mut self, node: usize, deaf: bool) {
        self.nodes[node].deaf = deaf;
    }

    /// From now on (`mute`) or no more, whatever `node` sends the server is lost on the
    /// way, whole writes at a time (acks among them).
    pub fn mute(&mut self, node: usize, mute: bool) {
        self.nodes[node].mute = mute;
    }

    /// The next write `node` sends the server that holds `needle` is lost on the way,
    /// whole (an ack lost, say, while what went before and comes after arrives).
    pub fn lose_write(&mut self, node: usize, needle: &[u8]) {
        self.nodes[node].lose = Some(needle.to_vec());
    }

    /// The next read `node` gets from the server that holds `needle` is lost on the
    /// way, whole (a PubAck lost after its message was stored, say).
    pub fn lose_read(&mut self, node: usize, needle: &[u8]) {
        self.nodes[node].lose_in = Some(needle.to_vec());
    }

    /// From `node`'s next write that holds `needle` on, what it sends the server is
    /// held back, in order, until [`Harness::release_writes`]: a publish late on the
    /// way, overtaken by another broker's.
    pub fn hold_writes(&mut self, node: usize, needle: &[u8]) {
        self.nodes[node].hold = Some(needle.to_vec());
    }

    /// What [`Harness::hold_writes`] held back of `node`'s writes reaches the server.
    pub fn release_writes(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        n.hold = None;
        if let (Some(bytes), Some(c)) = (n.held.take(), n.link) {
            self.server.receive(c, &bytes, self.now);
        }
        self.settle();
    }

    /// `node`'s NATS connection drops (its broker reconnects); it hears and is heard
    /// again.
    pub fn cut(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        n.deaf = false;
        n.mute = false;
        // What the link held back goes down with it.
        n.hold = None;
        n.held = None;
        if let Some(c) = n.link.take() {
            self.server.disconnect(c, self.now);
            n.conn.on_transport_closed(self.now, "link cut");
        }
        self.settle();
    }

    /// A broker process dies and one with the same id and configuration starts: its
    /// sessions are closed from the client's side (1006), its NATS transport drops.
    pub fn crash(&mut self, node: usize) {
        if let Some(c) = self.nodes[node].link.take() {
            self.server.disconnect(c, self.now);
        }
        for (s, mb) in self.mailboxes.iter_mut() {
            if s.node == node {
                mb.closed
                    .get_or_insert((1006, "the broker process ended".into()));
            }
        }
        // A new process reads new OS bytes for its seed.
        self.incarnations[node] = self.incarnations[node].wrapping_add(1);
        self.nodes[node] = self.start_node(node);
        self.settle();
    }

    /// A broker's NATS transport drops (the server sees it go); its connection dials
    /// again and goes through its reconnect.
    pub fn drop_nats(&mut self, node: usize) {
        if let Some(c) = self.nodes[node].link.take() {
            self.server.disconnect(c, self.now);
        }
        self.nodes[node]
            .conn
            .on_transport_closed(self.now, "dropped by the test");
        self.advance(Duration::from_secs(1));
    }

    /// A NATS event, as if the broker's connection had read it.
    pub fn nats_event(&mut self, node: usize, event: crate::nats::Event) {
        let n = &mut self.nodes[node];
        n.broker.handle(&mut n.conn, Input::Nats(event), self.now);
        self.settle();
    }

    /// Runs what is due at the next deadline, at most `until`.
    fn step(&mut self, until: Instant) {
        let next = self.next_deadline().map_or(until, |t| t.min(until));
        self.now = self.now.max(next);
        let now = self.now;
        if self.server.poll_timeout().is_some_and(|t| t <= now) {
            self.server.handle_timeout(now);
        }
        for n in &mut self.nodes {
            if n.conn.poll_timeout().is_some_and(|t| t <= now) {
                n.conn.handle_timeout(now);
            }
            if n.broker.poll_timeout().is_some_and(|t| t <= now) {
                n.broker.handle(&mut n.conn, Input::Timeout, now);
            }
        }
        self.settle();
    }

    fn next_deadline(&self) -> Option<Instant> {
        let nodes = self
            .nodes
            .iter()
            .flat_map(|n| [n.broker.poll_timeout(), n.conn.poll_timeout()]);
        std::iter::once(self.server.poll_timeout())
            .chain(nodes)
            .flatten()
            .min()
    }

    /// Moves bytes, events and outputs until all is quiet.
    fn settle(&mut self) {
        let now = self.now;
        let hold = self.hold_output;
        for _ in 0..256 {
            let mut busy = false;
            for node in 0..self.nodes.len() {
                let n = &mut self.nodes[node];
                if n.conn.poll_close()
                    && let Some(c) = n.link.take()
                {
                    self.server.disconnect(c, now);
                    busy = true;
                }
                if n.link.is_none() && n.conn.poll_connect(now).is_some() {
                    n.link = Some(self.server.accept(now));
                    n.conn.on_transport_open(now);
                    busy = true;
                }
                if let Some(c) = n.link {
                    let bytes = n.conn.output().to_vec();
                    if !bytes.is_empty() {
                        n.conn.consume_output(bytes.len());
                        if n.held.is_some() || spends(&mut n.hold, &bytes) {
                            n.held.get_or_insert_default().extend_from_slice(&bytes);
                        } else if !spends(&mut n.lose, &bytes) && !n.mute {
                            self.server.receive(c, &bytes, now);
                        }
                        busy = true;
                    }
                    let out = self.server.take_output(c);
                    if !out.is_empty() && !n.deaf && !spends(&mut n.lose_in, &out) {
                        n.conn.receive(&out, now);
                        busy = true;
                    }
                    if self.server.is_closed(c) {
                        n.conn.on_transport_closed(now, "closed by the server");
                        self.server.disconnect(c, now);
                        n.link = None;
                        busy = true;
                    }
                }
                while let Some(event) = n.conn.poll_event() {
                    busy = true;
                    n.broker.handle(&mut n.conn, Input::Nats(event), now);
                }
                let outputs: Vec<Output> = match hold {
                    true => Vec::new(),
                    false => std::iter::from_fn(|| n.broker.poll_output()).collect(),
                };
                busy |= !outputs.is_empty();
                for out in outputs {
                    self.route(node, out);
                }
            }
            if !busy {
                return;
            }
        }
    }

    fn route(&mut self, node: usize, out: Output) {
        match out {
            Output::Frame { session, text } => {
                let frame: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
                    panic!("broker sent a frame that is not JSON ({e}): {text}")
                });
                let s = Session { node, id: session };
                let mailbox = self.mailboxes.get_mut(&s).filter(|mb| mb.closed.is_none());
                let sent = mailbox.is_some();
                if let Some(mb) = mailbox {
                    if let Some(log) = &mut self.sent_log {
                        log.push((s, frame.clone()));
                    }
                    mb.frames.push_back(frame);
                }
                self.nodes[node].broker.frame_done(text, sent);
            }
            Output::Close {
                session,
                code,
                reason,
            } => {
                let s = Session { node, id: session };
                if let Some(mb) = self.mailboxes.get_mut(&s) {
                    mb.closed.get_or_insert((code, reason.to_string()));
                }
                if self.hold_closes {
                    return self.held_closes.push(s);
                }
                let n = &mut self.nodes[node];
                n.broker
                    .handle(&mut n.conn, Input::closed(session), self.now);
            }
            // Mailboxes bound nothing.
            Output::LoggedIn { .. } => {}
            // Mailboxes take every frame at once: what was queued is written by now.
            Output::WhenDrained { session } if !self.hold_drains => {
                let n = &mut self.nodes[node];
                n.broker
                    .handle(&mut n.conn, Input::Drained { session }, self.now);
            }
            Output::WhenDrained { session } => {
                self.held_drains.push(Session { node, id: session });
            }
        }
    }
}

/// The development configuration (namespace `dev`, anyone with [`TOKEN`]), for a test to
/// add jobs or policies to.
pub fn development_config() -> Config {
    Config::development(keygen::token_sha256(TOKEN))
}

/// Creates the binding's streams for `config` on the model, as start-up does.
pub fn provision(server: &mut Server, config: &Config, now: Instant) {
    let c = server.accept(now);
    let mut wire = b"CONNECT {\"headers\":true,\"verbose\":false}\r\nSUB _SETUP.> 1\r\n".to_vec();
    let streams = setup::desired_streams(config, None, StreamSettings::default());
    for (i, s) in streams.iter().enumerate() {
        let name = s.name.as_str();
        let body = serde_json::to_string(s).unwrap_or_default();
        wire.extend_from_slice(
            format!(
                "PUB $JS.API.STREAM.CREATE.{name} _SETUP.{i} {}\r\n{body}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    server.receive(c, &wire, now);
    let out = String::from_utf8_lossy(&server.take_output(c)).into_owned();
    assert!(
        !out.contains("\"error\"") && out.matches("MSG _SETUP.").count() == streams.len(),
        "harness: stream set-up failed: {out}"
    );
    server.disconnect(c, now);
}
