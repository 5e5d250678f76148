//! A frame's `body` as the client wrote it.
//!
//! The broker passes a body on byte for byte (whitespace, key order and number spelling
//! kept) instead of parsing it into a tree and writing that back out. It still admits
//! exactly the JSON it admitted when it did parse it: [`Body::parse`] refuses what
//! `serde_json::Value` refuses (a lone surrogate escape, a number beyond `f64`, nesting
//! deeper than a frame may hold), which a raw capture alone would let through. Bodies are
//! equal when their values are ([`PartialEq`]), whatever their spelling.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// Levels of arrays and objects a body may nest: serde_json's limit of 128 for the whole
/// frame, less the frame's own object and one more because serde_json refuses on
/// reaching the limit rather than on passing it.
const MAX_DEPTH: u32 = 126;

/// A JSON value as the client sent it, checked as strictly as a `Value` parse. Its text
/// is kept as a plain `str`, not a `RawValue`, so text already checked (by the plain
/// frame reader's walk) needs no second walk by serde to become a body.
#[derive(Clone)]
pub struct Body(Box<str>);

impl Body {
    /// The body of a frame the broker received: `None` when `Value` would refuse it.
    pub fn from_raw(raw: &RawValue) -> Option<Body> {
        strict(raw.get()).then(|| Body(raw.get().into()))
    }

    /// The text of a value already parsed as a `Value` (the schema path), unchecked.
    pub(crate) fn from_trusted(raw: &RawValue) -> Body {
        Body(raw.get().into())
    }

    /// Text that [`quick_json::value_end`](super::quick_json::value_end) found to be
    /// exactly one value it is sure of, unchecked.
    pub(crate) fn from_checked(text: &str) -> Body {
        Body(text.into())
    }

    /// Text that is one JSON value (leading and trailing whitespace allowed), checked
    /// as [`from_raw`](Self::from_raw) checks.
    pub fn parse(text: &str) -> Option<Body> {
        let raw: &RawValue = serde_json::from_str(text).ok()?;
        Body::from_raw(raw)
    }

    /// A value the broker made itself, in serde_json's compact form.
    pub fn from_value(value: &Value) -> Body {
        // A Value always serialises; `null` stands in for the impossible failure.
        Body(serde_json::to_string(value).map_or_else(|_| "null".into(), String::into_boxed_str))
    }

    /// The text, as received.
    pub fn get(&self) -> &str {
        &self.0
    }

    pub fn into_text(self) -> Box<str> {
        self.0
    }

    /// The value, for comparing and hashing by value.
    pub fn to_value(&self) -> Value {
        // Checked when made, so the parse succeeds; `null` for the impossible failure.
        serde_json::from_str(self.get()).unwrap_or(Value::Null)
    }
}

impl Default for Body {
    fn default() -> Body {
        Body("null".into())
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Body) -> bool {
        self.get() == other.get() || self.to_value() == other.to_value()
    }
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.get())
    }
}

/// As its text. serde_json writes raw text only through a `RawValue`, which it makes
/// by walking the text again: the broker writes bodies into its frames and envelopes by
/// hand, so only tests and tools serialise a `Body` through serde.
impl Serialize for Body {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        RawValue::from_string(self.0.to_string())
            .map_err(serde::ser::Error::custom)?
            .serialize(s)
    }
}

/// From a `Value` (the schema path), the compact form of that value; the schema path
/// then puts the frame's own text back ([`top_level_body`]).
impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Body, D::Error> {
        // Through a `Value`: the frame enum is internally tagged, so serde hands its
        // members over buffered, where serde_json's raw capture is not available.
        Value::deserialize(d).map(|v| Body::from_value(&v))
    }
}

/// The text of the `body` member of a frame (a JSON object), the last one when it is
/// written more than once (as `Value` keeps the last): `None` when the frame has none.
pub fn top_level_body(frame: &str) -> Option<&RawValue> {
    struct Frame<'a>(Option<&'a RawValue>);
    impl<'de> Deserialize<'de> for Frame<'de> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Frame<'de>;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Frame<'de>, A::Error> {
                    let mut body = None;
                    while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                        if key == "body" {
                            body = Some(map.next_value::<&'de RawValue>()?);
                        } else {
                            map.next_value::<de::IgnoredAny>()?;
                        }
                    }
                    Ok(Frame(body))
                }
            }
            d.deserialize_map(V)
        }
    }
    serde_json::from_str::<Frame>(frame).ok()?.0
}

