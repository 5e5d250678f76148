//! A fast path for the frames every message or task costs (`send`, `ack`, `nak`, `ping`,
//! and `submit` without `eligible`, `claim`, `complete`): one
//! typed parse of the text and hand-written checks of exactly the schema's rules for
//! that op, instead of a `Value` tree, the JSON Schema validator and a second conversion.
//!
//! It only ever accepts. Whatever it is not sure of (another op, `op` written with spaces,
//! an escaped string, a duplicate or unknown member, a value outside the rules,
//! `null` where the schema wants a type) returns `None` and the frame takes the full
//! path, so every rejection and its error text still come from the schema. A frame it
//! accepts must be one the schema accepts, decoded to the same `ClientFrame`:
//! `tests/amp_fast_path.rs` checks both over generated and fixture frames, and the
//! `amp_frame` fuzz target asserts it for any input.

use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::value::RawValue;

use super::body::Body;
use super::frame::{Ack, ClientFrame, Complete, Headers, Nak, Send, Submit, TaskRef};
use super::quick_json::{skip_ws, value_end};
use crate::scan::run_len;

/// Schema `id`: 1 to 64 characters. Checked on bytes, which is stricter: a string of at
/// most 64 bytes has at most 64 characters.
const MAX_ID: usize = 64;
/// Schema `name`: `^[A-Za-z0-9_-]{1,64}$`.
const MAX_NAME: usize = 64;
/// Schema `task_id`: `^[A-Za-z0-9_-]{1,128}$`.
const MAX_TASK_ID: usize = 128;
/// Schema `submit.max_attempts`: 1 to 1000.
const MAX_ATTEMPTS: u32 = 1000;
/// Schema `idem`: `^[!-~]{1,128}$`.
const MAX_IDEM: usize = 128;
/// Schema `headers`: names `^[!-9;-~]{1,256}$`, values at most 8192 characters without
/// CR or LF (bytes again: stricter).
const MAX_HEADER_NAME: usize = 256;
const MAX_HEADER_VALUE: usize = 8192;
/// Schema `seq`: 1 to 2^53 - 1.
const MAX_SEQ: u64 = 9_007_199_254_740_991;
/// `nak`'s `delay_ms`: 0 to one day.
const MAX_DELAY_MS: u64 = 86_400_000;

