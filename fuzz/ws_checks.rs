// Checks for the transport and frame fuzz targets (fuzz/fuzz_targets/ws_stream.rs,
// http_request.rs, amp_frame.rs), shared with the replay in tests/fuzz_ws_regressions.rs.
// Each panics when a property does not hold; no input may make the code under test panic.

#![allow(dead_code)]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use amp_broker::amp::FrameValidator;
use amp_broker::ws::{ConnEvent, Connection, HttpHost, WsConfig};

pub struct Host;

impl HttpHost for Host {
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn metrics(&self, out: &mut String) {
        out.push_str("amp_x 1\n");
    }
}

pub const UPGRADE: &[u8] =
    b"GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";

/// xorshift64*: split points from a seed without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        if n == 0 {
            0
        } else {
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n as u64) as usize
        }
    }
}

fn config(byte: u8) -> WsConfig {
    WsConfig {
        max_frame: 16 + usize::from(byte) * 64,
        max_head_bytes: 256 + usize::from(byte) * 32,
        max_frames_per_s: 1 + u32::from(byte & 0x0F) * 40,
        frame_burst: 1 + u32::from(byte >> 5) * 12,
        ..WsConfig::default()
    }
}

/// Decodes held input as the shell would, with a virtual clock that jumps to each
/// resume time.
fn catch_up(c: &mut Connection, now: &mut Instant) {
    while c.input_held() {
        *now = (*now).max(c.resume_at());
        assert!(
            c.resume_input(*now),
            "held input refused at its resume time"
        );
    }
}

/// Feeds `input` whole or in random pieces; the events and bytes written.
fn run(cfg: WsConfig, input: &[u8], split_seed: Option<u64>) -> (Vec<ConnEvent>, Vec<u8>) {
    let t0 = Instant::now();
    let mut now = t0;
    let mut c = Connection::new(t0, cfg);
    let mut events = Vec::new();
    let mut out = Vec::new();
    let mut rest = input;
    let mut rng = split_seed.map(|s| Rng(s | 1));
    while !rest.is_empty() {
        let n = match rng.as_mut() {
            Some(r) => 1 + r.below(rest.len().min(300)),
            None => rest.len(),
        };
        let (piece, later) = rest.split_at(n);
        c.handle_input(piece, now, &Host);
        catch_up(&mut c, &mut now);
        rest = later;
        while let Some(e) = c.poll_event() {
            events.push(e);
        }
        out.extend_from_slice(c.output());
        let len = c.output().len();
        c.consume_output(len);
    }
    // Timers never panic either, whatever state the input left.
    c.handle_timeout(now + Duration::from_secs(3600));
    while let Some(e) = c.poll_event() {
        events.push(e);
    }
    (events, out)
}

fn check_session_events(events: &[ConnEvent], max_frame: usize) {
    let mut opened = false;
    let mut closed = false;
    for e in events {
        match e {
            ConnEvent::Opened { .. } => {
                assert!(!opened, "opened twice");
                opened = true;
            }
            ConnEvent::Text(t) => {
                assert!(opened && !closed, "text outside the session");
                assert!(t.len() <= max_frame, "text over max_frame");
            }
            ConnEvent::Closed { .. } => {
                assert!(opened && !closed, "closed twice or before opening");
                closed = true;
            }
            ConnEvent::Http { .. } => panic!("HTTP response on an upgraded connection"),
        }
    }
}

/// First byte: limits; second: split seed; the rest: client bytes after the upgrade.
/// Whole or split, the same events and the same bytes come out.
pub fn check_ws_stream(data: &[u8]) {
    let [cfg_byte, seed, body @ ..] = data else {
        return;
    };
    let cfg = config(*cfg_byte);
    let mut input = UPGRADE.to_vec();
    input.extend_from_slice(body);
    let whole = run(cfg, &input, None);
    check_session_events(&whole.0, cfg.max_frame);
    let split = run(cfg, &input, Some(u64::from(*seed) + 1));
    assert_eq!(whole, split, "splitting the input changed the outcome");
}

