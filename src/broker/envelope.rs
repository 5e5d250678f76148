//! The AMP envelope: the JSON the broker stores in JetStream for every message, event and
//! task, and the ids that make resends idempotent. Bodies travel as raw JSON text, never
//! parsed into a tree and re-serialised.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
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
        // Sized once for the body and the members around it.
        let mut out = Vec::with_capacity(self.body.get().len() + 256);
        // Serialising strings, a string map and already-valid raw JSON cannot fail.
        match serde_json::to_writer(&mut out, self) {
            Ok(()) => out,
            Err(_) => Vec::new(),
        }
    }

    pub fn from_json(bytes: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A stored envelope read for delivery: the same members and the same rules as
/// [`Envelope`], borrowing from the payload instead of copying every string, header and
/// the body out of it.
#[derive(Debug, Deserialize)]
pub struct EnvelopeView<'a> {
    #[serde(borrow)]
    pub id: Text<'a>,
    pub kind: Kind,
    #[serde(borrow)]
    pub from: Text<'a>,
    #[serde(default, borrow)]
    pub to: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub topic: Option<Text<'a>>,
    #[serde(default, borrow)]
    pub job: Option<Text<'a>>,
    #[serde(borrow)]
    pub ts: Text<'a>,
    #[serde(default, borrow)]
    pub headers: BTreeMap<Text<'a>, Text<'a>>,
    #[serde(borrow)]
    pub body: &'a RawValue,
}

impl<'a> EnvelopeView<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<EnvelopeView<'a>, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// A JSON string borrowed from the text it was read from, or owned when it held escapes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Text<'a>(pub Cow<'a, str>);

impl Text<'_> {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(Text(Cow::Owned(v)))
            }
        }
        d.deserialize_str(Visitor)
    }
}

impl Serialize for Text<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
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

pub(crate) fn hex(bytes: &[u8]) -> String {
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
    fn a_view_reads_what_the_owned_form_reads() {
        let env = Envelope {
            id: "i1".into(),
            kind: Kind::TaskResult,
            from: "acme/w1".into(),
            to: Some("acme/w2".into()),
            topic: None,
            job: Some("render".into()),
            ts: "2026-11-29T08:00:00.000Z".into(),
            headers: BTreeMap::from([("k\"\n".to_string(), "v\u{7}é".to_string())]),
            body: RawValue::from_string(r#"{"b": [1, 2.50]}"#.to_string()).expect("raw"),
        };
        let json = env.to_json();
        let view = EnvelopeView::parse(&json).expect("view");
        assert_eq!(view.id.as_str(), "i1");
        assert_eq!(view.kind, Kind::TaskResult);
        assert_eq!(view.to.as_ref().map(Text::as_str), Some("acme/w2"));
        assert_eq!(view.job.as_ref().map(Text::as_str), Some("render"));
        assert!(view.topic.is_none());
        assert_eq!(view.body.get(), r#"{"b": [1, 2.50]}"#);
        assert_eq!(
            serde_json::to_string(&view.headers).expect("headers"),
            serde_json::to_string(&env.headers).expect("headers")
        );
        // What the owned form refuses, the view refuses.
        for bad in [
            r#"{"kind":"message","from":"a","ts":"t","body":1}"#,
            r#"{"id":"i","kind":"message","from":"a","ts":"t","headers":{"k":1},"body":1}"#,
            r#"{"id":"i","kind":"nope","from":"a","ts":"t","body":1}"#,
            r#"{"id":"i","kind":"message","from":"a","ts":"t"}"#,
            r#"[1]"#,
        ] {
            assert!(Envelope::from_json(bad.as_bytes()).is_err(), "{bad}");
            assert!(EnvelopeView::parse(bad.as_bytes()).is_err(), "{bad}");
        }
        let escaped = r#"{"id":"i","kind":"event","from":"a\/b","ts":"t","body":null}"#;
        let view = EnvelopeView::parse(escaped.as_bytes()).expect("escaped");
        assert_eq!(view.from.as_str(), "a/b");
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
    }
}
