//! The ids the broker makes up for tasks and messages that come without a client-chosen
//! one. They are capabilities in all but name: a task id is the key to its record and its
//! `Nats-Msg-Id`, so anyone who can predict the next one can pre-submit it (squatting) or
//! probe it. Each id is therefore 128 bits of a ChaCha20 keystream (ring's, as rustls
//! uses it) under a key derived from a secret seed: a stream cipher's output is a
//! cryptographic pseudo-random sequence, so without the key no id says anything about the
//! others. The stream is made 512 bytes (32 ids) at a time, each refill under its own
//! nonce, so an id costs a few dozen instructions instead of a SHA-256 compression. The
//! seed is 32 bytes from the OS random source that the runtime draws once and hands to
//! `Broker::new` (its parts get [derived](IdSource::derive) seeds); this module reads no
//! OS source and holds no global.
//!
//! The NATS connection names its reply and pull subjects from one too
//! ([`crate::nats::Connection::new_inbox`]): a peer that sees some of them (a leaf site's
//! hub sees every request the site sends into its domain) must not learn the others, or
//! it could put messages on them that the broker takes for JetStream's.
//!
//! Format: 26 characters of lowercase RFC 4648 base32 (`a-z`, `2-7`), no padding, within
//! the spec's task id alphabet and valid in a KV key and a NATS header.

use sha2::{Digest, Sha256};

/// Length of every generated id.
pub const ID_LEN: usize = 26;

/// Bytes of keystream made per refill: 32 ids.
const POOL: usize = 512;

/// A generator of unguessable ids (and challenge nonces) from one seed. It reads no OS
/// source itself: the runtime draws the seed (see [`super::clock::os_seed`]) and the
/// broker owns the generator, handing [derived](IdSource::derive) ones to its parts.
pub struct IdSource {
    seed: [u8; 32],
    /// The ChaCha20 key, derived from the seed.
    key: [u8; 32],
    /// Refills so far: the nonce of the next one.
    refills: u64,
    pool: [u8; POOL],
    /// Bytes of `pool` already handed out.
    used: usize,
}

impl std::fmt::Debug for IdSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The seed and the stream are secrets.
        f.debug_struct("IdSource")
            .field("refills", &self.refills)
            .finish_non_exhaustive()
    }
}

impl IdSource {
    /// A generator with a given seed: the OS's under the runtime, a fixed one in tests.
    pub fn from_seed(seed: [u8; 32]) -> IdSource {
        let key = Sha256::new()
            .chain_update(b"amp-broker id stream\0")
            .chain_update(seed)
            .finalize()
            .into();
        IdSource {
            seed,
            key,
            refills: 0,
            pool: [0; POOL],
            used: POOL,
        }
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

    /// The next `N` bytes of the stream.
    fn take<const N: usize>(&mut self) -> [u8; N] {
        if self.used + N > POOL {
            self.refill();
        }
        let mut out = [0u8; N];
        if let Some(bytes) = self.pool.get(self.used..self.used + N) {
            out.copy_from_slice(bytes);
        }
        self.used += N;
        out
    }

    /// The next 512 bytes of keystream: zeros encrypted under the key with a nonce used
    /// once (the refill count).
    fn refill(&mut self) {
        use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
        let n = self.refills;
        self.refills = self.refills.wrapping_add(1);
        let mut nonce = [0u8; 12];
        nonce[4..].copy_from_slice(&n.to_be_bytes());
        self.pool = [0; POOL];
        let sealed = UnboundKey::new(&CHACHA20_POLY1305, &self.key).and_then(|key| {
            LessSafeKey::new(key).seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::empty(),
                &mut self.pool,
            )
        });
        if sealed.is_err() {
            // Not reachable (a 32-byte key, 512 bytes of input); should it ever be, the
            // pool is SHA-256(key || refill || block), still unpredictable.
            for (i, chunk) in self.pool.chunks_mut(32).enumerate() {
                let block = Sha256::new()
                    .chain_update(self.key)
                    .chain_update(n.to_be_bytes())
                    .chain_update((i as u64).to_be_bytes())
                    .finalize();
                chunk.copy_from_slice(&block[..chunk.len()]);
            }
        }
        self.used = 0;
    }

    pub fn next_id(&mut self) -> String {
        let mut id = String::with_capacity(ID_LEN);
        self.push_id(&mut id);
        id
    }

    /// [`next_id`](Self::next_id) appended to `out`.
    pub fn push_id(&mut self, out: &mut String) {
        push_base32(out, u128::from_be_bytes(self.take::<16>()));
    }

    /// 32 unpredictable bytes (a session's hello challenge).
    pub fn next_nonce(&mut self) -> [u8; 32] {
        self.take::<32>()
    }
}

fn push_base32(out: &mut String, mut v: u128) {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    // 26 digits of 5 bits cover 130 bits; the top digit carries the 3 highest bits.
    let mut digits = [0u8; ID_LEN];
    for slot in digits.iter_mut().rev() {
        *slot = ALPHABET[(v & 31) as usize];
        v >>= 5;
    }
    // Letters and digits of the alphabet: always UTF-8, checked at once rather than
    // pushed a character at a time.
    out.push_str(std::str::from_utf8(&digits).unwrap_or_default());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base32(v: u128) -> String {
        let mut out = String::new();
        push_base32(&mut out, v);
        out
    }
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
    fn ids_continue_across_refills_without_repeating_a_block() {
        let mut source = IdSource::from_seed([3; 32]);
        // Three refills' worth of ids and nonces, interleaved so a take straddles none.
        let mut seen = HashSet::new();
        for i in 0..100 {
            let id = if i % 7 == 0 {
                base32(u128::from_be_bytes(
                    source.next_nonce()[..16].try_into().expect("16"),
                ))
            } else {
                source.next_id()
            };
            assert!(seen.insert(id), "repeat at {i}");
        }
        assert!(source.refills >= 3);
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
