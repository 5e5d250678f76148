//! Throttling of failed `hello` attempts, so that guessing credentials is slow without
//! letting an attacker lock a legitimate participant out.
//!
//! Two independent limits:
//!
//! - **Per source address** (IPv4 address, or IPv6 /64 since one host usually owns a whole
//!   /64): the first `address_free_failures` failures cost nothing, then each further
//!   failure doubles the wait before the next attempt from that address, from
//!   `address_base_delay` up to `address_max_delay`. The count is forgotten
//!   `address_forget_after` after the last failure, and a success from the address clears it
//!   when the failures were all in the name that succeeded.
//!   This is the limit that slows a single guesser down exponentially.
//! - **Per participant**: a bucket of `participant_burst` failures refilled at one per
//!   `participant_refill`. When it is empty, attempts for that participant wait for the next
//!   refill, but only from addresses that have not recently authenticated as that participant
//!   ("known" addresses, a few remembered per participant). So a guesser spread over many
//!   addresses gets at most one guess per `participant_refill`, while the participant itself,
//!   connecting from where it connected before, is never slowed by someone else's failures,
//!   and from a new address waits at most one refill interval per attempt.
//!
//! Participants that have authenticated here are kept in a map of their own, which only a
//! success adds to: failures in made-up names (any string a client sends) fill the other
//! one, and pushing its oldest entries out cannot make a participant forget its known
//! addresses.
//!
//! Sans-IO: `now` is passed in. All maps are bounded; the oldest entries are forgotten first.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use super::bounded_map::BoundedMap;
use crate::deadline::after;

#[derive(Debug, Clone)]
pub struct ThrottleConfig {
    pub address_free_failures: u32,
    pub address_base_delay: Duration,
    pub address_max_delay: Duration,
    pub address_forget_after: Duration,
    pub participant_burst: u32,
    pub participant_refill: Duration,
    /// Addresses remembered per participant as known-good.
    pub known_addresses: usize,
    /// How long a successful address stays known.
    pub known_for: Duration,
    pub max_addresses: usize,
    pub max_participants: usize,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig {
            address_free_failures: 5,
            address_base_delay: Duration::from_secs(1),
            address_max_delay: Duration::from_secs(300),
            address_forget_after: Duration::from_secs(3600),
            participant_burst: 20,
            participant_refill: Duration::from_secs(1),
            known_addresses: 8,
            known_for: Duration::from_secs(7 * 24 * 3600),
            max_addresses: 65_536,
            max_participants: 65_536,
        }
    }
}

/// Whether a `hello` may be checked now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Not before this long from now. The attempt was not counted.
    Delay(Duration),
}

/// The key of a source address: IPv6 addresses are grouped by /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AddressKey(IpAddr);

impl AddressKey {
    pub fn of(addr: IpAddr) -> AddressKey {
        match addr {
            IpAddr::V4(_) => AddressKey(addr),
            IpAddr::V6(v6) => {
                if let Some(v4) = v6.to_ipv4_mapped() {
                    return AddressKey(IpAddr::V4(v4));
                }
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                AddressKey(IpAddr::V6(bits.into()))
            }
        }
    }
}

#[derive(Debug)]
struct AddressState {
    failures: u32,
    last_failure: Instant,
    not_before: Instant,
    /// The name its failures were all in (a hash of it), `None` once there were several:
    /// a success clears only the failures it explains. Cleared by anyone's success, a
    /// participant sharing another's address (where the other's bucket does not apply) got
    /// a fresh count for every few guesses at the other's token.
    failed_in: Option<u64>,
}

#[derive(Debug)]
struct ParticipantState {
    /// Failure allowance left, as of `updated`.
    tokens: f64,
    updated: Instant,
    /// Addresses that authenticated as this participant, with when they last did.
    known: Vec<(AddressKey, Instant)>,
}

