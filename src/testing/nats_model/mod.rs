//! A deterministic, in-process model of nats-server with JetStream, sans-IO.
//!
//! It speaks the NATS client protocol byte for byte like nats-server does for what this
//! crate uses (core pub/sub, queue groups, no-responders, the `$JS.API`, pull and push
//! consumers, acks, KV as streams). It never reads a clock, a socket or an OS random
//! source: the caller passes `now`, moves bytes with [`Server::receive`] and
//! [`Server::output`], and drives time with [`Server::poll_timeout`] and
//! [`Server::handle_timeout`]. The same inputs give the same bytes out.
//!
//! ```
//! use std::time::{Duration, Instant, SystemTime};
//! use amp_broker::testing::nats_model::{ModelOptions, Server};
//!
//! let t0 = Instant::now();
//! let mut server = Server::new(ModelOptions::new(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)), t0);
//! let c = server.accept(t0);
//! assert!(server.output(c).starts_with(b"INFO {"));
//! let n = server.output(c).len();
//! server.consume_output(c, n);
//! server.receive(c, b"CONNECT {}\r\nSUB a 1\r\nPUB a 2\r\nhi\r\nPING\r\n", t0);
//! assert_eq!(server.output(c), b"MSG a 1 2\r\nhi\r\nPONG\r\n");
//! ```
//!
//! [`tcp::ModelServer`] runs it on a loopback port for tests that use real sockets.

mod api;
pub mod clock;
mod consumer;
mod errors;
mod jetstream;
mod stream;
pub mod subjects;
pub mod tcp;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use serde_json::json;

use crate::proto::encode;
use crate::proto::subject::validate_pattern;
use crate::proto::{Op, Parsed, Parser, Role};

use clock::WallClock;
use consumer::Outbound;
use jetstream::{Handled, JetStream};
pub use subjects::ClientId;
use subjects::{SubjectIndex, Subscription};

/// How the model is set up. The wall clock start is given, never read from the OS.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    pub max_payload: usize,
    pub wall_clock_start: SystemTime,
    pub server_name: String,
    /// The JetStream domain: the API answers on `$JS.<domain>.API` as well.
    pub domain: Option<String>,
    /// With JetStream off, nothing answers `$JS.API` (like a server without `-js`).
    pub jetstream: bool,
    /// Seeds the server id and ephemeral consumer names.
    pub seed: u64,
    /// Per-client output bound; a client past it is dropped as a slow consumer.
    pub max_pending_output: usize,
    /// Subscriptions one client may hold.
    pub max_subscriptions: usize,
    /// The port INFO reports.
    pub port: u16,
}

impl ModelOptions {
    pub fn new(wall_clock_start: SystemTime) -> ModelOptions {
        ModelOptions {
            max_payload: crate::proto::parser::DEFAULT_MAX_PAYLOAD,
            wall_clock_start,
            server_name: "nats-model".to_string(),
            domain: None,
            jetstream: true,
            seed: 1,
            max_pending_output: 64 * 1024 * 1024,
            max_subscriptions: 65_536,
            port: 4222,
        }
    }
}

#[derive(Debug)]
struct Client {
    out: Vec<u8>,
    inbuf: Vec<u8>,
    echo: bool,
    headers: bool,
    no_responders: bool,
    verbose: bool,
    closed: bool,
}

/// The model server: clients by id, their subscriptions, and JetStream.
#[derive(Debug)]
pub struct Server {
    opts: ModelOptions,
    clock: WallClock,
    parser: Parser,
    clients: BTreeMap<ClientId, Client>,
    next_client: ClientId,
    subs: SubjectIndex,
    js: JetStream,
    server_id: String,
    now: Instant,
}

