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
    conns: Arc<Mutex<Vec<TcpStream>>>,
    acceptor: Option<JoinHandle<()>>,
}

impl Relay {
    /// Forwards a free loopback port to `target` (`host:port`), open from the start.
    pub fn start(target: &str) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("relay port");
        let port = listener.local_addr().expect("relay addr").port();
        let open = Arc::new(AtomicBool::new(true));
        let frozen = Arc::new(AtomicBool::new(false));
        let stopping = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
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
                    for s in [&inbound, &outbound] {
                        if let Ok(c) = s.try_clone() {
                            list.push(c);
                        }
                    }
                    drop(list);
                    pipe(&inbound, &outbound, &frozen);
                    pipe(&outbound, &inbound, &frozen);
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
        self.open.store(false, Ordering::SeqCst);
        for c in self.conns.lock().expect("relay lock").drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
        self.frozen.store(false, Ordering::SeqCst);
    }

    /// Drops everything in both directions from now on, closing nothing: only the
    /// endpoints' own pings can tell the link is gone.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` on a thread until either side closes; drops the bytes while
/// `frozen`.
fn pipe(from: &TcpStream, to: &TcpStream, frozen: &Arc<AtomicBool>) {
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
            if frozen.load(Ordering::SeqCst) {
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
