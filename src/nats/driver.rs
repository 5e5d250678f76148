//! The socket driver: one non-blocking mio `TcpStream` moving bytes for one
//! [`Connection`]. It registers with whatever `mio::Poll` the caller runs (the broker's
//! single event loop, or [`Client`](super::Client)'s small one) under the caller's token.
//!
//! TLS sits here, under the connection: when the connection asks for it
//! ([`Connection::poll_start_tls`]) the driver wraps the socket in a [`TlsSession`], and
//! from then on moves ciphertext on the socket and plaintext to and from the connection.
//!
//! Loop contract: call [`Driver::handle_event`] for readiness events carrying the driver's
//! token, [`Driver::drive`] after anything else touched the connection (a publish, a
//! subscribe) and whenever [`Driver::poll_timeout`] has passed. Both do all IO that can be
//! done without blocking.

use super::connection::Connection;
use crate::tls::{ClientFiles, Received, TlsSession};
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// Host-name lookups running at once in this process, at most: a lookup that never
/// answers keeps its thread, and a connection that times out its dial and tries again
/// must not start one more each time.
const MAX_LOOKUPS: usize = 8;
static LOOKUPS: AtomicUsize = AtomicUsize::new(0);
/// Of those, lookups of servers learned from `connect_urls` hold at most this many: the
/// rest stay for the configured servers, whose dials failed at once while names an INFO
/// listed (a server's, or whoever is in the middle of a plaintext link) did not answer.
const MAX_DISCOVERED_LOOKUPS: usize = MAX_LOOKUPS - 2;
/// How often a pending lookup is looked at.
const LOOKUP_POLL: Duration = Duration::from_millis(5);

/// A host name being looked up on a thread of its own: `getaddrinfo` blocks, for seconds
/// when a resolver does not answer, and the loop it would block serves every session. A
/// server (or whoever stands in the middle) names hosts in its INFO's `connect_urls`.
#[derive(Debug)]
struct Lookup {
    addr: String,
    answer: mpsc::Receiver<io::Result<SocketAddr>>,
}

/// Takes a slot of `running` for a lookup of a `configured` server, or of a discovered one.
fn reserve(running: &AtomicUsize, configured: bool) -> bool {
    let max = if configured {
        MAX_LOOKUPS
    } else {
        MAX_DISCOVERED_LOOKUPS
    };
    if running.fetch_add(1, Ordering::SeqCst) >= max {
        running.fetch_sub(1, Ordering::SeqCst);
        return false;
    }
    true
}

impl Lookup {
    fn start(addr: &str, configured: bool) -> io::Result<Lookup> {
        if !reserve(&LOOKUPS, configured) {
            return Err(io::Error::other(format!(
                "host-name lookups are not answering ({MAX_LOOKUPS} at most, \
                 {MAX_DISCOVERED_LOOKUPS} of discovered servers)"
            )));
        }
        let (tx, answer) = mpsc::channel();
        let name = addr.to_string();
        let spawned = std::thread::Builder::new()
            .name("amp-lookup".into())
            .spawn(move || {
                let found = name
                    .to_socket_addrs()
                    .and_then(|mut a| a.next().ok_or_else(|| io::Error::other("no address")));
                LOOKUPS.fetch_sub(1, Ordering::SeqCst);
                // Nobody waits any more when the dial timed out: dropped.
                let _ = tx.send(found);
            });
        if let Err(e) = spawned {
            LOOKUPS.fetch_sub(1, Ordering::SeqCst);
            return Err(e);
        }
        Ok(Lookup {
            addr: addr.to_string(),
            answer,
        })
    }
}

/// Bytes read per `read` call.
const READ_CHUNK: usize = 64 * 1024;
/// `read` calls per readiness event or `drive` by default: the rest of a flood waits for
/// the next `drive`, so the caller's loop serves its other sockets and timers in between.
const MAX_READS_PER_PASS: usize = 16;

