//! The subscription table: what the server must know again after a reconnect.

use crate::id_map::IdMap;

/// A subscription id, unique within one [`Connection`](super::Connection) for its lifetime
/// (kept across reconnects).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sid(pub u64);

impl std::fmt::Display for Sid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, Clone)]
pub struct Subscription {
    pub subject: String,
    pub queue: Option<String>,
    /// Auto-unsubscribe after this many deliveries in total.
    pub max: Option<u64>,
    /// Deliveries so far, over all connections.
    pub delivered: u64,
    /// `delivered` when the SUB was last sent; the server counts `max` from there.
    pub delivered_at_sub: u64,
    /// Its messages carry only the inline status of their header block (see
    /// `Connection::status_only_headers`).
    pub status_only: bool,
}

impl Subscription {
    /// The UNSUB limit to send on the current connection, when there is one.
    pub fn remaining_on_this_connection(&self) -> Option<u64> {
        self.max
            .map(|m| m.saturating_sub(self.delivered_at_sub).max(1))
    }
}

/// What a delivery did to its subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Deliver it; the subscription stays.
    Deliver,
    /// Deliver it; it was the last one (auto-unsubscribe reached), the entry is gone.
    DeliverLast,
    /// No such subscription (unsubscribed meanwhile): drop.
    Unknown,
}

#[derive(Debug, Default)]
pub struct SubscriptionTable {
    subs: IdMap<u64, Subscription>,
    next_sid: u64,
}

impl SubscriptionTable {
    pub fn len(&self) -> usize {
        self.subs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.subs.is_empty()
    }

    pub fn compact(&mut self) {
        crate::heap::Compact::compact(&mut self.subs);
    }

    pub fn insert(&mut self, subject: &str, queue: Option<&str>) -> Sid {
        self.next_sid += 1;
        let sid = self.next_sid;
        self.subs.insert(
            sid,
            Subscription {
                subject: subject.to_string(),
                queue: queue.map(str::to_string),
                max: None,
                delivered: 0,
                delivered_at_sub: 0,
                status_only: false,
            },
        );
        Sid(sid)
    }

    pub fn get(&self, sid: Sid) -> Option<&Subscription> {
        self.subs.get(&sid.0)
    }

    pub fn get_mut(&mut self, sid: Sid) -> Option<&mut Subscription> {
        self.subs.get_mut(&sid.0)
    }

    pub fn remove(&mut self, sid: Sid) -> Option<Subscription> {
        self.subs.remove(&sid.0)
    }

    /// Counts a delivery on `sid` and applies auto-unsubscribe; also says whether the
    /// subscription reads only statuses (one lookup per message for both).
    pub fn deliver(&mut self, sid: Sid) -> (Delivery, bool) {
        let Some(sub) = self.subs.get_mut(&sid.0) else {
            return (Delivery::Unknown, false);
        };
        let status_only = sub.status_only;
        if sub.max.is_some_and(|m| sub.delivered >= m) {
            // The server delivered past the limit (its count restarted on reconnect).
            self.subs.remove(&sid.0);
            return (Delivery::Unknown, false);
        }
        sub.delivered += 1;
        if sub.max.is_some_and(|m| sub.delivered >= m) {
            self.subs.remove(&sid.0);
            return (Delivery::DeliverLast, status_only);
        }
        (Delivery::Deliver, status_only)
    }

    /// Every subscription, in sid order (the order they were made), for resubscribing.
    pub fn all_mut(&mut self) -> Vec<(Sid, &mut Subscription)> {
        let mut v: Vec<(Sid, &mut Subscription)> =
            self.subs.iter_mut().map(|(k, s)| (Sid(*k), s)).collect();
        v.sort_by_key(|(sid, _)| *sid);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_unsubscribe_removes_the_entry_at_the_limit() {
        let mut t = SubscriptionTable::default();
        let sid = t.insert("a", None);
        t.get_mut(sid).expect("sub").max = Some(2);
        assert_eq!(t.deliver(sid).0, Delivery::Deliver);
        assert_eq!(t.deliver(sid).0, Delivery::DeliverLast);
        assert_eq!(t.deliver(sid).0, Delivery::Unknown);
        assert!(t.is_empty());
    }

    #[test]
    fn resubscribe_limit_counts_only_what_is_left() {
        let mut t = SubscriptionTable::default();
        let sid = t.insert("a", Some("q"));
        let sub = t.get_mut(sid).expect("sub");
        sub.max = Some(5);
        sub.delivered = 3;
        sub.delivered_at_sub = 3;
        assert_eq!(sub.remaining_on_this_connection(), Some(2));
    }

    #[test]
    fn sids_are_unique_and_listed_in_creation_order() {
        let mut t = SubscriptionTable::default();
        let a = t.insert("a", None);
        let b = t.insert("b", None);
        t.remove(a);
        let c = t.insert("c", None);
        assert!(a < b && b < c);
        let order: Vec<Sid> = t.all_mut().into_iter().map(|(s, _)| s).collect();
        assert_eq!(order, [b, c]);
    }
}
