//! The core's one table of NATS round trips in flight. Every capability that asks NATS
//! something (the core's inbox, topics and registry, the jobs engine, the MIG front end)
//! files what should happen with the answer here, typed by capability; a reply the table
//! does not know is counted and logged by the core, never dropped unseen.
//!
//! Capabilities hold no reference to the core: they stage their continuations in a
//! [`Staged`] list, which the core files after every input it hands them. Replies only
//! arrive as a later input, so a staged continuation is always filed before its reply can
//! be looked up.

use std::time::Instant;

use super::id_map::IdMap;
use crate::nats::RequestId;

/// What a reply continues, by the capability that asked.
pub enum Continuation {
    Core(super::core::Awaiting),
    Jobs(super::jobs::Awaiting),
    Mig(super::mig::Awaiting),
}

/// Round trips a capability started, waiting to be filed in the core's table.
pub struct Staged<P> {
    list: Vec<(RequestId, P, Instant)>,
}

impl<P> Default for Staged<P> {
    fn default() -> Self {
        Staged { list: Vec::new() }
    }
}

impl<P> Staged<P> {
    /// `pending` continues request `id`, sent at `sent`.
    pub fn push(&mut self, id: RequestId, pending: P, sent: Instant) {
        self.list.push((id, pending, sent));
    }

    fn drain(&mut self) -> std::vec::Drain<'_, (RequestId, P, Instant)> {
        self.list.drain(..)
    }

    /// What was staged, for tests that answer the requests themselves.
    #[cfg(test)]
    pub fn take(&mut self) -> Vec<(RequestId, P)> {
        self.list.drain(..).map(|(id, p, _)| (id, p)).collect()
    }
}

/// Every request in flight, with when it was sent (for the round-trip histogram).
#[derive(Default)]
pub struct Continuations {
    table: IdMap<RequestId, (Continuation, Instant)>,
}

impl Continuations {
    pub fn insert(&mut self, id: RequestId, c: Continuation, sent: Instant) {
        self.table.insert(id, (c, sent));
    }

    /// Files what a capability staged, wrapped as that capability's continuation.
    pub fn file<P>(&mut self, staged: &mut Staged<P>, wrap: impl Fn(P) -> Continuation) {
        for (id, p, sent) in staged.drain() {
            self.table.insert(id, (wrap(p), sent));
        }
    }

    /// Gives back the room a burst of requests left (see [`crate::heap::Compact`]).
    pub fn compact(&mut self) {
        crate::heap::Compact::compact(&mut self.table);
    }

    /// The continuation of request `id`, taken out of the table.
    pub fn take(&mut self, id: RequestId) -> Option<(Continuation, Instant)> {
        self.table.remove(&id)
    }

    pub fn in_flight(&self) -> usize {
        self.table.len()
    }
}
