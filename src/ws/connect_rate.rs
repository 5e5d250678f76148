//! How fast one address may open connections: a token bucket per address (IPv6: per
//! /64). The per-address cap bounds how many connections are open at once, not how fast
//! they come and go; a client that connects, is refused or closes, and connects again in
//! a loop would otherwise cost an accept, a request head and a challenge every time.

use std::collections::HashMap;
use std::time::Instant;

use crate::broker::throttle::AddressKey;

/// Addresses tracked at once. When full, buckets that have refilled are forgotten
/// (forgetting them changes nothing); if none has, a new address is not limited, which
/// only helps an attacker who already holds that many addresses.
const MAX_TRACKED: usize = 65_536;

#[derive(Debug)]
pub struct ConnectRate {
    per_s: f64,
    burst: f64,
    buckets: HashMap<AddressKey, (f64, Instant)>,
}

impl ConnectRate {
    pub fn new(per_s: u32, burst: u32) -> ConnectRate {
        ConnectRate {
            per_s: f64::from(per_s.max(1)),
            burst: f64::from(burst.max(1)),
            buckets: HashMap::new(),
        }
    }

    /// Takes one connection from `ip`'s allowance; false when it is spent.
    pub fn allow(&mut self, ip: AddressKey, now: Instant) -> bool {
        let (per_s, burst) = (self.per_s, self.burst);
        let refill = |(tokens, at): (f64, Instant)| {
            (tokens + now.saturating_duration_since(at).as_secs_f64() * per_s).min(burst)
        };
        if !self.buckets.contains_key(&ip) && self.buckets.len() >= MAX_TRACKED {
            self.buckets.retain(|_, b| refill(*b) < burst);
            if self.buckets.len() >= MAX_TRACKED {
                return true;
            }
        }
        let bucket = self.buckets.entry(ip).or_insert((burst, now));
        let tokens = refill(*bucket);
        if tokens < 1.0 {
            *bucket = (tokens, now);
            return false;
        }
        *bucket = (tokens - 1.0, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;
    use std::time::Duration;

    fn key(s: &str) -> AddressKey {
        AddressKey::of(s.parse::<IpAddr>().expect("ip"))
    }

    #[test]
    fn an_address_gets_its_burst_then_its_rate_and_others_are_unaffected() {
        let mut rate = ConnectRate::new(10, 5);
        let t0 = Instant::now();
        let a = key("10.0.0.1");
        assert_eq!((0..8).filter(|_| rate.allow(a, t0)).count(), 5);
        assert!(
            rate.allow(key("10.0.0.2"), t0),
            "another address has its own"
        );
        assert!(!rate.allow(a, t0 + Duration::from_millis(50)));
        assert!(
            rate.allow(a, t0 + Duration::from_millis(100)),
            "one token per 100 ms"
        );
        assert!(!rate.allow(a, t0 + Duration::from_millis(110)));
        let later = t0 + Duration::from_secs(60);
        assert_eq!(
            (0..8).filter(|_| rate.allow(a, later)).count(),
            5,
            "refills to burst only"
        );
    }

    #[test]
    fn an_ipv6_slash_64_shares_one_allowance() {
        let mut rate = ConnectRate::new(1, 2);
        let t0 = Instant::now();
        assert!(rate.allow(key("2001:db8::1"), t0));
        assert!(rate.allow(key("2001:db8::2"), t0));
        assert!(!rate.allow(key("2001:db8::3"), t0));
        assert!(rate.allow(key("2001:db8:0:1::1"), t0));
    }

    #[test]
    fn the_table_stays_bounded() {
        let mut rate = ConnectRate::new(1, 1);
        let t0 = Instant::now();
        for i in 0..(MAX_TRACKED as u32 + 10) {
            let ip = IpAddr::from(std::net::Ipv4Addr::from(i));
            rate.allow(AddressKey::of(ip), t0);
        }
        assert!(rate.buckets.len() <= MAX_TRACKED);
    }
}
