//! Connections not logged in yet, grouped by where they come from, so that when room is
//! needed the one pushed out belongs to whoever holds the most.
//!
//! A connection costs a slot from its accept until its hello is answered (or its request
//! timeout, hello timeout or close). Without this, a few addresses could hold every slot
//! with connections that never say hello, and refill them as they time out: nobody else
//! could log in. Pushing out the oldest waiting connection of the group holding the most
//! leaves an honest client, one connection from its own address, to the last.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// Where waiting connections are counted: an IPv4 address, or an IPv6 /48 (a site's
/// allocation: one /64 each is no cost to someone holding a /48).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Group(u128);

impl Group {
    pub fn of(addr: IpAddr) -> Group {
        match addr {
            IpAddr::V4(v4) => Group(u128::from(u32::from(v4))),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Group(u128::from(u32::from(v4))),
                // The top bit set keeps the two families apart.
                None => Group((u128::from(v6) >> 80) | (1 << 127)),
            },
        }
    }
}

/// Slot indexes of the connections waiting for their hello, oldest first per group.
#[derive(Debug, Default)]
pub struct Waiting {
    groups: HashMap<Group, VecDeque<usize>>,
    len: usize,
}

impl Waiting {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn add(&mut self, group: Group, index: usize) {
        self.groups.entry(group).or_default().push_back(index);
        self.len += 1;
    }

    /// Forgets `index` (logged in, or closed); nothing when it was not waiting.
    pub fn remove(&mut self, group: Group, index: usize) {
        let Some(queue) = self.groups.get_mut(&group) else {
            return;
        };
        if let Some(at) = queue.iter().position(|&i| i == index) {
            queue.remove(at);
            self.len -= 1;
        }
        if queue.is_empty() {
            self.groups.remove(&group);
        }
    }

    /// The connection to push out for room for one from `newcomer`: the oldest of the
    /// group waiting with the most (ties: any of them), unless the newcomer's own group
    /// holds as many (then it is the one to turn away, at less cost). Taken out of the
    /// table.
    pub fn take_victim(&mut self, newcomer: Group) -> Option<usize> {
        let (&group, most) = self.groups.iter().max_by_key(|(_, q)| q.len())?;
        let own = self.groups.get(&newcomer).map_or(0, VecDeque::len);
        if own >= most.len() {
            return None;
        }
        let queue = self.groups.get_mut(&group)?;
        let index = queue.pop_front()?;
        self.len -= 1;
        if queue.is_empty() {
            self.groups.remove(&group);
        }
        Some(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn the_victim_is_the_oldest_of_the_largest_group() {
        let mut w = Waiting::default();
        let (a, b) = (Group::of(ip("192.0.2.1")), Group::of(ip("192.0.2.2")));
        w.add(b, 1);
        for i in 10..13 {
            w.add(a, i);
        }
        let newcomer = Group::of(ip("192.0.2.3"));
        assert_eq!(w.len(), 4);
        assert_eq!(w.take_victim(newcomer), Some(10));
        assert_eq!(w.take_victim(newcomer), Some(11));
        w.remove(a, 12);
        assert_eq!(w.take_victim(newcomer), Some(1));
        assert_eq!(w.take_victim(newcomer), None);
        assert!(w.is_empty());
    }

    #[test]
    fn a_newcomer_from_the_largest_group_pushes_out_nobody() {
        let mut w = Waiting::default();
        let (a, b) = (Group::of(ip("192.0.2.1")), Group::of(ip("192.0.2.2")));
        w.add(a, 1);
        w.add(a, 2);
        w.add(b, 3);
        assert_eq!(w.take_victim(a), None, "its own group holds the most");
        assert_eq!(w.take_victim(b), Some(1));
        assert_eq!(w.take_victim(b), None, "one each now");
        assert_eq!(w.len(), 2);
    }

    #[test]
    fn ipv6_counts_by_48_and_mapped_ipv4_as_ipv4() {
        assert_eq!(
            Group::of(ip("2001:db8:1:1::1")),
            Group::of(ip("2001:db8:1:ffff::2"))
        );
        assert_ne!(
            Group::of(ip("2001:db8:1::1")),
            Group::of(ip("2001:db8:2::1"))
        );
        assert_eq!(
            Group::of(ip("::ffff:192.0.2.1")),
            Group::of(ip("192.0.2.1"))
        );
        assert_ne!(Group::of(ip("::c000:201")), Group::of(ip("192.0.2.1")));
    }

    #[test]
    fn removing_what_is_not_there_changes_nothing() {
        let mut w = Waiting::default();
        let a = Group::of(ip("192.0.2.1"));
        w.add(a, 3);
        w.remove(a, 4);
        w.remove(Group::of(ip("192.0.2.9")), 3);
        assert_eq!(w.len(), 1);
    }
}
