//! Token buckets on the publish path (`send`, `publish`, `submit`), one pair per
//! participant: messages (`msgs_per_s`, capacity `burst`) and bytes (`bytes_per_s`,
//! capacity one second's worth, or `burst` times the average allowance per message when
//! larger). Buckets start full. A refused request takes nothing and is told honestly how
//! long until both buckets hold enough (`retry_after_ms`, rounded up).
//!
//! Sans-IO: `now` is passed in. The map of buckets is bounded; a participant whose bucket
//! was forgotten starts full again, which is what it would have refilled to anyway once
//! idle for a second or two.

use std::time::{Duration, Instant};

use super::bounded_map::BoundedMap;
use super::config::Policy;

/// The limits of one participant. `None` for a dimension means unlimited.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub msgs_per_s: Option<f64>,
    pub burst: f64,
    pub bytes_per_s: Option<f64>,
    /// Capacity of the byte bucket.
    pub bytes_burst: f64,
}

impl Limits {
    /// The limits a participant's policy sets, or `None` when it sets no rate at all.
    /// `burst` defaults to one second of `msgs_per_s` (at least 1).
    pub fn from_policy(policy: &Policy) -> Option<Limits> {
        if policy.msgs_per_s.is_none() && policy.bytes_per_s.is_none() {
            return None;
        }
        let burst = match (policy.burst, policy.msgs_per_s) {
            (Some(b), _) => f64::from(b.max(1)),
            (None, Some(rate)) => rate.ceil().max(1.0),
            (None, None) => 1.0,
        };
        let bytes_burst = policy
            .bytes_per_s
            .map_or(0.0, |bps| match policy.msgs_per_s {
                Some(rate) => bps.max(bps / rate * burst),
                None => bps,
            });
        Some(Limits {
            msgs_per_s: policy.msgs_per_s,
            burst,
            bytes_per_s: policy.bytes_per_s,
            bytes_burst,
        })
    }
}

/// Why a request was refused: the spec's `rate_limited` with its `retry_after_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimited {
    pub retry_after_ms: u64,
    /// The request can never pass: it is larger than the byte bucket holds.
    pub never: bool,
}

/// Tolerance for float rounding, so that waiting exactly `retry_after_ms` is enough.
const EPSILON: f64 = 1e-6;

#[derive(Debug, Clone)]
struct Bucket {
    msgs: f64,
    bytes: f64,
    updated: Instant,
}

#[derive(Debug)]
pub struct RateLimiter {
    buckets: BoundedMap<String, Bucket>,
}

impl RateLimiter {
    /// Buckets for at most `max_participants` participants at a time.
    pub fn new(max_participants: usize) -> RateLimiter {
        RateLimiter {
            buckets: BoundedMap::new(max_participants),
        }
    }

    /// Takes `msgs` messages and `bytes` bytes from `participant`'s buckets, or takes
    /// nothing and says how long until it could.
    pub fn try_take(
        &mut self,
        participant: &str,
        limits: &Limits,
        msgs: u32,
        bytes: u64,
        now: Instant,
    ) -> Result<(), RateLimited> {
        let msgs = f64::from(msgs);
        let bytes = bytes as f64;
        let b = self
            .buckets
            .get_or_insert_with(participant.to_string(), || Bucket {
                msgs: limits.burst,
                bytes: limits.bytes_burst,
                updated: now,
            });
        let elapsed = now.saturating_duration_since(b.updated).as_secs_f64();
        if let Some(rate) = limits.msgs_per_s {
            b.msgs = (b.msgs + elapsed * rate).min(limits.burst);
        }
        if let Some(rate) = limits.bytes_per_s {
            b.bytes = (b.bytes + elapsed * rate).min(limits.bytes_burst);
        }
        b.updated = now;

        let mut wait_s: f64 = 0.0;
        let mut never = false;
        if let Some(rate) = limits.msgs_per_s {
            if msgs > limits.burst {
                never = true;
            } else if b.msgs < msgs - EPSILON {
                wait_s = wait_s.max((msgs - b.msgs) / rate);
            }
        }
        if let Some(rate) = limits.bytes_per_s {
            if bytes > limits.bytes_burst {
                never = true;
            } else if b.bytes < bytes - EPSILON {
                wait_s = wait_s.max((bytes - b.bytes) / rate);
            }
        }
        if never {
            return Err(RateLimited {
                retry_after_ms: 0,
                never: true,
            });
        }
        if wait_s > 0.0 {
            // Rounded up, so a client that waits exactly this long is let through.
            let ms = (wait_s * 1000.0 - EPSILON).ceil().max(1.0);
            return Err(RateLimited {
                retry_after_ms: if ms.is_finite() { ms as u64 } else { u64::MAX },
                never: false,
            });
        }
        if limits.msgs_per_s.is_some() {
            b.msgs = (b.msgs - msgs).max(0.0);
        }
        if limits.bytes_per_s.is_some() {
            b.bytes = (b.bytes - bytes).max(0.0);
        }
        Ok(())
    }

