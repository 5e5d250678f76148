//! Encoder for every operation, appending straight to an output buffer.
//!
//! Arguments are written as given: subjects, replies, sids and queue groups must already
//! be valid (see [`crate::proto::subject`]); a space or CRLF inside one would corrupt the
//! stream. Header blocks are written as given too (build them with
//! [`crate::proto::headers::HeaderMap::encode_into`]).

use super::info::{ConnectOptions, ServerInfo};

/// Appends `n` in decimal without going through `fmt`.
#[inline]
pub fn write_decimal(out: &mut Vec<u8>, n: u64) {
    let (digits, start) = decimal(n);
    out.extend_from_slice(digits.get(start..).unwrap_or_default());
}

/// `n` in decimal appended to a string, without the formatting machinery (request
/// reply subjects and frame integers are written for every message).
pub fn push_decimal(out: &mut String, n: u64) {
    let (digits, start) = decimal(n);
    let digits = digits.get(start..).unwrap_or_default();
    // Pushed one by one: a UTF-8 check of a few digits costs more than the pushes.
    out.reserve(digits.len());
    for &d in digits {
        out.push(char::from(d));
    }
}

/// The decimal digits of `n` at the end of a buffer, and where they start: two digits
/// per division (sizes, sequences and timestamps are written for every message).
fn decimal(mut n: u64) -> ([u8; 20], usize) {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let pair = |p: u64| {
        let at = (p as usize) * 2;
        PAIRS.get(at..at + 2).unwrap_or(b"00")
    };
    // Twenty places hold `u64::MAX`, so `i` never runs below zero.
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut put = |i: usize, two: &[u8]| {
        if let Some(d) = digits.get_mut(i..i + two.len()) {
            d.copy_from_slice(two);
        }
    };
    while n >= 100 {
        i -= 2;
        put(i, pair(n % 100));
        n /= 100;
    }
    if n >= 10 {
        i -= 2;
        put(i, pair(n));
    } else {
        i -= 1;
        put(i, &[b'0' + n as u8]);
    }
    (digits, i)
}

/// Number of decimal digits of `n`.
#[inline]
fn decimal_len(mut n: u64) -> usize {
    let mut len = 1;
    while n >= 10 {
        n /= 10;
        len += 1;
    }
    len
}

#[inline]
fn with_reply(out: &mut Vec<u8>, reply: Option<&[u8]>) {
    if let Some(r) = reply {
        out.extend_from_slice(r);
        out.push(b' ');
    }
}

