//! Simulated AMP clients: each a participant `dev/p<i>` that connects to a broker,
//! answers the challenge with its token, then sends, acks (or not), subscribes, publishes,
//! serves, claims, heartbeats, completes, fails, cancels, reads slowly, vanishes and comes
//! back, all decided by its own seeded random stream.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::rng::SimRng;
use super::world::{JOB, LEASE_S, NS, TOKEN, World};
use crate::broker::SessionId;
use crate::rfc3339;

/// Requests a client has unanswered at once (it waits before sending more).
pub const MAX_OUTSTANDING: usize = 8;
/// Every request is answered within this (JetStream timeouts are 4 s; held submits and
/// reconnects add some).
pub const ANSWER_WITHIN_MS: u64 = 30_000;
/// Topics the clients publish on.
const TOPICS: [&str; 3] = ["t.a", "t.b", "t.c"];
/// Durable subscriptions by name, each always with the same pattern.
pub const DURABLES: [(&str, &str); 2] = [("d0", "t.a"), ("d1", "t.*")];
const PLAIN: [(&str, &str); 2] = [("s0", "t.b"), ("s1", "t.>")];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Offline,
    AwaitChallenge,
    AwaitHello,
    Active,
}

#[derive(Debug, Clone)]
pub enum Req {
    Hello,
    Send { to: String },
    Publish,
    Subscribe(SubView),
    Unsubscribe { sub: String },
    Serve,
    Submit { task: String },
    Claim { task: String },
    Decline,
    Heartbeat { task: String },
    Complete { task: String },
    Fail { task: String },
    Cancel { task: String },
    Status,
    Ping,
    AckSync,
    Bye,
    Watch,
}

#[derive(Debug, Clone)]
pub struct SubView {
    pub sub: String,
    pub pattern: String,
    pub durable: bool,
    pub from_all: bool,
    /// The last event seq this session got on it.
    pub last: Option<u64>,
}

pub struct Client {
    pub idx: usize,
    pub name: String,
    pub phase: Phase,
    pub session: Option<(usize, SessionId)>,
    pub next_at: Instant,
    /// Reads slowly: its reactions take seconds.
    pub slow: bool,
    pub rng: SimRng,
    next_req: u64,
    next_task: u64,
    pub outstanding: BTreeMap<String, (Req, u64)>,
    pub subs: BTreeMap<String, SubView>,
    pub serving: bool,
    pub submitted: Vec<String>,
    /// Submits (by task id) and cancels (`cancel:<task>`) not yet answered (unanswered
    /// when the session ended, or answered `unavailable`): a client retries them with the
    /// same task id, as the spec asks.
    pub unsettled: BTreeMap<String, Value>,
    /// Leases this session holds: task -> (attempt, lease_until ms).
    pub leases: BTreeMap<String, i64>,
    /// Since its `watch` was answered: the participants this session was told are up.
    pub watching: Option<BTreeSet<String>>,
    /// Told up before a repeated `watch`: the new snapshot may tell them up once more,
    /// and their changes keep coming before it does (a `down` it would never tell).
    pub retold: BTreeSet<String>,
}

impl Client {
    pub fn new(idx: usize, rng: &mut SimRng, t0: Instant) -> Client {
        let mut rng = rng.fork();
        let next_at = t0 + Duration::from_millis(rng.range(0, 500));
        Client {
            idx,
            name: format!("p{idx}"),
            phase: Phase::Offline,
            session: None,
            next_at,
            slow: false,
            rng,
            next_req: 0,
            next_task: 0,
            outstanding: BTreeMap::new(),
            subs: BTreeMap::new(),
            serving: false,
            submitted: Vec::new(),
            unsettled: BTreeMap::new(),
            leases: BTreeMap::new(),
            watching: None,
            retold: BTreeSet::new(),
        }
    }

    pub fn participant(&self) -> String {
        format!("{NS}/{}", self.name)
    }

