//! The signals the broker acts on, as readiness events on the mio loop.
//!
//! `signal-hook-mio` does the self-pipe: its handler only writes to a socket pair (saving
//! and restoring `errno`, which a hand-written handler easily forgets), and the loop polls
//! the read end like any socket.

use std::io;

use mio::event::Source;
use mio::{Interest, Registry, Token};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR2};

/// What a signal asks of the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// SIGTERM, SIGINT: drain now and exit.
    Stop,
    /// SIGHUP: re-read the configuration file.
    Reload,
    /// SIGUSR2: stop accepting, close sessions spread over the drain timeout, exit.
    LameDuck,
}

/// The broker's signal source. One per process.
pub struct Signals {
    inner: signal_hook_mio::v1_0::Signals,
}

impl Signals {
    /// Routes SIGINT, SIGTERM, SIGHUP and SIGUSR2 to the returned source.
    pub fn install() -> io::Result<Signals> {
        let inner = signal_hook_mio::v1_0::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR2])?;
        Ok(Signals { inner })
    }

    /// The requests received since the last call, oldest first (a signal sent twice before
    /// the loop looks may be reported once).
    pub fn take(&mut self) -> Vec<Request> {
        self.inner
            .pending()
            .filter_map(|signal| match signal {
                SIGINT | SIGTERM => Some(Request::Stop),
                SIGHUP => Some(Request::Reload),
                SIGUSR2 => Some(Request::LameDuck),
                _ => None,
            })
            .collect()
    }
}

impl Source for Signals {
    fn register(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        self.inner.register(registry, token, interests)
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        self.inner.reregister(registry, token, interests)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        self.inner.deregister(registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn signals_wake_the_poll_and_are_reported_once() {
        let mut signals = Signals::install().expect("install");
        let mut poll = mio::Poll::new().expect("poll");
        poll.registry()
            .register(&mut signals, Token(7), Interest::READABLE)
            .expect("register");
        // SAFETY: raise(3) sends the signal to this process; the handler above catches it.
        assert_eq!(unsafe { libc::raise(libc::SIGHUP) }, 0);
        let mut events = mio::Events::with_capacity(4);
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen = Vec::new();
        while seen.is_empty() && Instant::now() < deadline {
            poll.poll(&mut events, Some(Duration::from_millis(100)))
                .expect("poll");
            seen = signals.take();
        }
        assert_eq!(seen, vec![Request::Reload]);
        assert!(signals.take().is_empty());
    }
}
