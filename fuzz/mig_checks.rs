// The MIG request check of the `mig_request` fuzz target (fuzz/fuzz_targets/mig_request.rs),
// shared with the replay in tests/fuzz_mig_regressions.rs: a broker with MIG enabled is
// sent MIG requests (subject suffix, NATS headers and body from the fuzzer) as the server
// delivers them, on the core's request subscriptions, and its JetStream requests are
// answered with fuzzer bytes, canned API errors or the in-process JetStream model. Nothing
// may panic, and every answer the core writes to a caller is JSON within the server's
// `max_payload` (checked as the core writes it, in `broker_checks`).
//
// The input is a program of one-byte operations with their arguments:
//   0 k c x n m ..  a raw request: subject PREFIXES[k] + n suffix bytes, credential c,
//                   x bytes of extra header lines, then m * 4 body bytes
//   1 k c n ..      a canned request TEMPLATES[k] (header filled in: tenant, a fresh
//                   message id, the current time, a deadline), with n bytes of fuzzer
//                   text spliced in, under credential c (Ann's signs what is sent)
//   2 n ..          a reply with an n-byte payload to the newest request the core made
//   3 k e           an API error, 503 or empty answer to the request k picks
//   4 t             time passes: t * 37 ms
//   5 t             time passes: t s
//   6               the JetStream model takes the NATS connection over (or restarts),
//                   and three seconds pass
//   7 n ..          n raw server bytes to the NATS connection
//
// A reply subject names its caller, as a MIG caller's inbox must (`_INBOX_acme_<name>.n`).

#![allow(dead_code)]

use std::time::Duration;

use amp_broker::broker::config::Config;
use amp_broker::keygen::token_sha256;
use amp_broker::nkeys::{KeyKind, KeyPair};

use crate::broker_checks::{Cursor, World, splice};

/// The wall clock the core starts on (`broker_checks`' `Clock`), for signed timestamps.
const WALL_START_MS: i64 = 1_800_000_000_000;
const PREFIXES: &[&str] = &[
    "mig.v0_1.acme.hello",
    "mig.v0_1.acme.discover",
    "mig.v0_1.acme.invoke.",
    "mig.v0_1.acme.control.",
    "mig.v0_1.acme.events.",
    "mig.v0_1.acme.",
];

/// (subject, body): `@H` becomes the header's members, `@T` the fuzzer's text.
const TEMPLATES: &[(&str, &str)] = &[
    (
        "mig.v0_1.acme.hello",
        r#"{"header":{@H},"supported_versions":["@T","0.1"],"requested_bindings":["nats"]}"#,
    ),
    (
        "mig.v0_1.acme.discover",
        r#"{"header":{@H},"query":"@T","include_schema_refs":true,"include_qos":true}"#,
    ),
    (
        "mig.v0_1.acme.control.heartbeat",
        r#"{"header":{@H},"interval_ms":1000,"x":"@T"}"#,
    ),
    (
        "mig.v0_1.acme.invoke.infer",
        r#"{"header":{@H},"payload":{"t":"@T"}}"#,
    ),
    (
        "mig.v0_1.acme.invoke.infer",
        r#"{"header":{@H},"payload":{},"stream_preference":"server_stream","x":"@T"}"#,
    ),
    (
        "mig.v0_1.acme.events.orders.eu",
        r#"{"header":{@H},"payload":{"t":"@T"}}"#,
    ),
    (
        "mig.v0_1.acme.control.subscribe",
        r#"{"header":{@H},"topic":"orders.@T","resume_cursor":"0","max_inflight":4}"#,
    ),
    (
        "mig.v0_1.acme.control.cancel.m1",
        r#"{"header":{@H},"target_message_id":"m1","reason":"@T"}"#,
    ),
];

fn ann() -> KeyPair {
    KeyPair::from_raw_seed(KeyKind::User, &[9; 32])
}

fn config() -> Config {
    let perms = serde_json::json!({"submit": ["infer"], "publish": ["orders.>"],
        "subscribe": ["orders.>"]});
    let c = serde_json::json!({"mig": {"enabled": true},
        "limits": {"max_frames_per_s": 1_000_000},
        "namespaces": {"acme": {
            "participants": {
                "alice": {"token_sha256": token_sha256("alice-token"), "permissions": perms},
                "ann": {"nkey": ann().public_key(), "permissions": perms}},
            "jobs": {"infer": {"lease_s": 5, "offer_ms": 500, "max_attempts": 2,
                "mig": {"id": "infer", "modes": ["unary", "server_stream"]}}}}}});
    Config::parse(c.to_string().as_bytes()).expect("fuzz configuration")
}

