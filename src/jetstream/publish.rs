//! Publishing to a stream with a PubAck: the expectation headers and the ack reply.

use std::time::Duration;

use serde::Deserialize;

use super::api::Request;
use super::error::{ApiError, JsError};
use crate::proto::headers::HeaderMap;

pub const MSG_ID: &str = "Nats-Msg-Id";
pub const EXPECTED_STREAM: &str = "Nats-Expected-Stream";
pub const EXPECTED_LAST_SEQUENCE: &str = "Nats-Expected-Last-Sequence";
pub const EXPECTED_LAST_SUBJECT_SEQUENCE: &str = "Nats-Expected-Last-Subject-Sequence";
pub const EXPECTED_LAST_MSG_ID: &str = "Nats-Expected-Last-Msg-Id";
pub const MSG_TTL: &str = "Nats-TTL";
pub const ROLLUP: &str = "Nats-Rollup";
pub const MARKER_REASON: &str = "Nats-Marker-Reason";

/// The per-message TTL of ADR-43: whole seconds, at least one, or never expire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgTtl {
    After(Duration),
    Never,
}

impl MsgTtl {
    /// The `Nats-TTL` header value; the server counts whole seconds and refuses less
    /// than one, so sub-second parts are rounded up.
    pub fn header_value(&self) -> Result<String, JsError> {
        match self {
            MsgTtl::Never => Ok("never".to_string()),
            MsgTtl::After(d) if d.is_zero() => {
                Err(JsError::Invalid("message TTL must be at least 1s".into()))
            }
            MsgTtl::After(d) => {
                let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
                Ok(format!("{secs}s"))
            }
        }
    }
}

/// Expectations and options of one publish.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PublishOptions {
    /// Deduplication id within the stream's duplicate window.
    pub msg_id: Option<String>,
    pub expected_stream: Option<String>,
    pub expected_last_sequence: Option<u64>,
    /// `Some(0)`: there must be no message on this subject yet.
    pub expected_last_subject_sequence: Option<u64>,
    pub expected_last_msg_id: Option<String>,
    pub ttl: Option<MsgTtl>,
}

impl PublishOptions {
    /// Adds these options' headers to `headers`.
    pub fn apply(&self, headers: &mut HeaderMap) -> Result<(), JsError> {
        let bad = |e| JsError::Invalid(format!("publish header: {e}"));
        if let Some(id) = &self.msg_id {
            headers.insert(MSG_ID, id).map_err(bad)?;
        }
        if let Some(s) = &self.expected_stream {
            headers.insert(EXPECTED_STREAM, s).map_err(bad)?;
        }
        if let Some(seq) = self.expected_last_sequence {
            headers
                .insert(EXPECTED_LAST_SEQUENCE, &seq.to_string())
                .map_err(bad)?;
        }
        if let Some(seq) = self.expected_last_subject_sequence {
            headers
                .insert(EXPECTED_LAST_SUBJECT_SEQUENCE, &seq.to_string())
                .map_err(bad)?;
        }
        if let Some(id) = &self.expected_last_msg_id {
            headers.insert(EXPECTED_LAST_MSG_ID, id).map_err(bad)?;
        }
        if let Some(ttl) = &self.ttl {
            headers.insert(MSG_TTL, &ttl.header_value()?).map_err(bad)?;
        }
        Ok(())
    }

    /// True when no option is set (no header to add).
    pub fn is_empty(&self) -> bool {
        *self == PublishOptions::default()
    }
}

/// A publish to a stream subject, answered by a [`PubAck`]. `headers` are the
/// caller's; the options' headers are added to them.
pub fn publish_request(
    subject: &str,
    headers: Option<&HeaderMap>,
    payload: &[u8],
    options: &PublishOptions,
) -> Result<Request, JsError> {
    if subject.is_empty() || subject.split('.').any(|t| !super::api::is_token(t)) {
        return Err(JsError::Invalid(format!(
            "invalid publish subject {subject:?}"
        )));
    }
    let headers = if options.is_empty() {
        headers.cloned()
    } else {
        let mut h = headers.cloned().unwrap_or_default();
        options.apply(&mut h)?;
        Some(h)
    };
    Ok(Request {
        subject: subject.to_string(),
        headers,
        payload: payload.to_vec(),
    })
}

/// The stream's acknowledgement of a stored message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PubAck {
    pub stream: String,
    pub seq: u64,
    /// The message id was seen within the duplicate window; nothing new was stored.
    #[serde(default)]
    pub duplicate: bool,
    #[serde(default)]
    pub domain: Option<String>,
}

/// Decodes the reply to a stream publish. A 503 status (no stream on the subject)
/// is [`JsError::NoResponders`].
pub fn parse_pub_ack(status: Option<u16>, payload: &[u8]) -> Result<PubAck, JsError> {
    refused(status)?;
    match plain_pub_ack(payload) {
        Some(ack) => Ok(ack.owned()),
        None => read_pub_ack(payload),
    }
}

