//! The world: one model nats-server, 1-3 broker cores each with its own sans-IO NATS
//! connection, the simulated clients, and one virtual clock. Bytes move between the
//! connections and the model in memory; faults act on that path.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use super::SimConfig;
use super::clients::Client;
use super::invariants::Checker;
use super::rng::SimRng;
use crate::broker::clock::Clock;
use crate::broker::config::{Config, Job, Participant, Policy};
use crate::broker::{Broker, Input, Output, SessionId};
use crate::keygen;
use crate::nats::{Connection, Options};
use crate::testing::nats_model::{ClientId, ModelOptions, Server};

/// Unix time in milliseconds at the start of every run.
pub const WALL_MS: i64 = 1_800_000_000_000;
/// Every simulated participant's token.
pub const TOKEN: &str = "sim-token";
pub const NS: &str = "dev";
pub const JOB: &str = "render";
/// The job's lease (its consumer's AckWait) and offer time.
pub const LEASE_S: u64 = 3;
pub const OFFER_MS: u64 = 1000;
pub const INBOX_ACK_WAIT_S: u64 = 5;
pub const INBOX_WINDOW: u32 = 8;
/// Participants with a task budget, shared by every broker, and its size: small, so that
/// it runs out in most runs. Its window (31 days) outlasts any run.
pub const BUDGETED: [&str; 2] = ["p0", "p1"];
pub const TASK_BUDGET: u64 = 2;

/// The configuration every broker of a run shares; `budgets` gives [`BUDGETED`] their
/// task budget.
pub fn sim_config(budgets: bool) -> Config {
    let mut config = Config::development(keygen::token_sha256(TOKEN));
    if let Some(ns) = config.namespaces.get_mut(NS) {
        ns.jobs.insert(
            JOB.to_string(),
            Job {
                lease_s: LEASE_S,
                offer_ms: OFFER_MS,
                max_attempts: 3,
                ..Job::default()
            },
        );
        ns.inbox.ack_wait_s = INBOX_ACK_WAIT_S;
        ns.inbox.inbox_window = INBOX_WINDOW;
        if let Some(open) = ns.open.as_deref().cloned().filter(|_| budgets) {
            let budgeted = Participant {
                policy: Some(Policy {
                    msgs_per_s: None,
                    burst: None,
                    bytes_per_s: None,
                    tasks_per_window: Some(TASK_BUDGET),
                    window_s: Some(31 * 86_400),
                }),
                ..open
            };
            for name in BUDGETED {
                ns.participants
                    .insert(name.to_string(), budgeted.clone().into());
            }
        }
    }
    config
}

/// One broker core with its NATS connection and its link to the model.
pub struct Node {
    pub id: String,
    pub broker: Broker,
    pub conn: Connection,
    /// The model's id of the current transport, while one is open.
    pub link: Option<ClientId>,
    /// Server bytes held back by a delay fault, with when they arrive (in order).
    pub held: VecDeque<(Instant, Vec<u8>)>,
    /// While set, server bytes are held back this long.
    pub delay: Option<(Instant, Duration)>,
    /// Server output chunks still to lose.
    pub drop_chunks: u32,
    /// Virtual ms until which bytes held back by a delay fault may still arrive.
    pub delayed_until_ms: u64,
    /// Open sessions: session -> client index.
    pub sessions: BTreeMap<SessionId, usize>,
    pub next_session: SessionId,
    pub incarnation: u32,
}

