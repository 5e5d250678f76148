//! The ids the broker makes up for tasks and messages that come without a client-chosen
//! one. They are capabilities in all but name: a task id is the key to its record and its
//! `Nats-Msg-Id`, so anyone who can predict the next one can pre-submit it (squatting) or
//! probe it. Each id is therefore SHA-256(seed || counter) truncated to 128 bits. The seed
//! is 32 bytes from the OS random source that the runtime draws once and hands to
//! `Broker::new` (its parts get [derived](IdSource::derive) seeds); this module reads no
//! OS source and holds no global. The counter makes ids distinct without a system call per
//! id, the hash makes them unpredictable without the seed.
//!
//! Format: 26 characters of lowercase RFC 4648 base32 (`a-z`, `2-7`), no padding, within
//! the spec's task id alphabet and valid in a KV key and a NATS header.

use sha2::{Digest, Sha256};

/// Length of every generated id.
pub const ID_LEN: usize = 26;

/// A generator of unguessable ids (and challenge nonces) from one seed. It reads no OS
/// source itself: the runtime draws the seed (see [`super::clock::os_seed`]) and the
/// broker owns the generator, handing [derived](IdSource::derive) ones to its parts.
#[derive(Debug)]
pub struct IdSource {
    seed: [u8; 32],
    counter: u64,
}

impl IdSource {
    /// A generator with a given seed: the OS's under the runtime, a fixed one in tests.
    pub const fn from_seed(seed: [u8; 32]) -> IdSource {
        IdSource { seed, counter: 0 }
    }

    /// An independent generator for one part of the broker (`label` names it): its
    /// sequence is unrelated to this one's and as unguessable, and the same seed and
    /// label always give the same sequence.
    pub fn derive(&self, label: &str) -> IdSource {
        let seed = Sha256::new()
            .chain_update(b"amp-broker id source\0")
            .chain_update((label.len() as u64).to_be_bytes())
            .chain_update(label.as_bytes())
            .chain_update(self.seed)
            .finalize();
        IdSource::from_seed(seed.into())
    }

    fn next_block(&mut self) -> [u8; 32] {
        let n = self.counter;
        self.counter = self.counter.wrapping_add(1);
        Sha256::new()
            .chain_update(self.seed)
            .chain_update(n.to_be_bytes())
            .finalize()
            .into()
    }

    pub fn next_id(&mut self) -> String {
        let digest = self.next_block();
        let mut bits = [0u8; 16];
        bits.copy_from_slice(&digest[..16]);
        base32(u128::from_be_bytes(bits))
    }

    /// 32 unpredictable bytes (a session's hello challenge).
    pub fn next_nonce(&mut self) -> [u8; 32] {
        self.next_block()
    }
}

fn base32(mut v: u128) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    // 26 digits of 5 bits cover 130 bits; the top digit carries the 3 highest bits.
    let mut out = [0u8; ID_LEN];
    for slot in out.iter_mut().rev() {
        *slot = ALPHABET[(v & 31) as usize];
        v >>= 5;
    }
    out.iter().map(|&b| char::from(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_26_base32_characters_and_never_repeat() {
        let mut source = IdSource::from_seed([1; 32]);
        let ids: Vec<String> = (0..10_000).map(|_| source.next_id()).collect();
        assert!(ids.iter().all(|id| {
            id.len() == ID_LEN
                && id
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
        }));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
    }

    #[test]
    fn the_sequence_depends_on_the_seed_and_shares_no_prefix() {
        let mut a = IdSource::from_seed([1; 32]);
        let mut b = IdSource::from_seed([1; 32]);
        let mut c = IdSource::from_seed([2; 32]);
        let (a1, a2) = (a.next_id(), a.next_id());
        assert_eq!(a1, b.next_id(), "the same seed gives the same ids");
        assert_ne!(a1, c.next_id(), "another seed, other ids");
        let common = a1
            .bytes()
            .zip(a2.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(common < 4, "consecutive ids look unrelated: {a1} {a2}");
    }

    #[test]
    fn base32_is_big_endian_and_fixed_width() {
        assert_eq!(base32(0), "a".repeat(26));
        assert_eq!(base32(1), format!("{}b", "a".repeat(25)));
        assert_eq!(base32(u128::MAX), format!("h{}", "7".repeat(25)));
    }

    #[test]
    fn derived_sources_are_distinct_and_reproducible() {
        let root = IdSource::from_seed([7; 32]);
        let (mut x, mut y) = (root.derive("jobs"), root.derive("mig"));
        let x1 = x.next_id();
        assert_ne!(x1, y.next_id());
        assert_eq!(x1, root.derive("jobs").next_id());
        assert_ne!(x1, IdSource::from_seed([7; 32]).next_id());
        let mut n = root.derive("nonces");
        assert_ne!(n.next_nonce(), n.next_nonce());
    }
}
