//! Maps keyed by numbers the broker hands out itself (session, request and subscription
//! ids) or JetStream assigns (stream sequences). No client chooses these keys, so the
//! resistance of the default SipHash to chosen keys buys nothing here, and these maps are
//! looked up several times for every message.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
pub type IdSet<K> = HashSet<K, BuildHasherDefault<IdHasher>>;

/// A multiplicative hash of the integers a key is made of.
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(K);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_and_are_found_again() {
        let mut map: IdMap<u64, u64> = IdMap::default();
        for n in 0..10_000u64 {
            map.insert(n, n * 2);
        }
        assert!((0..10_000u64).all(|n| map.get(&n) == Some(&(n * 2))));
        assert_eq!(map.get(&10_000), None);
        let top_bits: std::collections::HashSet<u64> = (0..1024u64)
            .map(|n| {
                let mut h = IdHasher::default();
                h.write_u64(n);
                h.finish() >> 57
            })
            .collect();
        assert_eq!(
            top_bits.len(),
            128,
            "the control bits hashbrown uses all occur"
        );
    }
}
