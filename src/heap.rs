//! Giving freed heap back to the OS. glibc keeps memory a burst freed (10,000 hellos, the
//! consumers they create and their first pulls) in its arenas, so a broker's resident size
//! follows its peak rather than what it holds; on an edge node that peak is what counts.
//! `malloc_trim` hands the free pages back; the event loop calls it now and then, when a
//! turn had nothing left over, so it never delays work waiting in the same turn.

use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hash};
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

    /// Whether a trim is due: the owner compacts its tables first ([`Compact`]), so what
    /// they held beyond their needs is free when [`Trimmer::trim`] runs.
    pub fn due(&self, now: Instant) -> bool {
        now >= self.next
    }

    /// Makes a trim due now: start-up (streams made, schemas compiled) leaves a few
    /// megabytes free that would otherwise stay resident until the first interval ends.
    pub fn soon(&mut self, now: Instant) {
        self.next = self.next.min(now);
    }

    pub fn trim(&mut self, now: Instant) {
        self.next = now + TRIM_INTERVAL;
        trim();
    }
}

/// A table sized for a burst keeps that size when the burst is over (Rust's collections
/// never shrink on their own): 10,000 hellos leave request, timer and event tables with
/// room for 10,000 each, which `malloc_trim` cannot give back while they hold it.
/// `compact` shrinks a table to twice what it holds once it has four times that room.
pub trait Compact {
    fn compact(&mut self);
}

/// Room any table may keep however little it holds.
const COMPACT_FLOOR: usize = 64;

fn shrunk(len: usize, capacity: usize) -> Option<usize> {
    shrunk_to_floor(len, capacity, COMPACT_FLOOR)
}

fn shrunk_to_floor(len: usize, capacity: usize, floor: usize) -> Option<usize> {
    (capacity > floor && capacity / 4 > len).then(|| (2 * len).max(floor))
}

/// Room a connection's byte buffer keeps however little it holds: what a busy moment
/// needs without growing again.
const BUFFER_FLOOR: usize = 64 << 10;

/// [`Compact`] for a connection's read or write buffer: a burst (10,000 logins' consumer
/// creations) grows the NATS write buffer to megabytes, which it kept for good.
pub fn compact_buffer(buf: &mut Vec<u8>) {
    if let Some(to) = shrunk_to_floor(buf.len(), buf.capacity(), BUFFER_FLOOR) {
        buf.shrink_to(to);
    }
}

impl<K: Eq + Hash, V, S: BuildHasher> Compact for HashMap<K, V, S> {
    fn compact(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

impl<K: Eq + Hash, S: BuildHasher> Compact for HashSet<K, S> {
    fn compact(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

impl<T> Compact for VecDeque<T> {
    fn compact(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

impl<T> Compact for Vec<T> {
    fn compact(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

impl<T: Ord> Compact for BinaryHeap<T> {
    fn compact(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_a_burst_grew_gives_its_room_back_but_keeps_what_it_holds() {
        let mut buf: Vec<u8> = Vec::with_capacity(4 << 20);
        compact_buffer(&mut buf);
        assert!(buf.capacity() <= 2 * BUFFER_FLOOR, "{}", buf.capacity());
        let mut buf = vec![7u8; 100 << 10];
        buf.reserve(1 << 20);
        compact_buffer(&mut buf);
        assert!(buf.capacity() <= 2 * (100 << 10), "{}", buf.capacity());
        assert!(buf.len() == 100 << 10 && buf.iter().all(|&b| b == 7));
        // Room a busy moment needs stays.
        let mut buf: Vec<u8> = Vec::with_capacity(BUFFER_FLOOR);
        compact_buffer(&mut buf);
        assert_eq!(buf.capacity(), BUFFER_FLOOR);
    }

    #[test]
    fn a_trim_made_due_by_start_up_comes_at_once_and_then_at_the_interval() {
        let t0 = Instant::now();
        let mut t = Trimmer::new(t0);
        assert!(!t.due(t0 + Duration::from_secs(1)));
        t.soon(t0 + Duration::from_secs(1));
        assert!(t.due(t0 + Duration::from_secs(1)));
        t.trim(t0 + Duration::from_secs(1));
        assert_eq!(t.deadline(), t0 + Duration::from_secs(1) + TRIM_INTERVAL);
    }

    #[test]
    fn an_idle_websocket_connection_keeps_no_event_room() {
        // Compacting a table holding a quarter of its room halves it, to a floor.
        let mut q: VecDeque<u64> = VecDeque::with_capacity(10_000);
        q.push_back(1);
        q.compact();
        assert!(q.capacity() < 10_000 && q.capacity() >= COMPACT_FLOOR);
    }
}