#[derive(Debug)]
pub struct Driver {
    conn: Connection,
    token: Token,
    socket: Option<TcpStream>,
    /// Non-blocking connect in progress.
    dialing: bool,
    /// The last write hit `WouldBlock`; no write is tried until a writable event.
    write_blocked: bool,
    /// A read pass ended at its budget with input possibly left in the socket.
    read_more: bool,
    /// The caller cannot take more events now ([`Driver::hold_reads`]).
    reads_held: bool,
    /// A pass ran since the last [`Driver::drive`] (a readiness event's).
    read_since_drive: bool,
    /// `read` calls per pass ([`Driver::with_read_allowance`]).
    reads_per_pass: usize,
    read_buf: Vec<u8>,
    /// The TLS session under the current socket, once the connection asked for one.
    tls: Option<TlsSession>,
    /// The TLS configuration: the options', or the system's CA bundle loaded on first use.
    tls_config: Option<Arc<rustls::ClientConfig>>,
    /// Where decrypted bytes land on their way to the connection (empty without TLS).
    plain_buf: Vec<u8>,
    /// Bytes read from and written to the server socket since start, for `/metrics`.
    bytes_in: u64,
    bytes_out: u64,
    /// The host name of the dial under way, being looked up.
    lookup: Option<Lookup>,
}

impl Driver {
    pub fn new(conn: Connection, token: Token) -> Driver {
        let tls_config = conn.options().tls.clone();
        Driver {
            tls: None,
            tls_config,
            plain_buf: Vec::new(),
            conn,
            token,
            socket: None,
            dialing: false,
            write_blocked: false,
            read_more: false,
            reads_held: false,
            read_since_drive: false,
            reads_per_pass: MAX_READS_PER_PASS,
            read_buf: vec![0; READ_CHUNK],
            bytes_in: 0,
            bytes_out: 0,
            lookup: None,
        }
    }

    /// At most `bytes` read per pass instead of 1 MiB (in reads of up to 64 KiB, at least
    /// one read): a connection whose input anyone may send takes a smaller share of each
    /// loop turn.
    pub fn with_read_allowance(mut self, bytes: usize) -> Driver {
        let chunk = bytes.clamp(1, READ_CHUNK);
        self.read_buf = vec![0; chunk];
        self.reads_per_pass = (bytes / chunk).max(1);
        self
    }

    /// Bytes read from and written to the server since start (over all reconnections).
    pub fn bytes(&self) -> (u64, u64) {
        (self.bytes_in, self.bytes_out)
    }

