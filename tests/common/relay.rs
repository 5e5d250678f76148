//! A TCP relay the test owns, standing in for a network link it can cut and restore: a
//! loopback port whose connections are forwarded to `target`.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub struct Relay {
    pub port: u16,
    open: Arc<AtomicBool>,
    /// Connections stay open but carry nothing: a link that died without a word.
    frozen: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<Link>>>,
    acceptor: Option<JoinHandle<()>>,
}

/// One forwarded connection: both sockets, the first bytes its client sent, and whether
/// it alone is frozen ([`Relay::freeze_where`]).
struct Link {
    streams: [TcpStream; 2],
    said: Arc<Mutex<Vec<u8>>>,
    frozen: Arc<AtomicBool>,
}

impl Relay {
    /// Forwards a free loopback port to `target` (`host:port`), open from the start.
    pub fn start(target: &str) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("relay port");
        let port = listener.local_addr().expect("relay addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let frozen = Arc::new(AtomicBool::new(false));
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<Link>>> = Arc::default();
        let target = target.to_string();
        let acceptor = {
            let (open, frozen, stopping, conns) = (
                open.clone(),
                frozen.clone(),
                stopping.clone(),
                conns.clone(),
            );
            std::thread::spawn(move || {
                for inbound in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(inbound) = inbound else { continue };
                    if !open.load(Ordering::SeqCst) {
                        continue; // dropped: the link is down
                    }
                    let Ok(outbound) = TcpStream::connect(&target) else {
                        continue;
                    };
                    let mut list = conns.lock().expect("relay lock");
                    // A cut while this connection was being made: `cut` clears `open`
                    // before it takes the lock, so a connection listed here is one it
                    // shuts, and one it would not see is not piped.
                    if !open.load(Ordering::SeqCst) {
                        continue;
                    }
                    let said = Arc::<Mutex<Vec<u8>>>::default();
                    let link_frozen = Arc::new(AtomicBool::new(false));
                    if let (Ok(a), Ok(b)) = (inbound.try_clone(), outbound.try_clone()) {
                        list.push(Link {
                            streams: [a, b],
                            said: said.clone(),
                            frozen: link_frozen.clone(),
                        });
                    }
                    drop(list);
                    let frozen = [frozen.clone(), link_frozen];
                    pipe(&inbound, &outbound, &frozen, Some(said));
                    pipe(&outbound, &inbound, &frozen, None);
                }
            })
        };
        Relay {
            port,
            open,
            frozen,
            stopping,
            conns,
            acceptor: Some(acceptor),
        }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Closes every forwarded connection and refuses new ones until [`Relay::restore`].
    pub fn cut(&self) {
        self.cut_where(|_| true);
    }

    /// Closes the forwarded connections whose client's first bytes (a NATS client's
    /// `CONNECT {...}`, with its `name`) `said` holds true for, and refuses new ones
    /// until [`Relay::restore`]; the others stay. How many it closed.
    pub fn cut_where(&self, said: impl Fn(&str) -> bool) -> usize {
        self.open.store(false, Ordering::SeqCst);
        let mut list = self.conns.lock().expect("relay lock");
        let (cut, kept): (Vec<Link>, Vec<Link>) = list.drain(..).partition(|link| {
            said(&String::from_utf8_lossy(
                &link.said.lock().expect("relay lock"),
            ))
        });
        *list = kept;
        for link in &cut {
            for s in &link.streams {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        cut.len()
    }

    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.frozen.store(false, Ordering::SeqCst);
        for link in self.conns.lock().expect("relay lock").iter() {
            link.frozen.store(false, Ordering::SeqCst);
        }
    }

    /// Drops everything in both directions from now on, closing nothing: only the
    /// endpoints' own pings can tell the link is gone.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// [`Relay::freeze`] for the forwarded connections whose client's first bytes `said`
    /// holds true for (see [`Relay::cut_where`]); the others, and new ones, carry on. How
    /// many it froze.
    pub fn freeze_where(&self, said: impl Fn(&str) -> bool) -> usize {
        let list = self.conns.lock().expect("relay lock");
        let frozen = list.iter().filter(|link| {
            said(&String::from_utf8_lossy(
                &link.said.lock().expect("relay lock"),
            ))
        });
        frozen
            .inspect(|link| link.frozen.store(true, Ordering::SeqCst))
            .count()
    }
}

/// Copies `from` to `to` on a thread until either side closes; drops the bytes while
/// either of `frozen` (the relay's, the link's) is set. The first 4 KiB go into `said` too.
fn pipe(
    from: &TcpStream,
    to: &TcpStream,
    frozen: &[Arc<AtomicBool>; 2],
    said: Option<Arc<Mutex<Vec<u8>>>>,
) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    let frozen = frozen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            if let Some(said) = said.as_ref() {
                let mut said = said.lock().expect("relay lock");
                let room = 4096usize.saturating_sub(said.len()).min(n);
                said.extend_from_slice(&buf[..room]);
            }
            if frozen.iter().any(|f| f.load(Ordering::SeqCst)) {
                continue;
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.cut();
        // Wakes the acceptor so it sees `stopping`.
        let _ = TcpStream::connect(self.addr());
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}
