//! Requests waiting for their reply, each with a deadline.

use std::collections::BTreeSet;
use std::time::Instant;

use crate::id_map::IdMap;

/// Names one request; its reply subject is `<inbox prefix>.<id>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    deadline: Instant,
    /// Written on the current connection (not waiting in the reconnect buffer): losing the
    /// connection means its reply cannot come.
    on_wire: bool,
}

#[derive(Debug, Default)]
pub struct RequestTable {
    pending: IdMap<u64, Pending>,
    deadlines: BTreeSet<(Instant, u64)>,
    next_id: u64,
}

impl RequestTable {
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The id the next `insert` will use (the reply subject is written before inserting).
    pub fn next_id(&self) -> RequestId {
        RequestId(self.next_id + 1)
    }

    pub fn insert(&mut self, deadline: Instant, on_wire: bool) -> RequestId {
        self.next_id += 1;
        let id = self.next_id;
        self.pending.insert(id, Pending { deadline, on_wire });
        self.deadlines.insert((deadline, id));
        RequestId(id)
    }

    /// Takes a request out (its reply came, or it was cancelled). False if unknown.
    pub fn remove(&mut self, id: RequestId) -> bool {
        match self.pending.remove(&id.0) {
            Some(p) => {
                self.deadlines.remove(&(p.deadline, id.0));
                true
            }
            None => false,
        }
    }

    pub fn compact(&mut self) {
        crate::heap::Compact::compact(&mut self.pending);
    }

    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Removes and returns the requests whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        let mut out = Vec::new();
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            self.pending.remove(&id);
            out.push(RequestId(id));
        }
        out
    }

    /// Removes and returns the requests that were on the wire of a connection now lost.
    pub fn take_on_wire(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.on_wire)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        for id in &ids {
            self.remove(RequestId(*id));
        }
        ids.into_iter().map(RequestId).collect()
    }

    /// The reconnect buffer was written: every waiting request is now on the wire.
    pub fn mark_all_on_wire(&mut self) {
        for p in self.pending.values_mut() {
            p.on_wire = true;
        }
    }

    /// Removes and returns every request (the connection closed for good).
    pub fn take_all(&mut self) -> Vec<RequestId> {
        let mut ids: Vec<u64> = self.pending.keys().copied().collect();
        ids.sort_unstable();
        self.pending.clear();
        self.deadlines.clear();
        ids.into_iter().map(RequestId).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn requests_expire_in_deadline_order() {
        let t0 = Instant::now();
        let mut t = RequestTable::default();
        let late = t.insert(t0 + Duration::from_secs(3), true);
        let early = t.insert(t0 + Duration::from_secs(1), true);
        assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(1)));
        assert!(t.expire(t0).is_empty());
        assert_eq!(t.expire(t0 + Duration::from_secs(2)), [early]);
        assert!(t.remove(late));
        assert!(!t.remove(late));
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn losing_the_connection_fails_only_requests_on_the_wire() {
        let t0 = Instant::now();
        let mut t = RequestTable::default();
        let sent = t.insert(t0, true);
        let buffered = t.insert(t0, false);
        assert_eq!(t.take_on_wire(), [sent]);
        t.mark_all_on_wire();
        assert_eq!(t.take_on_wire(), [buffered]);
        assert!(t.is_empty());
    }
}
