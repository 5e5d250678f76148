//! Acknowledgements (`+ACK`, `-NAK`, `+WPI`, `+TERM`, ADR-15) and the metadata a
//! JetStream delivery carries in its `$JS.ACK` reply subject.

use std::borrow::Cow;
use std::time::Duration;

use super::error::JsError;
use super::pull::PullRequest;
use super::wire::nanos_of;

/// The answer to a delivery, published to its reply subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AckKind {
    /// Processed; do not redeliver.
    Ack,
    /// Not processed; redeliver now, or after `delay`.
    Nak { delay: Option<Duration> },
    /// Still working: restart the ack-wait timer.
    InProgress,
    /// Never redeliver, optionally saying why.
    Term { reason: Option<String> },
    /// Processed, and a pull of more (`+NXT`): published with the subject the next
    /// messages should go to as its reply, which then serves as the pull's.
    Next { pull: PullRequest },
}

impl AckKind {
    /// The ack payload: `+ACK`, `-NAK`, `-NAK {"delay": ns}`, `+WPI`, `+TERM`, `+TERM reason`,
    /// `+NXT {pull request}`.
    pub fn payload(&self) -> Cow<'static, [u8]> {
        // Every delivery is acked: the fixed ones are not allocated.
        let fixed = |bytes: &'static [u8]| Cow::Borrowed(bytes);
        match self {
            AckKind::Ack => fixed(b"+ACK"),
            AckKind::Nak { delay: None } => fixed(b"-NAK"),
            AckKind::Nak { delay: Some(d) } => {
                Cow::Owned(format!("-NAK {{\"delay\": {}}}", nanos_of(*d)).into_bytes())
            }
            AckKind::InProgress => fixed(b"+WPI"),
            AckKind::Term { reason: None } => fixed(b"+TERM"),
            AckKind::Term { reason: Some(r) } => Cow::Owned(format!("+TERM {r}").into_bytes()),
            AckKind::Next { pull } => {
                let mut out = b"+NXT ".to_vec();
                // A struct of integers and booleans: serialising it cannot fail.
                out.extend(serde_json::to_vec(pull).unwrap_or_default());
                Cow::Owned(out)
            }
        }
    }
}

/// What the `$JS.ACK` subject of a delivery says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckMetadata<'a> {
    /// The JetStream domain (v2 subjects; `None` for v1 or the `_` placeholder).
    pub domain: Option<&'a str>,
    /// The account hash (v2 subjects only).
    pub account_hash: Option<&'a str>,
    pub stream: &'a str,
    pub consumer: &'a str,
    /// How many times this message has been delivered, this one included.
    pub delivered: u64,
    pub stream_sequence: u64,
    pub consumer_sequence: u64,
    /// Nanoseconds since the Unix epoch when the stream stored the message.
    pub timestamp_nanos: u64,
    /// Messages left for this consumer after this one.
    pub pending: u64,
}

const V1_TOKENS: usize = 9;
const V2_MIN_TOKENS: usize = 11;