/// Whether `text` parses as a `Value` would at a body's depth in a frame: every string
/// and key decoded (lone surrogates refused), every number converted (out of range
/// refused), nothing built.
fn strict(text: &str) -> bool {
    if super::quick_json::certainly_strict(text) {
        return true;
    }
    let mut de = serde_json::Deserializer::from_str(text);
    Check { depth: 0 }.deserialize(&mut de).is_ok() && de.end().is_ok()
}

/// One value checked at `depth` levels of nesting.
#[derive(Clone, Copy)]
struct Check {
    depth: u32,
}

impl<'de> DeserializeSeed<'de> for Check {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl Check {
    fn inner<E: de::Error>(self) -> Result<Check, E> {
        if self.depth >= MAX_DEPTH {
            return Err(E::custom("body nested too deeply"));
        }
        Ok(Check {
            depth: self.depth + 1,
        })
    }
}

impl<'de> Visitor<'de> for Check {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let inner = self.inner()?;
        while seq.next_element_seed(inner)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let inner = self.inner()?;
        while map.next_key_seed(Key)?.is_some() {
            map.next_value_seed(inner)?;
        }
        Ok(())
    }
}

/// An object key, decoded as `Value` decodes it.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_str(Check { depth: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame_value_accepts(body: &str) -> bool {
        serde_json::from_str::<Value>(&format!(r#"{{"op":"send","body":{body}}}"#)).is_ok()
    }

    #[test]
    fn admits_what_a_value_parse_admits() {
        for body in [
            "null",
            "1",
            "-0",
            "1e308",
            "1e309",
            "-1e400",
            "123456789012345678901234567890",
            r#""\ud800""#,
            r#""\udc00x""#,
            r#""\ud83d\ude00""#,
            r#""\u00e9\n\t\/""#,
            r#"{"\ud800":1}"#,
            r#"{"a":[1,{"b":"\uDFFF"}]}"#,
            r#"{"a": 1 , "a": 2}"#,
            "[1, 2.50, true, false, null]",
            "\"tab\tinside\"",
        ] {
            let raw: Result<&RawValue, _> = serde_json::from_str(body);
            let ours = raw.ok().and_then(Body::from_raw).is_some();
            assert_eq!(ours, frame_value_accepts(body), "{body}");
        }
    }

    #[test]
    fn nesting_is_limited_where_a_frame_limits_it() {
        for depth in 120..132 {
            let body = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            assert_eq!(
                Body::parse(&body).is_some(),
                frame_value_accepts(&body),
                "depth {depth}"
            );
        }
    }

    #[test]
    fn keeps_the_text_and_compares_by_value() {
        let a = Body::parse(r#" {"b": 2.50, "a": [1 ,2]} "#).expect("valid");
        assert_eq!(a.get(), r#"{"b": 2.50, "a": [1 ,2]}"#);
        let b = Body::parse(r#"{"a":[1,2],"b":2.5}"#).expect("valid");
        assert_eq!(a, b);
        assert_ne!(a, Body::parse(r#"{"a":[1,2],"b":2.6}"#).expect("valid"));
        assert_eq!(
            Body::from_value(&serde_json::json!({"x": 1})).get(),
            r#"{"x":1}"#
        );
    }

    #[test]
    fn finds_the_last_top_level_body() {
        let text = r#"{"op":"send","x":{"body":1},"body" : [ 1 ],"id":"a"}"#;
        assert_eq!(top_level_body(text).map(RawValue::get), Some("[ 1 ]"));
        let twice = r#"{"body":1,"b\u006fdy":{"k": 2}}"#;
        assert_eq!(
            top_level_body(twice).map(RawValue::get),
            Some(r#"{"k": 2}"#)
        );
        assert!(top_level_body(r#"{"op":"ping"}"#).is_none());
        assert!(top_level_body("[1]").is_none());
    }
}
