//! Test support for the WebSocket transport: a `WsServer` running its own loop on a
//! thread (echoing text, flooding on request, draining on command), real WebSocket
//! clients, and raw TCP clients that speak the handshake by hand.
#![allow(dead_code)]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use amp_broker::ws::{HttpHost, SessionEvent, SessionId, WsConfig, WsServer};
use mio::{Poll, Token, Waker};
use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::WebSocket;

pub struct Host {
    pub healthy: AtomicBool,
}

impl HttpHost for Host {
    fn health(&self) -> Result<(), String> {
        if self.healthy.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err("nats: not connected".into())
        }
    }
    fn metrics(&self, out: &mut String) {
        out.push_str("# TYPE amp_sessions gauge\namp_sessions 0\n");
    }
}

/// What the server saw, for assertions.
#[derive(Default)]
pub struct Seen {
    pub events: Mutex<Vec<(SessionId, SessionEvent)>>,
    pub opened: AtomicUsize,
    pub closed: AtomicUsize,
}

impl Seen {
    pub fn closes(&self) -> Vec<(u16, String, bool)> {
        let events = self.events.lock().map(|e| e.clone()).unwrap_or_default();
        events
            .into_iter()
            .filter_map(|(_, e)| match e {
                SessionEvent::Closed {
                    code,
                    reason,
                    by_peer,
                } => Some((code, reason, by_peer)),
                _ => None,
            })
            .collect()
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub host: Arc<Host>,
    pub seen: Arc<Seen>,
    drain: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

/// Text `flood` makes the server send a 64 KiB message to that session every loop turn
/// until it is closed; text `drain` queues three messages and starts draining the
/// server; text `login` admits the session (as a broker does once its hello passed) and
/// is echoed; any other text is echoed.
pub fn start(cfg: WsConfig) -> TestServer {
    start_with(cfg, None)
}

/// [`start`] serving TLS (wss://, https://) with `tls`.
pub fn start_tls(cfg: WsConfig, tls: Arc<rustls::ServerConfig>) -> TestServer {
    start_with(cfg, Some(tls))
}

fn start_with(cfg: WsConfig, tls: Option<Arc<rustls::ServerConfig>>) -> TestServer {
    let mut poll = Poll::new().expect("poll");
    let waker = Arc::new(Waker::new(poll.registry(), Token(1 << 40)).expect("waker"));
    let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    let mut server = WsServer::bind(addr, cfg, poll.registry(), Token(0), 1).expect("bind");
    server.set_tls(tls);
    let addr = server.local_addr();
    let host = Arc::new(Host {
        healthy: AtomicBool::new(true),
    });
    let seen = Arc::new(Seen::default());
    let drain = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let (host, seen, drain, stop) = (host.clone(), seen.clone(), drain.clone(), stop.clone());
        std::thread::spawn(move || {
            let flooding = std::cell::RefCell::new(HashSet::new());
            let chunk = "f".repeat(64 << 10);
            run_loop(
                &mut server,
                &mut poll,
                &host,
                &seen,
                &drain,
                &stop,
                &flooding,
                &chunk,
            );
        })
    };
    TestServer {
        addr,
        host,
        seen,
        drain,
        stop,
        waker,
        thread: Some(thread),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_loop(
    server: &mut WsServer,
    poll: &mut Poll,
    host: &Host,
    seen: &Seen,
    drain: &AtomicBool,
    stop: &AtomicBool,
    flooding: &std::cell::RefCell<HashSet<SessionId>>,
    chunk: &str,
) {
    let mut draining = false;
    let result = server.run(
        poll,
        host,
        |ws, id, event, now| {
            match &event {
                SessionEvent::Opened { .. } => {
                    seen.opened.fetch_add(1, Ordering::SeqCst);
                }
                SessionEvent::Closed { .. } => {
                    seen.closed.fetch_add(1, Ordering::SeqCst);
                    flooding.borrow_mut().remove(&id);
                }
                SessionEvent::Text(t) if t.as_str() == "flood" => {
                    flooding.borrow_mut().insert(id);
                }
                SessionEvent::Text(t) if t.as_str() == "login" => {
                    ws.admit(id);
                    let _ = ws.send_text(id, t.as_str(), now);
                }
                SessionEvent::Text(t) if t.as_str() == "drain" => {
                    for i in 0..3 {
                        let _ = ws.send_text(id, &format!("before drain {i}"), now);
                    }
                    drain.store(true, Ordering::SeqCst);
                }
                SessionEvent::Text(t) => {
                    let _ = ws.send_text(id, t.as_str(), now);
                }
            }
            if let Ok(mut events) = seen.events.lock() {
                events.push((id, event));
            }
        },
        |ws, registry, now| {
            // One message per turn: the queue only grows when the socket stops draining.
            for &id in flooding.borrow().iter() {
                let _ = ws.send_text(id, chunk, now);
            }
            if drain.load(Ordering::SeqCst) && !draining {
                draining = true;
                ws.begin_drain(registry, now);
            }
            !(stop.load(Ordering::SeqCst) || ws.is_drained())
        },
    );
    if let Err(e) = result {
        panic!("server loop failed: {e}");
    }
}

impl TestServer {
    pub fn url(&self) -> String {
        format!("ws://{}/amp", self.addr)
    }

    pub fn start_drain(&self) {
        self.drain.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
    }

    /// Waits for the server loop to end (after a drain).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            t.join().expect("server thread");
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub type Client = WebSocket<TcpStream>;

/// A real WebSocket client; `protocols` go into `Sec-WebSocket-Protocol`.
pub fn connect(
    server: &TestServer,
    protocols: Option<&str>,
) -> Result<(Client, tungstenite::handshake::client::Response), tungstenite::Error> {
    connect_over(
        server,
        protocols,
        TcpStream::connect(server.addr).expect("connect"),
    )
}

/// [`connect`] from the loopback address `from`.
pub fn connect_from(
    server: &TestServer,
    from: std::net::Ipv4Addr,
) -> Result<Client, tungstenite::Error> {
    let stream = super::common::connect_from(from, server.addr);
    connect_over(server, None, stream).map(|(c, _)| c)
}

fn connect_over(
    server: &TestServer,
    protocols: Option<&str>,
    stream: TcpStream,
) -> Result<(Client, tungstenite::handshake::client::Response), tungstenite::Error> {
    let mut request = server.url().into_client_request()?;
    if let Some(p) = protocols {
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", p.parse().expect("header value"));
    }
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    tungstenite::client(request, stream).map_err(|e| match e {
        tungstenite::HandshakeError::Failure(e) => e,
        tungstenite::HandshakeError::Interrupted(_) => {
            tungstenite::Error::Io(std::io::ErrorKind::WouldBlock.into())
        }
    })
}

/// One plain HTTP/1.1 request over a fresh connection; the whole response (the server
/// closes after it).
pub fn http(server: &TestServer, request: &str) -> String {
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    s.write_all(request.as_bytes()).expect("write request");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read response until close");
    String::from_utf8_lossy(&out).into_owned()
}

/// A raw TCP connection upgraded by hand; the response head is consumed.
pub fn raw_upgrade(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    upgrade_over(&mut s);
    s
}

/// Sends the upgrade request over `s` by hand and consumes the response head.
pub fn upgrade_over(s: &mut (impl Read + Write)) {
    s.write_all(
        b"GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
          Sec-WebSocket-Protocol: amp.v1\r\n\r\n",
    )
    .expect("write upgrade");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = s.read(&mut byte).expect("read response head");
        assert_eq!(n, 1, "connection closed during the handshake: {head:?}");
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101 "),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.flush().expect("flush");
}

/// A TCP stream that counts the bytes written to it: what the server has to read.
pub struct Counted {
    pub tcp: TcpStream,
    pub written: usize,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.tcp.read(buf)
    }
}

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.tcp.write(buf)?;
        self.written += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

/// A TLS client whose writes never read: `rustls::StreamOwned` reads whatever the server
/// sent at every write, which a client that does not read must not do.
pub struct TlsClient {
    pub conn: rustls::ClientConnection,
    pub sock: Counted,
}

impl TlsClient {
    fn write_records(&mut self) -> std::io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(&mut self.sock)?;
        }
        Ok(())
    }
}

impl Read for TlsClient {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                other => return other,
            }
            if self.conn.read_tls(&mut self.sock)? == 0 {
                return Ok(0);
            }
            self.conn
                .process_new_packets()
                .map_err(std::io::Error::other)?;
        }
    }
}

