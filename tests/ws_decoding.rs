//! The transport's own frame decoder against tungstenite's server side: the same
//! generated client streams (text messages whole and in fragments split inside
//! characters, pings and pongs between fragments, closes, and every kind of frame the
//! broker refuses) give the same messages and end with the same close code.

use std::io::{self, Read, Write};
use std::time::Instant;

use amp_broker::ws::{ConnEvent, Connection, WsConfig};
use tungstenite::Message;
use tungstenite::error::{CapacityError, Error as WsError};
use tungstenite::protocol::{Role, WebSocket, WebSocketConfig};

#[path = "../fuzz/ws_checks.rs"]
mod ws_checks;

use ws_checks::{Host, Rng, UPGRADE};

fn chance(rng: &mut Rng, percent: usize) -> bool {
    rng.below(100) < percent
}

/// A client frame: `first` byte as given, the length in the form asked (`wide` writes
/// a short length in the 16- or 64-bit form, which RFC 6455 forbids but neither side
/// checks), masked unless `unmasked`.
fn frame(out: &mut Vec<u8>, first: u8, payload: &[u8], wide: u8, unmasked: bool, mask: [u8; 4]) {
    out.push(first);
    let m = if unmasked { 0 } else { 0x80 };
    let len = payload.len();
    if len < 126 && wide == 0 {
        out.push(m | len as u8);
    } else if len <= 0xFFFF && wide < 2 {
        out.push(m | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(m | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    if unmasked {
        out.extend_from_slice(payload);
    } else {
        out.extend_from_slice(&mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    }
}

const WORDS: [&str; 6] = [
    "a",
    "hello",
    "é",
    "日本語",
    "🦀",
    "{\"op\":\"ping\",\"id\":\"1\"}",
];

/// A stream of frames: mostly valid traffic, and with some chance one frame the broker
/// refuses, after which the stream may go on (both sides must stop reading there).
fn stream(rng: &mut Rng, max: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mask = [rng.below(256) as u8, 0x37, rng.below(256) as u8, 0xc1];
    for _ in 0..1 + rng.below(12) {
        let wide = if chance(rng, 10) {
            1 + rng.below(2) as u8
        } else {
            0
        };
        match rng.below(12) {
            0..=4 => {
                // A text message, long ones included, whole or in fragments split at any
                // byte (inside characters too), pings and pongs between them.
                let mut text = String::new();
                let words = if chance(rng, 10) {
                    3000
                } else {
                    1 + rng.below(20)
                };
                for _ in 0..words {
                    text.push_str(WORDS[rng.below(WORDS.len())]);
                }
                let bytes = text.as_bytes();
                let mut cuts: Vec<usize> =
                    (0..rng.below(4)).map(|_| rng.below(bytes.len())).collect();
                cuts.sort_unstable();
                let mut at = 0;
                let pieces = cuts.len() + 1;
                for (i, end) in cuts.into_iter().chain([bytes.len()]).enumerate() {
                    let opcode = if i == 0 { 0x1 } else { 0x0 };
                    let fin = if i + 1 == pieces { 0x80 } else { 0 };
                    frame(&mut out, fin | opcode, &bytes[at..end], wide, false, mask);
                    at = end;
                    if fin == 0 && chance(rng, 30) {
                        let control = if chance(rng, 50) { 0x89 } else { 0x8A };
                        frame(&mut out, control, b"beat", 0, false, mask);
                    }
                }
            }
            5 => frame(&mut out, 0x89, &vec![b'p'; rng.below(126)], 0, false, mask),
            6 => frame(&mut out, 0x8A, b"", 0, false, mask),
            7 => {
                let reason = WORDS[rng.below(WORDS.len())];
                let code = [1000u16, 1001, 1003, 1011, 3000, 4999][rng.below(6)];
                let mut payload = code.to_be_bytes().to_vec();
                if chance(rng, 50) {
                    payload.extend_from_slice(reason.as_bytes());
                }
                if chance(rng, 20) {
                    payload.clear();
                }
                frame(&mut out, 0x88, &payload, 0, false, mask);
            }
            _ => {
                // One frame the broker refuses.
                match rng.below(12) {
                    0 => frame(&mut out, 0x82, b"bin", wide, false, mask),
                    1 => frame(&mut out, 0x81, b"plain", 0, true, mask),
                    2 => frame(&mut out, 0xC1, b"rsv", 0, false, mask),
                    3 => frame(
                        &mut out,
                        0x80 | (3 + rng.below(5) as u8),
                        b"op",
                        0,
                        false,
                        mask,
                    ),
                    4 => frame(
                        &mut out,
                        0x80 | (0xB + rng.below(5) as u8),
                        b"",
                        0,
                        false,
                        mask,
                    ),
                    5 => frame(&mut out, 0x09, b"frag", 0, false, mask),
                    6 => frame(&mut out, 0x89, &[b'p'; 126], 0, false, mask),
                    7 => frame(&mut out, 0x80, b"cont", 0, false, mask),
                    8 => {
                        frame(&mut out, 0x01, b"open", 0, false, mask);
                        frame(&mut out, 0x81, b"again", 0, false, mask);
                    }
                    9 if chance(rng, 50) => {
                        frame(&mut out, 0x81, &vec![b'x'; max + 1], wide, false, mask)
                    }
                    9 => {
                        // Fragments within the limit, a message over it.
                        let half = vec![b'x'; max / 2 + 1];
                        frame(&mut out, 0x01, &half, wide, false, mask);
                        frame(&mut out, 0x80, &half, wide, false, mask);
                    }
                    10 => frame(&mut out, 0x81, b"ok\xff\xfe", 0, false, mask),
                    _ => frame(&mut out, 0x88, b"\x03", 0, false, mask),
                }
            }
        }
    }
    out
}

/// What a side made of a stream: its messages, and the close code it ended with
/// (`None`: the stream ran out with the session open).
type Outcome = (Vec<String>, Option<u16>);

fn ours(input: &[u8], max: usize, rng: &mut Rng) -> Outcome {
    let now = Instant::now();
    let cfg = WsConfig {
        max_frame: max,
        max_frames_per_s: 1_000_000,
        frame_burst: 1_000_000,
        ..WsConfig::default()
    };
    let mut c = Connection::new(now, cfg);
    c.handle_input(UPGRADE, now, &Host);
    let mut rest = input;
    while !rest.is_empty() {
        let n = 1 + rng.below(rest.len().min(700));
        let (piece, later) = rest.split_at(n);
        c.handle_input(piece, now, &Host);
        while c.input_held() {
            assert!(c.resume_input(c.resume_at().max(now)));
        }
        rest = later;
    }
    let (mut texts, mut code) = (Vec::new(), None);
    while let Some(e) = c.poll_event() {
        match e {
            ConnEvent::Text(t) => texts.push(t),
            ConnEvent::Closed { code: c, .. } => code = code.or(Some(c)),
            ConnEvent::Opened { .. } | ConnEvent::Http { .. } => {}
        }
    }
    (texts, code)
}

/// The client's bytes to read; what is written goes nowhere.
struct Stream<'a>(&'a [u8]);

impl Read for Stream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Stream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn theirs(input: &[u8], max: usize) -> Outcome {
    let config = WebSocketConfig::default()
        .max_message_size(Some(max))
        .max_frame_size(Some(max));
    let mut ws = WebSocket::from_raw_socket(Stream(input), Role::Server, Some(config));
    let mut texts = Vec::new();
    loop {
        let code = match ws.read() {
            Ok(Message::Text(t)) => {
                texts.push(t.as_str().to_owned());
                continue;
            }
            Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => continue,
            Ok(Message::Binary(_)) => Some(1003),
            Ok(Message::Close(Some(f))) => Some(u16::from(f.code)),
            Ok(Message::Close(None)) => Some(1005),
            Err(WsError::Protocol(
                tungstenite::error::ProtocolError::ResetWithoutClosingHandshake,
            )) => None,
            Err(WsError::Capacity(CapacityError::MessageTooLong { .. })) => Some(1009),
            Err(WsError::Utf8(_)) => Some(1007),
            Err(WsError::Protocol(_) | WsError::Capacity(_)) => Some(1002),
            Err(e) => panic!("unexpected tungstenite error {e}"),
        };
        return (texts, code);
    }
}

#[test]
fn generated_client_streams_read_the_same_by_both_decoders() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut endings = std::collections::BTreeMap::new();
    for round in 0..3000 {
        let max = if round % 3 == 0 { 300 } else { 1 << 20 };
        let input = stream(&mut rng, max);
        let want = theirs(&input, max);
        let got = ours(&input, max, &mut rng);
        assert_eq!(got, want, "round {round}, max {max}, input {input:02x?}");
        *endings.entry(want.1).or_insert(0) += 1;
    }
    // The streams reach every ending: open, peer closes, and each refusal.
    for code in [
        None,
        Some(1000),
        Some(1005),
        Some(1002),
        Some(1003),
        Some(1007),
        Some(1009),
    ] {
        assert!(endings.get(&code).is_some_and(|&n| n >= 20), "{endings:?}");
    }
}
