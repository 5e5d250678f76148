//! The core's one timer table. Every capability's deadlines (hello timeouts, registry
//! refreshes, pull checks, offer and lease expiries, MIG deadlines) wait here, typed by
//! capability, and fire in deadline order, first scheduled first among equal deadlines,
//! so a run on a virtual clock is the same every time.
//!
//! Capabilities hold no reference to the core: they put their deadlines in a [`Later`]
//! list, which the core files after every input it hands them (and between the timers it
//! fires). A timer is never cancelled: when it fires, the capability checks whether it
//! still matters (a generation, a phase), which costs less than finding it in the heap.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use super::id_map::IdMap;

/// What a timer wakes, by capability.
pub enum Wake {
    Core(super::core::Alarm),
    Jobs(super::jobs::Alarm),
    Mig(super::mig::Alarm),
}

/// Deadlines a capability set, waiting to be filed in the core's table.
pub struct Later<T> {
    list: Vec<(Instant, T)>,
}

impl<T> Default for Later<T> {
    fn default() -> Self {
        Later { list: Vec::new() }
    }
}

impl<T> Later<T> {
    pub fn push(&mut self, at: Instant, what: T) {
        self.list.push((at, what));
    }
}

#[derive(Default)]
pub struct Timers {
    /// (deadline, order of scheduling): the order breaks ties deterministically.
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    wakes: IdMap<u64, Wake>,
    next: u64,
}

impl Timers {
    pub fn schedule(&mut self, at: Instant, wake: Wake) {
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        self.heap.push(Reverse((at, n)));
        self.wakes.insert(n, wake);
    }

    /// Files what a capability set, wrapped as that capability's wake-up.
    pub fn file<T>(&mut self, later: &mut Later<T>, wrap: impl Fn(T) -> Wake) {
        for (at, what) in later.list.drain(..) {
            self.schedule(at, wrap(what));
        }
    }

    /// The earliest deadline.
    pub fn next_at(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((at, _))| *at)
    }

    /// The next timer due at `now`, with its deadline.
    pub fn pop_due(&mut self, now: Instant) -> Option<(Instant, Wake)> {
        let Reverse((at, n)) = *self.heap.peek()?;
        if at > now {
            return None;
        }
        self.heap.pop();
        self.wakes.remove(&n).map(|w| (at, w))
    }

    pub fn armed(&self) -> usize {
        self.heap.len()
    }
}