/// [`parse_pub_ack`]'s `seq` and `duplicate` alone, the stream's and domain's names
/// not copied: every `send` waits for one, and the sender knows where it stored.
pub fn pub_ack_seq(status: Option<u16>, payload: &[u8]) -> Result<(u64, bool), JsError> {
    refused(status)?;
    match plain_pub_ack(payload) {
        Some(ack) => Ok((ack.seq, false)),
        None => read_pub_ack(payload).map(|ack| (ack.seq, ack.duplicate)),
    }
}

fn refused(status: Option<u16>) -> Result<(), JsError> {
    match status {
        Some(503) => Err(JsError::NoResponders),
        Some(408) => Err(JsError::Timeout),
        _ => Ok(()),
    }
}

/// Any PubAck reply: the ack or its error, in one pass.
fn read_pub_ack(payload: &[u8]) -> Result<PubAck, JsError> {
    let reply: PubAckReply = serde_json::from_slice(payload).map_err(JsError::malformed)?;
    match (reply.error, reply.stream, reply.seq) {
        (Some(e), _, _) => Err(JsError::from_api(e)),
        (None, Some(stream), Some(seq)) => Ok(PubAck {
            stream,
            seq,
            duplicate: reply.duplicate,
            domain: reply.domain,
        }),
        _ => Err(JsError::Malformed("PubAck without stream and seq".into())),
    }
}

/// A new message's PubAck as [`plain_pub_ack`] reads it, borrowing from the reply.
#[derive(Debug)]
struct PlainPubAck<'a> {
    /// UTF-8, checked.
    stream: &'a [u8],
    seq: u64,
    domain: Option<&'a [u8]>,
}

impl PlainPubAck<'_> {
    fn owned(&self) -> PubAck {
        // Lossless: `plain_pub_ack` checked both names.
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        PubAck {
            stream: text(self.stream),
            seq: self.seq,
            duplicate: false,
            domain: self.domain.map(text),
        }
    }
}

/// The PubAck as nats-server writes it for a new message,
/// `{"stream":"S","seq":N}` or `{"stream":"S","domain":"D","seq":N}`, read without serde
/// (every publish waits for one). Anything else (an error, `duplicate`, escapes, spacing)
/// is `None`, for the general parse, which reads these the same.
fn plain_pub_ack(payload: &[u8]) -> Option<PlainPubAck<'_>> {
    // Checked, not converted: `pub_ack_seq`, which every `send` waits for, reads no
    // name, and a name is a few ASCII bytes, where `from_utf8`'s setup costs more than
    // `is_ascii`'s words.
    fn string<'a>(rest: &mut &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
        let after = rest.strip_prefix(key)?;
        let (text, tail) = after.split_at_checked(crate::scan::json_plain_len(after))?;
        *rest = tail.strip_prefix(b"\"")?;
        (text.is_ascii() || std::str::from_utf8(text).is_ok()).then_some(text)
    }
    let mut rest = payload;
    let stream = string(&mut rest, b"{\"stream\":\"")?;
    let domain = if rest.starts_with(b",\"domain\":\"") {
        Some(string(&mut rest, b",\"domain\":\"")?)
    } else {
        None
    };
    let digits = rest.strip_prefix(b",\"seq\":")?.strip_suffix(b"}")?;
    if digits.is_empty() || (digits.len() > 1 && digits[0] == b'0') {
        return None;
    }
    // As `u64`'s `parse` reads them, without a UTF-8 check of the digits first: past
    // `u64::MAX` is `None`.
    let seq = digits.iter().try_fold(0u64, |n, &b| {
        let digit = b.wrapping_sub(b'0');
        (digit <= 9)
            .then(|| n.checked_mul(10)?.checked_add(u64::from(digit)))
            .flatten()
    })?;
    Some(PlainPubAck {
        stream,
        seq,
        domain,
    })
}

#[derive(Deserialize)]
struct PubAckReply {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    stream: Option<String>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
    #[serde(default)]
    domain: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_expectation_headers() {
        let opts = PublishOptions {
            msg_id: Some("id-1".into()),
            expected_stream: Some("S".into()),
            expected_last_sequence: Some(4),
            expected_last_subject_sequence: Some(0),
            expected_last_msg_id: None,
            ttl: Some(MsgTtl::After(Duration::from_millis(1500))),
        };
        let mut user = HeaderMap::new();
        user.insert("X-Trace", "t1").expect("header");
        let r = publish_request("s.a", Some(&user), b"hi", &opts).expect("request");
        let h = r.headers.expect("headers");
        assert_eq!(h.get("X-Trace"), Some("t1"));
        assert_eq!(h.get(MSG_ID), Some("id-1"));
        assert_eq!(h.get(EXPECTED_STREAM), Some("S"));
        assert_eq!(h.get(EXPECTED_LAST_SEQUENCE), Some("4"));
        assert_eq!(h.get(EXPECTED_LAST_SUBJECT_SEQUENCE), Some("0"));
        assert_eq!(h.get(MSG_TTL), Some("2s"));
        let plain = publish_request("s.a", None, b"", &PublishOptions::default()).expect("req");
        assert!(plain.headers.is_none());
        assert!(publish_request("s.*", None, b"", &PublishOptions::default()).is_err());
        assert_eq!(MsgTtl::Never.header_value().expect("never"), "never");
        assert!(MsgTtl::After(Duration::ZERO).header_value().is_err());
    }