    pub fn oldest_outstanding(&self) -> Option<(&str, u64)> {
        self.outstanding
            .iter()
            .map(|(id, (_, sent))| (id.as_str(), *sent))
            .min_by_key(|x| x.1)
    }

    fn id(&mut self, prefix: &str) -> String {
        self.next_req += 1;
        format!("{prefix}{}", self.next_req)
    }

    fn reaction(&mut self, draining: bool) -> Duration {
        if self.slow && !draining {
            Duration::from_millis(self.rng.range(500, 6000))
        } else {
            Duration::from_millis(self.rng.range(1, 40))
        }
    }
}

impl World {
    /// Sends the due queued frames and lets clients whose time has come act.
    pub fn clients_due(&mut self) {
        let now = self.now;
        let mut due: Vec<super::world::Queued> = Vec::new();
        let mut i = 0;
        while i < self.queued.len() {
            if self.queued[i].at <= now {
                due.push(self.queued.remove(i));
            } else {
                i += 1;
            }
        }
        due.sort_by_key(|q| q.at);
        for q in due {
            if self.clients[q.client].session == Some(q.session) {
                self.send_now(q.client, q.frame);
            }
        }
        for c in 0..self.clients.len() {
            if self.clients[c].next_at <= now {
                self.client_act(c);
            }
        }
    }

    /// Queues a frame the client sends after its reaction delay.
    fn react(&mut self, client: usize, frame: Value, extra: Duration) {
        let draining = self.draining;
        let c = &mut self.clients[client];
        let Some(session) = c.session else { return };
        let at = self.now + c.reaction(draining) + extra;
        self.queued.push(super::world::Queued {
            at,
            client,
            session,
            frame,
        });
    }

    /// Sends `frame` on the client's session now, noting what the checker must know.
    fn send_now(&mut self, client: usize, frame: Value) {
        let Some(session) = self.clients[client].session else {
            return;
        };
        let who = self.clients[client].participant();
        if frame["op"] == "ack"
            && let (Some(seq), Some(sub)) = (frame["seq"].as_u64(), frame["sub"].as_str())
        {
            self.checker.durable_acked(&who, sub, seq);
        }
        // A worker that sends its outcome gives the lease up then: answered `unavailable`,
        // the write may have landed and the task moved on to someone else.
        if (frame["op"] == "complete" || frame["op"] == "fail")
            && let Some(task) = frame["task"].as_str()
        {
            self.checker.lease_ended(task, session);
        }
        let text = frame.to_string();
        self.deliver_frame(session, &text);
    }

    /// Sends a request with a fresh id, remembering what it was.
    fn request(&mut self, client: usize, prefix: &str, mut frame: Value, req: Req) {
        let now_ms = self.elapsed_ms();
        let c = &mut self.clients[client];
        if c.session.is_none() || c.outstanding.len() >= MAX_OUTSTANDING {
            return;
        }
        let id = c.id(prefix);
        frame["id"] = json!(id);
        c.outstanding.insert(id, (req, now_ms));
        self.send_now(client, frame);
    }

    fn client_act(&mut self, client: usize) {
        let now = self.now;
        let draining = self.draining;
        let phase = self.clients[client].phase;
        let wait = {
            let c = &mut self.clients[client];
            Duration::from_millis(if draining {
                c.rng.range(1000, 3000)
            } else {
                c.rng.range(50, 1500)
            })
        };
        self.clients[client].next_at = now + wait;
        match phase {
            Phase::Offline => {
                if self.leaving {
                    self.clients[client].next_at = now + Duration::from_secs(3600);
                    return;
                }
                let node = self.clients[client].rng.index(self.nodes.len());
                self.clients[client].phase = Phase::AwaitChallenge;
                let session = self.open_session(node, client);
                if self.nodes[node].sessions.contains_key(&session) {
                    self.clients[client].session = Some((node, session));
                }
            }
            Phase::AwaitChallenge | Phase::AwaitHello => {}
            Phase::Active if self.leaving => {
                let c = &self.clients[client];
                if let Some(s) = c.session {
                    self.close_session(s);
                    self.client_closed(client, s, None);
                    self.clients[client].next_at = now + Duration::from_secs(3600);
                }
            }
            Phase::Active if draining => {
                self.resubmit(client);
                if !self.clients[client].serving {
                    self.clients[client].serving = true;
                    let f = json!({"op":"serve","job":JOB,"slots":2});
                    self.request(client, "v", f, Req::Serve);
                }
            }
            Phase::Active => self.random_action(client),
        }
    }