impl Server {
    pub fn new(opts: ModelOptions, now: Instant) -> Server {
        let mut parser = Parser::new(Role::Server);
        parser.max_payload = opts.max_payload;
        let mut js = JetStream::new(opts.domain.clone(), opts.seed);
        let id: String = (0..7).map(|_| js.next_name()).collect();
        let server_id = format!("N{}", &id[..55.min(id.len())]);
        Server {
            clock: WallClock::new(opts.wall_clock_start, now),
            parser,
            clients: BTreeMap::new(),
            next_client: 1,
            subs: SubjectIndex::default(),
            js,
            server_id,
            now,
            opts,
        }
    }

    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }

    /// Steps the simulated wall clock: stream timestamps are start + elapsed + offset.
    pub fn set_wall_clock_offset(&mut self, offset: Duration, forward: bool) {
        let n = offset.as_nanos() as i128;
        self.clock.set_offset(if forward { n } else { -n });
    }

    /// Unix milliseconds of the simulated wall clock at `now`.
    pub fn wall_clock_millis(&self, now: Instant) -> i64 {
        i64::try_from(self.clock.nanos(now) / 1_000_000).unwrap_or(i64::MAX)
    }

    fn tick(&mut self, now: Instant) {
        if now > self.now {
            self.now = now;
        }
    }

    fn wall(&self) -> u64 {
        self.clock.nanos(self.now)
    }

    /// A new connection; its INFO line is queued.
    pub fn accept(&mut self, now: Instant) -> ClientId {
        self.tick(now);
        let id = self.next_client;
        self.next_client += 1;
        let mut info = json!({
            "server_id": self.server_id,
            "server_name": self.opts.server_name,
            "version": "2.15.1",
            "proto": 1,
            "go": "model",
            "host": "127.0.0.1",
            "port": self.opts.port,
            "headers": true,
            "max_payload": self.opts.max_payload,
            "jetstream": self.opts.jetstream,
            "client_id": id,
            "client_ip": "127.0.0.1",
        });
        if let (Some(d), true) = (&self.opts.domain, self.opts.jetstream) {
            info["domain"] = json!(d);
        }
        let mut out = Vec::new();
        encode::info_raw(&mut out, info.to_string().as_bytes());
        self.clients.insert(
            id,
            Client {
                out,
                inbuf: Vec::new(),
                echo: true,
                headers: false,
                no_responders: false,
                verbose: false,
                closed: false,
            },
        );
        id
    }

    /// Bytes waiting for `client` (empty for an unknown one).
    pub fn output(&self, client: ClientId) -> &[u8] {
        self.clients.get(&client).map_or(&[], |c| c.out.as_slice())
    }

    pub fn consume_output(&mut self, client: ClientId, n: usize) {
        if let Some(c) = self.clients.get_mut(&client) {
            let n = n.min(c.out.len());
            c.out.drain(..n);
        }
    }

    /// Takes everything waiting for `client`.
    pub fn take_output(&mut self, client: ClientId) -> Vec<u8> {
        self.clients
            .get_mut(&client)
            .map(|c| std::mem::take(&mut c.out))
            .unwrap_or_default()
    }

    /// The model closed this connection (protocol error, slow consumer): the transport
    /// writes what [`Server::output`] still holds, then closes, then calls `disconnect`.
    pub fn is_closed(&self, client: ClientId) -> bool {
        self.clients.get(&client).is_none_or(|c| c.closed)
    }

    /// The messages stream `name` holds, in sequence order, as `(seq, subject, payload)`
    /// (empty for an unknown stream): for checkers that judge what was stored.
    pub fn stream_messages(&self, name: &str) -> Vec<(u64, &str, &[u8])> {
        self.js.streams.get(name).map_or_else(Vec::new, |e| {
            e.stream
                .msgs
                .iter()
                .map(|(&seq, m)| (seq, m.subject.as_str(), m.payload.as_slice()))
                .collect()
        })
    }

    pub fn clients(&self) -> impl Iterator<Item = ClientId> + '_ {
        self.clients.keys().copied()
    }

    /// The connection is gone.
    pub fn disconnect(&mut self, client: ClientId, now: Instant) {
        self.tick(now);
        self.clients.remove(&client);
        self.subs.remove_client(client);
        self.pump();
    }

    /// Like a nats-server restart with a file store: every connection is dropped, streams,
    /// their messages and consumers (with their acks) stay; waiting pulls are gone.
    pub fn restart(&mut self, now: Instant) {
        self.tick(now);
        self.clients.clear();
        self.subs = SubjectIndex::default();
        for e in self.js.streams.values_mut() {
            for c in e.consumers.values_mut() {
                c.restart(now);
            }
        }
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.js.poll_timeout()
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.tick(now);
        let wall = self.wall();
        let mut out = Vec::new();
        self.js.handle_timeout(self.now, wall, &mut out);
        self.emit_all(out);
        self.pump();
    }

    /// Bytes from `client`.
    pub fn receive(&mut self, client: ClientId, bytes: &[u8], now: Instant) {
        self.tick(now);
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        if c.closed {
            return;
        }
        c.inbuf.extend_from_slice(bytes);
        let buf = std::mem::take(&mut c.inbuf);
        let mut at = 0;
        loop {
            match self.parser.parse(&buf[at..]) {
                Ok(Parsed::Complete(op, used)) => {
                    at += used;
                    self.handle_op(client, op);
                    if self.is_closed(client) {
                        break;
                    }
                }
                Ok(Parsed::Partial { .. }) => break,
                Err(e) => {
                    self.protocol_error(client, &e.to_string());
                    break;
                }
            }
        }
        if let Some(c) = self.clients.get_mut(&client)
            && !c.closed
        {
            c.inbuf = buf[at..].to_vec();
        }
        self.pump();
    }

    fn protocol_error(&mut self, client: ClientId, text: &str) {
        self.send_err(client, text);
        self.close(client);
    }

    fn send_err(&mut self, client: ClientId, text: &str) {
        if let Some(c) = self.clients.get_mut(&client) {
            encode::err(&mut c.out, text);
        }
    }

    fn close(&mut self, client: ClientId) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.closed = true;
            c.inbuf.clear();
        }
        self.subs.remove_client(client);
    }

    fn handle_op(&mut self, client: ClientId, op: Op<'_>) {
        let verbose = self.clients.get(&client).is_some_and(|c| c.verbose);
        let ok = match op {
            Op::Connect(json) => match serde_json::from_slice::<serde_json::Value>(json) {
                // nats-server's defaults for absent fields: echo on, the rest off.
                Ok(o) if o.is_object() => {
                    let flag = |k: &str, d: bool| {
                        o.get(k).and_then(serde_json::Value::as_bool).unwrap_or(d)
                    };
                    let verbose = flag("verbose", false);
                    if let Some(c) = self.clients.get_mut(&client) {
                        c.echo = flag("echo", true);
                        c.headers = flag("headers", false);
                        c.no_responders = flag("no_responders", false) && c.headers;
                        c.verbose = verbose;
                    }
                    verbose
                }
                _ => {
                    self.protocol_error(client, "Invalid CONNECT");
                    return;
                }
            },
            Op::Ping => {
                if let Some(c) = self.clients.get_mut(&client) {
                    encode::pong(&mut c.out);
                }
                false
            }
            Op::Pong | Op::Info(_) | Op::Ok | Op::Err(_) => false,
            Op::Sub {
                subject,
                queue,
                sid,
            } => self.subscribe(client, subject, queue, sid),
            Op::Unsub { sid, max_msgs } => {
                let sid = String::from_utf8_lossy(sid);
                match max_msgs {
                    Some(m) => self.subs.limit(client, &sid, m),
                    None => self.subs.remove(client, &sid),
                }
                true
            }
            Op::Pub {
                subject,
                reply,
                payload,
            } => self.client_publish(client, subject, reply, None, payload),
            Op::Hpub {
                subject,
                reply,
                headers,
                payload,
            } => self.client_publish(client, subject, reply, Some(headers), payload),
            Op::Msg { .. } | Op::Hmsg { .. } => {
                self.protocol_error(client, "Unknown Protocol Operation");
                return;
            }
        };
        if verbose
            && ok
            && let Some(c) = self.clients.get_mut(&client)
        {
            encode::ok(&mut c.out);
        }
    }

    fn subscribe(
        &mut self,
        client: ClientId,
        subject: &[u8],
        queue: Option<&[u8]>,
        sid: &[u8],
    ) -> bool {
        let (Ok(s), Ok(sid)) = (std::str::from_utf8(subject), std::str::from_utf8(sid)) else {
            self.send_err(client, "Invalid Subject");
            return false;
        };
        if validate_pattern(subject).is_err() {
            self.send_err(client, "Invalid Subject");
            return false;
        }
        let queue = match queue.map(std::str::from_utf8) {
            Some(Ok(q)) => Some(q.to_string()),
            Some(Err(_)) => {
                self.send_err(client, "Invalid Queue Name");
                return false;
            }
            None => None,
        };
        if self.subs.count_of(client) >= self.opts.max_subscriptions {
            self.send_err(client, "Maximum Subscriptions Exceeded");
            return false;
        }
        self.subs.insert(
            client,
            sid,
            Subscription {
                subject: s.to_string(),
                queue,
                remaining: None,
            },
        );
        true
    }

    fn client_publish(
        &mut self,
        client: ClientId,
        subject: &[u8],
        reply: Option<&[u8]>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) -> bool {
        // Like nats-server without `pedantic`, any bytes go as a subject; only text is
        // representable here.
        let (Ok(subject), Ok(reply)) = (
            std::str::from_utf8(subject),
            reply.map(std::str::from_utf8).transpose(),
        ) else {
            self.send_err(client, "Invalid Publish Subject");
            return false;
        };
        self.publish(Some(client), subject, reply, headers, payload);
        true
    }

    /// Routes one message: to subscribers, and to whatever in JetStream takes it.
    fn publish(
        &mut self,
        from: Option<ClientId>,
        subject: &str,
        reply: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        let skip = from.filter(|c| self.clients.get(c).is_some_and(|c| !c.echo));
        let targets = self.subs.route(subject, skip);
        for t in &targets {
            self.write_msg(t.client, subject, &t.sid, reply, headers, payload);
        }
        let handled = self.internal(subject, reply, headers, payload);
        let answered = match handled {
            Handled::NotMine => false,
            Handled::Out(out) => {
                self.emit_all(out);
                let closing = self.js.take_closing();
                self.emit_all(closing);
                true
            }
        };
        // nats-server answers a request nobody can receive with a 503 status, if asked to.
        if targets.is_empty()
            && !answered
            && let (Some(reply), Some(from)) = (reply, from)
            && self.clients.get(&from).is_some_and(|c| c.no_responders)
        {
            let status = Outbound::status(reply, 503, "", &[]);
            for t in self.subs.route(reply, None) {
                if t.client == from {
                    self.write_msg(
                        t.client,
                        reply,
                        &t.sid,
                        None,
                        status.headers.as_deref(),
                        &[],
                    );
                }
            }
        }
    }

    fn internal(
        &mut self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) -> Handled {
        if !self.opts.jetstream {
            return Handled::NotMine;
        }
        let now = self.now;
        let wall = self.wall();
        if subject.starts_with("$JS.ACK.") {
            return self.js.ack(subject, reply, payload, now);
        }
        if subject.starts_with("$JS.FC.") {
            return self.js.flow_control(subject);
        }
        let op = subject.strip_prefix("$JS.API.").or_else(|| {
            let d = self.opts.domain.as_deref()?;
            subject
                .strip_prefix("$JS.")?
                .strip_prefix(d)?
                .strip_prefix(".API.")
        });
        if let Some(op) = op {
            let name = self.opts.server_name.clone();
            return self.js.api(op, reply, payload, now, wall, &name);
        }
        self.js.capture(subject, reply, headers, payload, now, wall)
    }

    fn emit_all(&mut self, out: Vec<Outbound>) {
        for o in out {
            for t in self.subs.route(&o.to, None) {
                self.write_msg(
                    t.client,
                    &o.subject,
                    &t.sid,
                    o.reply.as_deref(),
                    o.headers.as_deref(),
                    &o.payload,
                );
            }
        }
    }

    fn pump(&mut self) {
        let mut out = Vec::new();
        let subs = &self.subs;
        self.js.pump(self.now, &|s| subs.has_interest(s), &mut out);
        self.emit_all(out);
    }

    fn write_msg(
        &mut self,
        client: ClientId,
        subject: &str,
        sid: &str,
        reply: Option<&str>,
        headers: Option<&[u8]>,
        payload: &[u8],
    ) {
        let max = self.opts.max_pending_output;
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        if c.closed {
            return;
        }
        let reply = reply.map(str::as_bytes);
        match headers.filter(|_| c.headers) {
            Some(h) => encode::hmsg(&mut c.out, subject, sid, reply, h, payload),
            None => encode::msg(&mut c.out, subject, sid, reply, payload),
        }
        if c.out.len() > max {
            // Slow consumer: nats-server drops the connection without a word.
            c.out.clear();
            self.close(client);
        }
    }
}
