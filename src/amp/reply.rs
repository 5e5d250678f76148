//! Builders for the frames the broker sends: `ok` and `error` replies and frames sent on
//! the broker's own initiative. Members are written in insertion order with `op` first, so
//! frames read naturally in logs and captures.

use serde::Serialize;

use super::error::AmpError;
use crate::scan::json_plain_len;

/// Writes one JSON object frame member by member.
#[derive(Debug)]
pub struct FrameWriter {
    out: String,
}

impl FrameWriter {
    /// Starts a frame with the given `op`.
    pub fn new(op: &'static str) -> Self {
        FrameWriter::with_capacity(op, 64)
    }

    /// Starts a frame expected to take about `bytes`, so it is allocated once.
    pub fn with_capacity(op: &'static str, bytes: usize) -> Self {
        FrameWriter::in_buffer(op, String::with_capacity(bytes))
    }

    /// Starts a frame in `out`, emptied first: a buffer kept from an earlier frame.
    pub fn in_buffer(op: &'static str, mut out: String) -> Self {
        out.clear();
        out.push_str("{\"op\":");
        push_literal(&mut out, op);
        FrameWriter { out }
    }

    /// Starts an `ok` reply; `re` is the request's `id` when it had a string one.
    pub fn ok(re: Option<&str>) -> Self {
        FrameWriter::ok_in(re, String::new())
    }

    /// [`ok`](Self::ok) in a kept buffer.
    pub fn ok_in(re: Option<&str>, out: String) -> Self {
        let mut w = FrameWriter::in_buffer("ok", out);
        if let Some(re) = re {
            w = w.str("re", re);
        }
        w
    }

    /// A string member.
    pub fn str(mut self, key: &'static str, value: &str) -> Self {
        self.key(key);
        push_json_str(&mut self.out, value);
        self
    }

    /// A string member whose value is one of the broker's own literals (an op, a kind):
    /// written as it is, like member names.
    pub fn literal(mut self, key: &'static str, value: &'static str) -> Self {
        self.key(key);
        push_literal(&mut self.out, value);
        self
    }

    /// A member holding any serializable value. A value that fails to serialize (a map
    /// with non-string keys, which no caller builds) is written as `null`.
    pub fn value<T: Serialize + ?Sized>(mut self, key: &'static str, value: &T) -> Self {
        self.key(key);
        match serde_json::to_string(value) {
            Ok(json) => self.out.push_str(&json),
            Err(_) => self.out.push_str("null"),
        }
        self
    }

    /// An object of string members (headers), written directly: an empty one, as most
    /// are, costs two bytes rather than a serialiser and a temporary string.
    pub fn str_map<'m, K, V>(
        mut self,
        key: &'static str,
        map: impl IntoIterator<Item = (&'m K, &'m V)>,
    ) -> Self
    where
        K: AsRef<str> + ?Sized + 'm,
        V: AsRef<str> + ?Sized + 'm,
    {
        self.key(key);
        push_json_str_map(&mut self.out, map);
        self
    }

    /// An integer member, written without a temporary string or the formatting
    /// machinery (every `ok` and `message` frame carries one or two).
    pub fn uint(mut self, key: &'static str, value: u64) -> Self {
        self.key(key);
        crate::proto::encode::push_decimal(&mut self.out, value);
        self
    }

    pub fn bool(mut self, key: &'static str, value: bool) -> Self {
        self.key(key);
        self.out.push_str(if value { "true" } else { "false" });
        self
    }

    /// A member whose value is already JSON text (e.g. a stored body). The caller
    /// guarantees it is valid JSON.
    pub fn raw(mut self, key: &'static str, json: &str) -> Self {
        self.key(key);
        self.out.push_str(json);
        self
    }

    pub fn finish(mut self) -> String {
        self.out.push('}');
        self.out
    }

    /// Member names are the broker's own literals (`&'static str`), none needing an
    /// escape, so they are written as they are; debug builds assert it.
    fn key(&mut self, key: &'static str) {
        debug_assert_eq!(json_plain_len(key.as_bytes()), key.len(), "{key}");
        self.out.push_str(",\"");
        self.out.push_str(key);
        self.out.push_str("\":");
    }
}

/// A literal of the broker's as a JSON string: none needs an escape (debug builds
/// assert it), so it is not scanned for one, as every frame's `op` was.
fn push_literal(out: &mut String, s: &'static str) {
    debug_assert_eq!(json_plain_len(s.as_bytes()), s.len(), "{s}");
    out.reserve(s.len() + 2);
    out.push('"');
    out.push_str(s);
    out.push('"');
}

/// `{"op":"ok","re":..}` with no result members.
pub fn ok(re: Option<&str>) -> String {
    FrameWriter::ok(re).finish()
}