    /// Sends the first unsettled submit again, with its task id.
    fn resubmit(&mut self, client: usize) -> bool {
        let c = &self.clients[client];
        let Some((task, frame)) = c.unsettled.iter().next() else {
            return false;
        };
        if c.outstanding
            .values()
            .any(|(r, _)| matches!(r, Req::Submit { task: t } if t == task))
        {
            return false;
        }
        let (key, frame) = (task.clone(), frame.clone());
        match key.strip_prefix("cancel:") {
            Some(task) => {
                let task = task.to_string();
                self.request(client, "c", frame, Req::Cancel { task });
            }
            None => self.request(client, "t", frame, Req::Submit { task: key }),
        }
        true
    }

    fn random_action(&mut self, client: usize) {
        if self.clients[client].rng.chance(300) && self.resubmit(client) {
            return;
        }
        let n = self.clients.len() as u64;
        let roll = self.clients[client].rng.below(100);
        let c = &mut self.clients[client];
        match roll {
            0..20 => {
                let to = format!("p{}", c.rng.below(n));
                let k = c.rng.below(1000);
                let f = json!({"op":"send","to":to,"body":{"k":k}});
                self.request(client, "s", f, Req::Send { to });
            }
            20..35 => {
                let topic = TOPICS[c.rng.index(TOPICS.len())];
                let f = json!({"op":"publish","topic":topic,"body":{"k":c.rng.below(1000)}});
                self.request(client, "p", f, Req::Publish);
            }
            35..45 => {
                let durable = c.rng.chance(500);
                let (sub, pattern) = if durable {
                    DURABLES[c.rng.index(DURABLES.len())]
                } else {
                    PLAIN[c.rng.index(PLAIN.len())]
                };
                if c.subs.contains_key(sub)
                    || c.outstanding
                        .values()
                        .any(|(r, _)| matches!(r, Req::Subscribe(v) if v.sub == sub))
                {
                    return;
                }
                // Durables always start from the beginning, so where a resumed one must
                // start is known exactly.
                let from_all = durable || c.rng.chance(500);
                let mut f = json!({"op":"subscribe","topic":pattern,"sub":sub,
                    "from": if from_all { "all" } else { "new" }});
                if durable {
                    f["durable"] = json!(true);
                }
                let view = SubView {
                    sub: sub.to_string(),
                    pattern: pattern.to_string(),
                    durable,
                    from_all,
                    last: None,
                };
                self.request(client, "u", f, Req::Subscribe(view));
            }
            45..48 => {
                let Some(sub) = c.subs.keys().next().cloned() else {
                    return;
                };
                // A durable's end is tested by disconnects; unsubscribe is for plain ones.
                if c.subs.get(&sub).is_some_and(|v| v.durable) {
                    return;
                }
                c.subs.remove(&sub);
                let f = json!({"op":"unsubscribe","sub":sub});
                self.request(client, "x", f, Req::Unsubscribe { sub });
            }
            48..54 => {
                let slots = c.rng.range(0, 2);
                c.serving = slots > 0;
                let f = json!({"op":"serve","job":JOB,"slots":slots});
                self.request(client, "v", f, Req::Serve);
            }
            54..68 => {
                c.next_task += 1;
                let task = format!("{}-t{}", c.name, c.next_task);
                let attempts = c.rng.range(1, 3);
                let f = json!({"op":"submit","job":JOB,"task":task,"max_attempts":attempts,
                    "body":{"n":c.next_task}});
                c.unsettled.insert(task.clone(), f.clone());
                self.request(client, "t", f, Req::Submit { task });
            }
            68..72 => {
                if c.submitted.is_empty() {
                    return;
                }
                let task = c.submitted[c.rng.index(c.submitted.len())].clone();
                let f = json!({"op":"cancel","task":task});
                c.unsettled.insert(format!("cancel:{task}"), f.clone());
                self.request(client, "c", f, Req::Cancel { task });
            }
            72..76 => {
                if c.submitted.is_empty() {
                    return;
                }
                let task = c.submitted[c.rng.index(c.submitted.len())].clone();
                let f = json!({"op":"status","task":task});
                self.request(client, "q", f, Req::Status);
            }
            76..80 => self.request(client, "g", json!({"op":"ping"}), Req::Ping),
            80..82 => self.request(client, "b", json!({"op":"bye"}), Req::Bye),
            82..84 => {
                // Vanishes mid-operation: the transport reports the close.
                if let Some(s) = c.session {
                    self.close_session(s);
                    self.client_closed(client, s, None);
                }
            }
            84..86 => c.slow = !c.slow,
            // Reconnects while the old socket is half open: the transport notices the old
            // session's end only later, and meanwhile the broker still sends it offers
            // and messages nobody reads.
            86..88 if self.cfg.generation >= 2 => {
                if let Some(s) = c.session {
                    let lingers = Duration::from_millis(c.rng.range(500, 20_000));
                    self.zombies.push((self.now + lingers, s));
                    self.client_closed(client, s, None);
                }
            }
            // Generation 3: presence, told in bursts (the world's outbound bound is small).
            88..90 if self.cfg.generation >= 3 => {
                self.request(client, "w", json!({"op":"watch"}), Req::Watch);
            }
            _ => {}
        }
    }

