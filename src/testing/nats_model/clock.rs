//! The model's wall clock: a start time passed in, moved by the virtual monotonic clock
//! and by explicit steps, never read from the OS.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone)]
pub struct WallClock {
    start_wall_nanos: u64,
    start: Instant,
    /// Added to every reading: positive or negative steps of the simulated wall clock.
    offset_nanos: i128,
}

impl WallClock {
    pub fn new(start: SystemTime, now: Instant) -> WallClock {
        let nanos = start
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        WallClock {
            start_wall_nanos: nanos,
            start: now,
            offset_nanos: 0,
        }
    }

    pub fn set_offset(&mut self, offset_nanos: i128) {
        self.offset_nanos = offset_nanos;
    }

    /// Unix nanoseconds at `now`.
    pub fn nanos(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.start).as_nanos() as i128;
        let t = i128::from(self.start_wall_nanos) + since + self.offset_nanos;
        u64::try_from(t.max(0)).unwrap_or(u64::MAX)
    }

    /// The monotonic instant at which the wall clock reads `nanos` (for `by_start_time`
    /// comparisons the model keeps everything in wall nanos instead).
    pub fn elapsed(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.start)
    }
}

/// RFC 3339 UTC with nanoseconds, as nats-server writes stream timestamps.
pub fn format_nanos(nanos: u64) -> String {
    let millis =
        crate::rfc3339::format_millis(i64::try_from(nanos / 1_000_000).unwrap_or(i64::MAX));
    let base = millis.get(..millis.len().saturating_sub(5)).unwrap_or("");
    format!("{base}.{:09}Z", nanos % 1_000_000_000)
}

/// Parses an RFC 3339 time into Unix nanoseconds.
pub fn parse_nanos(s: &str) -> Option<u64> {
    crate::rfc3339::parse_nanos(s).and_then(|n| u64::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_nanoseconds() {
        assert_eq!(
            format_nanos(1_700_000_000_123_456_789),
            "2023-11-14T22:13:20.123456789Z"
        );
        assert_eq!(
            parse_nanos("2023-11-14T22:13:20.123456789Z"),
            Some(1_700_000_000_123_456_789)
        );
    }
}