#[derive(Debug)]
pub struct HelloThrottle {
    config: ThrottleConfig,
    addresses: BoundedMap<AddressKey, AddressState>,
    /// Participants that authenticated here (each with its known addresses).
    members: BoundedMap<String, ParticipantState>,
    /// Names only failed so far, made-up ones included.
    strangers: BoundedMap<String, ParticipantState>,
}

impl HelloThrottle {
    pub fn new(config: ThrottleConfig) -> HelloThrottle {
        HelloThrottle {
            addresses: BoundedMap::new(config.max_addresses),
            members: BoundedMap::new(config.max_participants),
            strangers: BoundedMap::new(config.max_participants),
            config,
        }
    }

    /// Whether a `hello` from `addr` claiming `participant` (`ns/name`, known or not) may be
    /// checked now. Call before verifying the credential; then call
    /// [`record_failure`](Self::record_failure) or [`record_success`](Self::record_success).
    pub fn check(&self, addr: IpAddr, participant: &str, now: Instant) -> Verdict {
        let key = AddressKey::of(addr);
        let mut wait = self.address_wait(key, now);
        if let Some(p) = self.participant(participant)
            && !self.is_known(p, key, now)
        {
            let tokens = self.refilled(p, now);
            if tokens < 1.0 {
                let missing = 1.0 - tokens;
                let until = self.config.participant_refill.mul_f64(missing);
                wait = wait.max(until.max(Duration::from_millis(1)));
            }
        }
        if wait.is_zero() {
            Verdict::Allow
        } else {
            Verdict::Delay(wait)
        }
    }

    /// [`check`](Self::check) of the address alone, for a credential that names no
    /// participant until it has been checked (a NATS `auth_token`).
    pub fn check_address(&self, addr: IpAddr, now: Instant) -> Verdict {
        let wait = self.address_wait(AddressKey::of(addr), now);
        if wait.is_zero() {
            Verdict::Allow
        } else {
            Verdict::Delay(wait)
        }
    }

    fn address_wait(&self, key: AddressKey, now: Instant) -> Duration {
        match self.addresses.get(&key) {
            Some(a) if !self.address_forgotten(a, now) => {
                a.not_before.saturating_duration_since(now)
            }
            _ => Duration::ZERO,
        }
    }

    /// A `hello` from `addr` for `participant` failed (bad credential, unknown participant,
    /// wrong first frame).
    pub fn record_failure(&mut self, addr: IpAddr, participant: &str, now: Instant) {
        let key = AddressKey::of(addr);
        let forget_after = self.config.address_forget_after;
        let named = name_hash(participant);
        let a = self.addresses.get_or_insert_with(key, || AddressState {
            failures: 0,
            last_failure: now,
            not_before: now,
            failed_in: Some(named),
        });
        if now.saturating_duration_since(a.last_failure) > forget_after {
            a.failures = 0;
            a.failed_in = Some(named);
        }
        if a.failed_in != Some(named) {
            a.failed_in = None;
        }
        a.failures = a.failures.saturating_add(1);
        a.last_failure = now;
        let over = a.failures.saturating_sub(self.config.address_free_failures);
        a.not_before = if over == 0 {
            now
        } else {
            let factor = 2u32.saturating_pow(over - 1);
            let delay = self
                .config
                .address_base_delay
                .saturating_mul(factor)
                .min(self.config.address_max_delay);
            after(now, delay)
        };

        let tokens = match self.participant(participant) {
            Some(p) => self.refilled(p, now),
            None => f64::from(self.config.participant_burst),
        };
        let name = participant.to_string();
        let p = match self.members.get_mut(&name) {
            Some(p) => p,
            None => self
                .strangers
                .get_or_insert_with(name, || ParticipantState {
                    tokens,
                    updated: now,
                    known: Vec::new(),
                }),
        };
        // Never below empty, so a burst of concurrent failures costs a newcomer at most
        // one refill interval.
        p.tokens = (tokens - 1.0).max(0.0);
        p.updated = now;
    }

