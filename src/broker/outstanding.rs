//! A session's outstanding request ids. Clients choose them, so a hashed set of them
//! must be keyed (SipHash), and a SipHash of the id to take it, another to give it back
//! and the id's allocation cost 750 instructions of a 27,000-instruction message. Most
//! sessions have a few requests in flight: the first [`INLINE`] are kept in a list,
//! found by a scan of one word per id whose cost no choice of ids raises past
//! [`INLINE`] comparisons, and their strings are written again by later ids. Only ids
//! past those go to the keyed set.

use std::collections::HashSet;

/// Requests a pipelining client keeps in flight (the load bench: 16 `send`s).
pub const INLINE: usize = 32;

/// Largest answered id string kept for a later id: the schema allows 64 characters, up
/// to 256 bytes, and what a session keeps after its answers is at most
/// [`INLINE`] times this.
const KEEP: usize = 64;

#[derive(Debug, Default)]
pub struct Outstanding {
    /// A word per listed id ([`tag`]), in the order of `ids`: compared before the id.
    tags: Vec<u64>,
    /// The listed ids (`tags.len()` of them), then the strings of ids answered, kept for
    /// later ids: at most [`INLINE`] strings, each of an id's size.
    ids: Vec<String>,
    more: HashSet<String>,
}

/// The id's length and its last seven bytes, where counters and random ids differ.
fn tag(id: &str) -> u64 {
    let b = id.as_bytes();
    let mut word = [0u8; 8];
    let tail = b.len().min(7);
    word[..tail].copy_from_slice(&b[b.len() - tail..]);
    word[7] = b.len() as u8;
    u64::from_le_bytes(word)
}

impl Outstanding {
    pub fn len(&self) -> usize {
        self.tags.len() + self.more.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn position(&self, id: &str) -> Option<usize> {
        let t = tag(id);
        self.tags
            .iter()
            .enumerate()
            .find(|&(i, &x)| x == t && self.ids[i] == id)
            .map(|(i, _)| i)
    }

    pub fn contains(&self, id: &str) -> bool {
        self.position(id).is_some() || (!self.more.is_empty() && self.more.contains(id))
    }

    /// Adds `id`; false if it is already outstanding.
    pub fn insert(&mut self, id: &str) -> bool {
        if self.contains(id) {
            return false;
        }
        let n = self.tags.len();
        if n == INLINE {
            return self.more.insert(id.to_string());
        }
        self.tags.push(tag(id));
        match self.ids.get_mut(n) {
            Some(kept) => {
                kept.clear();
                kept.push_str(id);
            }
            None => self.ids.push(id.to_string()),
        }
        true
    }

    /// Removes `id`; false if it was not outstanding.
    pub fn remove(&mut self, id: &str) -> bool {
        let Some(i) = self.position(id) else {
            return !self.more.is_empty() && self.more.remove(id);
        };
        // The last listed id takes its place; its string stays, for the next id, unless
        // it is larger than the ids of most clients.
        let last = self.tags.len() - 1;
        self.tags.swap_remove(i);
        self.ids.swap(i, last);
        if let Some(kept) = self.ids.get_mut(last).filter(|s| s.capacity() > KEEP) {
            *kept = String::new();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The set it replaced, as the oracle: every answer the same, in any order of
    /// inserts and removes, past the list into the set and back.
    #[test]
    fn answers_as_a_hash_set_of_the_ids_does() {
        let mut oracle: HashSet<String> = HashSet::new();
        let mut set = Outstanding::default();
        // Ids sharing their tags (same length, same last seven bytes) and not.
        let ids: Vec<String> = (0..3 * INLINE)
            .map(|i| match i % 3 {
                0 => format!("{i}"),
                1 => format!("{i:x}-same-tail"),
                _ => format!("{}{i}", "é".repeat(i % 5)),
            })
            .collect();
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let id = &ids[(state % ids.len() as u64) as usize];
            // Inserts more often than removes while small, the other way when large,
            // so the count crosses `INLINE` both ways many times.
            let grow = (state >> 32) % 100 < if oracle.len() < INLINE { 70 } else { 30 };
            if grow {
                assert_eq!(set.insert(id), oracle.insert(id.clone()), "insert {id}");
            } else {
                assert_eq!(set.remove(id), oracle.remove(id.as_str()), "remove {id}");
            }
            assert_eq!(set.len(), oracle.len());
            let probe = &ids[((state >> 16) % ids.len() as u64) as usize];
            assert_eq!(
                set.contains(probe),
                oracle.contains(probe),
                "contains {probe}"
            );
            assert!(set.ids.len() <= INLINE && set.tags.len() <= INLINE);
        }
        for id in &ids {
            assert_eq!(set.contains(id), oracle.contains(id));
        }
    }

    /// What a session keeps after its answers is bounded by [`KEEP`] per string, whatever
    /// length of ids it used.
    #[test]
    fn an_answered_long_id_is_not_kept() {
        let mut set = Outstanding::default();
        let long = "é".repeat(64);
        assert!(set.insert(&long) && set.insert("short"));
        assert!(set.remove(&long) && set.remove("short"));
        assert!(
            set.ids.iter().all(|s| s.capacity() <= KEEP),
            "{:?}",
            set.ids
        );
        assert!(set.insert("again") && set.contains("again") && !set.contains(&long));
    }

    #[test]
    fn ids_with_one_tag_are_told_apart() {
        let mut set = Outstanding::default();
        assert!(set.insert("a-0000000"));
        assert!(set.insert("b-0000000"));
        assert_eq!(tag("a-0000000"), tag("b-0000000"));
        assert!(!set.insert("a-0000000"));
        assert!(set.remove("b-0000000"));
        assert!(set.contains("a-0000000") && !set.contains("b-0000000"));
        assert!(set.insert("b-0000000"));
        assert!(set.remove("a-0000000") && set.remove("b-0000000"));
        assert!(set.is_empty());
    }
}
