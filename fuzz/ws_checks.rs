// Checks for the transport and frame fuzz targets (fuzz/fuzz_targets/ws_stream.rs,
// http_request.rs, amp_frame.rs), shared with the replay in tests/fuzz_ws_regressions.rs.
// Each panics when a property does not hold; no input may make the code under test panic.

#![allow(dead_code)]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use amp_broker::amp::FrameValidator;
use amp_broker::ws::{ConnEvent, Connection, HttpHost, WsConfig};

struct Host;

impl HttpHost for Host {
    fn health(&self) -> Result<(), String> {
        Ok(())
    }
    fn metrics(&self, out: &mut String) {
        out.push_str("amp_x 1\n");
    }
}

const UPGRADE: &[u8] =
    b"GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";

/// xorshift64*: split points from a seed without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
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
        read_buffer_size: 1 + usize::from(byte >> 4) * 64,
        ..WsConfig::default()
    }
}

/// Feeds `input` whole or in random pieces; the events and bytes written.
fn run(cfg: WsConfig, input: &[u8], split_seed: Option<u64>) -> (Vec<ConnEvent>, Vec<u8>) {
    let t0 = Instant::now();
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
        let (now, later) = rest.split_at(n);
        c.handle_input(now, t0, &Host);
        rest = later;
        while let Some(e) = c.poll_event() {
            events.push(e);
        }
        out.extend_from_slice(c.output());
        let len = c.output().len();
        c.consume_output(len);
    }
    // Timers never panic either, whatever state the input left.
    c.handle_timeout(t0 + Duration::from_secs(3600));
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
/// is JSON, carries a spec code, and echoes a string `id` as `re`.
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
    let _ = validator().decode_hello(text);
}
