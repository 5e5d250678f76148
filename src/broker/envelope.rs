//! The AMP envelope: the JSON the broker stores in JetStream for every message, event and
//! task, and the ids that make resends idempotent. Bodies travel as raw JSON text, never
//! parsed into a tree and re-serialised.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

/// What a stored message is (`AMP-Kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Message,
    Event,
    Task,
    TaskResult,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Message => "message",
            Kind::Event => "event",
            Kind::Task => "task",
            Kind::TaskResult => "task_result",
        }
    }
}

/// A stored envelope. `to`, `topic` or `job` names the destination by kind; the broker
/// stamps `from`, `id` and `ts`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    pub id: String,
    pub kind: Kind,
    pub from: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    pub ts: String,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub body: Box<RawValue>,
}

impl Envelope {
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising strings, a string map and already-valid raw JSON cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_json(bytes: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The `Nats-Msg-Id` of a client's idempotent request: the same sender, kind, destination
/// and key give the same id (so JetStream answers a resend as a duplicate), and different
/// destinations never collide even with the same key.
pub fn idempotent_id(kind: Kind, from: &str, destination: &str, key: &str) -> String {
    let mut h = Sha256::new();
    for part in [kind.as_str(), from, destination, key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex(&h.finalize()[..16])
}

/// A fresh id for a message or task without a client-chosen one: unguessable and never
/// repeated (see [`super::ids`]).
pub fn unique_id() -> String {
    super::ids::fresh()
}

/// 16 bytes from the OS random source, as hex: for secrets such as development tokens.
pub fn random_id() -> String {
    let mut bytes = [0u8; 16];
    // The OS random source failing is not recoverable in any useful way; an all-zero id
    // would only risk a false duplicate, so fall back to the clock to stay unique.
    if getrandom::fill(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        bytes = nanos.to_le_bytes();
    }
    hex(&bytes)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_the_body_as_raw_json() {
        let body = RawValue::from_string(r#"{"b": [1, 2.50, null]}"#.to_string()).expect("raw");
        let env = Envelope {
            id: "i1".into(),
            kind: Kind::Message,
            from: "acme/w1".into(),
            to: Some("acme/w2".into()),
            topic: None,
            job: None,
            ts: "2026-11-29T08:00:00.000Z".into(),
            headers: BTreeMap::from([("traceparent".to_string(), "00-ab-cd-01".to_string())]),
            body,
        };
        let json = env.to_json();
        let text = String::from_utf8(json.clone()).expect("utf8");
        assert!(
            text.contains(r#""body":{"b": [1, 2.50, null]}"#),
            "body kept byte for byte: {text}"
        );
        assert!(!text.contains("topic"));
        let back = Envelope::from_json(&json).expect("parse");
        assert_eq!(back.kind, Kind::Message);
        assert_eq!(back.to.as_deref(), Some("acme/w2"));
        assert_eq!(back.body.get(), r#"{"b": [1, 2.50, null]}"#);
    }

    #[test]
    fn idempotent_ids_depend_on_every_part() {
        let a = idempotent_id(Kind::Message, "acme/a", "b", "k");
        assert_eq!(a, idempotent_id(Kind::Message, "acme/a", "b", "k"));
        assert_eq!(a.len(), 32);
        assert_ne!(a, idempotent_id(Kind::Message, "acme/a", "c", "k"));
        assert_ne!(a, idempotent_id(Kind::Event, "acme/a", "b", "k"));
        assert_ne!(a, idempotent_id(Kind::Message, "acme/x", "b", "k"));
        assert_ne!(
            idempotent_id(Kind::Message, "a", "bc", "k"),
            idempotent_id(Kind::Message, "a", "b", "ck")
        );
        assert_ne!(random_id(), random_id());
        let (a, b) = (unique_id(), unique_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), super::super::ids::ID_LEN);
    }
}
