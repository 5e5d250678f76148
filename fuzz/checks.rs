// Checks shared by the fuzz targets (fuzz/fuzz_targets/*.rs) and by the regression replay
// in tests/fuzz_regressions.rs, so a crash found by the fuzzer is replayed by `cargo test`
// through exactly the same code. Each check panics when a property does not hold.

#![allow(dead_code)]

use amp_broker::proto::encode;
use amp_broker::proto::headers::{HeaderMap, Headers};
use amp_broker::proto::subject;
use amp_broker::proto::{Op, ParseError, Parsed, Parser, Role};

/// What parsing a stream produced, in order: each op (as owned text) with its length, then
/// how it ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Event {
    Op(String, usize),
    Error(ParseError),
}

/// xorshift64*: split points from a seed without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// Picks role and limits from the first byte, the split seed from the second.
pub fn parser_from(config: u8) -> Parser {
    let role = if config & 1 == 0 {
        Role::Client
    } else {
        Role::Server
    };
    let mut p = Parser::new(role);
    if config & 2 != 0 {
        p.max_control_line = 1 + (config as usize >> 2);
        p.max_payload = (config as usize >> 2) * 3;
    }
    p
}

fn check_op_invariants(p: &Parser, op: &Op<'_>, used: usize, available: usize) {
    assert!(used > 0, "Complete with 0 bytes used");
    assert!(used <= available, "used {used} > available {available}");
    // Re-encoding what was parsed gives a stream that parses to the same op.
    let mut out = Vec::new();
    encode_op(&mut out, op);
    // Re-encoding may lengthen a line (quotes around -ERR text), so no small limits here.
    let mut p = p.clone();
    p.max_control_line = p.max_control_line.max(1 << 16);
    match p.parse(&out) {
        Ok(Parsed::Complete(again, n)) => {
            if let (Op::Err(text), Op::Err(got)) = (op, &again) {
                // The encoder turns CR/LF in error text into spaces (one line per -ERR).
                let want: Vec<u8> = text
                    .iter()
                    .map(|&b| if b == b'\r' { b' ' } else { b })
                    .collect();
                assert_eq!(got.trim_ascii(), want.trim_ascii(), "re-encoded -ERR");
            } else {
                assert_eq!(&again, op, "re-encoded {:?}", String::from_utf8_lossy(&out));
            }
            assert_eq!(n, out.len());
        }
        other => panic!(
            "re-encoded {:?} gave {other:?}",
            String::from_utf8_lossy(&out)
        ),
    }
}

/// Encodes any op with the public encoder.
pub fn encode_op(out: &mut Vec<u8>, op: &Op<'_>) {
    match *op {
        Op::Info(json) => encode::info_raw(out, json),
        Op::Connect(json) => encode::connect_raw(out, json),
        Op::Pub {
            subject,
            reply,
            payload,
        } => encode::publish(out, subject, reply, payload),
        Op::Hpub {
            subject,
            reply,
            headers,
            payload,
        } => encode::hpublish(out, subject, reply, headers, payload),
        Op::Sub {
            subject,
            queue,
            sid,
        } => encode::subscribe(out, subject, queue, sid),
        Op::Unsub { sid, max_msgs } => encode::unsubscribe(out, sid, max_msgs),
        Op::Msg {
            subject,
            sid,
            reply,
            payload,
        } => encode::msg(out, subject, sid, reply, payload),
        Op::Hmsg {
            subject,
            sid,
            reply,
            headers,
            payload,
        } => encode::hmsg(out, subject, sid, reply, headers, payload),
        Op::Ping => encode::ping(out),
        Op::Pong => encode::pong(out),
        Op::Ok => encode::ok(out),
        Op::Err(text) => encode::err(out, text),
    }
}

/// Parses a complete buffer op by op.
pub fn parse_whole(p: &Parser, data: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    let mut start = 0;
    loop {
        let rest = &data[start..];
        match p.parse(rest) {
            Ok(Parsed::Complete(op, used)) => {
                check_op_invariants(p, &op, used, rest.len());
                events.push(Event::Op(format!("{op:?}"), used));
                start += used;
            }
            Ok(Parsed::Partial { needed }) => {
                if let Some(n) = needed {
                    assert!(n > rest.len(), "needed {n} but {} available", rest.len());
                }
                return events;
            }
            Err(e) => {
                events.push(Event::Error(e));
                return events;
            }
        }
    }
}