    /// A `hello` from `addr` authenticated as `participant`: the address's failures are
    /// cleared if they were all in that name, and the address becomes known for the
    /// participant.
    pub fn record_success(&mut self, addr: IpAddr, participant: &str, now: Instant) {
        let key = AddressKey::of(addr);
        if self
            .addresses
            .get(&key)
            .is_some_and(|a| a.failed_in == Some(name_hash(participant)))
        {
            self.addresses.remove(&key);
        }
        let known_for = self.config.known_for;
        let limit = self.config.known_addresses.max(1);
        let name = participant.to_string();
        // Its failures so far come along: a success does not refill the allowance.
        let before = self.strangers.remove(&name);
        let burst = f64::from(self.config.participant_burst);
        let p = self.members.get_or_insert_with(name, || {
            before.unwrap_or(ParticipantState {
                tokens: burst,
                updated: now,
                // Most participants log in from one address: a first push would make
                // room for four.
                known: Vec::with_capacity(1),
            })
        });
        p.known
            .retain(|(k, at)| *k != key && now.saturating_duration_since(*at) <= known_for);
        if p.known.len() >= limit {
            // Forget the address that authenticated longest ago.
            if let Some(oldest) = p
                .known
                .iter()
                .enumerate()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(i, _)| i)
            {
                p.known.swap_remove(oldest);
            }
        }
        p.known.push((key, now));
    }

    /// Drops state that no longer affects any verdict; call now and then (e.g. once a
    /// minute) to return memory early. The maps are bounded regardless.
    pub fn prune(&mut self, now: Instant) {
        let forget_after = self.config.address_forget_after;
        self.addresses.retain(|_, a| {
            now.saturating_duration_since(a.last_failure) <= forget_after || a.not_before > now
        });
        let burst = f64::from(self.config.participant_burst);
        let refill = self.config.participant_refill;
        let known_for = self.config.known_for;
        let keep = |_: &String, p: &mut ParticipantState| {
            p.known
                .retain(|(_, at)| now.saturating_duration_since(*at) <= known_for);
            let full = refilled_tokens(p, now, refill, burst) >= burst;
            !(full && p.known.is_empty())
        };
        self.members.retain(keep);
        self.strangers.retain(keep);
    }

    pub fn tracked_addresses(&self) -> usize {
        self.addresses.len()
    }

    pub fn tracked_participants(&self) -> usize {
        self.members.len() + self.strangers.len()
    }

    fn participant(&self, name: &str) -> Option<&ParticipantState> {
        let name = name.to_string();
        self.members
            .get(&name)
            .or_else(|| self.strangers.get(&name))
    }

    fn address_forgotten(&self, a: &AddressState, now: Instant) -> bool {
        now.saturating_duration_since(a.last_failure) > self.config.address_forget_after
    }

    fn is_known(&self, p: &ParticipantState, key: AddressKey, now: Instant) -> bool {
        p.known
            .iter()
            .any(|(k, at)| *k == key && now.saturating_duration_since(*at) <= self.config.known_for)
    }

    fn refilled(&self, p: &ParticipantState, now: Instant) -> f64 {
        refilled_tokens(
            p,
            now,
            self.config.participant_refill,
            f64::from(self.config.participant_burst),
        )
    }
}

fn name_hash(participant: &str) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    participant.hash(&mut h);
    h.finish()
}

