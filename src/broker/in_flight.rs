//! Requests in flight per participant on this broker, one count for its WebSocket sessions
//! and its MIG requests (`limits.max_participant_requests_in_flight`): each may hold one of
//! the broker's NATS request slots, which everything it does shares, and a participant
//! reaching the cap through one front end must not find more room through the other.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

/// Past the cap a request is refused with this hint: requests are answered or time out
/// within seconds, most much sooner.
pub const FULL_RETRY_MS: u64 = 100;

/// Fewest entries at which counts nobody holds are swept.
const SWEEP_MIN: usize = 64;

/// The count of every participant (`ns/name`) that has a session or a request in flight.
/// A count lives as long as something holds it (a session, a [`Ticket`]); one nobody holds
/// is zero, so it is made again when needed.
#[derive(Default)]
pub struct Tally {
    counts: HashMap<String, Weak<Cell<usize>>>,
    /// The size at which entries of counts nobody holds are swept, so the map stays within
    /// twice what is held.
    sweep_at: usize,
}

impl Tally {
    /// The count of `participant`, shared with everyone else who holds it.
    pub fn count(&mut self, participant: &str) -> Rc<Cell<usize>> {
        if let Some(count) = self.counts.get(participant).and_then(Weak::upgrade) {
            return count;
        }
        if self.counts.len() >= self.sweep_at {
            self.counts.retain(|_, c| c.strong_count() > 0);
            self.sweep_at = (self.counts.len() * 2).max(SWEEP_MIN);
        }
        let count = Rc::default();
        self.counts
            .insert(participant.to_string(), Rc::downgrade(&count));
        count
    }

    /// Forgets counts nobody holds and gives back the room they left.
    pub fn compact(&mut self) {
        self.counts.retain(|_, c| c.strong_count() > 0);
        self.sweep_at = (self.counts.len() * 2).max(SWEEP_MIN);
        crate::heap::Compact::compact(&mut self.counts);
    }

    /// One more request of `participant` in flight, or `None` when it has `max`.
    pub fn take(&mut self, participant: &str, max: usize) -> Option<Ticket> {
        let count = self.count(participant);
        if count.get() >= max {
            return None;
        }
        count.set(count.get() + 1);
        Some(Ticket(count))
    }
}

/// A request counted in its participant's requests in flight until this is dropped, on
/// whatever path its answer (or its timeout, or the loss of the connection) ends it.
#[derive(Debug)]
pub struct Ticket(Rc<Cell<usize>>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_and_sessions_share_one_count_that_comes_back_when_dropped() {
        let mut t = Tally::default();
        let session = t.count("acme/a");
        session.set(2);
        let one = t.take("acme/a", 4).expect("room");
        let two = t.take("acme/a", 4).expect("room");
        assert!(t.take("acme/a", 4).is_none(), "the session's two count");
        assert!(
            t.take("acme/b", 4).is_some(),
            "another participant has its own"
        );
        drop(one);
        assert_eq!(session.get(), 3);
        drop(two);
        assert_eq!(
            t.count("acme/a").get(),
            2,
            "the same count while it is held"
        );
    }

    #[test]
    fn counts_nobody_holds_are_forgotten() {
        let mut t = Tally::default();
        for i in 0..10_000 {
            let _held = t.take(&format!("acme/p{i}"), 1);
        }
        assert!(
            t.counts.len() <= 2 * SWEEP_MIN,
            "{} entries",
            t.counts.len()
        );
    }
}
