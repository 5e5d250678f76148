//! The AMP envelope: the JSON the broker stores in JetStream for every message, event and
//! task, and the ids that make resends idempotent. Bodies travel as raw JSON text, never
//! parsed into a tree and re-serialised.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::amp::reply::{push_json_str, push_json_str_map};
use crate::scan::json_plain_len;

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
    /// The kind named by [`as_str`](Self::as_str)'s text (the serde name).
    pub fn from_name(name: &str) -> Option<Kind> {
        [Kind::Message, Kind::Event, Kind::Task, Kind::TaskResult]
            .into_iter()
            .find(|k| k.as_str() == name)
    }

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
    /// The text of one JSON value, as the client wrote it.
    #[serde(with = "raw_text")]
    pub body: Box<str>,
}

/// A body held as text, read and written by serde as the raw JSON it is.
mod raw_text {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use serde_json::value::RawValue;

    pub fn serialize<S: Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
        RawValue::from_string(text.to_owned())
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Box<str>, D::Error> {
        Box::<RawValue>::deserialize(d).map(Box::<str>::from)
    }
}

impl Envelope {
    /// The members in declaration order, as serde would write them, by hand: this is
    /// the layout [`EnvelopeView::parse`] reads without serde's machinery.
    pub fn to_json(&self) -> Vec<u8> {
        let mut out = String::new();
        self.write_json(&mut out);
        out.into_bytes()
    }

    /// [`to_json`](Self::to_json) appended to `out`.
    pub fn write_json(&self, out: &mut String) {
        let body = &*self.body;
        out.reserve(body.len() + 160);
        out.push_str("{\"id\":");
        push_json_str(out, &self.id);
        out.push_str(",\"kind\":\"");
        out.push_str(self.kind.as_str());
        out.push_str("\",\"from\":");
        push_json_str(out, &self.from);
        for (key, value) in [("to", &self.to), ("topic", &self.topic), ("job", &self.job)] {
            if let Some(v) = value {
                out.push_str(",\"");
                out.push_str(key);
                out.push_str("\":");
                push_json_str(out, v);
            }
        }
        out.push_str(",\"ts\":");
        push_json_str(out, &self.ts);
        out.push_str(",\"headers\":");
        push_json_str_map(out, &self.headers);
        out.push_str(",\"body\":");
        out.push_str(body);
        out.push('}');
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
    pub body: BodyText<'a>,
}

/// A stored envelope's body: the text of one JSON value, borrowed from the payload.
#[derive(Debug, Clone, Copy)]
pub struct BodyText<'a>(&'a str);

impl<'a> BodyText<'a> {
    pub fn get(&self) -> &'a str {
        self.0
    }

    pub fn to_raw(&self) -> Box<RawValue> {
        // Checked to be one value when read; `null` for the impossible failure.
        RawValue::from_string(self.0.to_owned()).unwrap_or_else(|_| RawValue::NULL.to_owned())
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for BodyText<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        <&'de RawValue>::deserialize(d).map(|raw| BodyText(raw.get()))
    }
}

impl<'a> EnvelopeView<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<EnvelopeView<'a>, serde_json::Error> {
        match EnvelopeView::as_written(bytes) {
            Some(view) => Ok(view),
            None => serde_json::from_slice(bytes),
        }
    }

    /// The envelope in the exact layout [`Envelope::to_json`] writes, with strings
    /// free of escapes and no headers: the common case, read with a few comparisons
    /// instead of serde's visitors (a tenth of the broker's instructions per message went
    /// there). Anything else is `None` and goes to the general parse, which reads it as
    /// before; every member this accepts is one the general parse reads the same, and
    /// the body is still checked to be one JSON value.
    fn as_written(bytes: &'a [u8]) -> Option<EnvelopeView<'a>> {
        // One UTF-8 check for the whole text instead of one per member.
        let mut r = Reader(std::str::from_utf8(bytes).ok()?);
        r.literal("{\"id\":")?;
        let id = r.string()?;
        r.literal(",\"kind\":")?;
        let kind = Kind::from_name(r.string()?.as_str())?;
        r.literal(",\"from\":")?;
        let from = r.string()?;
        let to = r.member(",\"to\":")?;
        let topic = r.member(",\"topic\":")?;
        let job = r.member(",\"job\":")?;
        r.literal(",\"ts\":")?;
        let ts = r.string()?;
        r.literal(",\"headers\":{},\"body\":")?;
        let body = r.0.strip_suffix('}')?;
        // As written there is no whitespace around the body; with some, the general parse
        // says what the value's text is.
        let space = |b: Option<&u8>| matches!(b, Some(b' ' | b'\t' | b'\n' | b'\r'));
        if body.is_empty() || space(body.as_bytes().first()) || space(body.as_bytes().last()) {
            return None;
        }
        let body = if crate::amp::quick_json::certainly_strict(body) {
            BodyText(body)
        } else {
            BodyText(serde_json::from_str::<&RawValue>(body).ok()?.get())
        };
        Some(EnvelopeView {
            id,
            kind,
            from,
            to,
            topic,
            job,
            ts,
            headers: BTreeMap::new(),
            body,
        })
    }
}

