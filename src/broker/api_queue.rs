//! JetStream API requests made on sessions' behalf (topic consumers created, looked up,
//! counted, deleted), at most a fixed number out at a time, participants taking turns,
//! and each participant's sessions taking turns within its own.
//!
//! Why: nats-server answers API requests from one queue, a few hundred consumer creations
//! a second. A participant subscribing and unsubscribing at its frame rate used to put a
//! creation and a delete into that queue for every two frames; sixteen such sessions kept
//! it seconds long, and another participant's `subscribe` timed out behind them
//! (`tests/hostile_topics.rs`). Out a few at a time, turn by turn, a participant's request
//! waits behind at most one of every other participant's, whatever they ask, and however
//! many sessions they hold: with turns per session, a participant's sessions (up to its
//! `max_sessions_per_participant`) each took one, and so it had that many times the share
//! of one with a single session.
//!
//! Clean-ups (deletes of consumers whose session ended, hand-backs of a durable's
//! events) take every other place, and any place sessions leave: they free what the
//! server holds and do not pile up behind creations, yet a participant ending sessions
//! as fast as it can open them does not stop every other session's requests.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use super::SessionId;

/// Whose turn a request waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lane<P> {
    /// Work left by sessions that ended; before any session's.
    Cleanup,
    /// A session's, of participant `P`.
    Session(P, SessionId),
}

/// A session's requests waiting.
#[derive(Debug)]
struct Waiting<T, P> {
    participant: P,
    items: VecDeque<T>,
    /// Tells this lane's entry in its participant's turns from one left by an earlier
    /// lane of the session.
    ticket: u64,
}

/// A participant with requests waiting.
#[derive(Debug)]
struct Turns {
    /// Tells this entry in the queue's turns from one left by an earlier entry of the
    /// participant.
    ticket: u64,
    /// Its sessions with requests waiting, in turn order; entries of lanes taken away
    /// are skipped when reached.
    sessions: VecDeque<(SessionId, u64)>,
    /// Its sessions with requests waiting.
    live: usize,
}

#[derive(Debug)]
pub struct ApiQueue<T, P> {
    limit: usize,
    in_flight: usize,
    cleanup: VecDeque<T>,
    /// The next place goes to a clean-up if one waits.
    cleanup_turn: bool,
    sessions: HashMap<SessionId, Waiting<T, P>>,
    participants: HashMap<P, Turns>,
    /// Participants with requests waiting, in turn order; entries of participants taken
    /// away are skipped when reached.
    turns: VecDeque<(P, u64)>,
    tickets: u64,
    waiting: usize,
}

impl<T, P: Clone + Eq + Hash> ApiQueue<T, P> {
    pub fn new(limit: usize) -> ApiQueue<T, P> {
        ApiQueue {
            limit: limit.max(1),
            in_flight: 0,
            cleanup: VecDeque::new(),
            cleanup_turn: true,
            sessions: HashMap::new(),
            participants: HashMap::new(),
            turns: VecDeque::new(),
            tickets: 0,
            waiting: 0,
        }
    }

    pub fn push(&mut self, lane: Lane<P>, item: T) {
        self.waiting += 1;
        let (participant, session) = match lane {
            Lane::Cleanup => return self.cleanup.push_back(item),
            Lane::Session(participant, session) => (participant, session),
        };
        if let Some(w) = self.sessions.get_mut(&session) {
            return w.items.push_back(item);
        }
        self.tickets += 1;
        let ticket = self.tickets;
        let sessions = &self.sessions;
        match self.participants.get_mut(&participant) {
            Some(turns) => {
                if turns.sessions.len() >= 2 * turns.live + 64 {
                    turns
                        .sessions
                        .retain(|(s, t)| sessions.get(s).is_some_and(|w| w.ticket == *t));
                }
                turns.sessions.push_back((session, ticket));
                turns.live += 1;
            }
            None => {
                if self.turns.len() >= 2 * self.participants.len() + 64 {
                    let participants = &self.participants;
                    self.turns
                        .retain(|(p, t)| participants.get(p).is_some_and(|x| x.ticket == *t));
                }
                self.turns.push_back((participant.clone(), ticket));
                let turns = Turns {
                    ticket,
                    sessions: VecDeque::from([(session, ticket)]),
                    live: 1,
                };
                self.participants.insert(participant.clone(), turns);
            }
        }
        let items = VecDeque::from([item]);
        let waiting = Waiting {
            participant,
            items,
            ticket,
        };
        self.sessions.insert(session, waiting);
    }

    #[cfg(test)]
    pub fn admit(&mut self) -> Option<T> {
        self.admit_from().map(|(item, _)| item)
    }

    /// The next request that may go out now, counted as out until [`done`], and whether
    /// it is from [`Lane::Cleanup`].
    ///
    /// [`done`]: ApiQueue::done
    pub fn admit_from(&mut self) -> Option<(T, bool)> {
        if self.in_flight >= self.limit {
            return None;
        }
        let cleanup = self.cleanup_turn;
        let first = if cleanup {
            self.cleanup.pop_front()
        } else {
            self.next_turn()
        };
        self.cleanup_turn = !self.cleanup_turn;
        let item = match first {
            Some(item) => (item, cleanup),
            None if self.cleanup_turn => (self.cleanup.pop_front()?, true),
            None => (self.next_turn()?, false),
        };
        self.waiting -= 1;
        self.in_flight += 1;
        Some(item)
    }

