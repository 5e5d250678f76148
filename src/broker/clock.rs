//! Time and randomness for the broker core, and the one place in `broker` (besides the
//! key generator and the nats-server process manager) that reads the OS clock or the OS
//! random source.
//!
//! The core is a state machine: it never asks the OS what time it is or for random bytes.
//! The runtime reads both once, at start ([`Clock::system`], [`os_seed`]), and hands them
//! to [`Broker::new`](super::Broker::new); from then on every wall-clock timestamp is
//! derived from the monotonic `now` the runtime passes with each event, and every id and
//! challenge nonce comes from an [`IdSource`](super::ids::IdSource) seeded once. A test
//! drives the same core with a virtual clock and a fixed seed.

use std::time::{Duration, Instant, SystemTime};

use crate::deadline::after;
use crate::rfc3339;

/// Wall-clock milliseconds derived from a monotonic `Instant`: the wall time at `now` is
/// `anchor_ms + (now - anchor)`. Anchored once, so every lease, timestamp and budget
/// window of a broker is stamped consistently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clock {
    anchor: Instant,
    anchor_ms: i64,
}

impl Clock {
    /// `anchor_ms` is the Unix time in milliseconds at `anchor`.
    pub const fn new(anchor: Instant, anchor_ms: i64) -> Clock {
        Clock { anchor, anchor_ms }
    }

    /// Anchored at the OS clocks now: for the runtime.
    pub fn system() -> Clock {
        Clock::new(Instant::now(), rfc3339::unix_millis(SystemTime::now()))
    }

    /// Unix time in milliseconds at `now`.
    pub fn ms(&self, now: Instant) -> i64 {
        match now.checked_duration_since(self.anchor) {
            Some(d) => self
                .anchor_ms
                .saturating_add(i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 2)),
            None => {
                let back = self.anchor.duration_since(now);
                self.anchor_ms
                    .saturating_sub(i64::try_from(back.as_millis()).unwrap_or(0))
            }
        }
    }

    /// Unix time in whole seconds at `now` (0 before the epoch).
    pub fn unix_seconds(&self, now: Instant) -> u64 {
        u64::try_from(self.ms(now).div_euclid(1000)).unwrap_or(0)
    }

    /// The RFC 3339 timestamp (UTC, milliseconds) of `now`.
    pub fn timestamp(&self, now: Instant) -> String {
        rfc3339::format_millis(self.ms(now))
    }

    /// [`timestamp`](Self::timestamp) appended to `out`.
    pub fn push_timestamp(&self, out: &mut String, now: Instant) {
        rfc3339::push_millis(out, self.ms(now));
    }

    /// The monotonic instant of Unix time `ms`, seen from `now` (`now` itself when `ms`
    /// is already past).
    pub fn instant(&self, now: Instant, ms: i64) -> Instant {
        let delta = ms.saturating_sub(self.ms(now));
        after(
            now,
            Duration::from_millis(u64::try_from(delta).unwrap_or(0)),
        )
    }
}

/// 32 bytes from the OS random source, to seed the broker's ids and nonces; fails when
/// that source does (a broker without randomness would hand out guessable ids).
pub fn os_seed() -> Result<[u8; 32], String> {
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).map_err(|e| format!("no OS randomness for ids: {e}"))?;
    Ok(seed)
}

/// 16 bytes from the OS random source, as hex: for secrets such as development tokens.
pub fn random_token() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no OS randomness: {e}"))?;
    Ok(super::envelope::hex(&bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_time_follows_the_monotonic_clock_from_the_anchor() {
        let t0 = Instant::now();
        let clock = Clock::new(t0, 1_800_000_000_000);
        let later = t0 + Duration::from_millis(1_500);
        assert_eq!(clock.ms(t0), 1_800_000_000_000);
        assert_eq!(clock.ms(later), 1_800_000_001_500);
        assert_eq!(clock.unix_seconds(later), 1_800_000_001);
        assert_eq!(clock.timestamp(later), "2027-01-15T08:00:01.500Z");
        assert_eq!(clock.instant(t0, 1_800_000_001_500), later);
        assert_eq!(clock.instant(later, 0), later, "a past time is now");
    }

    #[test]
    fn os_randomness_is_there() {
        let (a, b) = (
            random_token().expect("token"),
            random_token().expect("token"),
        );
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_ne!(os_seed().expect("seed"), os_seed().expect("seed"));
    }
}