/// A masked client frame.
fn client_frame(out: &mut Vec<u8>, first: u8, payload_len: usize, fill: u8) {
    out.push(first);
    if payload_len < 126 {
        out.push(0x80 | payload_len as u8);
    } else if payload_len <= 0xFFFF {
        out.push(0x80 | 126);
        out.extend_from_slice(&(payload_len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(payload_len as u64).to_be_bytes());
    }
    let mask = [0x5a, 0x11, 0xc3, 0x7e];
    out.extend_from_slice(&mask);
    out.extend((0..payload_len).map(|i| fill ^ mask[i % 4]));
}

/// The bytes as a program for a client that never reads: pings, pongs, text frames and
/// fragments of arbitrary sizes, replies queued by the embedder, and time passing; the
/// wire bytes arrive in pieces of arbitrary sizes. Whatever the program, the queued
/// output never passes the bound, held input stays bounded, and no text comes after
/// the session closed.
pub fn check_ws_never_read(data: &[u8]) {
    let [a, b, seed, program @ ..] = data else {
        return;
    };
    let cfg = WsConfig {
        max_outbound_bytes: 1024 + usize::from(*a) * 97,
        max_frame: 64 + usize::from(*b) * 64,
        max_frames_per_s: 1 + u32::from(*b & 0x1F) * 100,
        frame_burst: 1 + u32::from(*a >> 3) * 8,
        ..WsConfig::default()
    };
    let bound = cfg.max_outbound_bytes;
    let input_bound = 8 * cfg.max_frame + 2 * 4096 + cfg.max_head_bytes;
    let t0 = Instant::now();
    let mut now = t0;
    let mut c = Connection::new(t0, cfg);
    let mut rng = Rng(u64::from(*seed) << 8 | 1);
    let mut closed = false;
    let check = |c: &mut Connection, closed: &mut bool| {
        assert!(
            c.queued_bytes() <= bound,
            "{} bytes queued, bound {bound}",
            c.queued_bytes()
        );
        assert!(
            c.input_bytes() <= input_bound,
            "{} bytes of input held",
            c.input_bytes()
        );
        while let Some(e) = c.poll_event() {
            match e {
                ConnEvent::Text(_) => assert!(!*closed, "text after the close"),
                ConnEvent::Closed { .. } => *closed = true,
                _ => {}
            }
        }
    };
    let mut feed =
        |c: &mut Connection, wire: &mut Vec<u8>, now: &mut Instant, closed: &mut bool| {
            let mut rest = wire.as_slice();
            while !rest.is_empty() {
                let n = 1 + rng.below(rest.len().min(4096));
                let (piece, later) = rest.split_at(n);
                c.handle_input(piece, *now, &Host);
                check(c, closed);
                catch_up(c, now);
                check(c, closed);
                rest = later;
            }
            wire.clear();
        };
    let mut wire = UPGRADE.to_vec();
    let mut ops = program.iter().copied();
    while let Some(op) = ops.next() {
        let arg = usize::from(ops.next().unwrap_or(0));
        match op % 8 {
            0 => client_frame(&mut wire, 0x89, arg % 126, op),
            1 => client_frame(&mut wire, 0x81, arg * 37 % (cfg.max_frame + 64), b'a'),
            2 => client_frame(&mut wire, 0x01, arg, b'b'),
            3 => client_frame(&mut wire, 0x00, arg, b'c'),
            4 => client_frame(&mut wire, 0x80, arg, b'd'),
            5 => client_frame(&mut wire, 0x8A, arg % 126, op),
            6 => {
                feed(&mut c, &mut wire, &mut now, &mut closed);
                let _ = c.send_text(&"r".repeat(arg * 13), now);
                check(&mut c, &mut closed);
            }
            _ => {
                feed(&mut c, &mut wire, &mut now, &mut closed);
                now += Duration::from_millis(arg as u64 * 40);
                c.handle_timeout(now);
                check(&mut c, &mut closed);
            }
        }
    }
    feed(&mut c, &mut wire, &mut now, &mut closed);
    c.handle_timeout(now + Duration::from_secs(3600));
    check(&mut c, &mut closed);
}

/// Any bytes as a request: either nothing yet, or one HTTP/1.1 response (or an upgrade).
pub fn check_http_request(data: &[u8]) {
    let [cfg_byte, seed, body @ ..] = data else {
        return;
    };
    let cfg = config(*cfg_byte);
    let (events, out) = run(cfg, body, Some(u64::from(*seed) + 1));
    if out.is_empty() {
        assert!(events.is_empty(), "events without output: {events:?}");
        return;
    }
    assert!(
        out.starts_with(b"HTTP/1.1 "),
        "not a response: {:?}",
        String::from_utf8_lossy(&out)
    );
    match events.first() {
        Some(ConnEvent::Http { status }) => {
            assert!(
                [200, 400, 404, 426, 431].contains(status),
                "status {status}"
            );
            assert_eq!(events.len(), 1);
        }
        Some(ConnEvent::Opened { .. }) => check_session_events(&events, cfg.max_frame),
        other => panic!("output without a response event: {other:?}"),
    }
    let (whole_events, whole_out) = run(cfg, body, None);
    assert_eq!(
        (whole_events, whole_out),
        (events, out),
        "splitting the request changed the outcome"
    );
}

fn validator() -> &'static FrameValidator {
    static V: OnceLock<FrameValidator> = OnceLock::new();
    V.get_or_init(|| FrameValidator::new().expect("embedded schema compiles"))
}

/// Any text as a client frame: a typed frame of the op it names, or an error reply that
/// is JSON, carries a spec code, and echoes a string `id` as `re`; and the same outcome
/// with or without the fast path.
pub fn check_amp_frame(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let value: Option<serde_json::Value> = serde_json::from_str(text).ok();
    let id = value
        .as_ref()
        .and_then(|v| v.get("id"))
        .and_then(|v| v.as_str());
    match validator().decode(text) {
        Ok(frame) => {
            let op = value
                .as_ref()
                .and_then(|v| v.get("op"))
                .and_then(|v| v.as_str());
            assert_eq!(Some(frame.op().as_str()), op);
            assert_eq!(frame.id(), id);
        }
        Err(rejected) => {
            let reply: serde_json::Value =
                serde_json::from_str(&rejected.reply()).expect("error reply is JSON");
            assert_eq!(reply["op"], "error");
            let code = reply["code"].as_str().unwrap_or_default();
            assert!(
                ["bad_frame", "schema", "internal"].contains(&code),
                "code {code}"
            );
            assert_eq!(reply.get("re").and_then(|v| v.as_str()), id);
            if let Some(path) = reply.get("path").and_then(|p| p.as_str()) {
                assert!(path.is_empty() || path.starts_with('/'), "path {path:?}");
            }
        }
    }
    // The fast path for common frames decides exactly as the schema does.
    assert_eq!(
        validator().decode(text),
        validator().decode_full(text),
        "fast path and schema differ"
    );
    let _ = validator().decode_hello(text);
    // The quick JSON recogniser only ever takes what serde takes.
    if amp_broker::amp::quick_json::certainly_strict(text) {
        assert!(value.is_some(), "quick_json took what serde refuses");
    }
}