/// The frame, when it is one of the common ops and certainly valid; `None` otherwise.
pub fn decode(text: &str) -> Option<ClientFrame> {
    // Only a guess at which struct to try (the first `"op":"` could sit in a nested
    // object): the typed parse checks the real member.
    const OP: &str = r#""op":""#;
    // Most clients write `op` first; a search builds its searcher at every call.
    let start = if text.strip_prefix('{').is_some_and(|t| t.starts_with(OP)) {
        1 + OP.len()
    } else {
        memchr::memmem::find(text.as_bytes(), OP.as_bytes())? + OP.len()
    };
    let rest = text.get(start..)?;
    let op = rest.get(..memchr::memchr(b'"', rest.as_bytes())?)?;
    match op {
        "send" => plain_send(text).or_else(|| send(text)),
        "ack" => plain_ack(text).or_else(|| ack(text)),
        "nak" => nak(text),
        "ping" => ping(text),
        "submit" => submit(text),
        "claim" => claim(text),
        "complete" => complete(text),
        _ => None,
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SendFrame<'a> {
    op: &'a str,
    id: &'a str,
    to: &'a str,
    #[serde(borrow)]
    body: &'a RawValue,
    #[serde(default)]
    headers: Headers,
    #[serde(default, deserialize_with = "present")]
    idem: Option<&'a str>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AckFrame<'a> {
    op: &'a str,
    #[serde(default, deserialize_with = "present")]
    id: Option<&'a str>,
    seq: u64,
    #[serde(default, deserialize_with = "present")]
    sub: Option<&'a str>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NakFrame<'a> {
    op: &'a str,
    #[serde(default, deserialize_with = "present")]
    id: Option<&'a str>,
    seq: u64,
    #[serde(default, deserialize_with = "present")]
    delay_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PingFrame<'a> {
    op: &'a str,
    id: &'a str,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubmitFrame<'a> {
    op: &'a str,
    id: &'a str,
    job: &'a str,
    #[serde(borrow)]
    body: &'a RawValue,
    #[serde(default, deserialize_with = "present")]
    task: Option<&'a str>,
    #[serde(default, deserialize_with = "present")]
    max_attempts: Option<u32>,
    #[serde(default)]
    headers: Headers,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TaskFrame<'a> {
    op: &'a str,
    id: &'a str,
    task: &'a str,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteFrame<'a> {
    op: &'a str,
    id: &'a str,
    task: &'a str,
    // Any JSON value, `null` included, which the schema path's typed frame also reads
    // as `None`.
    #[serde(default)]
    result: Option<Value>,
}

/// An optional member that, when present, must hold a value of its type: `null` is not
/// "absent" to the schema, so it fails here and the frame takes the full path.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A member value written the plain way.
#[derive(Clone, Copy)]
enum Plain<'a> {
    /// A string's text, without escapes.
    Str(&'a str),
    /// Digits only.
    Digits(&'a str),
    /// Any value, as written.
    Raw(&'a str),
}

/// The members of a frame written the plain way, in one pass: an object of members
/// whose names `slot` places and whose values are strings without escapes, numbers of
/// digits only, or (for the member in slot `raw`) any value [`value_end`] is sure of.
/// `None` for anything else (an escape, a duplicate or other member, another value):
/// serde then decides. `slot` is a `match` on the name: it compiles to a comparison of
/// lengths and a word or two, where a search of a list of names called `memcmp` for each.
fn plain_members<'a, const N: usize>(
    text: &'a str,
    slot: impl Fn(&[u8]) -> Option<usize>,
    raw: Option<usize>,
) -> Option<[Option<Plain<'a>>; N]> {
    let s = text.as_bytes();
    let mut found = [None; N];
    let mut i = skip_ws(s, 0);
    if s.get(i) != Some(&b'{') {
        return None;
    }
    loop {
        i = skip_ws(s, i + 1);
        let (name, after) = plain_string(s, i)?;
        i = skip_ws(s, after);
        if s.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(s, i + 1);
        let slot = slot(s.get(name.0..name.1)?)?;
        let (value, after) = if raw == Some(slot) {
            let end = value_end(s, i)?;
            (Plain::Raw(text.get(i..end)?), end)
        } else {
            match s.get(i)? {
                b'"' => {
                    let ((start, end), after) = plain_string(s, i)?;
                    (Plain::Str(text.get(start..end)?), after)
                }
                b'0'..=b'9' => {
                    let end = i + s
                        .get(i..)?
                        .iter()
                        .take_while(|b| b.is_ascii_digit())
                        .count();
                    (Plain::Digits(text.get(i..end)?), end)
                }
                _ => return None,
            }
        };
        if found.get_mut(slot)?.replace(value).is_some() {
            return None;
        }
        i = skip_ws(s, after);
        match s.get(i)? {
            b',' => {}
            b'}' => break,
            _ => return None,
        }
    }
    (skip_ws(s, i + 1) == s.len()).then_some(found)
}

/// A string without escapes or control characters starting at its opening quote: the
/// span of its text and the index after its closing quote.
fn plain_string(s: &[u8], i: usize) -> Option<((usize, usize), usize)> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let start = i + 1;
    let end = start + run_len(s.get(start..)?, 0x20, [b'"', b'\\']);
    (s.get(end) == Some(&b'"')).then_some(((start, end), end + 1))
}

impl<'a> Plain<'a> {
    fn str(self) -> Option<&'a str> {
        match self {
            Plain::Str(s) => Some(s),
            _ => None,
        }
    }

    fn raw(self) -> Option<&'a str> {
        match self {
            Plain::Raw(s) => Some(s),
            _ => None,
        }
    }

    /// Digits as serde reads a `u64`: no leading zero (a fraction or exponent after
    /// them ends the member early, which `plain_members` refuses), at most nineteen, so
    /// they cannot overflow.
    fn u64(self) -> Option<u64> {
        let Plain::Digits(d) = self else {
            return None;
        };
        let valid = (1..=19).contains(&d.len()) && (d == "0" || !d.starts_with('0'));
        valid.then(|| d.bytes().fold(0u64, |n, b| n * 10 + u64::from(b - b'0')))
    }
}

/// An optional member that must be a plain string when present.
fn optional_str(member: Option<Plain<'_>>) -> Option<Option<&str>> {
    match member {
        None => Some(None),
        Some(p) => p.str().map(Some),
    }
}

/// `send` without `headers` and without escapes, in one pass: the body is walked once
/// for its end and its strictness together (instead of by serde's raw capture and the
/// strict check after it). `None` leaves the frame to [`send`], which takes every frame
/// this takes, and more.
fn plain_send(text: &str) -> Option<ClientFrame> {
    let slot = |name: &[u8]| match name {
        b"op" => Some(0),
        b"id" => Some(1),
        b"to" => Some(2),
        b"body" => Some(3),
        b"idem" => Some(4),
        _ => None,
    };
    let [op, id, to, body, idem] = plain_members(text, slot, Some(3))?;
    let (id, to, body, idem) = (id?.str()?, to?.str()?, body?.raw()?, optional_str(idem)?);
    let valid = op?.str()? == "send" && is_id(id) && is_name(to) && idem.is_none_or(is_idem);
    if !valid {
        return None;
    }
    Some(ClientFrame::Send(Send {
        id: id.to_owned(),
        to: to.to_owned(),
        // Exactly one value, checked strictly by the walk that found its end.
        body: Body::from_checked(body),
        headers: Headers::default(),
        idem: idem.map(str::to_owned),
    }))
}

/// `ack` without escapes, without serde.
fn plain_ack(text: &str) -> Option<ClientFrame> {
    let slot = |name: &[u8]| match name {
        b"op" => Some(0),
        b"id" => Some(1),
        b"seq" => Some(2),
        b"sub" => Some(3),
        _ => None,
    };
    let [op, id, seq, sub] = plain_members(text, slot, None)?;
    let (id, seq, sub) = (optional_str(id)?, seq?.u64()?, optional_str(sub)?);
    let valid =
        op?.str()? == "ack" && id.is_none_or(is_id) && is_seq(seq) && sub.is_none_or(is_name);
    valid.then(|| {
        ClientFrame::Ack(Ack {
            id: id.map(str::to_owned),
            seq,
            sub: sub.map(str::to_owned),
        })
    })
}

fn send(text: &str) -> Option<ClientFrame> {
    let f: SendFrame = serde_json::from_str(text).ok()?;
    let valid = f.op == "send"
        && is_id(f.id)
        && is_name(f.to)
        && f.idem.is_none_or(is_idem)
        && f.headers.iter().all(|(k, v)| is_header(k, v));
    if !valid {
        return None;
    }
    // The client's text, once checked as strictly as the schema path's `Value` parse.
    let body = Body::from_raw(f.body)?;
    Some(ClientFrame::Send(Send {
        id: f.id.to_owned(),
        to: f.to.to_owned(),
        body,
        headers: f.headers,
        idem: f.idem.map(str::to_owned),
    }))
}

fn ack(text: &str) -> Option<ClientFrame> {
    let f: AckFrame = serde_json::from_str(text).ok()?;
    let valid =
        f.op == "ack" && f.id.is_none_or(is_id) && is_seq(f.seq) && f.sub.is_none_or(is_name);
    valid.then(|| {
        ClientFrame::Ack(Ack {
            id: f.id.map(str::to_owned),
            seq: f.seq,
            sub: f.sub.map(str::to_owned),
        })
    })
}

fn nak(text: &str) -> Option<ClientFrame> {
    let f: NakFrame = serde_json::from_str(text).ok()?;
    let valid = f.op == "nak"
        && f.id.is_none_or(is_id)
        && is_seq(f.seq)
        && f.delay_ms.is_none_or(|d| d <= MAX_DELAY_MS);
    valid.then(|| {
        ClientFrame::Nak(Nak {
            id: f.id.map(str::to_owned),
            seq: f.seq,
            delay_ms: f.delay_ms,
        })
    })
}

fn ping(text: &str) -> Option<ClientFrame> {
    let f: PingFrame = serde_json::from_str(text).ok()?;
    (f.op == "ping" && is_id(f.id)).then(|| ClientFrame::Ping {
        id: f.id.to_owned(),
    })
}

fn submit(text: &str) -> Option<ClientFrame> {
    let f: SubmitFrame = serde_json::from_str(text).ok()?;
    let valid = f.op == "submit"
        && is_id(f.id)
        && is_name(f.job)
        && f.task.is_none_or(is_task_id)
        && f.max_attempts
            .is_none_or(|n| (1..=MAX_ATTEMPTS).contains(&n))
        && f.headers.iter().all(|(k, v)| is_header(k, v));
    if !valid {
        return None;
    }
    let body = Body::from_raw(f.body)?;
    Some(ClientFrame::Submit(Submit {
        id: f.id.to_owned(),
        job: f.job.to_owned(),
        body,
        task: f.task.map(str::to_owned),
        max_attempts: f.max_attempts,
        eligible: None,
        headers: f.headers,
    }))
}

fn claim(text: &str) -> Option<ClientFrame> {
    let f: TaskFrame = serde_json::from_str(text).ok()?;
    (f.op == "claim" && is_id(f.id) && is_task_id(f.task)).then(|| {
        ClientFrame::Claim(TaskRef {
            id: f.id.to_owned(),
            task: f.task.to_owned(),
        })
    })
}

fn complete(text: &str) -> Option<ClientFrame> {
    let f: CompleteFrame = serde_json::from_str(text).ok()?;
    (f.op == "complete" && is_id(f.id) && is_task_id(f.task)).then(|| {
        ClientFrame::Complete(Complete {
            id: f.id.to_owned(),
            task: f.task.to_owned(),
            result: f.result,
        })
    })
}

fn is_task_id(s: &str) -> bool {
    is_token(s, MAX_TASK_ID)
}

fn is_id(s: &str) -> bool {
    (1..=MAX_ID).contains(&s.len())
}

fn is_name(s: &str) -> bool {
    is_token(s, MAX_NAME)
}

/// `^[A-Za-z0-9_-]{1,max}$`.
fn is_token(s: &str, max: usize) -> bool {
    (1..=max).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn is_idem(s: &str) -> bool {
    (1..=MAX_IDEM).contains(&s.len()) && s.bytes().all(|b| (b'!'..=b'~').contains(&b))
}

fn is_header(name: &str, value: &str) -> bool {
    (1..=MAX_HEADER_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| (b'!'..=b'9').contains(&b) || (b';'..=b'~').contains(&b))
        && value.len() <= MAX_HEADER_VALUE
        && !value.bytes().any(|b| b == b'\r' || b == b'\n')
}

fn is_seq(seq: u64) -> bool {
    (1..=MAX_SEQ).contains(&seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_readers_take_the_common_frames_and_agree_with_serde_on_the_rest() {
        let taken = [
            r#"{"op":"send","id":"1","to":"bob","body":{"t":1,"pad":"xx"}}"#,
            r#" { "body" : [1, 2.5, "é"] , "to":"bob" ,"op":"send","id":"k-1","idem":"a!~"} "#,
            r#"{"op":"send","id":"1","to":"bob","body":"text"}"#,
            r#"{"op":"ack","seq":5}"#,
            r#"{"seq":9007199254740991,"op":"ack","id":"a","sub":"w-1"}"#,
        ];
        for text in taken {
            let plain = plain_send(text).or_else(|| plain_ack(text));
            assert!(plain.is_some(), "{text}");
            assert_eq!(plain, send(text).or_else(|| ack(text)), "{text}");
        }
        // Whatever the plain readers are unsure of they leave to serde, and whatever
        // they take serde reads the same way.
        let others = [
            r#"{"op":"send","id":"1","to":"bob","body":{},"headers":{"a":"b"}}"#,
            r#"{"op":"send","id":"\u0031","to":"bob","body":1}"#,
            r#"{"\u006fp":"send","id":"1","to":"bob","body":1}"#,
            r#"{"op":"send","id":"1","id":"2","to":"bob","body":1}"#,
            r#"{"op":"send","id":"1","to":"bob","body":1e3}"#,
            r#"{"op":"send","id":"1","to":"bob","body":"\ud800"}"#,
            r#"{"op":"send","id":"1","to":"bob","body":1,"idem":null}"#,
            r#"{"op":"send","id":"1","to":"bob","body":1,"idem":5}"#,
            r#"{"op":"send","id":1,"to":"bob","body":1}"#,
            r#"{"op":"send","id":"1","to":"bob","body":1} x"#,
            r#"{"op":"send","id":"1","to":"bob","body":1,}"#,
            r#"{"op":"send","id":"1","to":"bo b","body":1}"#,
            r#"{"op":"send","id":"1","to":"bob"}"#,
            r#"{"op":"ack","seq":"5"}"#,
            r#"{"op":"ack","seq":05}"#,
            r#"{"op":"ack","seq":5.0}"#,
            r#"{"op":"ack","seq":5e0}"#,
            r#"{"op":"ack","seq":-5}"#,
            r#"{"op":"ack","seq":0}"#,
            r#"{"op":"ack","seq":18446744073709551615}"#,
            r#"{"op":"ack","seq":5,"sub":null}"#,
            r#"{"op":"ack","seq":5,"delay_ms":1}"#,
            r#"{"op":"ack"}"#,
            r#"{"op":"nak","seq":5}"#,
            "[]",
            "",
        ];
        for text in others {
            for (plain, serde) in [(plain_send(text), send(text)), (plain_ack(text), ack(text))] {
                assert!(plain.is_none() || plain == serde, "{text}");
            }
        }
        assert!(plain_send(others[0]).is_none() && send(others[0]).is_some());
    }
}