    /// A `presence` frame: each participant is told up once, and changed or gone only
    /// after it was told up.
    fn presence(&mut self, client: usize, frame: &Value) {
        let c = &mut self.clients[client];
        let Some(seen) = c.watching.as_mut() else {
            return self.checker.violation(format!(
                "client {}: presence before its watch was answered: {frame}",
                c.name
            ));
        };
        let name = frame["name"].as_str().unwrap_or_default().to_string();
        let fine = match frame["state"].as_str() {
            Some("up") => seen.insert(name.clone()) || c.retold.remove(&name),
            Some("update") => seen.contains(&name),
            Some("down") => {
                c.retold.remove(&name);
                seen.remove(&name)
            }
            _ => false,
        };
        if !fine {
            let who = c.name.clone();
            self.checker.violation(format!(
                "client {who}: presence out of turn (told up twice, or changed or down before up): {frame}"
            ));
        }
    }

    /// A frame from the broker to one of the client's sessions.
    pub fn client_frame(&mut self, client: usize, session: (usize, SessionId), frame: Value) {
        if self.clients[client].session != Some(session) {
            return;
        }
        let op = frame["op"].as_str().unwrap_or_default().to_string();
        let draining = self.draining;
        match op.as_str() {
            "challenge" => {
                let c = &mut self.clients[client];
                c.phase = Phase::AwaitHello;
                let mut hello = json!({"op":"hello","ns":NS,"name":c.name,
                    "auth":{"type":"token","token":TOKEN}});
                if c.rng.chance(300) {
                    hello["serve"] = json!([{"job":JOB,"slots":1}]);
                    c.serving = true;
                }
                let now_ms = self.elapsed_ms();
                let c = &mut self.clients[client];
                let id = c.id("h");
                hello["id"] = json!(id);
                c.outstanding.insert(id, (Req::Hello, now_ms));
                // Even a slow reader answers its challenge within the hello timeout.
                let at = self.now + Duration::from_millis(c.rng.range(1, 40));
                self.queued.push(super::world::Queued {
                    at,
                    client,
                    session,
                    frame: hello,
                });
            }
            "ok" | "error" => self.answer(client, session, &frame),
            "presence" => self.presence(client, &frame),
            "message" => {
                let who = self.clients[client].participant();
                self.checker.message(&who, &frame);
                let Some(seq) = frame["seq"].as_u64() else {
                    return;
                };
                let roll = self.clients[client].rng.below(100);
                if draining || roll < 80 {
                    self.react(client, json!({"op":"ack","seq":seq}), Duration::ZERO);
                } else if roll < 90 {
                    let now_ms = self.elapsed_ms();
                    let c = &mut self.clients[client];
                    if c.outstanding.len() < MAX_OUTSTANDING {
                        let id = c.id("a");
                        c.outstanding.insert(id.clone(), (Req::AckSync, now_ms));
                        self.react(
                            client,
                            json!({"op":"ack","id":id,"seq":seq}),
                            Duration::ZERO,
                        );
                    }
                } else if roll < 95 {
                    self.react(
                        client,
                        json!({"op":"nak","seq":seq,"delay_ms":200}),
                        Duration::ZERO,
                    );
                }
            }
            "event" => {
                let who = self.clients[client].participant();
                let sub = frame["sub"].as_str().unwrap_or_default().to_string();
                let Some(seq) = frame["seq"].as_u64() else {
                    return self
                        .checker
                        .violation(format!("event without seq: {frame}"));
                };
                let Some(view) = self.clients[client].subs.get(&sub).cloned() else {
                    // Events of a subscription that is being set up or was just ended.
                    return;
                };
                let stream = self.server.stream_messages("AMP_TOPICS_dev");
                let now_ms = self.elapsed_ms();
                // Or another broker still has a pull of the durable (README "Resume
                // order", its limits): an event it got is held up on its link, or an old
                // session of this client there, not yet seen to end, still reads it; what
                // it holds comes back when it arrives or that session ends.
                let elsewhere = view.durable
                    && (self
                        .nodes
                        .iter()
                        .enumerate()
                        .any(|(i, n)| i != session.0 && now_ms <= n.delayed_until_ms)
                        || self.zombies.iter().any(|&(_, (node, id))| {
                            node != session.0 && self.nodes[node].sessions.get(&id) == Some(&client)
                        }));
                let loss = elsewhere
                    || self.last_loss_ms.is_some_and(|at| {
                        now_ms.saturating_sub(at) <= super::invariants::DURABLE_REDELIVERY_MS
                    });
                self.checker.event(&who, session, &view, seq, &stream, loss);
                if let Some(v) = self.clients[client].subs.get_mut(&sub) {
                    v.last = Some(seq);
                }
                if view.durable && (draining || self.clients[client].rng.chance(900)) {
                    self.react(
                        client,
                        json!({"op":"ack","sub":sub,"seq":seq}),
                        Duration::ZERO,
                    );
                }
            }
            "offer" => {
                let task = frame["task"].as_str().unwrap_or_default().to_string();
                let (attempt, max) = (frame["attempt"].as_u64(), frame["max_attempts"].as_u64());
                if let (Some(a), Some(m)) = (attempt, max)
                    && a > m
                {
                    self.checker
                        .violation(format!("offer of {task} for attempt {a} of {m}: {frame}"));
                }
                let roll = self.clients[client].rng.below(100);
                if draining || roll < 75 {
                    let f = json!({"op":"claim","task":task});
                    self.queue_request(client, "k", f, Req::Claim { task });
                } else if roll < 90 {
                    let f = json!({"op":"decline","task":task});
                    self.queue_request(client, "d", f, Req::Decline);
                }
            }
            "revoked" => {
                let task = frame["task"].as_str().unwrap_or_default().to_string();
                self.clients[client].leases.remove(&task);
                self.checker.lease_ended(&task, session);
            }
            _ => {}
        }
    }

