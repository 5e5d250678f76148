//! The ids the broker makes up for tasks and messages that come without a client-chosen
//! one. They are capabilities in all but name: a task id is the key to its record and its
//! `Nats-Msg-Id`, so anyone who can predict the next one can pre-submit it (squatting) or
//! probe it. Each id is therefore SHA-256(seed || counter) truncated to 128 bits, the seed
//! being 32 bytes from the OS random source drawn once; the counter makes ids distinct
//! without a system call per id, the hash makes them unpredictable without the seed.
//!
//! Format: 26 characters of lowercase RFC 4648 base32 (`a-z`, `2-7`), no padding, within
//! the spec's task id alphabet and valid in a KV key and a NATS header.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// Length of every generated id.
pub const ID_LEN: usize = 26;

/// A generator of unguessable ids from one seed.
pub struct IdSource {
    seed: [u8; 32],
    counter: AtomicU64,
}

impl IdSource {
    /// A generator with a given seed (tests, or a caller with its own random source).
    pub const fn from_seed(seed: [u8; 32]) -> IdSource {
        IdSource {
            seed,
            counter: AtomicU64::new(0),
        }
    }

    /// A generator seeded from the OS random source; fails when that source does.
    pub fn from_os() -> Result<IdSource, String> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| format!("no OS randomness for ids: {e}"))?;
        Ok(IdSource::from_seed(seed))
    }

    pub fn next_id(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let digest = Sha256::new()
            .chain_update(self.seed)
            .chain_update(n.to_be_bytes())
            .finalize();
        let mut bits = [0u8; 16];
        bits.copy_from_slice(&digest[..16]);
        base32(u128::from_be_bytes(bits))
    }
}

static PROCESS: OnceLock<IdSource> = OnceLock::new();

/// Seeds the process's generator from the OS random source, once; the broker calls it at
/// start so that a missing random source stops it instead of yielding guessable ids.
pub fn init() -> Result<(), String> {
    if PROCESS.get().is_none() {
        let source = IdSource::from_os()?;
        let _ = PROCESS.set(source);
    }
    Ok(())
}

/// A fresh id from the process's generator.
pub fn fresh() -> String {
    match PROCESS.get() {
        Some(source) => source.next_id(),
        None => match init() {
            Ok(()) => fresh(),
            // Only reachable without `init` (the broker calls it and stops on failure):
            // a seed from the clock and an address keeps ids distinct, not secret.
            Err(_) => PROCESS.get_or_init(fallback).next_id(),
        },
    }
}

fn fallback() -> IdSource {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let here = &nanos as *const u128 as usize;
    let seed = Sha256::new()
        .chain_update(nanos.to_le_bytes())
        .chain_update(here.to_le_bytes())
        .chain_update(std::process::id().to_le_bytes())
        .finalize();
    IdSource::from_seed(seed.into())
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
        let source = IdSource::from_seed([1; 32]);
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
        let a = IdSource::from_seed([1; 32]);
        let b = IdSource::from_seed([1; 32]);
        let c = IdSource::from_seed([2; 32]);
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
    fn the_process_generator_is_seeded_from_the_os() {
        init().expect("OS randomness");
        let (x, y) = (fresh(), fresh());
        assert_ne!(x, y);
        assert_eq!(x.len(), ID_LEN);
    }
}
