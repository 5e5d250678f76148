//! Requests of one kind to JetStream's API, at most a fixed number out at a time, the rest
//! waiting their turn in arrival order, each key once.
//!
//! Why: nats-server answers API requests from one queue and creates file-backed durable
//! consumers one after another. Ten thousand participants logging in at once (a broker
//! restart) used to send ten thousand creations at once: the server got through a few
//! hundred a second, most requests outlived their 4 s timeout in that queue and were sent
//! again, the server went on creating consumers for half a minute, and every other API
//! request (topic subscriptions, the task store) waited behind them. Out a few at a time,
//! each is answered well within its timeout and nothing is asked twice.

use std::collections::{HashSet, VecDeque};

#[derive(Debug)]
pub struct Admission {
    limit: usize,
    in_flight: usize,
    /// Arrival order; may still hold keys that were withdrawn (skipped when reached).
    order: VecDeque<String>,
    /// The keys waiting now.
    waiting: HashSet<String>,
}

impl Admission {
    pub fn new(limit: usize) -> Admission {
        Admission {
            limit: limit.max(1),
            in_flight: 0,
            order: VecDeque::new(),
            waiting: HashSet::new(),
        }
    }

    /// Queues `key` unless it already waits.
    pub fn push(&mut self, key: &str) {
        if self.waiting.contains(key) {
            return;
        }
        // Withdrawn keys are dropped when reached; compacting keeps the order within
        // twice what waits however many come and go meanwhile.
        if self.order.len() >= 2 * self.waiting.len() + 64 {
            let waiting = &self.waiting;
            self.order.retain(|k| waiting.contains(k));
        }
        self.waiting.insert(key.to_string());
        self.order.push_back(key.to_string());
    }

    /// Takes `key` out of the queue (its participant left); one already out is not
    /// affected.
    pub fn withdraw(&mut self, key: &str) {
        self.waiting.remove(key);
    }

    /// The next key whose request may go out now, counted as out until [`done`].
    ///
    /// [`done`]: Admission::done
    pub fn admit(&mut self) -> Option<String> {
        if self.in_flight >= self.limit {
            return None;
        }
        while let Some(key) = self.order.pop_front() {
            if self.waiting.remove(&key) {
                self.in_flight += 1;
                return Some(key);
            }
        }
        None
    }

    /// A request taken with [`admit`](Admission::admit) was answered, failed or not sent.
    pub fn done(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Keys waiting plus requests out.
    pub fn backlog(&self) -> usize {
        self.waiting.len() + self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_limit_is_out_and_the_rest_follows_in_order_once_each() {
        let mut a = Admission::new(2);
        for k in ["a", "b", "a", "c", "d"] {
            a.push(k);
        }
        assert_eq!(a.backlog(), 4);
        assert_eq!(a.admit().as_deref(), Some("a"));
        assert_eq!(a.admit().as_deref(), Some("b"));
        assert_eq!(a.admit(), None, "two are out");
        a.withdraw("c");
        a.done();
        assert_eq!(a.admit().as_deref(), Some("d"), "c left while waiting");
        assert_eq!(a.admit(), None);
        a.done();
        a.done();
        assert_eq!(a.admit(), None);
        assert_eq!(a.backlog(), 0);
        // A key out may wait again (its retry) while its first request is still out.
        a.push("a");
        assert_eq!(a.admit().as_deref(), Some("a"));
    }

    #[test]
    fn keys_that_come_and_go_do_not_grow_the_queue() {
        let mut a = Admission::new(1);
        a.push("stays");
        assert_eq!(a.admit().as_deref(), Some("stays"));
        a.push("blocked");
        for i in 0..100_000 {
            let key = format!("k{i}");
            a.push(&key);
            a.withdraw(&key);
        }
        assert!(
            a.order.len() <= 2 * a.waiting.len() + 64,
            "{}",
            a.order.len()
        );
        a.done();
        assert_eq!(a.admit().as_deref(), Some("blocked"));
    }
}
