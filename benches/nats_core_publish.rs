//! Core publish throughput of `nats::Client` against a same-run baseline: the same PUB
//! operations pre-encoded and written raw to the same nats-server over a plain TCP socket.
//! Both runs end with PING/PONG, so every message has been processed by the server.
//!
//!     cargo bench --bench nats_core_publish            (NATS_BENCH_MSGS, NATS_BENCH_SIZE)
//!
//! Prints messages per second for both and the ratio; absolute figures drift on shared
//! machines, the ratio is the result. A TLS round publishes the same through `tls://` to
//! the same server (`allow_non_tls`), against the client's plaintext figure.

#[path = "../tests/common/mod.rs"]
mod common;

use amp_broker::nats::{Client, Options};
use amp_broker::proto::encode;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Raw baseline: CONNECT, then the pre-encoded PUBs in 64 KiB writes, then PING/PONG.
fn raw(addr: &str, wire: &[u8]) -> Duration {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut writer = stream;
    let mut line = String::new();
    reader.read_line(&mut line).expect("INFO");
    writer
        .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false}\r\nPING\r\n")
        .expect("connect");
    line.clear();
    reader.read_line(&mut line).expect("PONG");
    let started = Instant::now();
    for chunk in wire.chunks(64 * 1024) {
        writer.write_all(chunk).expect("write");
    }
    writer.write_all(b"PING\r\n").expect("ping");
    loop {
        line.clear();
        reader.read_line(&mut line).expect("read");
        if line.starts_with("PONG") {
            break;
        }
    }
    started.elapsed()
}

fn client(options: Options, msgs: usize, payload: &[u8]) -> Duration {
    let mut c = Client::connect(options).expect("connect");
    let started = Instant::now();
    for _ in 0..msgs {
        c.publish("bench.core", None, None, payload)
            .expect("publish");
    }
    c.flush(Duration::from_secs(60)).expect("flush");
    started.elapsed()
}

fn main() {
    // `cargo test --benches` runs bench binaries with no arguments or `--bench`; a quick
    // pass keeps that cheap.
    let quick = !std::env::args().any(|a| a == "--bench");
    let msgs = env_usize("NATS_BENCH_MSGS", if quick { 10_000 } else { 1_000_000 });
    let size = env_usize("NATS_BENCH_SIZE", 128);
    let rounds = if quick { 1 } else { 5 };
    let pki = common::tls::Pki::new();
    let tls_and_plain = format!(
        "{}allow_non_tls: true\n",
        pki.nats_tls_block(&pki.server, "")
    );
    let server = common::NatsServer::with_config(&tls_and_plain);
    let tls_url = format!("tls://127.0.0.1:{}", server.port);
    let tls_options = Options::new(&tls_url).with_tls(pki.client_config(false));
    let payload = vec![b'x'; size];
    let mut wire = Vec::with_capacity(msgs * (size + 32));
    for _ in 0..msgs {
        encode::publish(&mut wire, "bench.core", None, &payload);
    }
    let mut best_raw = Duration::MAX;
    let mut best_client = Duration::MAX;
    let mut best_tls = Duration::MAX;
    for _ in 0..rounds {
        best_raw = best_raw.min(raw(&server.addr(), &wire));
        best_client = best_client.min(client(Options::new(&server.url()), msgs, &payload));
        best_tls = best_tls.min(client(tls_options.clone(), msgs, &payload));
    }
    let rate = |d: Duration| msgs as f64 / d.as_secs_f64();
    println!(
        "core publish, {msgs} x {size} B, best of {rounds}: raw {:.0} msg/s, nats::Client {:.0} msg/s, ratio {:.1}%",
        rate(best_raw),
        rate(best_client),
        100.0 * rate(best_client) / rate(best_raw)
    );
    let tls_ratio = rate(best_tls) / rate(best_client);
    println!(
        "core publish over TLS: {:.0} msg/s, {:.1}% of plaintext nats::Client   target >= 70%: {}",
        rate(best_tls),
        100.0 * tls_ratio,
        if tls_ratio >= 0.7 { "met" } else { "MISSED" }
    );
}