/// Parses the same bytes arriving in random chunks, as a connection would, using
/// `needed` to skip parse attempts that cannot succeed.
pub fn parse_split(p: &Parser, data: &[u8], rng: &mut Rng) -> Vec<Event> {
    let mut events = Vec::new();
    let mut start = 0;
    let mut have = 0;
    let mut wait_for: usize = 0;
    while have < data.len() {
        let chunk = 1 + rng.below(1 + (data.len() - have) as u64 / 2) as usize;
        have = (have + chunk).min(data.len());
        if have - start < wait_for {
            continue;
        }
        loop {
            let rest = &data[start..have];
            match p.parse(rest) {
                Ok(Parsed::Complete(op, used)) => {
                    check_op_invariants(p, &op, used, rest.len());
                    events.push(Event::Op(format!("{op:?}"), used));
                    start += used;
                }
                Ok(Parsed::Partial { needed }) => {
                    if let Some(n) = needed {
                        assert!(n > rest.len(), "needed {n} but {} available", rest.len());
                    }
                    wait_for = needed.unwrap_or(0);
                    break;
                }
                Err(e) => {
                    events.push(Event::Error(e));
                    return events;
                }
            }
        }
    }
    events
}

/// Target `parser`: arbitrary bytes, arbitrary split points.
pub fn check_parser(data: &[u8]) {
    let [config, seed, stream @ ..] = data else {
        return;
    };
    let p = parser_from(*config);
    let whole = parse_whole(&p, stream);
    let split = parse_split(&p, stream, &mut Rng::new(*seed as u64 + 1));
    assert_eq!(whole, split, "split parse differs from whole parse");
    // One byte at a time, the harshest split.
    let mut start = 0;
    let mut bytewise = Vec::new();
    for have in 1..=stream.len() {
        loop {
            match p.parse(&stream[start..have]) {
                Ok(Parsed::Complete(op, used)) => {
                    bytewise.push(Event::Op(format!("{op:?}"), used));
                    start += used;
                }
                Ok(Parsed::Partial { .. }) => break,
                Err(e) => {
                    bytewise.push(Event::Error(e));
                    break;
                }
            }
        }
        if matches!(bytewise.last(), Some(Event::Error(_))) {
            break;
        }
    }
    assert_eq!(
        whole, bytewise,
        "byte-by-byte parse differs from whole parse"
    );
}

/// Target `headers`: a block that parses survives HeaderMap and re-encoding unchanged.
pub fn check_headers(data: &[u8]) {
    // The one-pass owned parse accepts, refuses and reads exactly as the view does.
    assert_eq!(
        HeaderMap::parse(data),
        Headers::parse(data).map(|v| HeaderMap::from(&v)),
        "HeaderMap::parse differs from Headers::parse"
    );
    // The status alone (inbox and topic pulls) is the full parse's, whenever that one
    // accepts the block; it never panics on any other.
    let status = HeaderMap::parse_status(data);
    let Ok(view) = Headers::parse(data) else {
        return;
    };
    let status = status.expect("a block the full parse accepts has a status line");
    assert_eq!(status.status(), view.status());
    assert_eq!(status.description(), view.description());
    let map = HeaderMap::from(&view);
    assert_eq!(map.iter().count(), view.iter().count());
    for (name, _) in view.iter() {
        assert_eq!(view.get(name), map.get(name));
        assert_eq!(view.get_all(name).count(), map.get_all(name).count());
    }
    let block = map.to_bytes();
    assert_eq!(block.len(), map.encoded_len());
    let again = HeaderMap::parse(&block).unwrap_or_else(|e| {
        panic!(
            "re-encoded block rejected: {e:?} {:?}",
            String::from_utf8_lossy(&block)
        )
    });
    assert_eq!(again, map);
    // Re-encoding is a fixed point.
    assert_eq!(again.to_bytes(), block);
}

fn ref_tokens(s: &[u8]) -> Vec<&[u8]> {
    s.split(|&b| b == b'.').collect()
}

/// Straightforward reference: recursive token matching.
fn ref_matches(p: &[&[u8]], s: &[&[u8]]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(&b">"), Some(_)) if p.len() == 1 => true,
        (Some(pt), Some(st)) => (*pt == b"*" || pt == st) && ref_matches(&p[1..], &s[1..]),
        _ => false,
    }
}

fn ref_valid_pattern(s: &[u8]) -> bool {
    let t = ref_tokens(s);
    !s.is_empty()
        && t.iter()
            .all(|t| !t.is_empty() && !t.iter().any(|b| b" \t\r\n\x0c".contains(b)))
        && t.iter().rev().skip(1).all(|t| *t != b">")
}

fn ref_valid_subject(s: &[u8]) -> bool {
    ref_valid_pattern(s) && ref_tokens(s).iter().all(|t| *t != b"*" && *t != b">")
}

