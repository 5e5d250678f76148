//! JetStream API requests made on sessions' behalf (topic consumers created, looked up,
//! counted, deleted), at most a fixed number out at a time, sessions taking turns.
//!
//! Why: nats-server answers API requests from one queue, a few hundred consumer creations
//! a second. A participant subscribing and unsubscribing at its frame rate used to put a
//! creation and a delete into that queue for every two frames; sixteen such sessions kept
//! it seconds long, and another participant's `subscribe` timed out behind them
//! (`tests/hostile_topics.rs`). Out a few at a time, turn by turn, a session's request
//! waits behind at most one of every other session's, whatever they ask.
//!
//! Clean-ups (deletes of consumers whose session ended, hand-backs of a durable's
//! events) take every other place, and any place sessions leave: they free what the
//! server holds and do not pile up behind creations, yet a participant ending sessions
//! as fast as it can open them does not stop every other session's requests.

use std::collections::{HashMap, VecDeque};

use super::SessionId;

/// Whose turn a request waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// Work left by sessions that ended; before any session's.
    Cleanup,
    Session(SessionId),
}

#[derive(Debug)]
struct Waiting<T> {
    items: VecDeque<T>,
    /// Tells this lane's entry in `turns` from one left by an earlier lane of the session.
    ticket: u64,
}

#[derive(Debug)]
pub struct ApiQueue<T> {
    limit: usize,
    in_flight: usize,
    cleanup: VecDeque<T>,
    /// The next place goes to a clean-up if one waits.
    cleanup_turn: bool,
    sessions: HashMap<SessionId, Waiting<T>>,
    /// Sessions with requests waiting, in turn order; entries of lanes taken away are
    /// skipped when reached.
    turns: VecDeque<(SessionId, u64)>,
    tickets: u64,
    waiting: usize,
}

impl<T> ApiQueue<T> {
    pub fn new(limit: usize) -> ApiQueue<T> {
        ApiQueue {
            limit: limit.max(1),
            in_flight: 0,
            cleanup: VecDeque::new(),
            cleanup_turn: true,
            sessions: HashMap::new(),
            turns: VecDeque::new(),
            tickets: 0,
            waiting: 0,
        }
    }

    pub fn push(&mut self, lane: Lane, item: T) {
        self.waiting += 1;
        let session = match lane {
            Lane::Cleanup => return self.cleanup.push_back(item),
            Lane::Session(session) => session,
        };
        if let Some(w) = self.sessions.get_mut(&session) {
            return w.items.push_back(item);
        }
        if self.turns.len() >= 2 * self.sessions.len() + 64 {
            let sessions = &self.sessions;
            self.turns
                .retain(|(s, t)| sessions.get(s).is_some_and(|w| w.ticket == *t));
        }
        self.tickets += 1;
        self.sessions.insert(
            session,
            Waiting {
                items: VecDeque::from([item]),
                ticket: self.tickets,
            },
        );
        self.turns.push_back((session, self.tickets));
    }

    /// The next request that may go out now, counted as out until [`done`].
    ///
    /// [`done`]: ApiQueue::done
    pub fn admit(&mut self) -> Option<T> {
        if self.in_flight >= self.limit {
            return None;
        }
        let first = if self.cleanup_turn {
            self.cleanup.pop_front()
        } else {
            self.next_turn()
        };
        self.cleanup_turn = !self.cleanup_turn;
        let item = match first {
            Some(item) => item,
            None if self.cleanup_turn => self.cleanup.pop_front()?,
            None => self.next_turn()?,
        };
        self.waiting -= 1;
        self.in_flight += 1;
        Some(item)
    }

    fn next_turn(&mut self) -> Option<T> {
        while let Some((session, ticket)) = self.turns.pop_front() {
            let Some(w) = self
                .sessions
                .get_mut(&session)
                .filter(|w| w.ticket == ticket)
            else {
                continue;
            };
            let item = w.items.pop_front();
            if w.items.is_empty() {
                self.sessions.remove(&session);
            } else {
                self.turns.push_back((session, ticket));
            }
            if item.is_some() {
                return item;
            }
        }
        None
    }

