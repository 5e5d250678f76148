//! Signed ids every broker has taken. Each subscriber of a topic receives every PUBLISH
//! request whole (README "PUBLISH takes an NKey signature"), and the signature covers the
//! message id, time and subject, not the body; a broker's own replay cache stops a replay
//! sent to it, not one sent to another broker of the tenant. So before a PUBLISH's event
//! is stored, or the PUBLISH refused, its signed id is created as a key of a bucket the
//! brokers of the domain share: the second create of a key fails, whichever broker asks.
//!
//! The bucket also holds the message ids that name streams and forwarded cancels
//! ([`claim_invocation`]): they are chosen by callers, and frames of a stream are readable
//! tenant-wide (so even a stream id the broker made is known to others once it streams),
//! so an id one caller uses must not be taken by another on any broker.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::caller::REPLAY_WINDOW;
use super::envelope::{Code, MigError};
use crate::broker::envelope::hex;
use crate::jetstream::kv::Kv;
use crate::jetstream::{ApiPrefix, JsError, MsgTtl, Request};

pub const BUCKET: &str = "AMP_MIG_SEEN";
/// A broker accepts a signature within the replay window either side of its clock, so a
/// record outlives twice that, plus a minute for the brokers' clocks to disagree.
pub const KEEP: Duration = Duration::from_secs(2 * REPLAY_WINDOW.as_secs() + 60);
/// A full bucket refuses new keys (`MIG_UNAVAILABLE`, retryable) rather than forget
/// ones still inside their window. About 200 bytes a key: some 300,000 signed requests
/// in `KEEP`, while each caller is paced at `max_frames_per_s`.
pub const MAX_BYTES: u64 = 64 << 20;
/// Every key carries its own TTL; the bucket's age limit only backs them up, above the
/// longest an invocation may claim (a day's deadline, `mig.max_deadline_ms`, plus
/// [`INVOCATION_MARGIN`]).
pub const MAX_AGE: Duration = Duration::from_secs(86_400 + 2 * 60);
/// An invocation's id is held this long past its deadline: its last frame goes out at
/// the deadline at the latest.
pub const INVOCATION_MARGIN: Duration = Duration::from_secs(60);

/// The key of `name`'s signed `message_id` in tenant `ns`: the parts are length-prefixed
/// before hashing, so no two (name, id) pairs share one.
pub fn key(ns: &str, name: &str, message_id: &str) -> String {
    let mut h = Sha256::new();
    for part in [name, message_id] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    [ns, ".", &hex(&h.finalize()[..16])].concat()
}

/// The create that takes `message_id` for `name`; it fails with
/// [`JsError::WrongLastSequence`] when any broker took it before.
pub fn claim(api: ApiPrefix, ns: &str, name: &str, message_id: &str) -> Result<Request, JsError> {
    claim_key(api, &key(ns, name, message_id), KEEP)
}

/// The create that takes a signed id's [`key`] for `ttl`.
pub fn claim_key(api: ApiPrefix, key: &str, ttl: Duration) -> Result<Request, JsError> {
    Kv::new(api, BUCKET)?.create_request(key, b"", Some(MsgTtl::After(ttl)))
}

/// The key of the invocation whose `message_id` names a stream and a forwarded cancel in
/// tenant `ns`. Its token count differs from [`key`]'s, so the two never meet.
pub fn invocation_key(ns: &str, message_id: &str) -> String {
    let digest = Sha256::digest(message_id.as_bytes());
    [ns, ".invoke.", &hex(&digest[..16])].concat()
}

/// The create that takes `message_id` for `caller`'s invocation until its deadline, `left`
/// from now, plus [`INVOCATION_MARGIN`] have passed; the value is the caller, so that its
/// own retry through another broker (which finds the key) is told from someone else's.
pub fn claim_invocation(
    api: ApiPrefix,
    ns: &str,
    message_id: &str,
    caller: &str,
    left: Duration,
) -> Result<Request, JsError> {
    let ttl = left + INVOCATION_MARGIN;
    Kv::new(api, BUCKET)?.create_request(
        &invocation_key(ns, message_id),
        caller.as_bytes(),
        Some(MsgTtl::After(ttl)),
    )
}

/// The answer to a request whose claim had no responders: the bucket is gone, and the
/// core makes it again (`remake`), so the caller is told to come back.
pub fn gone() -> MigError {
    MigError::new(
        Code::Unavailable,
        format!("JetStream stream KV_{BUCKET} is gone; the broker is making it again"),
    )
    .detail(
        "retry_after_ms",
        serde_json::json!(crate::broker::remake::RETRY_AFTER_MS),
    )
}

/// Who holds `message_id` ([`claim_invocation`]).
pub fn invocation_owner(api: ApiPrefix, ns: &str, message_id: &str) -> Result<Request, JsError> {
    Kv::new(api, BUCKET)?.get_request(&invocation_key(ns, message_id))
}

/// Live invocation claims one broker keeps track of at once, about what [`MAX_BYTES`]
/// holds (some 170 bytes a key): past it the bucket is full anyway.
pub const MAX_LIVE_CLAIMS: usize = (MAX_BYTES / 170) as usize;

/// Why a claim is not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// The caller holds its bound; one of its claims ends in this long.
    Caller(Duration),
    /// This broker holds [`MAX_LIVE_CLAIMS`]; the first ends in this long.
    Broker(Duration),
}