    /// Gives back what a successful [`try_take`](Self::try_take) took, when the request
    /// failed later for another reason (e.g. `budget_exhausted`), so that a failed request
    /// changes nothing a later one can observe. Capped at the buckets' capacity.
    pub fn refund(&mut self, participant: &str, limits: &Limits, msgs: u32, bytes: u64) {
        if let Some(b) = self.buckets.get_mut(&participant.to_string()) {
            if limits.msgs_per_s.is_some() {
                b.msgs = (b.msgs + f64::from(msgs)).min(limits.burst);
            }
            if limits.bytes_per_s.is_some() {
                b.bytes = (b.bytes + bytes as f64).min(limits.bytes_burst);
            }
        }
    }

    /// Forgets buckets untouched for `idle`, which should be at least the longest refill
    /// time of any participant (`burst / msgs_per_s`), so only full buckets are dropped (they
    /// are recreated full on demand).
    pub fn prune(&mut self, now: Instant, idle: Duration) {
        self.buckets
            .retain(|_, b| now.saturating_duration_since(b.updated) < idle);
    }

    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }
}

/// A bucket for requests whose cost the client does not choose (a listing of everyone
/// present): one goes through whenever the bucket holds anything, however much it costs,
/// and the bucket then stays empty until that is paid back at `rate` a second. So no
/// request is refused for good, and the sustained rate is bounded all the same.
#[derive(Debug, Clone, Copy)]
pub struct DebtBucket {
    level: f64,
    updated: Instant,
}

impl DebtBucket {
    /// A bucket that holds one second's worth, full from the start.
    pub fn new(now: Instant) -> DebtBucket {
        DebtBucket {
            level: f64::INFINITY,
            updated: now,
        }
    }

    /// Takes `cost` at `rate` a second when the bucket holds anything; otherwise how many
    /// milliseconds until it does (rounded up, at least 1).
    pub fn take(&mut self, cost: f64, rate: f64, now: Instant) -> Result<(), u64> {
        let rate = rate.max(EPSILON);
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level = (self.level + elapsed * rate).min(rate);
        self.updated = now;
        if self.level > 0.0 {
            self.level -= cost;
            return Ok(());
        }
        let ms = (-self.level / rate * 1000.0).ceil().max(1.0);
        Err(if ms.is_finite() { ms as u64 } else { u64::MAX })
    }

