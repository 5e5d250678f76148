//! Lame duck (SIGUSR2): the sessions open when it starts are closed one at a time, evenly
//! over the drain period, so a fleet of brokers being replaced does not send every client
//! back at once.

use std::time::{Duration, Instant};

/// The close schedule. Session `i` of `n` closes at `start + period * (i + 1) / (n + 1)`:
/// the first one a slice after the start and the last one a slice before the end, so
/// clients reconnecting elsewhere arrive at a steady rate.
#[derive(Debug)]
pub struct LameDuck {
    start: Instant,
    period: Duration,
    /// In close order; `next` indexes the first not yet handed out.
    sessions: Vec<u64>,
    next: usize,
}

impl LameDuck {
    pub fn new(mut sessions: Vec<u64>, start: Instant, period: Duration) -> LameDuck {
        // The oldest first: stable and easy to reason about in logs.
        sessions.sort_unstable();
        LameDuck {
            start,
            period,
            sessions,
            next: 0,
        }
    }

    fn slot(&self, index: usize) -> Instant {
        let slices = u32::try_from(self.sessions.len().saturating_add(1)).unwrap_or(u32::MAX);
        let nth = u32::try_from(index.saturating_add(1)).unwrap_or(u32::MAX);
        let offset = (self.period / slices.max(1)).saturating_mul(nth);
        self.start.checked_add(offset).unwrap_or(self.start)
    }

    /// The sessions whose turn has come by `now`.
    pub fn due(&mut self, now: Instant) -> Vec<u64> {
        let mut due = Vec::new();
        while self.next < self.sessions.len() && self.slot(self.next) <= now {
            due.push(self.sessions[self.next]);
            self.next += 1;
        }
        due
    }

    /// When the next session's turn comes; `None` once every session has been handed out.
    pub fn next_deadline(&self) -> Option<Instant> {
        (self.next < self.sessions.len()).then(|| self.slot(self.next))
    }

    /// The end of the period: whatever is still open then is closed at once.
    pub fn end(&self) -> Instant {
        self.start.checked_add(self.period).unwrap_or(self.start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closes_are_spread_evenly_over_the_period() {
        let t0 = Instant::now();
        let mut duck = LameDuck::new((0..9).rev().collect(), t0, Duration::from_secs(10));
        assert!(duck.due(t0).is_empty());
        assert_eq!(duck.next_deadline(), Some(t0 + Duration::from_secs(1)));
        assert_eq!(duck.due(t0 + Duration::from_millis(2500)), vec![0, 1]);
        assert_eq!(duck.next_deadline(), Some(t0 + Duration::from_secs(3)));
        assert_eq!(
            duck.due(t0 + Duration::from_secs(9)),
            vec![2, 3, 4, 5, 6, 7, 8]
        );
        assert_eq!(duck.next_deadline(), None);
        assert!(duck.due(t0 + Duration::from_secs(20)).is_empty());
        assert_eq!(duck.end(), t0 + Duration::from_secs(10));
    }

    #[test]
    fn no_sessions_means_nothing_to_wait_for() {
        let t0 = Instant::now();
        let mut duck = LameDuck::new(Vec::new(), t0, Duration::from_secs(30));
        assert_eq!(duck.next_deadline(), None);
        assert!(duck.due(t0 + Duration::from_secs(31)).is_empty());
    }
}