/// `{"op":"error","re":..,"code":..,"message":..,"path":..?,"retry_after_ms":..?}`.
pub fn error(re: Option<&str>, err: &AmpError) -> String {
    let mut w = FrameWriter::new("error");
    if let Some(re) = re {
        w = w.str("re", re);
    }
    w = w
        .str("code", err.code.as_str())
        .str("message", &err.message);
    if let Some(path) = &err.path {
        w = w.str("path", path);
    }
    if let Some(ms) = err.retry_after_ms {
        w = w.value("retry_after_ms", &ms);
    }
    w.finish()
}

/// `s` as a JSON string. DEL is escaped too (valid JSON either way), so the same text is
/// safe in a log line read on a terminal.
/// `{"name":"value",...}` of string pairs, each escaped as [`push_json_str`] does.
pub(crate) fn push_json_str_map<'m, K, V>(
    out: &mut String,
    map: impl IntoIterator<Item = (&'m K, &'m V)>,
) where
    K: AsRef<str> + ?Sized + 'm,
    V: AsRef<str> + ?Sized + 'm,
{
    out.push('{');
    for (i, (name, value)) in map.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_str(out, name.as_ref());
        out.push(':');
        push_json_str(out, value.as_ref());
    }
    out.push('}');
}

pub(crate) fn push_json_str(out: &mut String, s: &str) {
    use std::fmt::Write;
    let plain = json_plain_len(s.as_bytes());
    out.reserve(s.len() + 2);
    out.push('"');
    if plain == s.len() {
        // Most strings: names, ids, timestamps, member names.
        out.push_str(s);
        out.push('"');
        return;
    }
    // Every byte that needs an escape is ASCII, so the runs between them are copied
    // whole.
    let mut rest = s;
    loop {
        let (run, tail) = rest
            .split_at_checked(json_plain_len(rest.as_bytes()))
            .unwrap_or((rest, ""));
        out.push_str(run);
        let mut chars = tail.chars();
        let Some(c) = chars.next() else { break };
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
        }
        rest = chars.as_str();
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amp::error::ErrorCode;
    use serde_json::{Value, json};

    fn parse(s: &str) -> Value {
        serde_json::from_str(s).unwrap_or_else(|e| panic!("invalid JSON {s}: {e}"))
    }

    #[test]
    fn ok_reply_carries_re_and_result_members_in_order() {
        let frame = FrameWriter::ok(Some("s1"))
            .value("seq", &42u64)
            .value("dup", &false)
            .finish();
        assert_eq!(frame, r#"{"op":"ok","re":"s1","seq":42,"dup":false}"#);
    }

    #[test]
    fn strings_are_escaped_the_same_with_or_without_a_plain_head() {
        let slow = |s: &str| {
            let mut out = String::from("\"");
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if u32::from(c) < 0x20 || c == '\u{7f}' => {
                        out.push_str(&format!("\\u{:04x}", u32::from(c)))
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        };
        for s in [
            "",
            "acme/w1",
            "é\"x",
            "a\\b\nc",
            "\u{7f}",
            "tab\there\u{1}",
            "日本\r",
        ] {
            let mut fast = String::new();
            push_json_str(&mut fast, s);
            assert_eq!(fast, slow(s), "{s:?}");
            assert_eq!(serde_json::from_str::<String>(&fast).expect("JSON"), s);
        }
    }

    #[test]
    fn integer_and_boolean_members_match_their_serialised_form() {
        for n in [0u64, 7, 10, 42, 100, 9_999_999_999, u64::MAX] {
            assert_eq!(
                FrameWriter::new("x").uint("n", n).finish(),
                FrameWriter::new("x").value("n", &n).finish()
            );
        }
        for b in [true, false] {
            assert_eq!(
                FrameWriter::new("x").bool("b", b).finish(),
                FrameWriter::new("x").value("b", &b).finish()
            );
        }
    }

    #[test]
    fn ok_reply_without_id_has_no_re() {
        assert_eq!(ok(None), r#"{"op":"ok"}"#);
    }

    #[test]
    fn error_reply_has_code_message_path_and_retry_after() {
        let err = AmpError::new(ErrorCode::Schema, "unknown member").with_path("/from");
        assert_eq!(
            parse(&error(Some("x"), &err)),
            json!({"op":"error","re":"x","code":"schema","message":"unknown member","path":"/from"})
        );
        let err = AmpError::rate_limited(250);
        assert_eq!(
            parse(&error(None, &err)),
            json!({"op":"error","code":"rate_limited","message":"rate limit exceeded","retry_after_ms":250})
        );
    }

    #[test]
    fn strings_are_escaped() {
        let frame = FrameWriter::new("challenge")
            .str("nonce", "a\"b\\c\n\u{1}é")
            .finish();
        assert_eq!(
            parse(&frame),
            json!({"op":"challenge","nonce":"a\"b\\c\n\u{1}é"})
        );
    }
}
