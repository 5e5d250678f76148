//! Signed ids every broker has taken. Each subscriber of a topic receives every PUBLISH
//! request whole (README "PUBLISH takes an NKey signature"), and the signature covers the
//! message id, time and subject, not the body; a broker's own replay cache stops a replay
//! sent to it, not one sent to another broker of the tenant. So before an event is stored
//! its signed id is created as a key of a bucket the brokers of the domain share: the
//! second create of a key fails, whichever broker asks.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::caller::REPLAY_WINDOW;
use crate::broker::envelope::hex;
use crate::jetstream::kv::Kv;
use crate::jetstream::{ApiPrefix, JsError, Request};

pub const BUCKET: &str = "AMP_MIG_SEEN";
/// A broker accepts a signature within the replay window either side of its clock, so a
/// record outlives twice that, plus a minute for the brokers' clocks to disagree.
pub const KEEP: Duration = Duration::from_secs(2 * REPLAY_WINDOW.as_secs() + 60);
/// A full bucket refuses new keys (`MIG_UNAVAILABLE`, retryable) rather than forget
/// ones still inside their window. About 200 bytes a key: some 300,000 signed requests
/// in `KEEP`, while each caller is paced at `max_frames_per_s`.
pub const MAX_BYTES: u64 = 64 << 20;

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
    Kv::new(api, BUCKET)?.create_request(&key(ns, name, message_id), b"", None)
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
    }
}