impl Write for TlsClient {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_records()?;
        let n = self.conn.writer().write(buf)?;
        self.write_records()?;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.write_records()
    }
}

/// A finished TLS handshake with the server from the loopback address `from`; `narrow`:
/// over [`connect_narrow`](super::common::connect_narrow), for a client that stops reading.
pub fn tls_connect(
    server: &TestServer,
    config: Arc<rustls::ClientConfig>,
    from: std::net::Ipv4Addr,
    narrow: bool,
) -> TlsClient {
    let tcp = if narrow {
        super::common::connect_narrow(from, server.addr)
    } else {
        super::common::connect_from(from, server.addr)
    };
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    let conn = rustls::ClientConnection::new(config, name).expect("client");
    let mut s = TlsClient {
        conn,
        sock: Counted { tcp, written: 0 },
    };
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).expect("TLS handshake");
    }
    s
}

/// Reads one server frame (opcode, payload) from a raw connection.
pub fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut h = [0u8; 2];
    s.read_exact(&mut h)?;
    let len = match h[1] & 0x7F {
        126 => {
            let mut b = [0u8; 2];
            s.read_exact(&mut b)?;
            u16::from_be_bytes(b) as usize
        }
        127 => {
            let mut b = [0u8; 8];
            s.read_exact(&mut b)?;
            u64::from_be_bytes(b) as usize
        }
        n => n as usize,
    };
    let mut payload = vec![0; len];
    s.read_exact(&mut payload)?;
    Ok((h[0] & 0x0F, payload))
}
