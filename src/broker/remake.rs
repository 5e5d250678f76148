//! Streams and buckets found gone while the broker runs (deleted by an operator or anyone
//! with JetStream rights in the account): start-up made them, and nothing would make them
//! again, so every request on them would fail until a restart while the probes said ready.
//! Each one found gone is made again alone, with start-up's configuration
//! (`setup::desired_stream`), one create out at a time and the next after a growing wait;
//! until it is back `/readyz` names it. Sans-IO: the core sends the creates.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::amp::{AmpError, ErrorCode};

/// `retry_after_ms` of a request that found its stream gone: about a create's round trip
/// and the first wait after a miss.
pub const RETRY_AFTER_MS: u64 = 1000;
/// The wait after a create that failed, doubled after each further miss up to `MAX_WAIT`.
const FIRST_WAIT: Duration = Duration::from_secs(1);
const MAX_WAIT: Duration = Duration::from_secs(30);

/// A stream and the namespace whose JetStream (domain) holds it. The buckets every
/// namespace of a domain shares (the task store) may be found gone by several
/// namespaces: each asks for it once, and a create of what is already there succeeds.
pub type Key = (String, String);

/// The answer to a request that found `stream` gone.
pub fn gone(stream: &str) -> AmpError {
    let mut e = AmpError::new(
        ErrorCode::Unavailable,
        format!("JetStream stream {stream} is gone; the broker is making it again"),
    );
    e.retry_after_ms = Some(RETRY_AFTER_MS);
    e
}

#[derive(Debug, Default)]
struct Remake {
    /// Creates that failed in a row.
    misses: u32,
    /// JetStream's last refusal of the create.
    refused: Option<String>,
    /// Nobody answered the last create: JetStream (or the domain) is away, which the
    /// JetStream probe reports; that says nothing of this stream, so it is not named.
    away: bool,
    /// A create is out.
    out: bool,
}

/// The streams being made again. Only those start-up makes are ever here (the core asks
/// `setup::desired_stream` first), so the map is bounded by the configuration.
#[derive(Debug, Default)]
pub struct Remakes {
    streams: BTreeMap<Key, Remake>,
}

impl Remakes {
    /// `stream` of `ns` was found gone: whether a create should go out now (none is out
    /// or waiting for its retry).
    pub fn begin(&mut self, ns: &str, stream: &str) -> bool {
        let key = (ns.to_string(), stream.to_string());
        if self.streams.contains_key(&key) {
            return false;
        }
        self.streams.insert(
            key,
            Remake {
                out: true,
                ..Remake::default()
            },
        );
        true
    }

    /// The retry of `key` is due: whether its create should go out now.
    pub fn due(&mut self, key: &Key) -> bool {
        self.streams
            .get_mut(key)
            .is_some_and(|r| !std::mem::replace(&mut r.out, true))
    }

    /// The stream is there again (made, or found made by another broker), or is no
    /// longer the configuration's.
    pub fn done(&mut self, key: &Key) {
        self.streams.remove(key);
    }

    /// The create failed (`away`: nobody answered it): how long until the next.
    pub fn missed(&mut self, key: &Key, why: String, away: bool) -> Option<Duration> {
        let r = self.streams.get_mut(key)?;
        r.out = false;
        r.away = away;
        r.refused = Some(why);
        let wait = FIRST_WAIT
            .saturating_mul(1 << r.misses.min(5))
            .min(MAX_WAIT);
        r.misses = r.misses.saturating_add(1);
        Some(wait)
    }

    /// Ready unless a stream found gone is not back, each named (with why its last
    /// create failed).
    pub fn readiness(&self) -> Result<(), String> {
        let mut named: Vec<String> = Vec::new();
        for ((_, stream), r) in self.streams.iter().filter(|(_, r)| !r.away) {
            let line = match &r.refused {
                Some(why) => format!("{stream} ({why})"),
                None => stream.clone(),
            };
            if !named.contains(&line) {
                named.push(line);
            }
        }
        if named.is_empty() {
            return Ok(());
        }
        Err(format!(
            "JetStream streams gone, being made again: {}",
            named.join(", ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_create_at_a_time_each_miss_waiting_longer_and_away_is_not_named() {
        let mut r = Remakes::default();
        let key = ("acme".to_string(), "AMP_INBOX_acme".to_string());
        assert!(r.begin("acme", "AMP_INBOX_acme"));
        assert!(!r.begin("acme", "AMP_INBOX_acme"), "one out already");
        assert!(!r.due(&key), "its create is out");
        assert_eq!(
            r.readiness(),
            Err("JetStream streams gone, being made again: AMP_INBOX_acme".into())
        );
        let waits: Vec<Duration> = (0..8)
            .map(|_| {
                let wait = r.missed(&key, "refused".into(), false).expect("tracked");
                assert!(r.due(&key));
                wait
            })
            .collect();
        let s = Duration::from_secs;
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30].map(s));
        assert!(
            r.readiness()
                .is_err_and(|e| e.contains("AMP_INBOX_acme (refused)"))
        );
        r.missed(&key, "no responders".into(), true);
        assert_eq!(
            r.readiness(),
            Ok(()),
            "JetStream away is the probe's to report"
        );
        r.done(&key);
        assert!(!r.due(&key));
        assert!(r.missed(&key, "late".into(), false).is_none());
        assert!(r.begin("acme", "AMP_INBOX_acme"), "found gone again");
    }
}
