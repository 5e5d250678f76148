//! Signed ids every broker has taken. Each subscriber of a topic receives every PUBLISH
//! request whole (README "PUBLISH takes an NKey signature"), and the signature covers the
//! message id, time and subject, not the body; a broker's own replay cache stops a replay
//! sent to it, not one sent to another broker of the tenant. So before an event is stored
//! its signed id is created as a key of a bucket the brokers of the domain share: the
//! second create of a key fails, whichever broker asks.
//!
//! The bucket also holds the message ids that name streams and forwarded cancels
//! ([`claim_invocation`]): they are chosen by callers, and frames of a stream are readable
//! tenant-wide (so even a stream id the broker made is known to others once it streams),
//! so an id one caller uses must not be taken by another on any broker.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::caller::REPLAY_WINDOW;
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
    Kv::new(api, BUCKET)?.create_request(&key(ns, name, message_id), b"", Some(MsgTtl::After(KEEP)))
}

/// The key of the invocation whose `message_id` names a stream and a forwarded cancel in
/// tenant `ns`. Its token count differs from [`key`]'s, so the two never meet.
pub fn invocation_key(ns: &str, message_id: &str) -> String {
    let digest = Sha256::digest(message_id.as_bytes());
    [ns, ".invoke.", &hex(&digest[..16])].concat()
}

/// The create that takes `message_id` for `caller`'s invocation until `deadline_ms` plus
/// [`INVOCATION_MARGIN`] have passed; the value is the caller, so that its own retry
/// through another broker (which finds the key) is told from someone else's.
pub fn claim_invocation(
    api: ApiPrefix,
    ns: &str,
    message_id: &str,
    caller: &str,
    deadline_ms: u64,
) -> Result<Request, JsError> {
    let ttl = Duration::from_millis(deadline_ms) + INVOCATION_MARGIN;
    Kv::new(api, BUCKET)?.create_request(
        &invocation_key(ns, message_id),
        caller.as_bytes(),
        Some(MsgTtl::After(ttl)),
    )
}

/// Who holds `message_id` ([`claim_invocation`]).
pub fn invocation_owner(api: ApiPrefix, ns: &str, message_id: &str) -> Result<Request, JsError> {
    Kv::new(api, BUCKET)?.get_request(&invocation_key(ns, message_id))
}

#[cfg(test)]
mod tests {
    use super::*;

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
