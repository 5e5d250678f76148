//! Giving freed heap back to the OS. glibc keeps memory a burst freed (10,000 hellos, the
//! consumers they create and their first pulls) in its arenas, so a broker's resident size
//! follows its peak rather than what it holds; on an edge node that peak is what counts.
//! `malloc_trim` hands the free pages back; the event loop calls it now and then, when a
//! turn had nothing left over, so it never delays work waiting in the same turn.

use std::time::{Duration, Instant};

/// At most this often: a trim walks the free lists, and pages it gives back are faulted in
/// again when the heap grows into them.
const TRIM_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Trimmer {
    next: Instant,
}

impl Trimmer {
    pub fn new(now: Instant) -> Trimmer {
        Trimmer {
            next: now + TRIM_INTERVAL,
        }
    }

    /// When the next trim is due.
    pub fn deadline(&self) -> Instant {
        self.next
    }

    /// Trims when due.
    pub fn tick(&mut self, now: Instant) {
        if now < self.next {
            return;
        }
        self.next = now + TRIM_INTERVAL;
        trim();
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim() {
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}