    /// A request sent after the reaction delay; its id is reserved now.
    fn queue_request(&mut self, client: usize, prefix: &str, mut frame: Value, req: Req) {
        self.queue_request_after(client, prefix, &mut frame, req, Duration::ZERO);
    }

    fn queue_request_after(
        &mut self,
        client: usize,
        prefix: &str,
        frame: &mut Value,
        req: Req,
        extra: Duration,
    ) {
        let now_ms = self.elapsed_ms();
        let c = &mut self.clients[client];
        if c.outstanding.len() >= MAX_OUTSTANDING {
            return;
        }
        let id = c.id(prefix);
        frame["id"] = json!(id);
        // Counted from when it is sent: the reaction delay is the client's, not the broker's.
        let delay = c.reaction(self.draining) + extra;
        c.outstanding
            .insert(id, (req, now_ms + delay.as_millis() as u64));
        let Some(session) = c.session else { return };
        self.queued.push(super::world::Queued {
            at: self.now + delay,
            client,
            session,
            frame: frame.take(),
        });
    }

    fn answer(&mut self, client: usize, session: (usize, SessionId), frame: &Value) {
        let Some(re) = frame["re"].as_str() else {
            return self
                .checker
                .violation(format!("an answer without `re`: {frame}"));
        };
        let name = self.clients[client].name.clone();
        let Some((req, _)) = self.clients[client].outstanding.remove(re) else {
            return self.checker.violation(format!(
                "client {name}: answer to request {re}, which is not outstanding (answered twice?): {frame}"
            ));
        };
        let ok = frame["op"] == "ok";
        let code = frame["code"].as_str().unwrap_or_default();
        if !ok && matches!(code, "internal" | "bad_frame" | "schema") {
            self.checker.violation(format!(
                "client {name}: request {re} ({req:?}) answered {code}: {frame}"
            ));
        }
        let wall = self.wall_ms();
        let draining = self.draining;
        match req {
            Req::Hello if ok => self.clients[client].phase = Phase::Active,
            Req::Hello => self
                .checker
                .violation(format!("client {name}: hello refused: {frame}")),
            Req::Send { to } if ok => {
                if let Some(seq) = frame["seq"].as_u64() {
                    self.checker.send_ok(&format!("{NS}/{to}"), seq);
                }
            }
            Req::Subscribe(view) if ok => {
                self.clients[client].subs.insert(view.sub.clone(), view);
            }
            // Its snapshot follows: everyone present, told again (once more for names a
            // watch before told up, whose changes keep coming meanwhile).
            Req::Watch if ok => {
                let c = &mut self.clients[client];
                let seen = c.watching.get_or_insert_with(BTreeSet::new);
                c.retold = seen.clone();
            }
            Req::Submit { task } => {
                if code == "budget_exhausted" {
                    self.checker.counts.budget_refusals += 1;
                }
                let c = &mut self.clients[client];
                if ok {
                    c.unsettled.remove(&task);
                    c.submitted.push(task);
                } else if !matches!(code, "unavailable" | "rate_limited") {
                    // `budget_exhausted` too: the task store has no such task, and the
                    // window's budget is spent.
                    c.unsettled.remove(&task);
                }
            }
            Req::Claim { task } if ok => {
                let until = frame["lease_until"]
                    .as_str()
                    .and_then(rfc3339::parse_nanos)
                    .map(|n| (n / 1_000_000) as i64);
                let Some(until) = until else {
                    return self
                        .checker
                        .violation(format!("claim ok without lease_until: {frame}"));
                };
                self.clients[client].leases.insert(task.clone(), until);
                self.checker.claim_ok(&task, session, &name, until, wall);
                self.plan_work(client, task, draining);
            }
            Req::Heartbeat { task } if ok => {
                if let Some(until) = frame["lease_until"]
                    .as_str()
                    .and_then(rfc3339::parse_nanos)
                    .map(|n| (n / 1_000_000) as i64)
                {
                    self.checker.heartbeat_ok(&task, session, until);
                }
            }
            // Done, or refused with lease_lost: either way this session holds no lease.
            // `unavailable` leaves it unknown: the lease may still be there.
            // `unavailable`: the write may have landed; the spec has the client retry.
            Req::Complete { task } if code == "unavailable" => {
                let mut f = json!({"op":"complete","task":task,"result":{"retried":true}});
                let d = Duration::from_millis(200);
                self.queue_request_after(client, "k", &mut f, Req::Complete { task }, d);
            }
            Req::Fail { task } if code == "unavailable" => {
                let mut f = json!({"op":"fail","task":task,
                    "error":{"code":"sim","message":"simulated failure"},"retry":false});
                let d = Duration::from_millis(200);
                self.queue_request_after(client, "f", &mut f, Req::Fail { task }, d);
            }
            // Retried from `unsettled` like a submit, in this session or the next.
            Req::Cancel { .. } if code == "unavailable" => {}
            Req::Cancel { task } => {
                self.clients[client]
                    .unsettled
                    .remove(&format!("cancel:{task}"));
            }
            Req::Complete { task } | Req::Fail { task } if ok || code == "lease_lost" => {
                self.clients[client].leases.remove(&task);
                self.checker.lease_ended(&task, session);
            }
            Req::Heartbeat { task } | Req::Claim { task } if code == "lease_lost" => {
                self.clients[client].leases.remove(&task);
                self.checker.lease_ended(&task, session);
            }
            Req::Bye if ok => {}
            _ => {}
        }
    }