impl Node {
    fn new(
        id: &str,
        incarnation: u32,
        cfg: &SimConfig,
        rng: &mut SimRng,
        clock: Clock,
        now: Instant,
    ) -> Node {
        let mut options = Options::new("nats://127.0.0.1:4222");
        options.rng_seed = Some(rng.next_u64());
        options.retry_on_failed_connect = true;
        options.reconnect_delay = Duration::from_millis(50);
        options.reconnect_delay_max = Duration::from_secs(1);
        options.name = Some(format!("{id}.{incarnation}"));
        let mut conn = Connection::new(options, now);
        // The frame schema is compiled once per process (FrameValidator::new).
        let mut config = sim_config(cfg.generation >= 2);
        if cfg.generation >= 3 {
            // `watch` snapshots of a dozen participants in bursts of two or three.
            config.limits.max_outbound_bytes = 1200;
        }
        let mut broker = Broker::new(config, id.to_string(), clock, rng.bytes32())
            .unwrap_or_else(|e| panic!("harness: broker {id} does not build: {e}"));
        broker
            .start(&mut conn, now)
            .unwrap_or_else(|e| panic!("harness: broker {id} does not start: {e}"));
        Node {
            id: id.to_string(),
            broker,
            conn,
            link: None,
            held: VecDeque::new(),
            delay: None,
            drop_chunks: 0,
            delayed_until_ms: 0,
            sessions: BTreeMap::new(),
            // Sessions of later incarnations get fresh numbers, as a new process's would
            // start again from 1: keep them apart for the checker's sake.
            next_session: u64::from(incarnation) * 1_000_000,
            incarnation,
        }
    }
}

/// A frame a client will send once its reaction delay has passed.
pub struct Queued {
    pub at: Instant,
    pub client: usize,
    /// The session the frame belongs to; dropped if that session is gone by then.
    pub session: (usize, SessionId),
    pub frame: Value,
}

pub struct World {
    pub cfg: SimConfig,
    pub rng: SimRng,
    pub t0: Instant,
    pub now: Instant,
    pub server: Server,
    pub nodes: Vec<Node>,
    pub clients: Vec<Client>,
    pub queued: Vec<Queued>,
    /// Sessions their clients left for a new one while the transport still holds them
    /// open, with when the transport notices.
    pub zombies: Vec<(Instant, (usize, SessionId))>,
    pub checker: Checker,
    /// Faults may happen (off during the drain at the end).
    pub faults_on: bool,
    /// The fault-free end of a run: clients come online, ack, serve and finish work.
    pub draining: bool,
    /// The very end: clients leave and stay away.
    pub leaving: bool,
    /// A running hash of what happened, for the determinism check.
    pub trace: u64,
    pub step: u64,
    pub stats: Stats,
    /// Virtual ms of the last loss of bytes from the server to a broker (lost chunk,
    /// transport drop with bytes in flight, crash, server restart).
    pub last_loss_ms: Option<u64>,
}

/// Counters of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub frames_in: u64,
    pub frames_out: u64,
    pub faults: u64,
    pub crashes: u64,
    pub nats_drops: u64,
    pub sessions: u64,
}

impl World {
    pub fn new(cfg: SimConfig) -> World {
        let mut rng = SimRng::new(cfg.seed);
        let t0 = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_millis(WALL_MS as u64);
        let mut options = ModelOptions::new(wall);
        options.seed = rng.next_u64();
        let mut server = Server::new(options, t0);
        crate::testing::harness::provision(&mut server, &sim_config(true), t0);
        let brokers = cfg.brokers.unwrap_or_else(|| rng.range(1, 3) as usize);
        let clients = cfg.clients.unwrap_or_else(|| rng.range(2, 12) as usize);
        let clock = Clock::new(t0, WALL_MS);
        let nodes = (0..brokers)
            .map(|i| Node::new(&format!("b{i}"), 0, &cfg, &mut rng, clock, t0))
            .collect();
        let clients = (0..clients).map(|i| Client::new(i, &mut rng, t0)).collect();
        World {
            cfg,
            rng,
            t0,
            now: t0,
            server,
            nodes,
            clients,
            queued: Vec::new(),
            zombies: Vec::new(),
            checker: Checker::default(),
            faults_on: cfg.faults,
            draining: false,
            leaving: false,
            trace: 0xcbf2_9ce4_8422_2325,
            step: 0,
            stats: Stats::default(),
            last_loss_ms: None,
        }
    }