    /// Whether the bucket is full again at `rate` by `now`: as good as a new one.
    pub fn refilled(&self, rate: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.level + elapsed * rate.max(EPSILON) >= rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(msgs_per_s: Option<f64>, burst: Option<u32>, bytes_per_s: Option<f64>) -> Limits {
        Limits::from_policy(&Policy {
            msgs_per_s,
            burst,
            bytes_per_s,
            tasks_per_window: None,
            window_s: None,
        })
        .expect("a rate is set")
    }

    #[test]
    fn buckets_start_full_and_refuse_past_the_burst() {
        let l = limits(Some(2.0), Some(5), None);
        let mut r = RateLimiter::new(10);
        let now = Instant::now();
        for i in 0..5 {
            assert_eq!(r.try_take("acme/a", &l, 1, 10, now), Ok(()), "message {i}");
        }
        assert_eq!(
            r.try_take("acme/a", &l, 1, 10, now),
            Err(RateLimited {
                retry_after_ms: 500,
                never: false
            })
        );
        assert_eq!(
            r.try_take("acme/b", &l, 1, 10, now),
            Ok(()),
            "per participant"
        );
    }

    #[test]
    fn retry_after_is_honest_waiting_it_succeeds_and_one_ms_less_does_not() {
        let l = limits(Some(3.0), Some(1), None);
        let mut r = RateLimiter::new(10);
        let now = Instant::now();
        assert_eq!(r.try_take("p", &l, 1, 0, now), Ok(()));
        let Err(e) = r.try_take("p", &l, 1, 0, now) else {
            panic!("bucket is empty")
        };
        assert_eq!(e.retry_after_ms, 334, "1/3 s rounded up");
        let early = now + Duration::from_millis(e.retry_after_ms - 1);
        assert!(r.try_take("p", &l, 1, 0, early).is_err());
        let on_time = now + Duration::from_millis(e.retry_after_ms);
        assert_eq!(r.try_take("p", &l, 1, 0, on_time), Ok(()));
    }

    #[test]
    fn a_refused_request_takes_nothing() {
        let l = limits(Some(1.0), Some(2), None);
        let mut r = RateLimiter::new(10);
        let now = Instant::now();
        assert_eq!(r.try_take("p", &l, 2, 0, now), Ok(()));
        for _ in 0..100 {
            assert!(r.try_take("p", &l, 1, 0, now).is_err());
        }
        assert_eq!(
            r.try_take("p", &l, 1, 0, now + Duration::from_secs(1)),
            Ok(())
        );
    }

    #[test]
    fn byte_rate_limits_independently_and_reports_the_longer_wait() {
        // 1000 bytes/s, burst of 10 messages at 100 msgs/s: the byte bucket holds 1000.
        let l = limits(Some(100.0), Some(10), Some(1000.0));
        assert_eq!(l.bytes_burst, 1000.0);
        let mut r = RateLimiter::new(10);
        let now = Instant::now();
        assert_eq!(r.try_take("p", &l, 1, 800, now), Ok(()));
        // 200 bytes left: 500 more need 0.3 s of byte refill; messages are plentiful.
        assert_eq!(
            r.try_take("p", &l, 1, 500, now)
                .map_err(|e| e.retry_after_ms),
            Err(300)
        );
        assert_eq!(
            r.try_take("p", &l, 1, 500, now + Duration::from_millis(300)),
            Ok(())
        );
    }

    #[test]
    fn a_refund_restores_what_was_taken_but_never_beyond_capacity() {
        let l = limits(Some(1.0), Some(2), Some(100.0));
        let mut r = RateLimiter::new(10);
        let now = Instant::now();
        assert_eq!(r.try_take("p", &l, 2, 100, now), Ok(()));
        assert!(r.try_take("p", &l, 1, 1, now).is_err());
        r.refund("p", &l, 2, 100);
        assert_eq!(r.try_take("p", &l, 2, 100, now), Ok(()));
        r.refund("p", &l, 50, 5000);
        assert!(
            r.try_take("p", &l, 3, 1, now).is_err(),
            "capped at the burst"
        );
    }

    #[test]
    fn a_request_larger_than_the_byte_bucket_can_never_pass() {
        let l = limits(None, None, Some(100.0));
        let mut r = RateLimiter::new(10);
        let e = r
            .try_take("p", &l, 1, 101, Instant::now())
            .expect_err("too big");
        assert!(e.never);
    }

    #[test]
    fn no_rate_in_the_policy_means_no_limiter() {
        let p = Policy {
            msgs_per_s: None,
            burst: Some(3),
            bytes_per_s: None,
            tasks_per_window: Some(5),
            window_s: Some(60),
        };
        assert_eq!(Limits::from_policy(&p), None);
        let l = limits(Some(2.5), None, None);
        assert_eq!(l.burst, 3.0, "burst defaults to one second's worth");
    }

    #[test]
    fn the_bucket_map_is_bounded_and_prunes_idle_participants() {
        let l = limits(Some(1.0), Some(1), None);
        let mut r = RateLimiter::new(3);
        let now = Instant::now();
        for i in 0..10 {
            assert_eq!(r.try_take(&format!("p{i}"), &l, 1, 0, now), Ok(()));
        }
        assert_eq!(r.tracked(), 3);
        r.prune(now + Duration::from_secs(5), Duration::from_secs(2));
        assert_eq!(r.tracked(), 0);
    }
}

#[cfg(test)]
mod debt_tests {
    use std::time::{Duration, Instant};

    use super::DebtBucket;

    #[test]
    fn a_costly_request_passes_on_anything_and_the_next_waits_until_it_is_paid() {
        let now = Instant::now();
        let mut b = DebtBucket::new(now);
        // 1,000 a second: a second's worth at once, the last one into debt.
        assert_eq!(b.take(600.0, 1000.0, now), Ok(()));
        assert_eq!(b.take(600.0, 1000.0, now), Ok(()));
        assert_eq!(b.take(1.0, 1000.0, now), Err(200));
        let paid = now + Duration::from_millis(200);
        assert_eq!(b.take(5000.0, 1000.0, paid), Err(1));
        let later = paid + Duration::from_millis(1);
        assert_eq!(b.take(5000.0, 1000.0, later), Ok(()));
        assert_eq!(b.take(1.0, 1000.0, later), Err(4999));
    }
}