    /// The next participant's turn, taken by its next session.
    fn next_turn(&mut self) -> Option<T> {
        while let Some((participant, ticket)) = self.turns.pop_front() {
            let Some(turns) = self
                .participants
                .get_mut(&participant)
                .filter(|x| x.ticket == ticket)
            else {
                continue;
            };
            let mut item = None;
            while let Some((session, ticket)) = turns.sessions.pop_front() {
                let Some(w) = self
                    .sessions
                    .get_mut(&session)
                    .filter(|w| w.ticket == ticket)
                else {
                    continue;
                };
                item = w.items.pop_front();
                if w.items.is_empty() {
                    self.sessions.remove(&session);
                    turns.live -= 1;
                } else {
                    turns.sessions.push_back((session, ticket));
                }
                break;
            }
            if turns.live == 0 {
                self.participants.remove(&participant);
            } else {
                self.turns.push_back((participant, ticket));
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
        let Some(w) = self.sessions.remove(&session) else {
            return VecDeque::new();
        };
        if let Some(turns) = self.participants.get_mut(&w.participant) {
            turns.live -= 1;
            if turns.live == 0 {
                self.participants.remove(&w.participant);
            }
        }
        self.waiting -= w.items.len();
        w.items
    }

    /// Requests waiting plus requests out.
    pub fn backlog(&self) -> usize {
        self.waiting + self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(q: &mut ApiQueue<(u64, u32), u64>) -> Vec<(u64, u32)> {
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
            q.push(Lane::Session(1, 1), (1, i));
        }
        q.push(Lane::Session(2, 2), (2, 0));
        q.push(Lane::Cleanup, (0, 0));
        q.push(Lane::Session(3, 3), (3, 0));
        q.push(Lane::Session(2, 2), (2, 1));
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
        q.push(Lane::Session(1, 1), (1, 0));
        q.push(Lane::Session(1, 1), (1, 1));
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
            q.push(Lane::Session(7, 7), (7, i));
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
        q.push(Lane::Session(1, 1), (1, 0));
        q.push(Lane::Session(1, 1), (1, 1));
        q.push(Lane::Session(2, 2), (2, 0));
        assert_eq!(q.remove(1).len(), 2);
        // The session's lane again, while its old entry still waits in the turns.
        q.push(Lane::Session(1, 1), (1, 2));
        q.push(Lane::Session(1, 1), (1, 3));
        q.push(Lane::Session(2, 2), (2, 1));
        assert_eq!(drain(&mut q), [(2, 0), (1, 2), (2, 1), (1, 3)]);
    }

    #[test]
    fn turns_stay_bounded_however_many_lanes_come_and_go() {
        let mut q = ApiQueue::new(1);
        q.push(Lane::Session(0, 0), (0, 0));
        q.push(Lane::Session(1, 1), (1, 0));
        for s in 2..100_000u64 {
            // Participants, and sessions of one that stays.
            q.push(Lane::Session(s, s), (s, 0));
            q.remove(s);
            q.push(Lane::Session(1, s), (s, 0));
            q.remove(s);
            assert!(
                q.turns.len() <= 2 * q.participants.len() + 65,
                "{}",
                q.turns.len()
            );
            let one = &q.participants[&1].sessions;
            assert!(one.len() <= 2 + 65, "{}", one.len());
        }
        assert_eq!(drain(&mut q), [(0, 0), (1, 0)]);
    }

    #[test]
    fn participants_take_turns_whatever_number_of_sessions_they_hold() {
        // Turns were per session: participant 1's four sessions had four turns to
        // participant 2's one.
        let mut q = ApiQueue::new(1);
        for s in 10..14 {
            q.push(Lane::Session(1, s), (s, 0));
            q.push(Lane::Session(1, s), (s, 1));
        }
        q.push(Lane::Session(2, 20), (20, 0));
        q.push(Lane::Session(2, 20), (20, 1));
        q.push(Lane::Session(3, 30), (30, 0));
        assert_eq!(
            drain(&mut q),
            [
                (10, 0),
                (20, 0),
                (30, 0),
                (11, 0),
                (20, 1),
                (12, 0),
                (13, 0),
                (10, 1),
                (11, 1),
                (12, 1),
                (13, 1)
            ]
        );
        assert_eq!(q.backlog(), 0);
        assert!(q.participants.is_empty() && q.sessions.is_empty());
    }

    #[test]
    fn a_participant_whose_sessions_all_ended_loses_its_turn() {
        let mut q = ApiQueue::new(1);
        q.push(Lane::Session(1, 10), (10, 0));
        q.push(Lane::Session(1, 11), (11, 0));
        q.push(Lane::Session(2, 20), (20, 0));
        q.push(Lane::Session(2, 20), (20, 1));
        assert_eq!(q.remove(10).len(), 1);
        // The participant keeps its turn while one of its sessions waits.
        assert_eq!(q.admit(), Some((11, 0)));
        q.done();
        q.push(Lane::Session(1, 12), (12, 0));
        assert_eq!(q.remove(12).len(), 1);
        assert!(!q.participants.contains_key(&1));
        assert_eq!(q.backlog(), 2);
        assert_eq!(drain(&mut q), [(20, 0), (20, 1)]);
    }
}
