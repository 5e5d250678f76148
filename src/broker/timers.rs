//! The core's one timer table. Every capability's deadlines (hello timeouts, registry
//! refreshes, pull checks, offer and lease expiries, MIG deadlines) wait here, typed by
//! capability, and fire in deadline order, first scheduled first among equal deadlines,
//! so a run on a virtual clock is the same every time.
//!
//! Capabilities hold no reference to the core: they put their deadlines in a [`Later`]
//! list, which the core files after every input it hands them (and between the timers it
//! fires). A timer is never cancelled: when it fires, the capability checks whether it
//! still matters (a generation, a phase), which costs less than finding it in the heap.
//! Timers that no longer matter would otherwise wait for their deadlines (a lease's
//! expiry re-armed by every heartbeat, the deadline of an invocation long answered), so
//! whenever the table has doubled since it was last swept, [`Timers::prune`] drops them:
//! the table stays within twice what matters, at a sweep's cost spread over as many
//! schedulings as it holds.

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

/// Timers held without a sweep, at least (see [`Timers::due_for_pruning`]).
const PRUNE_FLOOR: usize = 1024;

#[derive(Default)]
pub struct Timers {
    /// (deadline, order of scheduling): the order breaks ties deterministically.
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    wakes: IdMap<u64, Wake>,
    next: u64,
    /// How many timers were left by the last sweep.
    kept: usize,
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
        loop {
            let Reverse((at, n)) = *self.heap.peek()?;
            if at > now {
                return None;
            }
            self.heap.pop();
            if let Some(w) = self.wakes.remove(&n) {
                return Some((at, w));
            }
        }
    }

    /// The table has doubled since its last sweep (and holds more than a few).
    pub fn due_for_pruning(&self) -> bool {
        self.heap.len() > PRUNE_FLOOR.max(2 * self.kept)
    }

    /// Drops every timer `matters` says no longer does; the others keep their order.
    pub fn prune(&mut self, mut matters: impl FnMut(Instant, &Wake) -> bool) {
        let wakes = &mut self.wakes;
        self.heap.retain(|Reverse((at, n))| {
            let keep = wakes.get(n).is_some_and(|w| matters(*at, w));
            if !keep {
                wakes.remove(n);
            }
            keep
        });
        self.kept = self.heap.len();
    }

    pub fn armed(&self) -> usize {
        self.heap.len()
    }

    /// Gives back the room a burst of timers left (see [`crate::heap::Compact`]).
    pub fn compact(&mut self) {
        use crate::heap::Compact;
        self.heap.compact();
        self.wakes.compact();
    }
}