fn refilled_tokens(p: &ParticipantState, now: Instant, refill: Duration, burst: f64) -> f64 {
    let elapsed = now.saturating_duration_since(p.updated).as_secs_f64();
    let per = refill.as_secs_f64();
    let gained = if per > 0.0 { elapsed / per } else { burst };
    (p.tokens + gained).min(burst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
    }

    fn config() -> ThrottleConfig {
        ThrottleConfig {
            address_free_failures: 3,
            address_base_delay: Duration::from_secs(1),
            address_max_delay: Duration::from_secs(60),
            address_forget_after: Duration::from_secs(600),
            participant_burst: 5,
            participant_refill: Duration::from_secs(2),
            known_addresses: 2,
            known_for: Duration::from_secs(3600),
            max_addresses: 100,
            max_participants: 100,
        }
    }

    #[test]
    fn an_address_waits_exponentially_longer_after_its_free_failures() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        let mut delays = Vec::new();
        for i in 0..10 {
            // A different participant each time, so only the address limit applies.
            t.record_failure(ip(1), &format!("acme/p{i}"), now);
            delays.push(t.check(ip(1), "acme/other", now));
        }
        let expected: Vec<Verdict> = [0, 0, 0, 1, 2, 4, 8, 16, 32, 60]
            .into_iter()
            .map(|s| match s {
                0 => Verdict::Allow,
                s => Verdict::Delay(Duration::from_secs(s)),
            })
            .collect();
        assert_eq!(delays, expected);
        assert_eq!(
            t.check(ip(2), "acme/other", now),
            Verdict::Allow,
            "other addresses are unaffected"
        );
    }

    #[test]
    fn an_address_delay_elapses_and_its_count_is_forgotten_after_quiet() {
        let mut t = HelloThrottle::new(config());
        let start = Instant::now();
        for i in 0..5 {
            t.record_failure(ip(1), &format!("acme/p{i}"), start);
        }
        assert_eq!(
            t.check(ip(1), "acme/x", start),
            Verdict::Delay(Duration::from_secs(2))
        );
        let later = start + Duration::from_millis(1500);
        assert_eq!(
            t.check(ip(1), "acme/x", later),
            Verdict::Delay(Duration::from_millis(500))
        );
        assert_eq!(
            t.check(ip(1), "acme/x", start + Duration::from_secs(2)),
            Verdict::Allow
        );
        // Quiet for longer than forget_after: the next failure counts from one again.
        let much_later = start + Duration::from_secs(601);
        t.record_failure(ip(1), "acme/p9", much_later);
        assert_eq!(t.check(ip(1), "acme/x", much_later), Verdict::Allow);
    }

    #[test]
    fn success_clears_the_address_failures() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        for _ in 0..4 {
            t.record_failure(ip(1), "acme/w1", now);
        }
        assert!(matches!(t.check(ip(1), "acme/zz", now), Verdict::Delay(_)));
        t.record_success(ip(1), "acme/w1", now + Duration::from_secs(1));
        assert_eq!(
            t.check(ip(1), "acme/zz", now + Duration::from_secs(1)),
            Verdict::Allow
        );
    }

    #[test]
    fn a_success_in_one_name_does_not_clear_failures_in_another() {
        // Eve shares Bob's address (an office NAT), where Bob's bucket does not apply: it
        // is his known address. Her own success cleared the address's count after each
        // round of guesses at his token, so she guessed at the connect rate.
        let mut t = HelloThrottle::new(config());
        let mut now = Instant::now();
        t.record_success(ip(1), "acme/bob", now);
        let mut held = false;
        for _ in 0..20 {
            for _ in 0..3 {
                if let Verdict::Delay(d) = t.check(ip(1), "acme/bob", now) {
                    held = true;
                    now += d;
                }
                t.record_failure(ip(1), "acme/bob", now);
            }
            t.record_success(ip(1), "acme/eve", now);
        }
        assert!(held, "60 guesses at bob's token went unthrottled");
        // A success in the name that failed still clears them.
        let later = now + Duration::from_secs(120);
        t.record_success(ip(2), "acme/carol", later);
        for _ in 0..4 {
            t.record_failure(ip(2), "acme/carol", later);
        }
        t.record_success(ip(2), "acme/carol", later);
        assert_eq!(t.check(ip(2), "acme/zz", later), Verdict::Allow);
    }

    #[test]
    fn distributed_guessing_is_limited_per_participant() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        // Five addresses, one failure each: each address is within its free failures.
        for i in 0..5 {
            assert_eq!(t.check(ip(i), "acme/w1", now), Verdict::Allow);
            t.record_failure(ip(i), "acme/w1", now);
        }
        // The participant's allowance is spent: a sixth address waits for one refill.
        assert_eq!(
            t.check(ip(9), "acme/w1", now),
            Verdict::Delay(Duration::from_secs(2))
        );
        assert_eq!(
            t.check(ip(9), "acme/w1", now + Duration::from_secs(1)),
            Verdict::Delay(Duration::from_secs(1))
        );
        assert_eq!(
            t.check(ip(9), "acme/w1", now + Duration::from_secs(2)),
            Verdict::Allow
        );
        assert_eq!(
            t.check(ip(9), "acme/w2", now),
            Verdict::Allow,
            "other participants unaffected"
        );
    }

    #[test]
    fn an_attack_on_a_participant_does_not_slow_it_from_a_known_address() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        let home = ip(200);
        t.record_success(home, "acme/w1", now);
        // Many attacker addresses exhaust the participant's allowance, again and again.
        for round in 0..50u64 {
            let at = now + Duration::from_secs(round);
            t.record_failure(ip((round % 100) as u8), "acme/w1", at);
            t.record_failure(ip((round % 100) as u8 + 100), "acme/w1", at);
            assert_eq!(
                t.check(home, "acme/w1", at),
                Verdict::Allow,
                "round {round}"
            );
        }
        // From a new address the participant waits, but never longer than one refill.
        let at = now + Duration::from_secs(49);
        match t.check(ip(250), "acme/w1", at) {
            Verdict::Delay(d) => assert!(d <= Duration::from_secs(2), "{d:?}"),
            Verdict::Allow => panic!("the participant is under attack"),
        }
    }

    #[test]
    fn failures_in_made_up_names_do_not_make_a_participant_forget_its_addresses() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        let home = ip(200);
        t.record_success(home, "acme/w1", now);
        // More made-up names than the map holds, each from an address of its own...
        for i in 0..1000u32 {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            t.record_failure(addr, &format!("acme/guess{i}"), now);
        }
        // ...then the participant's own allowance emptied from yet more addresses.
        for i in 0..10u32 {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + i));
            t.record_failure(addr, "acme/w1", now);
        }
        assert_eq!(
            t.check(home, "acme/w1", now),
            Verdict::Allow,
            "its known address is still known"
        );
        assert_eq!(
            t.tracked_participants(),
            101,
            "the made-up names are still bounded"
        );
    }

    #[test]
    fn ipv6_addresses_are_grouped_by_their_64_prefix() {
        let a: Ipv6Addr = "2001:db8:1:2::1".parse().unwrap_or(Ipv6Addr::LOCALHOST);
        let b: Ipv6Addr = "2001:db8:1:2:ffff::9"
            .parse()
            .unwrap_or(Ipv6Addr::LOCALHOST);
        let c: Ipv6Addr = "2001:db8:1:3::1".parse().unwrap_or(Ipv6Addr::LOCALHOST);
        assert_eq!(AddressKey::of(a.into()), AddressKey::of(b.into()));
        assert_ne!(AddressKey::of(a.into()), AddressKey::of(c.into()));
        let mapped: Ipv6Addr = "::ffff:192.0.2.7".parse().unwrap_or(Ipv6Addr::LOCALHOST);
        assert_eq!(AddressKey::of(mapped.into()), AddressKey::of(ip(7)));
    }

    #[test]
    fn state_stays_bounded_and_prunes_to_nothing_when_quiet() {
        let mut t = HelloThrottle::new(config());
        let now = Instant::now();
        for i in 0..1000u32 {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
            t.record_failure(addr, &format!("acme/guess{i}"), now);
        }
        assert_eq!(t.tracked_addresses(), 100);
        assert_eq!(t.tracked_participants(), 100);
        t.prune(now + Duration::from_secs(3 * 3600));
        assert_eq!(t.tracked_addresses(), 0);
        assert_eq!(t.tracked_participants(), 0);
    }
}