/// `PUB <subject> [reply] <size>\r\n<payload>\r\n`
#[inline]
pub fn publish(out: &mut Vec<u8>, subject: impl AsRef<[u8]>, reply: Option<&[u8]>, payload: &[u8]) {
    let subject = subject.as_ref();
    out.reserve(
        4 + subject.len() + 1 + reply.map_or(0, |r| r.len() + 1) + 10 + 2 + payload.len() + 2,
    );
    out.extend_from_slice(b"PUB ");
    out.extend_from_slice(subject);
    out.push(b' ');
    with_reply(out, reply);
    write_decimal(out, payload.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

/// `HPUB <subject> [reply] <hdr_len> <total_len>\r\n<headers><payload>\r\n`
#[inline]
pub fn hpublish(
    out: &mut Vec<u8>,
    subject: impl AsRef<[u8]>,
    reply: Option<&[u8]>,
    headers: &[u8],
    payload: &[u8],
) {
    let subject = subject.as_ref();
    let total = headers.len() + payload.len();
    out.reserve(5 + subject.len() + reply.map_or(0, |r| r.len() + 1) + 24 + total + 2);
    out.extend_from_slice(b"HPUB ");
    out.extend_from_slice(subject);
    out.push(b' ');
    with_reply(out, reply);
    write_decimal(out, headers.len() as u64);
    out.push(b' ');
    write_decimal(out, total as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(headers);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

/// `SUB <subject> [queue] <sid>\r\n`
pub fn subscribe(
    out: &mut Vec<u8>,
    subject: impl AsRef<[u8]>,
    queue: Option<&[u8]>,
    sid: impl AsRef<[u8]>,
) {
    out.extend_from_slice(b"SUB ");
    out.extend_from_slice(subject.as_ref());
    out.push(b' ');
    with_reply(out, queue);
    out.extend_from_slice(sid.as_ref());
    out.extend_from_slice(b"\r\n");
}

/// `UNSUB <sid> [max_msgs]\r\n`
pub fn unsubscribe(out: &mut Vec<u8>, sid: impl AsRef<[u8]>, max_msgs: Option<u64>) {
    out.extend_from_slice(b"UNSUB ");
    out.extend_from_slice(sid.as_ref());
    if let Some(m) = max_msgs {
        out.push(b' ');
        write_decimal(out, m);
    }
    out.extend_from_slice(b"\r\n");
}

/// `MSG <subject> <sid> [reply] <size>\r\n<payload>\r\n`
pub fn msg(
    out: &mut Vec<u8>,
    subject: impl AsRef<[u8]>,
    sid: impl AsRef<[u8]>,
    reply: Option<&[u8]>,
    payload: &[u8],
) {
    let (subject, sid) = (subject.as_ref(), sid.as_ref());
    out.reserve(
        4 + subject.len() + sid.len() + reply.map_or(0, |r| r.len() + 1) + 14 + payload.len(),
    );
    out.extend_from_slice(b"MSG ");
    out.extend_from_slice(subject);
    out.push(b' ');
    out.extend_from_slice(sid);
    out.push(b' ');
    with_reply(out, reply);
    write_decimal(out, payload.len() as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

/// `HMSG <subject> <sid> [reply] <hdr_len> <total_len>\r\n<headers><payload>\r\n`
pub fn hmsg(
    out: &mut Vec<u8>,
    subject: impl AsRef<[u8]>,
    sid: impl AsRef<[u8]>,
    reply: Option<&[u8]>,
    headers: &[u8],
    payload: &[u8],
) {
    let (subject, sid) = (subject.as_ref(), sid.as_ref());
    let total = headers.len() + payload.len();
    out.reserve(5 + subject.len() + sid.len() + reply.map_or(0, |r| r.len() + 1) + 26 + total);
    out.extend_from_slice(b"HMSG ");
    out.extend_from_slice(subject);
    out.push(b' ');
    out.extend_from_slice(sid);
    out.push(b' ');
    with_reply(out, reply);
    write_decimal(out, headers.len() as u64);
    out.push(b' ');
    write_decimal(out, total as u64);
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(headers);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\n");
}

pub fn ping(out: &mut Vec<u8>) {
    out.extend_from_slice(b"PING\r\n");
}

pub fn pong(out: &mut Vec<u8>) {
    out.extend_from_slice(b"PONG\r\n");
}

pub fn ok(out: &mut Vec<u8>) {
    out.extend_from_slice(b"+OK\r\n");
}

/// `-ERR '<text>'\r\n`; CR and LF in `text` become spaces so the line stays one line.
pub fn err(out: &mut Vec<u8>, text: impl AsRef<[u8]>) {
    out.extend_from_slice(b"-ERR '");
    out.extend(
        text.as_ref()
            .iter()
            .map(|&b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
    );
    out.extend_from_slice(b"'\r\n");
}

/// `INFO {json}\r\n`. JSON never holds a raw CR or LF, so the line cannot break.
pub fn info(out: &mut Vec<u8>, info: &ServerInfo) -> serde_json::Result<()> {
    json_line(out, b"INFO ", info)
}

/// `CONNECT {json}\r\n`
pub fn connect(out: &mut Vec<u8>, options: &ConnectOptions) -> serde_json::Result<()> {
    json_line(out, b"CONNECT ", options)
}

/// `INFO <json>\r\n` from JSON already serialized (e.g. forwarded as received).
pub fn info_raw(out: &mut Vec<u8>, json: &[u8]) {
    out.extend_from_slice(b"INFO ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\r\n");
}

/// `CONNECT <json>\r\n` from JSON already serialized.
pub fn connect_raw(out: &mut Vec<u8>, json: &[u8]) {
    out.extend_from_slice(b"CONNECT ");
    out.extend_from_slice(json);
    out.extend_from_slice(b"\r\n");
}

fn json_line<T: serde::Serialize>(
    out: &mut Vec<u8>,
    op: &[u8],
    value: &T,
) -> serde_json::Result<()> {
    let mark = out.len();
    out.extend_from_slice(op);
    if let Err(e) = serde_json::to_writer(&mut *out, value) {
        out.truncate(mark);
        return Err(e);
    }
    out.extend_from_slice(b"\r\n");
    Ok(())
}

/// Exact length `publish` appends.
pub fn publish_len(subject: &[u8], reply: Option<&[u8]>, payload_len: usize) -> usize {
    4 + subject.len()
        + 1
        + reply.map_or(0, |r| r.len() + 1)
        + decimal_len(payload_len as u64)
        + 2
        + payload_len
        + 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{Op, Parsed, Parser, Role};

    fn parse_one<'a>(role: Role, buf: &'a [u8]) -> Op<'a> {
        match Parser::new(role).parse(buf) {
            Ok(Parsed::Complete(op, used)) if used == buf.len() => op,
            other => panic!("{other:?} for {:?}", String::from_utf8_lossy(buf)),
        }
    }

    #[test]
    fn every_operation_encodes_to_its_wire_form() {
        let mut out = Vec::new();
        publish(&mut out, "foo", None, b"hi");
        publish(&mut out, b"foo", Some(b"r"), b"");
        hpublish(&mut out, "foo", Some(b"r"), b"NATS/1.0\r\n\r\n", b"x");
        subscribe(&mut out, "foo", None, "1");
        subscribe(&mut out, "foo", Some(b"q"), "2");
        unsubscribe(&mut out, "1", None);
        unsubscribe(&mut out, "2", Some(10));
        ping(&mut out);
        pong(&mut out);
        ok(&mut out);
        err(&mut out, "Bad\r\nThing");
        msg(&mut out, "foo", "7", Some(b"r"), b"hello");
        hmsg(&mut out, "foo", "7", None, b"NATS/1.0 503\r\n\r\n", b"");
        let want: &[u8] =
            b"PUB foo 2\r\nhi\r\nPUB foo r 0\r\n\r\nHPUB foo r 12 13\r\nNATS/1.0\r\n\r\nx\r\n\
SUB foo 1\r\nSUB foo q 2\r\nUNSUB 1\r\nUNSUB 2 10\r\nPING\r\nPONG\r\n+OK\r\n-ERR 'Bad  Thing'\r\n\
MSG foo 7 r 5\r\nhello\r\nHMSG foo 7 16 16\r\nNATS/1.0 503\r\n\r\n\r\n";
        assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(want));
    }

    #[test]
    fn encoded_operations_parse_back() {
        let mut out = Vec::new();
        hpublish(&mut out, "a.b", None, b"NATS/1.0\r\nK: v\r\n\r\n", b"data");
        assert_eq!(
            parse_one(Role::Server, &out),
            Op::Hpub {
                subject: b"a.b",
                reply: None,
                headers: b"NATS/1.0\r\nK: v\r\n\r\n",
                payload: b"data"
            }
        );
        out.clear();
        msg(&mut out, "a", "12", None, b"");
        assert_eq!(
            parse_one(Role::Client, &out),
            Op::Msg {
                subject: b"a",
                sid: b"12",
                reply: None,
                payload: b""
            }
        );
        out.clear();
        connect(&mut out, &ConnectOptions::default()).expect("serializable");
        let Op::Connect(json) = parse_one(Role::Server, &out) else {
            panic!("connect")
        };
        assert_eq!(
            ConnectOptions::from_json(json).expect("json"),
            ConnectOptions::default()
        );
        out.clear();
        let info_in = ServerInfo {
            server_id: "S".into(),
            max_payload: 1 << 20,
            jetstream: true,
            ..Default::default()
        };
        info(&mut out, &info_in).expect("serializable");
        let Op::Info(json) = parse_one(Role::Client, &out) else {
            panic!("info")
        };
        assert_eq!(ServerInfo::from_json(json).expect("json"), info_in);
    }

    #[test]
    fn decimal_writer_and_publish_len_are_exact() {
        let mut numbers = vec![0u64, 1, 9, 10, 99, 100, 12345, u64::MAX];
        numbers.extend((0..20).flat_map(|e| {
            let p = 10u64.pow(e);
            [p - 1, p, p + 1, p.saturating_mul(7).saturating_add(3)]
        }));
        for n in numbers {
            let mut out = Vec::new();
            write_decimal(&mut out, n);
            assert_eq!(out, n.to_string().as_bytes());
            let mut text = String::from("x");
            push_decimal(&mut text, n);
            assert_eq!(text, format!("x{n}"));
        }
        for len in [0usize, 9, 10, 1000] {
            let mut out = Vec::new();
            let payload = vec![b'x'; len];
            publish(&mut out, "subj", Some(b"rep"), &payload);
            assert_eq!(out.len(), publish_len(b"subj", Some(b"rep"), len));
        }
    }
}