/// Target `subject`: validation and matching against the reference above.
pub fn check_subject(data: &[u8]) {
    let (pattern, subj) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, data),
    };
    assert_eq!(
        subject::validate_pattern(pattern).is_ok(),
        ref_valid_pattern(pattern)
    );
    assert_eq!(
        subject::validate_subject(subj).is_ok(),
        ref_valid_subject(subj)
    );
    let got = subject::matches(pattern, subj);
    if ref_valid_pattern(pattern) && ref_valid_subject(subj) {
        assert_eq!(got, ref_matches(&ref_tokens(pattern), &ref_tokens(subj)));
        // A permission pattern covers a literal target exactly when NATS would match it.
        if let (Ok(p), Ok(t)) = (std::str::from_utf8(pattern), std::str::from_utf8(subj)) {
            assert_eq!(
                amp_broker::broker::permissions::covers(p, t),
                got,
                "{p:?} {t:?}"
            );
        }
    }
    if ref_valid_subject(subj) {
        assert!(subject::matches(subj, subj), "a literal matches itself");
        assert!(subject::matches(b">", subj));
    }
}

/// Reads structured choices from fuzz bytes.
pub struct Source<'a>(pub &'a [u8]);

impl<'a> Source<'a> {
    pub fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = (self.byte() as usize).min(max).min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    /// A non-empty token of subject-ish characters.
    pub fn token(&mut self, out: &mut Vec<u8>) {
        const ALPHABET: &[u8] = b"abcXYZ019_-$*>.:/";
        let n = 1 + self.byte() as usize % 12;
        let start = out.len();
        for _ in 0..n {
            out.push(ALPHABET[self.byte() as usize % ALPHABET.len()]);
        }
        // A token never starts with '.' to keep it a valid field; dots inside are fine.
        if out[start] == b'.' {
            out[start] = b'a';
        }
    }
    pub fn text(&mut self, max: usize) -> String {
        const ALPHABET: &[u8] = b"abc XYZ-09:;'\"\t_/\xc3\xa9";
        let n = self.byte() as usize % (max + 1);
        let bytes: Vec<u8> = (0..n)
            .map(|_| ALPHABET[self.byte() as usize % ALPHABET.len()])
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Target `roundtrip`: ops built from fuzz bytes, encoded one after another, parse back to
/// the same ops, whole and split.
pub fn check_roundtrip(data: &[u8]) {
    let mut src = Source(data);
    let role = if src.byte() & 1 == 0 {
        Role::Client
    } else {
        Role::Server
    };
    let p = Parser::new(role);
    let mut wire = Vec::new();
    let mut expected = Vec::new();
    let mut scratch: Vec<Vec<u8>> = Vec::new();
    for _ in 0..(1 + src.byte() % 8) {
        let kind = src.byte() % 7;
        let mut subj = Vec::new();
        src.token(&mut subj);
        let mut reply = Vec::new();
        src.token(&mut reply);
        let has_reply = src.byte() & 1 == 1;
        let payload = src.bytes(300).to_vec();
        let mut map = HeaderMap::new();
        if src.byte() & 1 == 1 {
            let status = src.byte() as u16 * 4;
            let description = src.text(20);
            if let Ok(m) = HeaderMap::with_status(status, &description) {
                map = m;
            }
        }
        for _ in 0..src.byte() % 4 {
            let mut name = Vec::new();
            src.token(&mut name);
            let name = String::from_utf8_lossy(&name).replace(':', "-");
            let value = src.text(16);
            let _ = map.append(&name, &value);
        }
        let headers = map.to_bytes();
        let sid = (src.byte() as u64 * 7).to_string().into_bytes();
        let reply_opt = has_reply.then_some(&reply[..]);
        let start = wire.len();
        match (role, kind) {
            (_, 0) => encode::ping(&mut wire),
            (_, 1) => encode::pong(&mut wire),
            (Role::Client, 2) => encode::msg(&mut wire, &subj, &sid, reply_opt, &payload),
            (Role::Client, 3) => {
                encode::hmsg(&mut wire, &subj, &sid, reply_opt, &headers, &payload)
            }
            (Role::Client, 4) => encode::ok(&mut wire),
            (Role::Client, _) => encode::err(&mut wire, src.text(30).trim().trim_matches('\'')),
            (Role::Server, 2) => encode::publish(&mut wire, &subj, reply_opt, &payload),
            (Role::Server, 3) => encode::hpublish(&mut wire, &subj, reply_opt, &headers, &payload),
            (Role::Server, 4) => {
                encode::subscribe(&mut wire, &subj, has_reply.then_some(&reply[..]), &sid)
            }
            (Role::Server, _) => {
                let max = src.byte() as u64;
                encode::unsubscribe(&mut wire, &sid, (max > 0).then_some(max))
            }
        }
        scratch.push(wire[start..].to_vec());
        expected.push(wire.len() - start);
        if matches!((role, kind), (_, 3)) {
            // The header block in the op must parse to the map we encoded.
            let again = HeaderMap::parse(&headers).expect("encoded block parses");
            assert_eq!(again, map);
        }
    }
    let whole = parse_whole(&p, &wire);
    assert_eq!(
        whole.len(),
        expected.len(),
        "every encoded op parses: {whole:?}"
    );
    for (event, (len, bytes)) in whole.iter().zip(expected.iter().zip(&scratch)) {
        match event {
            Event::Op(_, used) => assert_eq!(used, len, "op {:?}", String::from_utf8_lossy(bytes)),
            Event::Error(e) => panic!("{e:?} parsing {:?}", String::from_utf8_lossy(bytes)),
        }
    }
    let split = parse_split(&p, &wire, &mut Rng::new(data.len() as u64));
    assert_eq!(whole, split);
}

/// The `$JS.ACK` subject as read token by token with `str::split` and `str::parse`: the
/// reference of the one-pass reading (SSE2 dots, eight digits at a time).
#[allow(clippy::type_complexity)]
fn ref_ack_metadata(s: &str) -> Option<(Option<&str>, Option<&str>, &str, &str, [u64; 5])> {
    let t: Vec<&str> = s.split('.').collect();
    if t.len() < 2 || t[0] != "$JS" || t[1] != "ACK" {
        return None;
    }
    let (domain, hash, rest) = match t.len() {
        9 => (None, None, &t[2..9]),
        n if n >= 11 => (
            Some(t[2]).filter(|d| *d != "_" && !d.is_empty()),
            Some(t[3]),
            &t[4..11],
        ),
        _ => return None,
    };
    if rest[0].is_empty() || rest[1].is_empty() {
        return None;
    }
    let mut n = [0u64; 5];
    for (slot, text) in n.iter_mut().zip(&rest[2..]) {
        // `parse` also takes a leading `+`, which the subject must not have.
        if !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *slot = text.parse().ok()?;
    }
    Some((domain, hash, rest[0], rest[1], n))
}

/// Target `jetstream_reply`: bytes from a NATS peer read as a delivery's `$JS.ACK` subject
/// and as a PubAck, each fast reader held to a reference: the subject to `str::split`,
/// the PubAck to `serde_json::Value` (whatever the plain reader takes, serde reads the
/// same way).
pub fn check_jetstream_reply(data: &[u8]) {
    use amp_broker::jetstream::ack::AckMetadata;
    use amp_broker::jetstream::publish::{parse_pub_ack, pub_ack_seq};
    if let Ok(text) = std::str::from_utf8(data) {
        let got = AckMetadata::parse(text).ok().map(|m| {
            (
                m.domain,
                m.account_hash,
                m.stream,
                m.consumer,
                [
                    m.delivered,
                    m.stream_sequence,
                    m.consumer_sequence,
                    m.timestamp_nanos,
                    m.pending,
                ],
            )
        });
        assert_eq!(got, ref_ack_metadata(text), "ack subject {text:?}");
    }
    let seq = pub_ack_seq(None, data);
    let full = parse_pub_ack(None, data);
    assert_eq!(
        seq,
        full.clone().map(|a| (a.seq, a.duplicate)),
        "pub_ack_seq and parse_pub_ack differ"
    );
    // Only where `Value` reads the reply: the general parse skips members it does not
    // know without checking their strings (invalid UTF-8 there is taken), which the plain
    // reader never does (its form has no other member).
    if let (Ok(ack), Ok(v)) = (full, serde_json::from_slice::<serde_json::Value>(data)) {
        assert!(v.get("error").is_none_or(|e| e.is_null()), "{v}");
        assert_eq!(v.get("seq").and_then(|s| s.as_u64()), Some(ack.seq), "{v}");
        assert_eq!(
            v.get("stream").and_then(|s| s.as_str()),
            Some(ack.stream.as_str())
        );
        assert_eq!(
            v.get("domain").and_then(|s| s.as_str()),
            ack.domain.as_deref()
        );
        let dup = v
            .get("duplicate")
            .and_then(|d| d.as_bool())
            .unwrap_or(false);
        assert_eq!(dup, ack.duplicate, "{v}");
    }
}