    pub fn token(&self) -> Token {
        self.token
    }

    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    pub fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
    }

    /// The socket took no more bytes last time; output waits for a writable event.
    pub fn is_write_blocked(&self) -> bool {
        self.write_blocked
    }

    /// Whether a socket is open or being dialed.
    pub fn has_socket(&self) -> bool {
        self.socket.is_some()
    }

    /// While held, the socket is not read: what was read stays in the kernel and the
    /// server waits, instead of events queueing (and past their bound, being dropped)
    /// that the caller cannot handle yet.
    pub fn hold_reads(&mut self, hold: bool) {
        self.reads_held = hold;
    }

    /// Whether the events read and not yet taken hold a pass's allowance: the socket is
    /// not read until the caller takes them. Held only while the caller was over its
    /// memory budget, a caller slowed by that budget took fewer events each turn than a
    /// pass read, and they piled up to `max_pending_messages`, of up to `max_payload`
    /// each. So the queue holds at most a pass, a read and one message more.
    fn queue_full(&self) -> bool {
        self.conn.queued_bytes() >= self.reads_per_pass.saturating_mul(self.read_buf.len())
    }

    /// The next instant [`Driver::drive`] must run even without readiness.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.read_more && !self.reads_held && !self.queue_full() {
            return Some(Instant::now());
        }
        let conn = self.conn.poll_timeout();
        match self.lookup {
            Some(_) => {
                let soon = Instant::now() + LOOKUP_POLL;
                Some(conn.map_or(soon, |t| t.min(soon)))
            }
            None => conn,
        }
    }

    /// Readiness for this driver's token.
    pub fn handle_event(&mut self, registry: &Registry, event: &mio::event::Event, now: Instant) {
        if event.token() != self.token || self.socket.is_none() {
            return;
        }
        if event.is_writable() {
            self.write_blocked = false;
        }
        if self.dialing {
            self.finish_dial(registry, now);
        }
        if !self.dialing && (event.is_readable() || event.is_read_closed()) {
            self.read(registry, now, !event.is_read_closed() && !event.is_error());
        }
        self.drive_writes(registry, now);
    }

    /// Timers, dialing, closing and writing, and one more read pass when the last one
    /// stopped at its allowance and no readiness event read since the last call: call it
    /// once per loop turn, and the socket is read at most a pass per turn.
    pub fn drive(&mut self, registry: &Registry, now: Instant) {
        if self.read_more && !self.read_since_drive && !self.dialing && self.socket.is_some() {
            self.read(registry, now, false);
        }
        self.read_since_drive = false;
        self.drive_writes(registry, now);
    }

    /// As [`Driver::drive`], without reading: for the rounds of a loop turn after the
    /// first. Each round reading a pass made one turn read up to 64 of them (66 MiB of a
    /// flood), while each WebSocket connection reads its allowance once per turn.
    pub fn drive_writes(&mut self, registry: &Registry, now: Instant) {
        // Bounded: each pass either changes state or stops.
        for _ in 0..16 {
            if self.conn.poll_close() {
                self.drop_socket(registry);
            }
            if self.conn.poll_timeout().is_some_and(|t| t <= now) {
                self.conn.handle_timeout(now);
                if self.conn.poll_close() {
                    self.drop_socket(registry);
                }
            }
            if self.socket.is_none() {
                if let Some(lookup) = &self.lookup {
                    let found = match lookup.answer.try_recv() {
                        Ok(found) => found,
                        Err(mpsc::TryRecvError::Empty) => return,
                        Err(mpsc::TryRecvError::Disconnected) => {
                            Err(io::Error::other("the lookup ended without an answer"))
                        }
                    };
                    let addr = self.lookup.take().map(|l| l.addr).unwrap_or_default();
                    self.connect(registry, &addr, found, now);
                    continue;
                }
                match self.conn.poll_connect(now) {
                    Some(addr) => {
                        let configured = self.conn.options().servers.iter().any(|u| u.addr == addr);
                        self.dial(registry, &addr.to_string(), configured, now);
                        if self.lookup.is_some() {
                            // Its answer is looked at from the next wake-up on, never in
                            // the pass that started it: one behaviour however fast the
                            // resolver is.
                            return;
                        }
                        continue;
                    }
                    None => return,
                }
            }
            if self.dialing || self.write_blocked {
                return;
            }
            if !self.write(registry, now) {
                continue;
            }
            return;
        }
    }

    /// An address is connected to at once; a host name is looked up first, off the loop.
    fn dial(&mut self, registry: &Registry, addr: &str, configured: bool, now: Instant) {
        if let Ok(sa) = addr.parse::<SocketAddr>() {
            return self.connect(registry, addr, Ok(sa), now);
        }
        match Lookup::start(addr, configured) {
            Ok(lookup) => self.lookup = Some(lookup),
            Err(e) => self.conn.on_transport_closed(now, &format!("{addr}: {e}")),
        }
    }

    fn connect(
        &mut self,
        registry: &Registry,
        addr: &str,
        resolved: io::Result<SocketAddr>,
        now: Instant,
    ) {
        let result = resolved.and_then(|sa| {
            let mut stream = TcpStream::connect(sa)?;
            registry.register(
                &mut stream,
                self.token,
                Interest::READABLE | Interest::WRITABLE,
            )?;
            Ok(stream)
        });
        match result {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                self.socket = Some(stream);
                self.dialing = true;
            }
            Err(e) => self.conn.on_transport_closed(now, &format!("{addr}: {e}")),
        }
    }

    fn finish_dial(&mut self, registry: &Registry, now: Instant) {
        let Some(stream) = self.socket.as_ref() else {
            return;
        };
        match stream.take_error() {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => return self.failed(registry, now, &e.to_string()),
        }
        match stream.peer_addr() {
            Ok(_) => {
                self.dialing = false;
                self.conn.on_transport_open(now);
                self.start_tls(registry, now);
            }
            Err(e) if e.kind() == io::ErrorKind::NotConnected => {}
            Err(e) => self.failed(registry, now, &e.to_string()),
        }
    }

    /// Reads until `WouldBlock` or the pass's allowance. With `short_read_drains` (a
    /// readiness event without the peer's end), a read shorter than the buffer ends it:
    /// the socket's queue is empty and the next byte raises a new edge (see the same
    /// rule in `ws::server`).
    fn read(&mut self, registry: &Registry, now: Instant, short_read_drains: bool) {
        if self.reads_held || self.queue_full() {
            // Edge-triggered readiness is not repeated: remember to read.
            self.read_more = true;
            self.conn.input_held(now);
            return;
        }
        self.read_more = false;
        self.read_since_drive = true;
        for n in 0..self.reads_per_pass {
            if n > 0 && self.queue_full() {
                break;
            }
            let Some(stream) = self.socket.as_mut() else {
                return;
            };
            match stream.read(&mut self.read_buf) {
                Ok(0) => return self.failed(registry, now, "connection closed by server"),
                Ok(n) => {
                    self.bytes_in = self.bytes_in.saturating_add(n as u64);
                    let Some(bytes) = self.read_buf.get(..n) else {
                        return;
                    };
                    match self.tls.as_mut() {
                        None => self.conn.receive(bytes, now),
                        Some(tls) => {
                            let conn = &mut self.conn;
                            match tls.receive(bytes, &mut self.plain_buf, |p| conn.receive(p, now))
                            {
                                Ok(Received::Open) => {}
                                Ok(Received::Closed) => {
                                    return self.failed(registry, now, "TLS closed by server");
                                }
                                Err(e) => {
                                    self.send_alert();
                                    return self.failed(registry, now, &format!("TLS: {e}"));
                                }
                            }
                        }
                    }
                    if self.conn.poll_close() {
                        self.drop_socket(registry);
                        return;
                    }
                    self.start_tls(registry, now);
                    if short_read_drains && n < self.read_buf.len() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.failed(registry, now, &e.to_string()),
            }
        }
        self.read_more = true;
    }

    /// Puts TLS under the socket when the connection asks for it.
    fn start_tls(&mut self, registry: &Registry, now: Instant) {
        let Some(name) = self.conn.poll_start_tls() else {
            return;
        };
        let config = match self.tls_config.clone() {
            Some(config) => Ok(config),
            None => ClientFiles::default().load(),
        };
        let session = config.and_then(|config| {
            self.tls_config = Some(config.clone());
            TlsSession::client(config, &name)
        });
        match session {
            Ok(session) => {
                if self.plain_buf.is_empty() {
                    self.plain_buf = vec![0; READ_CHUNK];
                }
                self.tls = Some(session);
            }
            Err(e) => self.failed(registry, now, &format!("TLS: {e}")),
        }
    }

    /// Best effort: the alert that says why the handshake or session failed.
    fn send_alert(&mut self) {
        if let (Some(tls), Some(stream)) = (self.tls.as_mut(), self.socket.as_mut()) {
            let _ = tls.write_to(stream);
        }
    }

    /// Writes until the output is empty or the socket would block. False when the socket
    /// failed (state changed).
    fn write(&mut self, registry: &Registry, now: Instant) -> bool {
        if self.tls.is_some() {
            return self.write_tls(registry, now);
        }
        loop {
            let Some(stream) = self.socket.as_mut() else {
                return true;
            };
            let out = self.conn.output();
            if out.is_empty() {
                return true;
            }
            match stream.write(out) {
                Ok(0) => {
                    self.failed(registry, now, "socket accepted no bytes");
                    return false;
                }
                Ok(n) => {
                    self.bytes_out = self.bytes_out.saturating_add(n as u64);
                    self.conn.consume_output_at(n, now);
                    if self.conn.poll_close() {
                        self.drop_socket(registry);
                        return false;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.write_blocked = true;
                    return true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.failed(registry, now, &e.to_string());
                    return false;
                }
            }
        }
    }

    /// `write` through the TLS session: plaintext in as the session's bound allows,
    /// ciphertext out until the socket would block.
    fn write_tls(&mut self, registry: &Registry, now: Instant) -> bool {
        loop {
            let (Some(stream), Some(tls)) = (self.socket.as_mut(), self.tls.as_mut()) else {
                return true;
            };
            let taken = tls.send(self.conn.output());
            if taken > 0 {
                self.conn.consume_output_at(taken, now);
            }
            match tls.write_to(stream) {
                Ok(n) => self.bytes_out = self.bytes_out.saturating_add(n as u64),
                Err(e) => {
                    self.failed(registry, now, &e.to_string());
                    return false;
                }
            }
            if self.conn.poll_close() {
                self.drop_socket(registry);
                return false;
            }
            let tls_pending = self.tls.as_ref().is_some_and(|t| !t.output().is_empty());
            if tls_pending {
                self.write_blocked = true;
                return true;
            }
            if taken == 0 {
                return true;
            }
        }
    }

    fn failed(&mut self, registry: &Registry, now: Instant, reason: &str) {
        self.drop_socket(registry);
        self.conn.on_transport_closed(now, reason);
        // The connection may have abandoned nothing else; clear a stale request.
        self.conn.poll_close();
    }

    fn drop_socket(&mut self, registry: &Registry) {
        // A dial given up (timed out) while its host name was looked up: the answer,
        // whenever it comes, goes nowhere.
        self.lookup = None;
        if let Some(mut stream) = self.socket.take() {
            let _ = registry.deregister(&mut stream);
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        self.tls = None;
        self.dialing = false;
        self.write_blocked = false;
        self.read_more = false;
    }

    /// Deregisters and closes the socket (the connection itself is left as it is).
    pub fn shutdown(&mut self, registry: &Registry) {
        self.drop_socket(registry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nats::{Event, Options};

    #[test]
    fn a_host_name_is_looked_up_off_the_loop_and_then_dialed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let port = listener.local_addr().expect("addr").port();
        let poll = mio::Poll::new().expect("poll");
        let now = Instant::now();
        let conn = Connection::new(Options::new(&format!("nats://localhost:{port}")), now);
        let mut d = Driver::new(conn, Token(1));
        d.drive(poll.registry(), now);
        // The dial waits for the lookup: no socket yet, and a wake-up soon to look again.
        assert!(d.lookup.is_some() && !d.has_socket());
        assert!(
            d.poll_timeout()
                .is_some_and(|t| t <= Instant::now() + LOOKUP_POLL)
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while !d.has_socket() {
            assert!(Instant::now() < deadline, "never dialed");
            std::thread::sleep(LOOKUP_POLL);
            d.drive(poll.registry(), now);
        }
        assert!(d.lookup.is_none());
        // An address needs no lookup.
        let conn = Connection::new(Options::new(&format!("nats://127.0.0.1:{port}")), now);
        let mut d = Driver::new(conn, Token(2));
        d.drive(poll.registry(), now);
        assert!(d.lookup.is_none() && d.has_socket());
    }

    #[test]
    fn lookups_for_discovered_servers_leave_slots_for_the_configured_ones() {
        // Host names an INFO names whose lookups never answer held every slot, and each
        // dial of the configured server failed at once while they did.
        let running = AtomicUsize::new(0);
        let discovered = (0..MAX_LOOKUPS + 4)
            .filter(|_| reserve(&running, false))
            .count();
        assert!(
            discovered < MAX_LOOKUPS,
            "discovered lookups took {discovered}"
        );
        let configured = (0..MAX_LOOKUPS).filter(|_| reserve(&running, true)).count();
        assert_eq!(discovered + configured, MAX_LOOKUPS);
    }

    #[test]
    fn held_reads_leave_the_input_in_the_socket_until_released() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let addr = listener.local_addr().expect("addr");
        let mut poll = mio::Poll::new().expect("poll");
        let mut events = mio::Events::with_capacity(16);
        let now = Instant::now();
        let conn = Connection::new(Options::new(&format!("nats://{addr}")), now);
        let mut d = Driver::new(conn, Token(1));
        d.drive(poll.registry(), now);
        let (mut server, _) = listener.accept().expect("accept");
        server
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        server
            .write_all(b"INFO {\"server_id\":\"s\",\"max_payload\":1048576}\r\n")
            .expect("info");
        let mut turn = |d: &mut Driver, poll: &mut mio::Poll| {
            let _ = poll.poll(&mut events, Some(Duration::from_millis(100)));
            for event in events.iter() {
                d.handle_event(poll.registry(), event, Instant::now());
            }
            d.drive(poll.registry(), Instant::now());
        };
        d.hold_reads(true);
        for _ in 0..3 {
            turn(&mut d, &mut poll);
        }
        // The INFO was not read, so no CONNECT answers it.
        let mut buf = [0u8; 256];
        assert!(
            server.read(&mut buf).is_err(),
            "nothing is written while held"
        );
        assert!(d.poll_timeout().is_none_or(|t| t > Instant::now()));
        d.hold_reads(false);
        turn(&mut d, &mut poll);
        let n = server.read(&mut buf).expect("the CONNECT, once released");
        assert!(buf.get(..n).is_some_and(|b| b.starts_with(b"CONNECT ")));
    }

    /// A server that answers the handshake, waits for a `SUB` and then writes `flood`
    /// messages of `size` bytes to it as fast as the socket takes them; its port.
    fn flooding_server(flood: usize, size: usize) -> u16 {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let info = "INFO {\"server_id\":\"S\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n";
            s.write_all(info.as_bytes()).expect("info");
            let mut said = String::new();
            let mut buf = [0u8; 4096];
            let mut ponged = false;
            let sid = loop {
                let n = s.read(&mut buf).expect("read");
                assert!(n > 0, "the client left");
                said.push_str(&String::from_utf8_lossy(&buf[..n]));
                if !ponged && said.contains("PING\r\n") {
                    ponged = true;
                    s.write_all(b"PONG\r\n").expect("pong");
                }
                if let Some(line) = said.lines().find(|l| l.starts_with("SUB flood ")) {
                    break line.rsplit(' ').next().unwrap_or_default().to_string();
                }
            };
            let msg = format!("MSG flood {sid} {size}\r\n{}\r\n", "x".repeat(size));
            for _ in 0..flood {
                if s.write_all(msg.as_bytes()).is_err() {
                    return;
                }
            }
            // Open until the test is done with it (not joined).
            std::thread::sleep(Duration::from_secs(30));
        });
        port
    }

    /// Runs loop turns (readiness, then `drive`) without taking any event, until the
    /// driver has read nothing for a while; the bytes it read.
    fn turns_until_quiet(d: &mut Driver, poll: &mut mio::Poll) -> u64 {
        let mut events = mio::Events::with_capacity(16);
        let mut quiet = 0;
        while quiet < 10 {
            let before = d.bytes().0;
            poll.poll(&mut events, Some(Duration::from_millis(20)))
                .expect("poll");
            for e in events.iter() {
                d.handle_event(poll.registry(), e, Instant::now());
            }
            d.drive(poll.registry(), Instant::now());
            quiet = if d.bytes().0 == before { quiet + 1 } else { 0 };
        }
        d.bytes().0
    }

    #[test]
    fn events_nobody_takes_stop_the_reads_one_pass_past_the_allowance() {
        // The socket was held only while the caller was over its memory budget: events
        // read and not yet taken (a caller slowed by that budget, a turn's rounds used
        // up) piled up as fast as the server wrote, up to `max_pending_messages`
        // messages of any size.
        const SIZE: usize = 1024;
        const FLOOD: usize = 16 * 1024;
        let port = flooding_server(FLOOD, SIZE);
        let mut poll = mio::Poll::new().expect("poll");
        let mut events = mio::Events::with_capacity(16);
        let now = Instant::now();
        let conn = Connection::new(Options::new(&format!("nats://127.0.0.1:{port}")), now);
        let mut d = Driver::new(conn, Token(1));
        d.drive(poll.registry(), now);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !d.connection().is_connected() {
            assert!(Instant::now() < deadline, "never connected");
            poll.poll(&mut events, Some(Duration::from_millis(50)))
                .expect("poll");
            for e in events.iter() {
                d.handle_event(poll.registry(), e, Instant::now());
            }
            d.drive(poll.registry(), Instant::now());
        }
        while d.connection_mut().poll_event().is_some() {}
        d.connection_mut()
            .subscribe("flood", None)
            .expect("subscribe");
        d.drive(poll.registry(), Instant::now());

        turns_until_quiet(&mut d, &mut poll);
        let allowance = MAX_READS_PER_PASS * READ_CHUNK;
        let queued = d.connection().queued_bytes();
        assert!(
            queued > 0 && queued <= allowance + READ_CHUNK + SIZE,
            "{queued} bytes of events queued, one pass is {allowance}"
        );
        // Taken, they make room: the reads go on.
        let mut taken = 0;
        while let Some(e) = d.connection_mut().poll_event() {
            taken += usize::from(matches!(e, Event::Message { .. }));
        }
        assert_eq!(d.connection().queued_bytes(), 0);
        let read = d.bytes().0;
        turns_until_quiet(&mut d, &mut poll);
        assert!(
            d.bytes().0 > read,
            "nothing read once the events were taken"
        );
        assert!(d.connection().queued_bytes() > 0 && taken < FLOOD);
    }

    #[test]
    fn a_flood_is_read_one_pass_per_turn() {
        use std::io::Write as _;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            let info = "INFO {\"server_id\":\"S\",\"version\":\"2.15.1\",\"proto\":1,\"headers\":true,\"max_payload\":1048576}\r\n";
            s.write_all(info.as_bytes()).expect("info");
            let flood = "+OK\r\n".repeat(1 << 20);
            let _ = s.write_all(flood.as_bytes());
            // Open until the test is done with it (not joined).
            std::thread::sleep(Duration::from_secs(10));
        });
        let mut poll = mio::Poll::new().expect("poll");
        let mut events = mio::Events::with_capacity(16);
        let now = Instant::now();
        let conn = Connection::new(Options::new(&format!("nats://127.0.0.1:{port}")), now);
        let mut d = Driver::new(conn, Token(1)).with_read_allowance(2 * READ_CHUNK);
        d.drive(poll.registry(), now);
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.bytes().0 == 0 {
            assert!(Instant::now() < deadline, "no INFO");
            poll.poll(&mut events, Some(Duration::from_millis(50)))
                .expect("poll");
            for e in events.iter() {
                d.handle_event(poll.registry(), e, now);
            }
        }
        // Each time as after a pass that stopped at its allowance: the rounds of the turn
        // read nothing, its one `drive` reads at most a pass.
        let pass = 2 * READ_CHUNK as u64;
        loop {
            assert!(Instant::now() < deadline, "the flood never came");
            let (read, _) = d.bytes();
            d.read_more = true;
            d.drive_writes(poll.registry(), now);
            assert_eq!(d.bytes().0, read, "the rounds of a turn read nothing");
            d.drive(poll.registry(), now);
            let (after, _) = d.bytes();
            assert!(after - read <= pass, "one pass");
            if after > read {
                break;
            }
        }
        // A pass a readiness event read counts as the turn's.
        d.read(poll.registry(), now, false);
        let (read, _) = d.bytes();
        d.read_more = true;
        d.drive(poll.registry(), now);
        assert_eq!(d.bytes().0, read, "one pass per turn, readiness included");
    }
}
