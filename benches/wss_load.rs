//! WSS against plain WS through one broker: the broker listens with TLS and, beside it,
//! plain (`--plain-listen`), so both paths run in the same process against the same
//! nats-server in the same run, rounds alternating. Participants `send`, `message`, `ack`
//! as in broker_load. Then the broker's resident memory with idle authenticated sessions,
//! first plain and then TLS ones, so the cost of TLS per idle session shows by itself.
//!
//! `cargo bench --bench wss_load` runs the full load (release binary); without `--bench`
//! (as `cargo test --all-targets` runs it) it is a smoke run with tiny sizes. Sizes:
//! `WSS_LOAD_PAIRS` (8), `WSS_LOAD_MESSAGES` per pair (2000), `WSS_LOAD_BODY_BYTES` (256),
//! `WSS_LOAD_WINDOW` (16), `WSS_LOAD_ROUNDS` (2), `WSS_LOAD_IDLE_SESSIONS` (500).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use common::amp::{Broker, open_config};
use common::tls::Pki;
use common::{NatsServer, free_port};
use serde_json::Value;
use tungstenite::{ClientRequestBuilder, Message, WebSocket};

const WAIT: Duration = Duration::from_secs(30);

struct Sizes {
    pairs: usize,
    messages: usize,
    body_bytes: usize,
    window: usize,
    rounds: usize,
    idle_sessions: usize,
}

impl Sizes {
    fn new(full: bool) -> Sizes {
        let env = |name: &str, full_default: usize, smoke: usize| {
            if !full {
                return smoke;
            }
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&v| v > 0)
                .unwrap_or(full_default)
        };
        Sizes {
            pairs: env("WSS_LOAD_PAIRS", 8, 2),
            messages: env("WSS_LOAD_MESSAGES", 2000, 20),
            body_bytes: env("WSS_LOAD_BODY_BYTES", 256, 64),
            window: env("WSS_LOAD_WINDOW", 16, 4),
            rounds: env("WSS_LOAD_ROUNDS", 2, 1),
            idle_sessions: env("WSS_LOAD_IDLE_SESSIONS", 500, 10),
        }
    }
}

#[derive(Clone)]
enum Path {
    Ws(SocketAddr),
    Wss(SocketAddr, Arc<rustls::ClientConfig>),
}

impl Path {
    fn name(&self) -> &'static str {
        match self {
            Path::Ws(_) => "ws",
            Path::Wss(..) => "wss",
        }
    }
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

type Ws = WebSocket<Box<dyn Stream>>;

fn open(path: &Path) -> Ws {
    let (stream, scheme, addr): (Box<dyn Stream>, &str, SocketAddr) = match path {
        Path::Ws(addr) => {
            let tcp = TcpStream::connect(addr).expect("tcp");
            tcp.set_nodelay(true).expect("nodelay");
            tcp.set_read_timeout(Some(WAIT)).expect("timeout");
            (Box::new(tcp), "ws", *addr)
        }
        Path::Wss(addr, config) => {
            let tls = common::tls::connect(*addr, config.clone(), "localhost").expect("tls");
            tls.sock.set_nodelay(true).expect("nodelay");
            tls.sock.set_read_timeout(Some(WAIT)).expect("timeout");
            (Box::new(tls), "wss", *addr)
        }
    };
    let uri: tungstenite::http::Uri = format!("{scheme}://localhost:{}/amp", addr.port())
        .parse()
        .expect("uri");
    let request = ClientRequestBuilder::new(uri).with_sub_protocol("amp.v1");
    let (ws, _) = tungstenite::client(request, stream).expect("upgrade");
    ws
}

fn read_text(ws: &mut Ws) -> String {
    loop {
        match ws.read() {
            Ok(Message::Text(t)) => return t.as_str().to_string(),
            Ok(Message::Close(c)) => panic!("broker closed the session: {c:?}"),
            Ok(_) => continue,
            Err(e) => panic!("broker session: {e}"),
        }
    }
}