/// What is left of an envelope being read in its written layout.
struct Reader<'a>(&'a str);

impl<'a> Reader<'a> {
    fn literal(&mut self, text: &str) -> Option<()> {
        self.0 = self.0.strip_prefix(text)?;
        Some(())
    }

    /// A string without escapes, control characters or DEL (anything else is the
    /// general parse's to decode).
    fn string(&mut self) -> Option<Text<'a>> {
        let rest = self.0.strip_prefix('"')?;
        // The run ends at the text's end or at an ASCII byte: a character boundary.
        let (text, after) = rest.split_at_checked(json_plain_len(rest.as_bytes()))?;
        self.0 = after.strip_prefix('"')?;
        Some(Text(Cow::Borrowed(text)))
    }

    /// An optional string member: `Some(None)` when the next member is another.
    fn member(&mut self, key: &str) -> Option<Option<Text<'a>>> {
        if !self.0.starts_with(key) {
            return Some(None);
        }
        self.literal(key)?;
        self.string().map(Some)
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

impl AsRef<str> for Text<'_> {
    fn as_ref(&self) -> &str {
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
        let body: Box<str> = r#"{"b": [1, 2.50, null]}"#.into();
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
        assert_eq!(&*back.body, r#"{"b": [1, 2.50, null]}"#);
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
            body: r#"{"b": [1, 2.50]}"#.into(),
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

    fn envelope(headers: &[(&str, &str)], from: &str, body: &str) -> Envelope {
        Envelope {
            id: "denvusxdgbassf376bo4fsc6ex".into(),
            kind: Kind::Message,
            from: from.into(),
            to: Some("acme/w2".into()),
            topic: None,
            job: None,
            ts: "2026-11-29T08:00:00.000Z".into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.into(),
        }
    }

    /// The view as the general parse alone reads it.
    fn general(bytes: &[u8]) -> Option<String> {
        serde_json::from_slice::<EnvelopeView>(bytes)
            .ok()
            .map(|v| format!("{v:?}"))
    }

    #[test]
    fn the_written_layout_is_what_serde_writes() {
        let cases = [
            envelope(&[], "acme/w1", r#"{"n":1}"#),
            envelope(&[("traceparent", "00-ab"), ("a", "b")], "acme/w1", "[1, 2]"),
            envelope(&[("k\"\n", "v\u{8}é")], "ac\\me/\"w1\"", "null"),
        ];
        for (i, env) in cases.iter().enumerate() {
            let ours = String::from_utf8(env.to_json()).expect("utf8");
            let serde = serde_json::to_string(env).expect("serde");
            // Control characters are escaped as frames escape them (`\u0008` where serde
            // writes `\b`): the same strings, spelled differently.
            if i < 2 {
                assert_eq!(ours, serde);
            }
            let value = |t: &str| serde_json::from_str::<serde_json::Value>(t).expect("JSON");
            assert_eq!(value(&ours), value(&serde), "{ours}");
        }
        let mut all = envelope(&[], "acme/w1", "1");
        all.topic = Some("orders.eu".into());
        all.job = Some("render".into());
        all.kind = Kind::TaskResult;
        assert_eq!(
            String::from_utf8(all.to_json()).expect("utf8"),
            serde_json::to_string(&all).expect("serde"),
        );
    }

    #[test]
    fn the_written_layout_is_read_without_serde_and_as_serde_reads_it() {
        let mut env = envelope(&[], "acme/w1", r#"{"b": [1, 2.50, null], "s": "x\"}"}"#);
        for (kind, topic, job) in [
            (Kind::Message, None, None),
            (Kind::Event, Some("orders.eu"), None),
            (Kind::Task, None, Some("render")),
            (Kind::TaskResult, Some("t"), Some("j")),
        ] {
            env.kind = kind;
            env.topic = topic.map(str::to_string);
            env.job = job.map(str::to_string);
            let json = env.to_json();
            let fast = EnvelopeView::as_written(&json).expect("the written layout");
            assert_eq!(Some(format!("{fast:?}")), general(&json));
        }
        // Escapes and headers are the general parse's; so is anything out of order.
        let escaped = envelope(&[], "acme/\"w1", "1").to_json();
        let headed = envelope(&[("a", "b")], "acme/w1", "1").to_json();
        assert!(EnvelopeView::as_written(&escaped).is_none());
        assert!(EnvelopeView::as_written(&headed).is_none());
        for json in [&escaped, &headed] {
            let view = EnvelopeView::parse(json).expect("general");
            assert_eq!(Some(format!("{view:?}")), general(json));
        }
    }

    #[test]
    fn an_envelope_that_only_looks_written_reads_as_serde_reads_it() {
        let head = r#"{"id":"i","kind":"message","from":"a","ts":"t","headers":{},"body":"#;
        for tail in [
            "1}",
            "{\"a\":1}}",
            // A body followed by more members: not one value, so the general parse
            // decides (it ignores unknown members).
            "{\"a\":1},\"x\":2}",
            // Two bodies: serde refuses the duplicate.
            "1,\"body\":2}",
            "{\"a\":1",
            "1} ",
            " 1 }",
            "}",
            "\"\\ud800\"}",
            "[1,]}",
            "1e400}",
            "\"\u{1}\"}",
        ] {
            let text = format!("{head}{tail}");
            let view = EnvelopeView::parse(text.as_bytes())
                .ok()
                .map(|v| format!("{v:?}"));
            assert_eq!(view, general(text.as_bytes()), "{text}");
        }
        for text in [
            r#"{"id":"i","kind":"message","from":"a","to":"b","to":"c","ts":"t","headers":{},"body":1}"#,
            r#"{"id":"i","kind":"message","from":"a","ts":"t","ts":"u","headers":{},"body":1}"#,
            r#"{"id":"i","kind":"Message","from":"a","ts":"t","headers":{},"body":1}"#,
            r#"{"id":"i","kind":"message","from":"a","ts":"t","headers":{},"body":1}"#,
            "{\"id\":\"\u{1}\",\"kind\":\"message\",\"from\":\"a\",\"ts\":\"t\",\"headers\":{},\"body\":1}",
            r#"{"id":"i","kind":"message","from":"a","ts":"t","headers":{},"body":1}"#,
        ] {
            let view = EnvelopeView::parse(text.as_bytes())
                .ok()
                .map(|v| format!("{v:?}"));
            assert_eq!(view, general(text.as_bytes()), "{text}");
        }
        let bad_utf8 = b"{\"id\":\"\xff\",\"kind\":\"message\",\"from\":\"a\",\"ts\":\"t\",\"headers\":{},\"body\":1}";
        assert!(EnvelopeView::parse(bad_utf8).is_err());
    }

    #[test]
    fn kinds_are_named_as_serde_names_them() {
        for kind in [Kind::Message, Kind::Event, Kind::Task, Kind::TaskResult] {
            let serde = serde_json::to_value(kind).expect("kind");
            assert_eq!(serde.as_str(), Some(kind.as_str()));
            assert_eq!(Kind::from_name(kind.as_str()), Some(kind));
        }
        assert_eq!(Kind::from_name("Message"), None);
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
