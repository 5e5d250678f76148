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

/// How far the OS wall clock may be from a broker's [`Clock`] before the broker anchors
/// it again ([`Clock::follow`]): a step (NTP, an operator, a resume from suspend), not the
/// few microseconds between reading the two clocks.
pub const STEP_TOLERANCE_MS: i64 = 1000;

/// Wall-clock milliseconds derived from a monotonic `Instant`: the wall time at `now` is
/// `anchor_ms + (now - anchor)`. The monotonic clock moves at the wall clock's rate (NTP
/// slews both), so stamps stay consistent between steps of the wall clock, which the
/// runtime reports ([`Clock::follow`]).
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

    /// `wall_ms` is the OS wall clock read at `now`. When it is more than
    /// [`STEP_TOLERANCE_MS`] off this clock, the clock anchored there and the step (ms,
    /// negative backwards): nats-server and the other brokers on the host follow the OS
    /// clock, and JWTs, the callout's request windows and MIG signature windows are
    /// judged against theirs.
    pub fn follow(&self, now: Instant, wall_ms: i64) -> Option<(Clock, i64)> {
        let step = wall_ms.saturating_sub(self.ms(now));
        (step.saturating_abs() > STEP_TOLERANCE_MS).then(|| (Clock::new(now, wall_ms), step))
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
    fn only_a_step_past_the_tolerance_moves_the_anchor() {
        let t0 = Instant::now();
        let clock = Clock::new(t0, 1_800_000_000_000);
        let later = t0 + Duration::from_secs(10);
        assert_eq!(clock.follow(later, 1_800_000_010_000), None);
        assert_eq!(clock.follow(later, 1_800_000_011_000), None, "jitter");
        let (ahead, step) = clock
            .follow(later, 1_800_003_610_000)
            .expect("an hour ahead");
        assert_eq!(step, 3_600_000);
        assert_eq!(ahead.ms(later + Duration::from_secs(1)), 1_800_003_611_000);
        let (behind, step) = clock.follow(later, 1_799_999_000_000).expect("behind");
        assert_eq!((step, behind.ms(later)), (-1_010_000, 1_799_999_000_000));
        assert!(clock.follow(later, i64::MIN).is_some(), "no overflow");
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

#[cfg(all(test, feature = "testing"))]
mod stepped {
    //! The broker core on the model, whose wall clock steps as an OS clock does.

    use std::time::Duration;

    use serde_json::json;

    use crate::rfc3339;
    use crate::testing::harness::Harness;

    #[test]
    fn a_step_of_the_wall_clock_is_followed() {
        // The clock was anchored once, at start: after an NTP step every timestamp, JWT
        // and callout answer of the broker stayed as far off as the step, for good.
        let mut h = Harness::development(1);
        let alice = h.join(0, "alice", json!({}));
        let bob = h.join(0, "bob", json!({}));
        // An hour ahead, then an hour behind where the broker started.
        for (by, forward) in [(3600, true), (3600, false)] {
            h.step_wall_clock(Duration::from_secs(by), forward);
            h.advance(Duration::from_millis(10));
            let ok = h.request(alice, json!({"op":"send","to":"bob","body":1}));
            assert_eq!(ok["op"], "ok", "{ok}");
            let m = h.wait_for(bob, |f| f["op"] == "message");
            let stamped = m["ts"]
                .as_str()
                .and_then(rfc3339::parse_nanos)
                .and_then(|ns| i64::try_from(ns / 1_000_000).ok());
            let wall = h.server.wall_clock_millis(h.now);
            assert!(
                stamped.is_some_and(|ms| (wall - ms).abs() < 1000),
                "stamped {:?}, the wall clock reads {}",
                m["ts"],
                rfc3339::format_millis(wall)
            );
        }
    }
}