    /// Virtual milliseconds since the start.
    pub fn elapsed_ms(&self) -> u64 {
        self.now.duration_since(self.t0).as_millis() as u64
    }

    /// The wall clock every broker reads, in Unix milliseconds.
    pub fn wall_ms(&self) -> i64 {
        WALL_MS + self.elapsed_ms() as i64
    }

    pub fn mix(&mut self, text: &str) {
        if self.cfg.trace {
            eprintln!("{:>8} {text}", self.elapsed_ms());
        }
        for b in text.bytes() {
            self.trace ^= u64::from(b);
            self.trace = self.trace.wrapping_mul(0x100_0000_01b3);
        }
    }

    /// The earliest instant anything wants to run.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut at: Option<Instant> = None;
        let mut take = |t: Option<Instant>| {
            if let Some(t) = t {
                at = Some(at.map_or(t, |a| a.min(t)));
            }
        };
        take(self.server.poll_timeout());
        for n in &self.nodes {
            take(n.broker.poll_timeout());
            take(n.conn.poll_timeout());
            take(n.held.front().map(|h| h.0));
        }
        for c in &self.clients {
            take(Some(c.next_at));
        }
        for q in &self.queued {
            take(Some(q.at));
        }
        for z in &self.zombies {
            take(Some(z.0));
        }
        at
    }

    /// Runs every timer that is due at `now`.
    pub fn fire_timers(&mut self) {
        let now = self.now;
        let (due, lingering): (Vec<_>, Vec<_>) = self.zombies.drain(..).partition(|z| z.0 <= now);
        self.zombies = lingering;
        for (_, session) in due {
            self.mix(&format!("zombie b{}/{} closed", session.0, session.1));
            self.close_session(session);
            self.checker.session_closed(session);
        }
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
    }

    /// Moves bytes, events and outputs until everything is quiet; session outputs go to
    /// the clients.
    pub fn settle(&mut self) {
        for _ in 0..64 {
            let mut outputs = Vec::new();
            let mut busy = false;
            for i in 0..self.nodes.len() {
                busy |= self.pump_node(i, &mut outputs);
            }
            if !outputs.is_empty() {
                busy = true;
                for (node, out) in outputs {
                    self.route_output(node, out);
                }
            }
            if !busy {
                return;
            }
        }
    }

    fn pump_node(&mut self, i: usize, outputs: &mut Vec<(usize, Output)>) -> bool {
        let now = self.now;
        let server = &mut self.server;
        let n = &mut self.nodes[i];
        let mut busy = false;
        let mut lost = false;
        if n.conn.poll_close()
            && let Some(c) = n.link.take()
        {
            lost = true;
            server.disconnect(c, now);
            n.held.clear();
            busy = true;
        }
        if n.link.is_none() && n.conn.poll_connect(now).is_some() {
            n.link = Some(server.accept(now));
            n.conn.on_transport_open(now);
            busy = true;
        }
        if let Some(c) = n.link {
            let bytes = n.conn.output().to_vec();
            if !bytes.is_empty() {
                n.conn.consume_output(bytes.len());
                server.receive(c, &bytes, now);
                busy = true;
            }
            let out = server.take_output(c);
            if !out.is_empty() {
                busy = true;
                if n.drop_chunks > 0 {
                    n.drop_chunks -= 1;
                    lost = true;
                } else if let Some((until, by)) = n.delay.filter(|d| now < d.0) {
                    let _ = until;
                    n.held.push_back((now + by, out));
                } else if n.held.is_empty() {
                    n.conn.receive(&out, now);
                } else {
                    // Behind held bytes: order is kept.
                    n.held.push_back((now, out));
                }
            }
            while n.held.front().is_some_and(|h| h.0 <= now) {
                if let Some((_, bytes)) = n.held.pop_front() {
                    n.conn.receive(&bytes, now);
                    busy = true;
                }
            }
            if server.is_closed(c) {
                lost = true;
                n.conn.on_transport_closed(now, "closed by the server");
                server.disconnect(c, now);
                n.link = None;
                n.held.clear();
                busy = true;
            }
        }
        while let Some(event) = n.conn.poll_event() {
            busy = true;
            n.broker.handle(&mut n.conn, Input::Nats(event), now);
        }
        while let Some(out) = n.broker.poll_output() {
            outputs.push((i, out));
        }
        if lost {
            self.last_loss_ms = Some(self.elapsed_ms());
        }
        busy
    }

    fn route_output(&mut self, node: usize, out: Output) {
        match out {
            Output::Frame { session, text } => {
                self.stats.frames_out += 1;
                if self.cfg.trace {
                    let who = self.nodes[node].sessions.get(&session).copied();
                    self.mix(&format!("<- b{node}/{session} c{who:?} {text}"));
                } else {
                    self.mix(&text);
                }
                let Some(&client) = self.nodes[node].sessions.get(&session) else {
                    return;
                };
                match serde_json::from_str::<Value>(&text) {
                    Ok(frame) => self.client_frame(client, (node, session), frame),
                    Err(e) => self.checker.violation(format!(
                        "broker sent a frame that is not JSON ({e}): {text}"
                    )),
                }
            }
            Output::Close {
                session,
                code,
                reason,
            } => {
                self.mix(&format!("close b{node}/{session} {code} {reason}"));
                self.zombies.retain(|z| z.1 != (node, session));
                if let Some(client) = self.nodes[node].sessions.remove(&session) {
                    self.client_closed(client, (node, session), Some((code, reason)));
                }
                let n = &mut self.nodes[node];
                n.broker
                    .handle(&mut n.conn, Input::closed(session), self.now);
            }
            // The simulated transport bounds nothing.
            Output::LoggedIn { .. } => {}
            // Clients read at once: what was queued is written by now.
            Output::WhenDrained { session } => {
                self.mix(&format!("drained b{node}/{session}"));
                if self.nodes[node].sessions.contains_key(&session) {
                    let n = &mut self.nodes[node];
                    n.broker
                        .handle(&mut n.conn, Input::Drained { session }, self.now);
                }
            }
        }
    }

    /// Opens a session on `node` for `client`.
    pub fn open_session(&mut self, node: usize, client: usize) -> SessionId {
        let n = &mut self.nodes[node];
        n.next_session += 1;
        let session = n.next_session;
        n.sessions.insert(session, client);
        let peer = SocketAddr::from((
            [10, 0, (client / 250) as u8, (client % 250) as u8 + 1],
            40_000,
        ));
        n.broker.handle(
            &mut n.conn,
            Input::SessionOpened { session, peer },
            self.now,
        );
        self.stats.sessions += 1;
        session
    }

    /// A client frame to its session's broker.
    pub fn deliver_frame(&mut self, (node, session): (usize, SessionId), text: &str) {
        self.stats.frames_in += 1;
        if self.cfg.trace {
            self.mix(&format!("-> b{node}/{session} {text}"));
        } else {
            self.mix(text);
        }
        let n = &mut self.nodes[node];
        if !n.sessions.contains_key(&session) {
            return;
        }
        n.broker
            .handle(&mut n.conn, Input::Frame { session, text }, self.now);
    }

    /// The client side ends a session (bye done, vanished): the transport reports it.
    pub fn close_session(&mut self, (node, session): (usize, SessionId)) {
        self.mix(&format!("client closes b{node}/{session}"));
        let n = &mut self.nodes[node];
        if n.sessions.remove(&session).is_some() {
            n.broker
                .handle(&mut n.conn, Input::closed(session), self.now);
        }
    }

    /// A broker process dies and a new one with the same id and configuration starts:
    /// its sessions are gone, its NATS transport closes.
    pub fn crash(&mut self, node: usize) {
        self.stats.crashes += 1;
        self.last_loss_ms = Some(self.elapsed_ms());
        let now = self.now;
        let old = &mut self.nodes[node];
        if let Some(c) = old.link.take() {
            self.server.disconnect(c, now);
        }
        let sessions: Vec<(SessionId, usize)> =
            old.sessions.iter().map(|(&s, &c)| (s, c)).collect();
        let (id, incarnation) = (old.id.clone(), old.incarnation + 1);
        self.zombies.retain(|z| z.1.0 != node);
        let clock = Clock::new(self.t0, WALL_MS);
        self.nodes[node] = Node::new(&id, incarnation, &self.cfg, &mut self.rng, clock, now);
        for (session, client) in sessions {
            self.client_closed(client, (node, session), None);
        }
    }

    /// The broker's NATS transport drops; the connection reconnects by itself.
    pub fn drop_nats(&mut self, node: usize) {
        self.stats.nats_drops += 1;
        self.last_loss_ms = Some(self.elapsed_ms());
        let now = self.now;
        let n = &mut self.nodes[node];
        if let Some(c) = n.link.take() {
            self.server.disconnect(c, now);
            n.held.clear();
            n.conn.on_transport_closed(now, "simulated network drop");
        }
    }

    /// The model nats-server restarts (file store: streams and consumers stay).
    pub fn restart_server(&mut self) {
        self.last_loss_ms = Some(self.elapsed_ms());
        let now = self.now;
        self.server.restart(now);
        for n in &mut self.nodes {
            if n.link.take().is_some() {
                n.held.clear();
                n.conn.on_transport_closed(now, "nats-server restarted");
            }
        }
    }

    /// Faults stop; held bytes are let through at once.
    pub fn heal(&mut self) {
        self.faults_on = false;
        for n in &mut self.nodes {
            n.delay = None;
            n.drop_chunks = 0;
            for h in &mut n.held {
                h.0 = self.now;
            }
        }
    }

    /// Runs one step: advance the clock to the next deadline (at most `cap` ahead), fire
    /// what is due, let the clients act, settle, check.
    pub fn step(&mut self, cap: Duration) {
        self.step += 1;
        if self.faults_on {
            self.maybe_fault();
        }
        let limit = self.now + cap;
        let next = self.next_deadline().map_or(limit, |t| t.min(limit));
        if next > self.now {
            self.now = next;
        }
        self.fire_timers();
        self.settle();
        self.clients_due();
        self.settle();
        self.check_step();
    }

    fn check_step(&mut self) {
        let now_ms = self.elapsed_ms();
        for (i, n) in self.nodes.iter().enumerate() {
            let f = n.broker.footprint();
            let open = n.sessions.len();
            if f.sessions != open {
                self.checker.violation(format!(
                    "broker {i} holds {} sessions, the transport has {open} open",
                    f.sessions
                ));
            }
            if f.max_session_inflight > INBOX_WINDOW as usize {
                self.checker.violation(format!(
                    "broker {i}: a session has {} unacknowledged inbox deliveries (window {INBOX_WINDOW})",
                    f.max_session_inflight
                ));
            }
            if f.max_session_outstanding > super::clients::MAX_OUTSTANDING {
                self.checker.violation(format!(
                    "broker {i}: a session has {} outstanding requests, its client sent at most {}",
                    f.max_session_outstanding,
                    super::clients::MAX_OUTSTANDING
                ));
            }
            if f.in_flight > 4096 || n.conn.pending_requests() > 4096 || f.timers > 65_536 {
                self.checker
                    .violation(format!("broker {i} grows without bound: {f:?}"));
            }
        }
        for c in &self.clients {
            if let Some((id, sent)) = c.oldest_outstanding()
                && now_ms.saturating_sub(sent) > super::clients::ANSWER_WITHIN_MS
            {
                self.checker.violation(format!(
                    "client {} request {id} unanswered for {} ms",
                    c.name,
                    now_ms - sent
                ));
            }
        }
    }
}
