//! JetStream publish-with-ack throughput, 256 publishes in flight, against a same-run
//! baseline: the same PUBs (each with its own reply subject) pre-encoded and written raw
//! to the same nats-server over a plain TCP socket, reading the PubAcks with the protocol
//! parser and keeping the same 256 in flight. Both count a publish done when its PubAck
//! arrives.
//!
//!     cargo bench --bench jetstream_publish        (JS_BENCH_MSGS, JS_BENCH_SIZE)
//!
//! Prints acks per second for both and the ratio; absolute figures drift on shared
//! machines, the ratio is the result.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use amp_broker::jetstream::{Context, PublishOptions, PurgeRequest, StorageType, StreamConfig};
use amp_broker::nats::{Client, Options};
use amp_broker::proto::{Op, Parsed, Parser, Role, encode};

const IN_FLIGHT: usize = 256;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Raw baseline: pre-encoded PUBs with reply subjects; at most `IN_FLIGHT` unanswered.
fn raw(addr: &str, pubs: &[Vec<u8>]) -> Duration {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).expect("INFO");
    writer
        .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\nSUB _INBOX.raw.* 1\r\nPING\r\n")
        .expect("connect");
    line.clear();
    reader.read_line(&mut line).expect("PONG");
    let parser = Parser::new(Role::Client);
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 20);
    let mut chunk = vec![0u8; 64 * 1024];
    let (mut sent, mut acked) = (0usize, 0usize);
    let started = Instant::now();
    while acked < pubs.len() {
        let mut out = Vec::new();
        while sent < pubs.len() && sent - acked < IN_FLIGHT {
            out.extend_from_slice(&pubs[sent]);
            sent += 1;
        }
        if !out.is_empty() {
            writer.write_all(&out).expect("write");
        }
        let n = reader.read(&mut chunk).expect("read");
        assert!(n > 0, "server closed the baseline connection");
        buf.extend_from_slice(&chunk[..n]);
        let mut start = 0;
        while let Ok(Parsed::Complete(op, used)) = parser.parse(&buf[start..]) {
            if let Op::Msg { payload, .. } = op {
                assert!(payload.starts_with(b"{\"stream\""), "not a PubAck");
                acked += 1;
            }
            start += used;
        }
        buf.drain(..start);
    }
    started.elapsed()
}

fn client(url: &str, msgs: usize, payload: &[u8]) -> Duration {
    let c = Client::connect(Options::new(url)).expect("connect");
    let mut js = Context::new(c).with_timeout(Duration::from_secs(30));
    let opts = PublishOptions::default();
    let mut window = VecDeque::with_capacity(IN_FLIGHT);
    let started = Instant::now();
    for _ in 0..msgs {
        if window.len() == IN_FLIGHT {
            let id = window.pop_front().expect("window");
            js.wait_pub_ack(id).expect("ack");
        }
        window.push_back(
            js.publish_async("bench.js", None, payload, &opts)
                .expect("publish"),
        );
    }
    while let Some(id) = window.pop_front() {
        js.wait_pub_ack(id).expect("ack");
    }
    started.elapsed()
}

fn main() {
    // `cargo test --benches` runs bench binaries without `--bench`; keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let msgs = env_usize("JS_BENCH_MSGS", if quick { 2_000 } else { 100_000 });
    let size = env_usize("JS_BENCH_SIZE", 128);
    let rounds = if quick { 1 } else { 3 };
    let server = common::NatsServer::start();
    let mut admin = Context::new(Client::connect(Options::new(&server.url())).expect("connect"));
    let mut cfg = StreamConfig::new("BENCH", &["bench.js"]);
    cfg.storage = Some(StorageType::Memory);
    admin.create_stream(&cfg).expect("stream");
    let payload = vec![b'x'; size];
    let pubs: Vec<Vec<u8>> = (0..msgs)
        .map(|i| {
            let mut p = Vec::with_capacity(size + 48);
            encode::publish(
                &mut p,
                "bench.js",
                Some(format!("_INBOX.raw.{i}").as_bytes()),
                &payload,
            );
            p
        })
        .collect();
    let mut best_raw = Duration::MAX;
    let mut best_client = Duration::MAX;
    for _ in 0..rounds {
        best_raw = best_raw.min(raw(&server.addr(), &pubs));
        admin
            .purge_stream("BENCH", &PurgeRequest::default())
            .expect("purge");
        best_client = best_client.min(client(&server.url(), msgs, &payload));
        admin
            .purge_stream("BENCH", &PurgeRequest::default())
            .expect("purge");
    }
    let rate = |d: Duration| msgs as f64 / d.as_secs_f64();
    println!(
        "JetStream publish with ack, {IN_FLIGHT} in flight, {msgs} x {size} B, memory stream, best of {rounds}: raw {:.0} acks/s, jetstream::Context {:.0} acks/s, ratio {:.1}%",
        rate(best_raw),
        rate(best_client),
        100.0 * rate(best_client) / rate(best_raw)
    );
}