    #[test]
    fn the_plain_pub_ack_reads_as_the_general_parse_reads_it() {
        for text in [
            r#"{"stream":"AMP_INBOX_dev","seq":123}"#,
            r#"{"stream":"S","domain":"hub","seq":0}"#,
            r#"{"stream":"S","seq":18446744073709551615}"#,
        ] {
            let plain = plain_pub_ack(text.as_bytes()).expect("plain").owned();
            let general = read_pub_ack(text.as_bytes()).expect("general");
            assert_eq!(plain, general, "{text}");
            assert_eq!(
                pub_ack_seq(None, text.as_bytes()),
                Ok((general.seq, general.duplicate)),
                "{text}"
            );
        }
        for text in [
            r#"{"stream":"S","seq":2,"duplicate": true}"#,
            r#"{"stream":"S","seq":18446744073709551616}"#,
            r#"{"stream":"S","seq":99999999999999999999}"#,
            r#"{"stream":"S","seq":01}"#,
            r#"{"stream":"S","seq":1a}"#,
            r#"{"stream":"S","seq":+1}"#,
            r#"{"stream":"S","seq":-1}"#,
            r#"{"stream":"S","seq":}"#,
            r#"{"stream":"S","seq":1.0}"#,
            r#"{"stream":"S\"x","seq":1}"#,
            r#"{"stream":"S","seq":1} "#,
            r#"{"stream":"S","domain":"d","seq":1,"seq":2}"#,
            r#"{"error":{"code":503,"description":"no"}}"#,
        ] {
            assert!(plain_pub_ack(text.as_bytes()).is_none(), "{text}");
        }
    }

    #[test]
    fn the_plain_pub_ack_agrees_with_the_general_parse_on_assembled_replies() {
        // Every reply made of these pieces in a row: the plain form's own, `seq` in a
        // string, twice, negative, a float, huge, an error beside it, spacing, escapes.
        let pieces: &[&[u8]] = &[
            b"{\"stream\":\"",
            b"S",
            b"\\u00e9",
            b"\xc3\xa9",
            b"\xff",
            b"\x7f",
            b"\\\"",
            b"\"",
            b",\"domain\":\"",
            b",\"seq\":",
            b"\",\"seq\":",
            b"\"seq\":1,\"x\":\"",
            b"0",
            b"1",
            b"01",
            b"-1",
            b"1.5",
            b"1e3",
            b"18446744073709551615",
            b"18446744073709551616",
            b",\"duplicate\":true",
            b",\"error\":{\"code\":503,\"description\":\"x\"}",
            b" ",
            b"}",
        ];
        let mut checked = 0;
        let mut check = |payload: &[u8]| {
            checked += 1;
            let general = read_pub_ack(payload);
            if let Some(plain) = plain_pub_ack(payload) {
                assert_eq!(
                    Ok(plain.owned()),
                    general,
                    "{:?}",
                    payload.escape_ascii().to_string()
                );
            }
            assert_eq!(
                pub_ack_seq(None, payload),
                general.map(|a| (a.seq, a.duplicate)),
                "{:?}",
                payload.escape_ascii().to_string()
            );
        };
        // The plain form's skeleton with every choice of piece in each of its places.
        for a in pieces {
            for b in pieces {
                for c in pieces {
                    for d in pieces {
                        check(&[b"{\"stream\":\"", *a, *b, b",\"seq\":", *c, *d].concat());
                        check(&[b"{\"stream\":\"S\",\"domain\":\"", *a, *b, *c, *d].concat());
                        check(&[*a, *b, *c, *d, b"}"].concat());
                    }
                }
            }
        }
        assert!(checked > 300_000, "{checked}");
    }

    #[test]
    fn pub_ack_replies_decode_to_acks_or_typed_errors() {
        let ack = parse_pub_ack(None, br#"{"stream":"S","seq":3,"duplicate":true}"#).expect("ack");
        assert_eq!(
            ack,
            PubAck {
                stream: "S".into(),
                seq: 3,
                duplicate: true,
                domain: None
            }
        );
        let wrong = parse_pub_ack(
            None,
            br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 2"}}"#,
        );
        assert!(matches!(wrong, Err(JsError::WrongLastSequence(_))));
        assert_eq!(parse_pub_ack(Some(503), b""), Err(JsError::NoResponders));
        assert!(matches!(
            parse_pub_ack(None, br#"{"stream":"S"}"#),
            Err(JsError::Malformed(_))
        ));
        assert!(matches!(
            parse_pub_ack(None, b"{"),
            Err(JsError::Malformed(_))
        ));
    }
}
