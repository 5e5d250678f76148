//! Saturating time arithmetic. `Instant + Duration` panics on overflow and the release
//! profile aborts on panic, so one absurd duration (configured, or passed to the NATS client
//! API) would take every session down; deadlines computed here saturate instead.

use std::time::{Duration, Instant};

/// Far enough ahead to mean "never" for any timer of a running process.
const FAR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `at + d`, or a deadline [`FAR`] ahead when that overflows.
pub fn after(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(FAR))
        .unwrap_or(at)
}

/// Seconds as nanoseconds for a NATS wire duration (a Go `time.Duration`, an i64),
/// saturating at its largest value instead of wrapping.
pub fn secs_as_nanos(secs: u64) -> u64 {
    secs.saturating_mul(1_000_000_000).min(i64::MAX as u64)
}

/// Seconds as milliseconds in an i64, saturating.
pub fn secs_as_millis(secs: u64) -> i64 {
    i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflowing_sums_saturate_instead_of_panicking() {
        let now = Instant::now();
        assert!(after(now, Duration::MAX) >= now + Duration::from_secs(365 * 24 * 3600));
        assert!(after(now, Duration::from_secs(u64::MAX)) > now);
        assert_eq!(
            after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
    }

    #[test]
    fn wire_conversions_saturate_at_the_go_duration_range() {
        assert_eq!(secs_as_nanos(30), 30_000_000_000);
        assert_eq!(secs_as_nanos(u64::MAX), i64::MAX as u64);
        // 18446744074 s * 1e9 wraps u64 to a small number on plain multiplication.
        assert_eq!(secs_as_nanos(18_446_744_074), i64::MAX as u64);
        assert_eq!(secs_as_millis(30), 30_000);
        assert_eq!(secs_as_millis(u64::MAX), i64::MAX);
    }
}
