//! The model on a loopback TCP port, for tests that connect with real sockets: one
//! background thread with a mio loop and the real clock. Killing it keeps the model's
//! streams (a restart with a file store); starting it again serves them on the same port.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use super::{ClientId, ModelOptions, Server};

const LISTENER: Token = Token(usize::MAX);
const WAKER: Token = Token(usize::MAX - 1);
/// Read at most this much from one connection per turn, so one cannot starve the rest.
const READ_PER_TURN: usize = 1024 * 1024;

struct Running {
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    thread: JoinHandle<Server>,
}

/// A model server on `127.0.0.1:<port>`, stopped when dropped.
pub struct ModelServer {
    addr: SocketAddr,
    running: Option<Running>,
    stopped: Option<Server>,
}

impl ModelServer {
    /// JetStream on, default limits, on a free port.
    pub fn start() -> ModelServer {
        ModelServer::start_with(ModelOptions::new(SystemTime::now()))
    }

    /// Fails (panics) only if no loopback port can be bound: a test setup problem.
    pub fn start_with(options: ModelOptions) -> ModelServer {
        let listener = TcpListener::bind("127.0.0.1:0".parse().expect("loopback address"))
            .expect("bind a loopback port for the NATS model");
        let addr = listener.local_addr().expect("listener address");
        let mut options = options;
        options.port = addr.port();
        let server = Server::new(options, Instant::now());
        let mut me = ModelServer {
            addr,
            running: None,
            stopped: None,
        };
        me.run(server, listener);
        me
    }

    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    fn run(&mut self, server: Server, listener: TcpListener) {
        let poll = Poll::new().expect("mio poll");
        let waker = Arc::new(Waker::new(poll.registry(), WAKER).expect("mio waker"));
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("nats-model".into())
            .spawn(move || serve(server, listener, poll, &flag))
            .expect("spawn the NATS model thread");
        self.running = Some(Running {
            stop,
            waker,
            thread,
        });
    }

    /// Stops serving and closes every connection; streams and consumers are kept.
    pub fn kill(&mut self) {
        if let Some(r) = self.running.take() {
            r.stop.store(true, Ordering::SeqCst);
            let _ = r.waker.wake();
            if let Ok(server) = r.thread.join() {
                self.stopped = Some(server);
            }
        }
    }

    /// Serves the kept state again on the same port.
    pub fn start_again(&mut self) {
        if self.running.is_some() {
            return;
        }
        let Some(mut server) = self.stopped.take() else {
            return;
        };
        server.restart(Instant::now());
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match TcpListener::bind(self.addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => panic!("rebind {} for the NATS model: {e}", self.addr),
            }
        };
        self.run(server, listener);
    }

    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn serve(
    mut server: Server,
    mut listener: TcpListener,
    mut poll: Poll,
    stop: &AtomicBool,
) -> Server {
    let mut events = Events::with_capacity(256);
    let mut conns: BTreeMap<ClientId, TcpStream> = BTreeMap::new();
    if poll
        .registry()
        .register(&mut listener, LISTENER, Interest::READABLE)
        .is_err()
    {
        return server;
    }
    let mut buf = vec![0u8; 64 * 1024];
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        let wait = server
            .poll_timeout()
            .map_or(Duration::from_millis(100), |t| {
                t.saturating_duration_since(now)
            })
            .min(Duration::from_millis(100));
        if poll.poll(&mut events, Some(wait)).is_err() {
            continue;
        }
        let now = Instant::now();
        loop {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    let id = server.accept(now);
                    let token = Token(id as usize);
                    if poll
                        .registry()
                        .register(&mut stream, token, Interest::READABLE | Interest::WRITABLE)
                        .is_ok()
                    {
                        conns.insert(id, stream);
                    } else {
                        server.disconnect(id, now);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => break,
            }
        }
        let mut gone = Vec::new();
        for (id, stream) in conns.iter_mut() {
            let mut taken = 0;
            while taken < READ_PER_TURN {
                match stream.read(&mut buf) {
                    Ok(0) => {
                        gone.push(*id);
                        break;
                    }
                    Ok(n) => {
                        taken += n;
                        server.receive(*id, &buf[..n], Instant::now());
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => {
                        gone.push(*id);
                        break;
                    }
                }
            }
        }
        let now = Instant::now();
        if server.poll_timeout().is_some_and(|t| t <= now) {
            server.handle_timeout(now);
        }
        for (id, stream) in conns.iter_mut() {
            loop {
                let out = server.output(*id);
                if out.is_empty() {
                    break;
                }
                match stream.write(out) {
                    Ok(0) => {
                        gone.push(*id);
                        break;
                    }
                    Ok(n) => server.consume_output(*id, n),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => {
                        gone.push(*id);
                        break;
                    }
                }
            }
            if server.is_closed(*id) && server.output(*id).is_empty() {
                gone.push(*id);
            }
        }
        gone.sort_unstable();
        gone.dedup();
        for id in gone {
            if let Some(mut s) = conns.remove(&id) {
                let _ = poll.registry().deregister(&mut s);
            }
            server.disconnect(id, Instant::now());
        }
    }
    server
}