/// base64url without padding, as an NKey signature is presented.
fn base64url(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(char::from(A[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

struct Mig {
    w: World,
    /// Requests sent, for fresh message ids and reply subjects.
    n: u64,
}

impl Mig {
    fn timestamp(&self, start: std::time::Instant) -> String {
        let ms = self.w.now.saturating_duration_since(start).as_millis();
        amp_broker::rfc3339::format_millis(WALL_START_MS + i64::try_from(ms).unwrap_or(0))
    }

    /// A request as the server delivers it on the core's subscription of `subject`
    /// (none matching: the server would not deliver it).
    fn request(&mut self, subject: &str, credential: u8, extra: &[u8], body: &[u8]) {
        self.n += 1;
        let n = self.n;
        let Some(sid) = self.w.reply_sid(subject) else {
            return;
        };
        let (auth, name) = match credential % 6 {
            0 => ("Bearer alice-token".to_string(), "alice".to_string()),
            1 => ("Bearer wrong".to_string(), format!("m{n}")),
            2 => {
                // Ann signs the id and time the body carries (read the way the core reads
                // them), or nothing useful when it has none.
                let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
                let id = v["header"]["message_id"].as_str().unwrap_or_default();
                let ts = v["header"]["timestamp"].as_str().unwrap_or_default();
                let sig = ann().sign(format!("{id}\n{ts}\n{subject}").as_bytes());
                let auth = format!("NKey {} {}", ann().public_key(), base64url(&sig));
                (auth, "ann".to_string())
            }
            3 => ("Bearer alice-token".to_string(), format!("m{n}")),
            4 => (format!("NKey {} x", ann().public_key()), "ann".to_string()),
            _ => (String::new(), format!("m{n}")),
        };
        let reply = format!("_INBOX_acme_{name}.{n}");
        let mut headers = b"NATS/1.0\r\n".to_vec();
        if !auth.is_empty() {
            headers.extend_from_slice(format!("Authorization: {auth}\r\n").as_bytes());
        }
        headers.extend_from_slice(extra);
        headers.extend_from_slice(b"\r\n");
        self.w
            .deliver_full(subject, &sid, Some(&reply), Some(&headers), body);
    }
}

pub fn check_mig(data: &[u8]) {
    run(data);
}

/// Runs a program; the answers MIG callers were sent, newest last (at most 64).
pub fn run(data: &[u8]) -> Vec<serde_json::Value> {
    let w = World::with_config(config());
    let start = w.now;
    let mut m = Mig { w, n: 0 };
    let mut c = Cursor(data);
    let mut steps = 0;
    while let Some(op) = c.byte() {
        steps += 1;
        if steps > 200 {
            break;
        }
        match op % 8 {
            0 => {
                let k = usize::from(c.byte().unwrap_or(0)) % PREFIXES.len();
                let credential = c.byte().unwrap_or(0);
                let x = usize::from(c.byte().unwrap_or(0));
                let n = usize::from(c.byte().unwrap_or(0));
                // What a server delivers has no white space in its subject.
                let suffix: String = String::from_utf8_lossy(c.take(n))
                    .chars()
                    .filter(|ch| !ch.is_whitespace())
                    .collect();
                let extra = c.take(x).to_vec();
                let len = usize::from(c.byte().unwrap_or(0)) * 4;
                let body = c.take(len).to_vec();
                let subject = format!("{}{suffix}", PREFIXES[k]);
                m.request(&subject, credential, &extra, &body);
            }
            1 => {
                let (subject, template) =
                    TEMPLATES[usize::from(c.byte().unwrap_or(0)) % TEMPLATES.len()];
                let credential = c.byte().unwrap_or(0);
                let n = usize::from(c.byte().unwrap_or(0) % 64);
                let header = format!(
                    r#""tenant_id":"acme","message_id":"m{}","timestamp":"{}","deadline_ms":3000"#,
                    m.n + 1,
                    m.timestamp(start)
                );
                let text = String::from_utf8_lossy(&splice("{}", c.take(n))).into_owned();
                let body = template.replace("@H", &header).replace("@T", &text);
                m.request(subject, credential, b"", body.as_bytes());
            }
            2 => {
                let n = usize::from(c.byte().unwrap_or(0));
                let payload = c.take(n).to_vec();
                if let Some(reply) = m.w.replies.pop()
                    && let Some(sid) = m.w.reply_sid(&reply)
                {
                    m.w.deliver_full(&reply, &sid, None, None, &payload);
                }
            }
            3 => m.w.request_error(&mut c),
            4 => {
                let t = u64::from(c.byte().unwrap_or(0));
                m.w.advance(Duration::from_millis(t * 37));
            }
            5 => {
                let t = u64::from(c.byte().unwrap_or(0));
                m.w.advance(Duration::from_secs(t));
            }
            6 => {
                // Long enough for the core to reconnect to it and subscribe again.
                m.w.model_takes_over();
                m.w.settle();
                m.w.advance(Duration::from_secs(3));
            }
            _ => {
                let n = usize::from(c.byte().unwrap_or(0));
                let bytes = c.take(n);
                m.w.nats.receive(bytes, m.w.now);
            }
        }
        m.w.settle();
    }
    // Every timer may fire (deadlines, retries), whatever state the program left.
    m.w.advance(Duration::from_secs(120));
    m.w.mig_answers
}