impl<'a> AckMetadata<'a> {
    /// Parses `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (v1)
    /// or `$JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<token>...]` (v2).
    pub fn parse(reply: &'a str) -> Result<AckMetadata<'a>, JsError> {
        let bad = |why: &str| JsError::Malformed(format!("ack subject {reply:?}: {why}"));
        // The tokens are read where they lie: only the names become `str`s.
        let (dots, dot_count) = crate::scan::dots::<V2_MIN_TOKENS>(reply.as_bytes());
        let count = dot_count + 1;
        // Token `i`: from after the dot before it to the dot after it (empty when there
        // is no such token).
        let span = |i: usize| {
            if i >= count {
                return reply.len()..reply.len();
            }
            let start = i
                .checked_sub(1)
                .map_or(0, |d| dots.get(d).map_or(reply.len(), |&d| d + 1));
            let end = if i < dot_count {
                dots.get(i).copied().unwrap_or(reply.len())
            } else {
                reply.len()
            };
            start..end
        };
        // A dot is ASCII: every span starts and ends on a character boundary.
        let text = |i: usize| reply.get(span(i)).unwrap_or_default();
        let bytes = |i: usize| reply.as_bytes().get(span(i)).unwrap_or_default();
        if bytes(0) != b"$JS" || bytes(1) != b"ACK" {
            return Err(bad("does not start with $JS.ACK"));
        }
        let (domain, account_hash, first) = if count == V1_TOKENS {
            (None, None, 2)
        } else if count >= V2_MIN_TOKENS {
            let domain = Some(text(2)).filter(|d| *d != "_" && !d.is_empty());
            (domain, Some(text(3)), 4)
        } else {
            return Err(bad("wrong number of tokens"));
        };
        let (stream, consumer) = (text(first), text(first + 1));
        if stream.is_empty() || consumer.is_empty() {
            return Err(bad("empty stream or consumer"));
        }
        let num = |t: &[u8]| -> Result<u64, JsError> {
            // Nineteen digits cannot overflow a u64: only longer numbers are checked
            // step by step.
            if t.len() <= 19 {
                return crate::scan::digits(t).ok_or_else(|| bad("non-numeric field"));
            }
            t.iter().try_fold(0u64, |n, &b| {
                let digit = u64::from(b.wrapping_sub(b'0'));
                if digit > 9 {
                    return Err(bad("non-numeric field"));
                }
                n.checked_mul(10)
                    .and_then(|n| n.checked_add(digit))
                    .ok_or_else(|| bad("number out of range"))
            })
        };
        Ok(AckMetadata {
            domain,
            account_hash,
            stream,
            consumer,
            delivered: num(bytes(first + 2))?,
            stream_sequence: num(bytes(first + 3))?,
            consumer_sequence: num(bytes(first + 4))?,
            timestamp_nanos: num(bytes(first + 5))?,
            pending: num(bytes(first + 6))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_payloads_match_the_protocol() {
        assert_eq!(AckKind::Ack.payload().as_ref(), b"+ACK".as_slice());
        assert_eq!(
            AckKind::Nak { delay: None }.payload().as_ref(),
            b"-NAK".as_slice()
        );
        assert_eq!(
            AckKind::Nak {
                delay: Some(Duration::from_millis(1500))
            }
            .payload()
            .as_ref(),
            br#"-NAK {"delay": 1500000000}"#.as_slice()
        );
        assert_eq!(AckKind::InProgress.payload().as_ref(), b"+WPI".as_slice());
        let pull = PullRequest {
            expires: Some(Duration::from_secs(2)),
            ..PullRequest::batch(3)
        };
        assert_eq!(
            AckKind::Next { pull }.payload().as_ref(),
            br#"+NXT {"batch":3,"expires":2000000000}"#.as_slice()
        );
        assert_eq!(
            AckKind::Term { reason: None }.payload().as_ref(),
            b"+TERM".as_slice()
        );
        assert_eq!(
            AckKind::Term {
                reason: Some("bad input".into())
            }
            .payload()
            .as_ref(),
            b"+TERM bad input".as_slice()
        );
    }

    #[test]
    fn v1_ack_subject_metadata_parses() {
        let m =
            AckMetadata::parse("$JS.ACK.ORDERS.proc.2.1007.17.1700000000123456789.42").expect("v1");
        assert_eq!(m.domain, None);
        assert_eq!(m.account_hash, None);
        assert_eq!(m.stream, "ORDERS");
        assert_eq!(m.consumer, "proc");
        assert_eq!(m.delivered, 2);
        assert_eq!(m.stream_sequence, 1007);
        assert_eq!(m.consumer_sequence, 17);
        assert_eq!(m.timestamp_nanos, 1_700_000_000_123_456_789);
        assert_eq!(m.pending, 42);
    }

    #[test]
    fn v2_ack_subject_metadata_parses_with_domain_and_account_hash() {
        let m = AckMetadata::parse(
            "$JS.ACK.hub.AH7sUvVqa8Ex.ORDERS.proc.1.5.3.1700000000000000001.0.r4nd0m",
        )
        .expect("v2");
        assert_eq!(m.domain, Some("hub"));
        assert_eq!(m.account_hash, Some("AH7sUvVqa8Ex"));
        assert_eq!(m.stream, "ORDERS");
        assert_eq!(m.consumer, "proc");
        assert_eq!(m.delivered, 1);
        assert_eq!(m.stream_sequence, 5);
        assert_eq!(m.consumer_sequence, 3);
        assert_eq!(m.timestamp_nanos, 1_700_000_000_000_000_001);
        assert_eq!(m.pending, 0);
        let no_domain =
            AckMetadata::parse("$JS.ACK._.ACC.S.C.1.2.3.4.5.tok").expect("v2 without domain");
        assert_eq!(no_domain.domain, None);
        assert_eq!(no_domain.stream_sequence, 2);
        let no_token = AckMetadata::parse("$JS.ACK._.ACC.S.C.1.2.3.4.5").expect("11 tokens");
        assert_eq!(no_token.pending, 5);
    }

    /// The parse as it was, a `memchr` per token and a digit at a time: the oracle of
    /// the one-pass reading.
    fn parse_token_by_token(reply: &str) -> Result<AckMetadata<'_>, JsError> {
        let bad = |why: &str| JsError::Malformed(format!("ack subject {reply:?}: {why}"));
        let mut tokens = [""; 12];
        let mut count = 0;
        let mut start = 0;
        let ends = memchr::memchr_iter(b'.', reply.as_bytes()).chain(std::iter::once(reply.len()));
        for end in ends {
            if count < tokens.len() {
                tokens[count] = reply.get(start..end).unwrap_or_default();
            }
            count += 1;
            start = end + 1;
        }
        if tokens[0] != "$JS" || tokens[1] != "ACK" {
            return Err(bad("does not start with $JS.ACK"));
        }
        let (domain, account_hash, rest) = if count == V1_TOKENS {
            (None, None, &tokens[2..9])
        } else if count >= V2_MIN_TOKENS {
            let domain = Some(tokens[2]).filter(|d| *d != "_" && !d.is_empty());
            (domain, Some(tokens[3]), &tokens[4..11])
        } else {
            return Err(bad("wrong number of tokens"));
        };
        let [stream, consumer, delivered, sseq, cseq, ts, pending] = rest else {
            return Err(bad("wrong number of tokens"));
        };
        if stream.is_empty() || consumer.is_empty() {
            return Err(bad("empty stream or consumer"));
        }
        let num = |t: &str| -> Result<u64, JsError> {
            if t.is_empty() {
                return Err(bad("non-numeric field"));
            }
            let mut n: u64 = 0;
            for b in t.bytes() {
                let digit = u64::from(b.wrapping_sub(b'0'));
                if digit > 9 {
                    return Err(bad("non-numeric field"));
                }
                n = n
                    .checked_mul(10)
                    .and_then(|n| n.checked_add(digit))
                    .ok_or_else(|| bad("number out of range"))?;
            }
            Ok(n)
        };
        Ok(AckMetadata {
            domain,
            account_hash,
            stream,
            consumer,
            delivered: num(delivered)?,
            stream_sequence: num(sseq)?,
            consumer_sequence: num(cseq)?,
            timestamp_nanos: num(ts)?,
            pending: num(pending)?,
        })
    }

    #[test]
    fn the_one_pass_reading_agrees_with_token_by_token() {
        let numbers = [
            "0",
            "7",
            "007",
            "1733600000123456789",
            "9999999999999999999",
            "18446744073709551615",
            "18446744073709551616",
            "184467440737095516150",
            "12345678",
            "123456789",
            "1234567x",
            "12345678x",
            "1234567890123456789x",
            "1:",
            "-1",
            "",
            "é",
        ];
        let names = ["S", "", "AMP_INBOX_acme", "_", "é.", "ünï"];
        let mut subjects = vec![
            String::new(),
            "$JS".into(),
            "$JS.ACK".into(),
            "$JS.ACK.".into(),
            "$JSACK.S.C.1.2.3.4.5".into(),
        ];
        for prefix in ["$JS.ACK", "$JS.NAK", "$js.ACK"] {
            for name in names {
                for (i, n) in numbers.iter().enumerate() {
                    let m = numbers[(i * 5 + 3) % numbers.len()];
                    // v1, v2 with and without a domain, a random token, more tokens.
                    subjects.push(format!("{prefix}.{name}.C.1.{n}.3.{m}.5"));
                    subjects.push(format!("{prefix}.{name}.C.{n}.2.3.4.{m}"));
                    subjects.push(format!("{prefix}.{name}.acct.S.C.1.2.{n}.{m}.5"));
                    subjects.push(format!("{prefix}._.acct.{name}.C.{n}.2.3.4.5.tok"));
                    subjects.push(format!("{prefix}.d.acct.S.{name}.1.2.3.{n}.{m}.tok.x.y"));
                    subjects.push(format!("{prefix}.{name}.C.1.2.3.{n}"));
                    subjects.push(format!("{prefix}.{name}.acct.S.C.1.2.3.4.{n}.{m}.e.f.g.h"));
                }
            }
        }
        for subject in &subjects {
            assert_eq!(
                AckMetadata::parse(subject),
                parse_token_by_token(subject),
                "{subject:?}"
            );
        }
    }

    #[test]
    fn the_one_pass_reading_agrees_with_token_by_token_on_random_subjects() {
        // Numbers with a non-digit at each place of an 8-digit group, leading zeros, 19,
        // 20 and 21 digits around `u64::MAX`; names that are empty, dots, non-ASCII.
        let mut tokens: Vec<String> = [
            "$JS",
            "ACK",
            "",
            "_",
            "S",
            "é",
            "ü.",
            "0",
            "00",
            "007",
            "9",
            "1:",
            "/1",
            "9999999999999999999",
            "09999999999999999999",
            "18446744073709551615",
            "018446744073709551615",
            "18446744073709551616",
            "99999999999999999999",
            "100000000000000000000",
            "12345678",
            "123456789",
            "1234567890123456",
            "12345678901234567",
        ]
        .iter()
        .map(|t| t.to_string())
        .collect();
        for len in [7, 8, 9, 15, 16, 17, 19, 20] {
            for at in 0..len {
                for bad in ['/', ':', 'a', '\u{b0}', ' ', '.'] {
                    let mut t: Vec<char> =
                        (0..len).map(|i| (b'1' + (i % 9) as u8) as char).collect();
                    t[at] = bad;
                    tokens.push(t.into_iter().collect());
                }
            }
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        for _ in 0..200_000 {
            let count = (next() % 15) as usize;
            let mut parts: Vec<&str> = Vec::with_capacity(count);
            for i in 0..count {
                let r = next();
                // Mostly a real ack subject's start, so the numbers are reached.
                parts.push(match (i, r % 8) {
                    (0, 0..=6) => "$JS",
                    (1, 0..=6) => "ACK",
                    _ => &tokens[(r >> 8) as usize % tokens.len()],
                });
            }
            let subject = parts.join(".");
            assert_eq!(
                AckMetadata::parse(&subject),
                parse_token_by_token(&subject),
                "{subject:?}"
            );
        }
    }

    #[test]
    fn malformed_ack_subjects_are_errors() {
        for bad in [
            "",
            "$JS.ACK",
            "_INBOX.abc.def",
            "$JS.ACK.S.C.1.2.3.4",
            "$JS.ACK.S.C.1.2.3.4.5.6",
            "$JS.ACK.S.C.x.2.3.4.5",
            "$JS.ACK.S.C.1.2.3.4.-5",
            "$JS.ACK.S.C.1.2.3.4.99999999999999999999999",
            "$JS.ACK..C.1.2.3.4.5",
            "$JS.NAK.S.C.1.2.3.4.5",
            "$JS.ACK.d.h.S.C.1.2.3.4.",
            "$JS.ACK.S.C.1.2.3.4.18446744073709551616",
            "$JS.ACK.S.C.1.2.3.4.+5",
            "$JS.ACK.S.C.1.2.3.4.5 ",
            "$JS.ACK.S.C.1.2.:.4.5",
        ] {
            assert!(AckMetadata::parse(bad).is_err(), "{bad:?}");
        }
        let most =
            AckMetadata::parse("$JS.ACK.S.C.1.2.3.4.18446744073709551615").expect("u64::MAX");
        assert_eq!(most.pending, u64::MAX);
        assert_eq!(
            AckMetadata::parse("$JS.ACK.S.C.007.2.3.4.5")
                .map(|m| m.delivered)
                .ok(),
            Some(7)
        );
    }
}