fn login(path: &Path, ns: &str, name: &str) -> Ws {
    let mut ws = open(path);
    assert!(read_text(&mut ws).contains("challenge"));
    ws.send(Message::text(format!(
        r#"{{"op":"hello","id":"h","ns":"{ns}","name":"{name}","auth":{{"type":"token","token":"{name}-token"}}}}"#
    )))
    .expect("hello");
    let ok = read_text(&mut ws);
    assert!(ok.starts_with(r#"{"op":"ok""#), "hello: {ok}");
    ws
}

fn sender(path: &Path, me: &str, to: &str, s: &Sizes, barrier: &Barrier) {
    let mut ws = login(path, "acme", me);
    let body = format!("\"{}\"", "x".repeat(s.body_bytes));
    let send = |ws: &mut Ws, k: usize| {
        ws.write(Message::text(format!(
            r#"{{"op":"send","id":"{k}","to":"{to}","body":{body}}}"#
        )))
        .expect("write");
    };
    barrier.wait();
    let (mut sent, mut answered) = (0, 0);
    while answered < s.messages {
        while sent < s.messages && sent - answered < s.window {
            sent += 1;
            send(&mut ws, sent);
        }
        ws.flush().expect("flush");
        let answer = read_text(&mut ws);
        assert!(answer.starts_with(r#"{"op":"ok""#), "send: {answer}");
        answered += 1;
    }
}

fn receiver(path: &Path, me: &str, s: &Sizes, barrier: &Barrier) -> Instant {
    let mut ws = login(path, "acme", me);
    barrier.wait();
    let mut first = 0;
    while first < s.messages {
        let frame: Value = serde_json::from_str(&read_text(&mut ws)).expect("json");
        let seq = frame["seq"].as_u64().expect("seq");
        ws.send(Message::text(format!(r#"{{"op":"ack","seq":{seq}}}"#)))
            .expect("ack");
        if frame["delivery"] == 1 {
            first += 1;
        }
    }
    Instant::now()
}

/// Messages per second delivered (first deliveries) over all pairs.
fn round(path: &Path, tag: &str, s: &Sizes) -> f64 {
    let barrier = Barrier::new(2 * s.pairs + 1);
    let (started, ended) = thread::scope(|scope| {
        let mut ends = Vec::new();
        for i in 0..s.pairs {
            let (barrier, to_sender, to_receiver) = (&barrier, path.clone(), path.clone());
            scope.spawn(move || {
                let (me, to) = (format!("s{tag}-{i}"), format!("r{tag}-{i}"));
                sender(&to_sender, &me, &to, s, barrier)
            });
            ends.push(
                scope.spawn(move || receiver(&to_receiver, &format!("r{tag}-{i}"), s, barrier)),
            );
        }
        barrier.wait();
        let started = Instant::now();
        let ended = ends
            .into_iter()
            .map(|h| h.join().expect("receiver"))
            .max()
            .unwrap_or(started);
        (started, ended)
    });
    (s.pairs * s.messages) as f64 / ended.duration_since(started).as_secs_f64()
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The RSS once it has stopped moving for a second (at most 15 s of waiting).
fn settled_rss_kib(pid: u32) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = rss_kib(pid);
    loop {
        thread::sleep(Duration::from_secs(1));
        let now = rss_kib(pid);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let s = Sizes::new(full);
    let pki = Pki::new();
    let nats = NatsServer::start();
    let names: Vec<String> = (0..s.rounds * 2)
        .flat_map(|r| (0..s.pairs).flat_map(move |i| [format!("s{r}-{i}"), format!("r{r}-{i}")]))
        .collect();
    let idle: Vec<String> = (0..2 * s.idle_sessions)
        .map(|i| format!("idle{i}"))
        .collect();
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let mut config = open_config(&refs(&names));
    config["namespaces"]["idle"] = open_config(&refs(&idle))["namespaces"]["acme"].take();
    config["limits"]["max_sessions"] = (2 * s.idle_sessions + 4 * s.pairs + 16).into();
    config["limits"]["max_connections_per_ip"] = config["limits"]["max_sessions"].clone();

    let tls_addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let plain: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let (plain_arg, tls_arg) = (plain.to_string(), tls_addr.to_string());
    let (cert, key) = (pki.server.cert_arg(), pki.server.key_arg());
    let args = [
        "--plain-listen",
        &plain_arg,
        "--listen",
        &tls_arg,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--log-level",
        "warn",
    ];
    let broker = Broker::start_at(plain, &nats.url(), &config, &args);
    let pid = broker.pid().expect("broker pid");
    let ws = Path::Ws(plain);
    let wss = Path::Wss(tls_addr, pki.client_config(false));

    let mut rates: Vec<(&str, f64)> = Vec::new();
    for r in 0..s.rounds {
        // Alternate the order so that neither path always runs on a warmer broker.
        let order = if r % 2 == 0 { [&ws, &wss] } else { [&wss, &ws] };
        for (k, path) in order.into_iter().enumerate() {
            let rate = round(path, &format!("{}", 2 * r + k), &s);
            println!("round {} {:<4} {rate:>10.0} msgs/s", r + 1, path.name());
            rates.push((path.name(), rate));
        }
    }
    let best = |name: &str| {
        rates
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, r)| *r)
            .fold(0.0, f64::max)
    };
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let ratio = best("wss") / best("ws");
    println!(
        "throughput wss/ws (best of each): {:.0}%   target >= 75%: {}",
        100.0 * ratio,
        verdict(ratio >= 0.75)
    );

    let before = settled_rss_kib(pid);
    let (plain_idle, tls_idle) = idle.split_at(s.idle_sessions);
    let plain_sessions: Vec<Ws> = plain_idle.iter().map(|n| login(&ws, "idle", n)).collect();
    let with_plain = settled_rss_kib(pid);
    let tls_sessions: Vec<Ws> = tls_idle.iter().map(|n| login(&wss, "idle", n)).collect();
    let with_tls = settled_rss_kib(pid);
    let per = |kib: u64| kib as f64 / s.idle_sessions as f64;
    let per_plain = per(with_plain.saturating_sub(before));
    let per_tls = per(with_tls.saturating_sub(with_plain));
    println!(
        "broker RSS per idle session: plain {per_plain:.1} KiB, TLS {per_tls:.1} KiB ({} of each)   TLS target <= 48 KiB: {}",
        s.idle_sessions,
        verdict(per_tls <= 48.0)
    );
    drop(tls_sessions);
    drop(plain_sessions);
}