/// The invocation claims this broker made in the bucket and whose keys still live, per
/// caller. A retry of a finished keyed invoke costs nothing but its claim, so without a
/// bound one caller at its request pace kept the shared bucket full and every tenant of
/// the domain was refused claims and signed PUBLISHes.
#[derive(Default)]
pub struct Ledger {
    /// Every live claim's expiry, soonest first, with its caller.
    all: BinaryHeap<Reverse<(Instant, Arc<str>)>>,
    callers: HashMap<Arc<str>, Held>,
    in_flight: usize,
}

#[derive(Default)]
struct Held {
    /// Claims sent and not answered yet.
    in_flight: usize,
    /// Expiries of this caller's live keys, soonest first.
    live: BinaryHeap<Reverse<Instant>>,
}

impl Ledger {
    /// Takes room for one claim by `caller` (`ns/name`), or says when there may be some.
    pub fn admit(&mut self, caller: &str, bound: usize, now: Instant) -> Result<(), Over> {
        self.prune(now);
        let until = |t: Option<&Reverse<Instant>>| {
            // With only claims in flight, their answers come within the request timeout.
            t.map_or(Duration::from_secs(1), |Reverse(t)| {
                t.saturating_duration_since(now)
            })
        };
        if let Some(held) = self.callers.get(caller)
            && held.in_flight + held.live.len() >= bound
        {
            return Err(Over::Caller(until(held.live.peek())));
        }
        if self.all.len() + self.in_flight >= MAX_LIVE_CLAIMS {
            let first = self.all.peek().map(|Reverse((t, _))| Reverse(*t));
            return Err(Over::Broker(until(first.as_ref())));
        }
        self.in_flight += 1;
        self.callers.entry(caller.into()).or_default().in_flight += 1;
        Ok(())
    }

    /// The answer to a claim [`Ledger::admit`] let through: `Some(ttl)` when a key may have
    /// been created (a lost answer counts: the server may have stored it).
    pub fn settle(&mut self, caller: &str, created: Option<Duration>, now: Instant) {
        let Some((key, held)) = self.callers.get_key_value(caller) else {
            return;
        };
        let key = key.clone();
        if held.in_flight == 0 {
            return;
        }
        self.in_flight = self.in_flight.saturating_sub(1);
        let Some(held) = self.callers.get_mut(caller) else {
            return;
        };
        held.in_flight -= 1;
        match created {
            Some(ttl) => {
                let until = now + ttl;
                held.live.push(Reverse(until));
                self.all.push(Reverse((until, key)));
            }
            None if held.live.is_empty() && held.in_flight == 0 => {
                self.callers.remove(caller);
            }
            None => {}
        }
    }

    /// Claims `caller` holds (live or in flight).
    #[cfg(test)]
    pub fn held(&self, caller: &str) -> usize {
        self.callers
            .get(caller)
            .map_or(0, |h| h.in_flight + h.live.len())
    }

    fn prune(&mut self, now: Instant) {
        while let Some(Reverse((t, _))) = self.all.peek()
            && *t <= now
        {
            let Some(Reverse((_, caller))) = self.all.pop() else {
                break;
            };
            // Both heaps hold the same expiries of `caller`: the soonest of its own is
            // one that has passed.
            if let Some(held) = self.callers.get_mut(&caller) {
                held.live.pop();
                if held.live.is_empty() && held.in_flight == 0 {
                    self.callers.remove(&caller);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caller_holds_at_most_its_bound_of_live_claims() {
        let mut l = Ledger::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(90);
        for _ in 0..3 {
            l.admit("acme/x", 3, t0).expect("room");
        }
        assert_eq!(
            l.admit("acme/x", 3, t0),
            Err(Over::Caller(Duration::from_secs(1)))
        );
        l.admit("acme/y", 3, t0).expect("another caller has room");
        // One answered without a key frees its place; two made keys.
        l.settle("acme/x", None, t0);
        l.settle("acme/x", Some(ttl), t0);
        l.settle("acme/x", Some(ttl + Duration::from_secs(10)), t0);
        assert_eq!(l.held("acme/x"), 2);
        l.admit("acme/x", 3, t0).expect("room again");
        l.settle("acme/x", Some(ttl), t0);
        assert_eq!(l.admit("acme/x", 3, t0), Err(Over::Caller(ttl)));
        // Keys past their TTL are gone from the bucket and from the count.
        let later = t0 + ttl;
        l.admit("acme/x", 3, later).expect("two keys ended");
        assert_eq!(l.held("acme/x"), 2);
        l.settle("acme/y", None, t0);
        assert_eq!(l.held("acme/y"), 0);
        assert!(
            !l.callers.contains_key("acme/y"),
            "an empty entry is forgotten"
        );
        let gone = t0 + ttl + Duration::from_secs(11);
        l.settle("acme/x", None, gone);
        l.prune(gone);
        assert!(l.callers.is_empty() && l.all.is_empty() && l.in_flight == 0);
    }

    #[test]
    fn keys_tell_every_name_and_id_apart() {
        // The same characters split differently between name and id.
        assert_ne!(key("acme", "ann", "b.1"), key("acme", "annb", ".1"));
        assert_ne!(key("acme", "ann", "1"), key("other", "ann", "1"));
        assert_eq!(key("acme", "ann", "1"), key("acme", "ann", "1"));
        crate::jetstream::kv::validate_key(&key("acme", "ann", "x y/z*>")).expect("a valid key");
        let inv = invocation_key("acme", "x y/z*>");
        crate::jetstream::kv::validate_key(&inv).expect("a valid key");
        assert_ne!(inv, invocation_key("other", "x y/z*>"));
        assert_ne!(
            inv.split('.').count(),
            key("acme", "a", "b").split('.').count()
        );
    }
}