    /// What a worker does with a lease it got: finish it, fail it, keep it alive, or let
    /// it run out.
    fn plan_work(&mut self, client: usize, task: String, draining: bool) {
        let roll = self.clients[client].rng.below(100);
        let lease_ms = LEASE_S * 1000;
        if draining || roll < 50 {
            let d = Duration::from_millis(self.clients[client].rng.range(5, 1500));
            let mut f = json!({"op":"complete","task":task,"result":{"ok":true}});
            self.queue_request_after(client, "k", &mut f, Req::Complete { task }, d);
        } else if roll < 65 {
            let retry = self.clients[client].rng.chance(600);
            let d = Duration::from_millis(self.clients[client].rng.range(5, 1500));
            let mut f = json!({"op":"fail","task":task,
                "error":{"code":"sim","message":"simulated failure"},"retry":retry});
            self.queue_request_after(client, "f", &mut f, Req::Fail { task }, d);
        } else if roll < 85 {
            let hb = Duration::from_millis(lease_ms / 2);
            let mut f = json!({"op":"heartbeat","task":task,"progress":{"p":1}});
            self.queue_request_after(
                client,
                "b",
                &mut f,
                Req::Heartbeat { task: task.clone() },
                hb,
            );
            let done = Duration::from_millis(lease_ms + lease_ms / 4);
            let mut f = json!({"op":"complete","task":task,"result":{"late":true}});
            self.queue_request_after(client, "k", &mut f, Req::Complete { task }, done);
        } else if roll < 93 {
            // Too slow: the lease runs out first.
            let d = Duration::from_millis(lease_ms * 2);
            let mut f = json!({"op":"complete","task":task,"result":{"slow":true}});
            self.queue_request_after(client, "k", &mut f, Req::Complete { task }, d);
        }
        // else: abandons it; the lease runs out.
    }

    /// The client's session ended (closed by the broker, or by the client's side).
    pub fn client_closed(
        &mut self,
        client: usize,
        session: (usize, SessionId),
        _why: Option<(u16, String)>,
    ) {
        let now = self.now;
        if self.zombies.iter().all(|z| z.1 != session) {
            self.checker.session_closed(session);
        }
        let c = &mut self.clients[client];
        if c.session != Some(session) {
            return;
        }
        c.session = None;
        c.phase = Phase::Offline;
        c.outstanding.clear();
        c.subs.clear();
        c.leases.clear();
        c.watching = None;
        c.retold.clear();
        c.serving = false;
        let back = if self.draining {
            c.rng.range(10, 200)
        } else {
            c.rng.range(50, 3000)
        };
        c.next_at = now + Duration::from_millis(back);
        self.queued.retain(|q| q.session != session);
    }
}