    /// A request taken with [`admit`](ApiQueue::admit) was answered, failed or not sent.
    pub fn done(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Takes the session's waiting requests out (it ended); those out are not affected.
    pub fn remove(&mut self, session: SessionId) -> VecDeque<T> {
        let items = self
            .sessions
            .remove(&session)
            .map(|w| w.items)
            .unwrap_or_default();
        self.waiting -= items.len();
        items
    }

    /// Requests waiting plus requests out.
    pub fn backlog(&self) -> usize {
        self.waiting + self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut ApiQueue<(u64, u32)>) -> Vec<(u64, u32)> {
        let mut out = Vec::new();
        while let Some(item) = q.admit() {
            out.push(item);
            q.done();
        }
        out
    }

    #[test]
    fn sessions_take_turns_and_cleanups_go_first() {
        let mut q = ApiQueue::new(4);
        for i in 0..3 {
            q.push(Lane::Session(1), (1, i));
        }
        q.push(Lane::Session(2), (2, 0));
        q.push(Lane::Cleanup, (0, 0));
        q.push(Lane::Session(3), (3, 0));
        q.push(Lane::Session(2), (2, 1));
        assert_eq!(q.backlog(), 7);
        assert_eq!(
            drain(&mut q),
            [(0, 0), (1, 0), (2, 0), (3, 0), (1, 1), (2, 1), (1, 2)]
        );
        assert_eq!(q.backlog(), 0);
    }

    #[test]
    fn cleanups_take_every_other_place_while_sessions_wait() {
        // Sessions that end as fast as they open left deletes that went before every
        // other session's request, for as long as they kept coming.
        let mut q = ApiQueue::new(1);
        for i in 0..6 {
            q.push(Lane::Cleanup, (0, i));
        }
        q.push(Lane::Session(1), (1, 0));
        q.push(Lane::Session(1), (1, 1));
        assert_eq!(
            drain(&mut q),
            [
                (0, 0),
                (1, 0),
                (0, 1),
                (1, 1),
                (0, 2),
                (0, 3),
                (0, 4),
                (0, 5)
            ]
        );
    }

    #[test]
    fn at_most_limit_are_out() {
        let mut q = ApiQueue::new(2);
        for i in 0..5 {
            q.push(Lane::Session(7), (7, i));
        }
        assert!(q.admit().is_some());
        assert!(q.admit().is_some());
        assert!(q.admit().is_none());
        assert_eq!(q.backlog(), 5);
        q.done();
        assert_eq!(q.admit(), Some((7, 2)));
        assert!(q.admit().is_none());
    }

    #[test]
    fn a_removed_session_loses_its_turn_and_a_new_lane_gets_one_turn() {
        let mut q = ApiQueue::new(1);
        q.push(Lane::Session(1), (1, 0));
        q.push(Lane::Session(1), (1, 1));
        q.push(Lane::Session(2), (2, 0));
        assert_eq!(q.remove(1).len(), 2);
        // The session's lane again, while its old entry still waits in the turns.
        q.push(Lane::Session(1), (1, 2));
        q.push(Lane::Session(1), (1, 3));
        q.push(Lane::Session(2), (2, 1));
        assert_eq!(drain(&mut q), [(2, 0), (1, 2), (2, 1), (1, 3)]);
    }

    #[test]
    fn turns_stay_bounded_however_many_lanes_come_and_go() {
        let mut q = ApiQueue::new(1);
        q.push(Lane::Session(0), (0, 0));
        for s in 1..100_000u64 {
            q.push(Lane::Session(s), (s, 0));
            q.remove(s);
            assert!(
                q.turns.len() <= 2 * q.sessions.len() + 65,
                "{}",
                q.turns.len()
            );
        }
        assert_eq!(drain(&mut q), [(0, 0)]);
    }
}
