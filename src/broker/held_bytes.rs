//! Client bytes the broker holds while JetStream answers: a submit's task message until
//! the task store's create is answered, a submit's frame while its task budget is read, a
//! MIG PUBLISH's event until it is stored, a MIG INVOKE's payload until its submit.
//! Requests in flight are capped in number, not in bytes; with JetStream slow, pipelined
//! submits of large bodies held up to a thousand of them per session for the 4 s request
//! timeout, outside every memory bound. Together they hold at most this bound.

use std::cell::Cell;
use std::rc::Rc;

use crate::amp::{AmpError, ErrorCode};

/// Past the bound a submit answers `unavailable` with this hint: the bytes come back as
/// JetStream answers, within the request timeout.
pub const RETRY_AFTER_MS: u64 = 1000;

/// The bound and what is held against it; clones share both.
#[derive(Debug, Clone)]
pub struct HeldBytes {
    held: Rc<Cell<usize>>,
    cap: usize,
}

/// Bytes held until this is dropped, with what holds them.
#[derive(Debug)]
pub struct Hold {
    held: Rc<Cell<usize>>,
    bytes: usize,
}

impl HeldBytes {
    pub fn new(cap: usize) -> HeldBytes {
        HeldBytes {
            held: Rc::new(Cell::new(0)),
            cap,
        }
    }

    /// Holds `bytes`, or `None` when they do not fit.
    pub fn take(&self, bytes: usize) -> Option<Hold> {
        let held = self.held.get().checked_add(bytes)?;
        (held <= self.cap).then(|| {
            self.held.set(held);
            Hold {
                held: Rc::clone(&self.held),
                bytes,
            }
        })
    }

    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// Whether `bytes` would fit now: asked before a submit's rate and budget are
    /// charged, so that a refusal for want of room spends neither.
    pub fn has_room(&self, bytes: usize) -> bool {
        self.held.get().saturating_add(bytes) <= self.cap
    }
}

/// The answer to a submit past the bound: JetStream is slow, the room comes back as it
/// answers.
pub fn full() -> AmpError {
    let mut e = AmpError::new(
        ErrorCode::Unavailable,
        "the broker holds as many submits as it may while JetStream answers",
    );
    e.retry_after_ms = Some(RETRY_AFTER_MS);
    e
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.held.set(self.held.get().saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_held_until_their_hold_is_dropped() {
        let bytes = HeldBytes::new(100);
        let a = bytes.take(60).expect("room");
        assert!(bytes.take(41).is_none());
        let b = bytes.clone().take(40).expect("room");
        assert_eq!(bytes.held(), 100);
        drop(a);
        assert_eq!(bytes.held(), 40);
        assert!(bytes.take(usize::MAX).is_none());
        drop(b);
        assert_eq!(bytes.held(), 0);
    }
}
