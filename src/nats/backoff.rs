//! Jittered exponential backoff and the small random source behind it.

use std::time::Duration;

/// xorshift64*: fast, seedable, and good enough for jitter and the order of servers. Its
/// state shows through its output, so nothing that must stay secret comes from it
/// (subject names come from `crate::ids`). Seeded from the operating system.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn from_os() -> Rng {
        let seed = getrandom::u64().unwrap_or(0x9e37_79b9_7f4a_7c15);
        Rng::with_seed(seed)
    }

    pub fn with_seed(seed: u64) -> Rng {
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0), close enough for our uses.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// Delay before retry number `failures` (1 = after the first failure): `first * 2^(n-1)`
/// capped at `max`, then jittered uniformly into `[d/2, d]` so that many clients losing the
/// same server do not return in lockstep.
pub fn delay(first: Duration, max: Duration, failures: u32, rng: &mut Rng) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let shift = (failures - 1).min(30);
    let full = first.saturating_mul(1u32 << shift).min(max);
    let nanos = u64::try_from(full.as_nanos()).unwrap_or(u64::MAX);
    let half = nanos / 2;
    Duration::from_nanos(half + rng.below(nanos - half + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_doubles_per_failure_within_jitter_and_caps() {
        let mut rng = Rng::with_seed(7);
        let first = Duration::from_millis(100);
        let max = Duration::from_secs(2);
        assert_eq!(delay(first, max, 0, &mut rng), Duration::ZERO);
        for (failures, full_ms) in [
            (1, 100),
            (2, 200),
            (3, 400),
            (4, 800),
            (5, 1600),
            (6, 2000),
            (40, 2000),
        ] {
            for _ in 0..50 {
                let d = delay(first, max, failures, &mut rng);
                assert!(d >= Duration::from_millis(full_ms / 2), "{failures}: {d:?}");
                assert!(d <= Duration::from_millis(full_ms), "{failures}: {d:?}");
            }
        }
    }

    #[test]
    fn jitter_spreads_delays() {
        let mut rng = Rng::with_seed(42);
        let delays: std::collections::HashSet<Duration> = (0..20)
            .map(|_| delay(Duration::from_secs(1), Duration::from_secs(1), 1, &mut rng))
            .collect();
        assert!(delays.len() > 10);
    }
}
