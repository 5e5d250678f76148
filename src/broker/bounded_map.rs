//! A hash map with a fixed capacity that forgets its oldest insertions when full. Used for
//! state keyed by data from the network (source addresses, participant names), where an
//! attacker choosing keys must not be able to grow memory.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

#[derive(Debug)]
pub struct BoundedMap<K, V> {
    capacity: usize,
    entries: HashMap<K, (V, u64)>,
    /// Insertion order with the generation each key was inserted under; a key removed and
    /// inserted again leaves a stale record here, skipped on eviction.
    order: VecDeque<(K, u64)>,
    generation: u64,
}

impl<K: Hash + Eq + Clone, V> BoundedMap<K, V> {
    /// A map holding at most `capacity` entries (at least one).
    pub fn new(capacity: usize) -> Self {
        BoundedMap {
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
            generation: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.entries.get(key).map(|(v, _)| v)
    }

    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.entries.get_mut(key).map(|(v, _)| v)
    }

    pub fn remove(&mut self, key: &K) -> Option<V> {
        let removed = self.entries.remove(key).map(|(v, _)| v);
        self.compact();
        removed
    }

    /// The entry for `key`, inserted with `make()` when absent (evicting the oldest entry
    /// when the map is full).
    pub fn get_or_insert_with(&mut self, key: K, make: impl FnOnce() -> V) -> &mut V {
        if !self.entries.contains_key(&key) {
            while self.entries.len() >= self.capacity {
                if !self.evict_oldest() {
                    break;
                }
            }
            self.generation += 1;
            self.order.push_back((key.clone(), self.generation));
        }
        let generation = self.generation;
        match self.entries.entry(key) {
            Entry::Occupied(o) => &mut o.into_mut().0,
            Entry::Vacant(v) => &mut v.insert((make(), generation)).0,
        }
    }

    /// Drops every entry for which `keep` is false.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        self.entries.retain(|k, (v, _)| keep(k, v));
        self.compact();
    }

    /// Gives back the room of entries gone (see [`crate::heap::Compact`]).
    pub fn compact_tables(&mut self) {
        use crate::heap::Compact;
        self.entries.compact();
        self.order.compact();
    }

    fn evict_oldest(&mut self) -> bool {
        while let Some((key, generation)) = self.order.pop_front() {
            if self
                .entries
                .get(&key)
                .is_some_and(|(_, g)| *g == generation)
            {
                self.entries.remove(&key);
                return true;
            }
        }
        false
    }

    /// Keeps the order queue proportional to the live entries.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.entries.len() + 16 {
            let entries = &self.entries;
            self.order
                .retain(|(k, g)| entries.get(k).is_some_and(|(_, live)| live == g));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_oldest_insertion_when_full() {
        let mut m = BoundedMap::new(2);
        *m.get_or_insert_with("a", || 0) += 1;
        *m.get_or_insert_with("b", || 0) += 1;
        *m.get_or_insert_with("a", || 0) += 1;
        *m.get_or_insert_with("c", || 0) += 1;
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(&"a"), None, "a was inserted first");
        assert_eq!(m.get(&"b"), Some(&1));
        assert_eq!(m.get(&"c"), Some(&1));
    }

    #[test]
    fn a_removed_and_reinserted_key_counts_from_its_new_insertion() {
        let mut m = BoundedMap::new(2);
        m.get_or_insert_with("a", || 1);
        m.get_or_insert_with("b", || 2);
        m.remove(&"a");
        m.get_or_insert_with("a", || 3);
        m.get_or_insert_with("c", || 4);
        assert_eq!(m.get(&"b"), None);
        assert_eq!(m.get(&"a"), Some(&3));
        assert_eq!(m.get(&"c"), Some(&4));
    }

    #[test]
    fn order_queue_stays_bounded_under_churn() {
        let mut m = BoundedMap::new(4);
        for i in 0..10_000u32 {
            m.get_or_insert_with(i % 3, || i);
            m.remove(&(i % 3));
        }
        assert!(m.order.len() <= 2 * m.len() + 16);
        for i in 0..10_000u32 {
            m.get_or_insert_with(i, || i);
        }
        assert_eq!(m.len(), 4);
        assert!(m.order.len() <= 2 * 4 + 16 + 4);
    }
}
