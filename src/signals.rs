//! SIGINT/SIGTERM as readiness events on the mio loop (the self-pipe trick): the handler
//! only writes the signal number to a non-blocking pipe, which the loop polls like a socket.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};

use mio::event::Source;
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};

static WRITE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(signal: libc::c_int) {
    let fd = WRITE_FD.load(Ordering::Relaxed);
    if fd >= 0 {
        let byte = signal as u8;
        // SAFETY: write(2) is async-signal-safe; a full pipe drops the byte, which is fine
        // because one pending byte already wakes the loop.
        unsafe { libc::write(fd, (&byte as *const u8).cast(), 1) };
    }
}

/// The read end of the signal pipe. One per process.
pub struct Signals {
    read_fd: RawFd,
}

impl Signals {
    /// Routes SIGINT and SIGTERM to the returned pipe.
    pub fn install() -> io::Result<Signals> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 fills the two-element array it is given.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        WRITE_FD.store(fds[1], Ordering::Relaxed);
        for signal in [libc::SIGINT, libc::SIGTERM] {
            // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as *const () as usize;
                action.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut action.sa_mask);
                if libc::sigaction(signal, &action, std::ptr::null_mut()) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
        }
        Ok(Signals { read_fd: fds[0] })
    }

    /// The signals received since the last call, oldest first.
    pub fn take(&mut self) -> Vec<i32> {
        let mut received = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            // SAFETY: reads into a buffer of the given length from our own pipe.
            let n = unsafe { libc::read(self.read_fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return received;
            }
            received.extend(buf.iter().take(n as usize).map(|&b| i32::from(b)));
        }
    }
}

impl Source for Signals {
    fn register(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        SourceFd(&self.read_fd).register(registry, token, interests)
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: Token,
        interests: Interest,
    ) -> io::Result<()> {
        SourceFd(&self.read_fd).reregister(registry, token, interests)
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        SourceFd(&self.read_fd).deregister(registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_sigterm_wakes_the_poll_and_is_reported_once() {
        let mut signals = Signals::install().expect("install");
        let mut poll = mio::Poll::new().expect("poll");
        poll.registry()
            .register(&mut signals, Token(7), Interest::READABLE)
            .expect("register");
        // SAFETY: raise(3) sends the signal to this process; the handler above catches it.
        assert_eq!(unsafe { libc::raise(libc::SIGTERM) }, 0);
        let mut events = mio::Events::with_capacity(4);
        poll.poll(&mut events, Some(Duration::from_secs(5)))
            .expect("poll");
        assert!(events.iter().any(|e| e.token() == Token(7)));
        assert_eq!(signals.take(), vec![libc::SIGTERM]);
        assert!(signals.take().is_empty());
    }
}
