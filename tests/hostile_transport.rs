//! Hostile clients against the broker binary and a real nats-server: a ping flood from a
//! client that never reads, an ack flood from a logged-in session, more connections from
//! one address than allowed, and many half-sent large frames. Each checks both that the
//! attacker is contained and that honest sessions are still served meanwhile.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::amp::{Broker, Client, open_config, open_to_any_name};
use common::{NatsServer, client_frame, connect_from, connect_with, status_bytes, wait_until};
use serde_json::{Value, json};
use tungstenite::Message;

/// The broker child's resident set.
fn rss_bytes(pid: u32) -> usize {
    status_bytes(pid, "VmRSS:")
}

/// One sample of a metric from `/metrics` (`name` with its labels, as rendered), asked
/// from an address of its own so per-address caps do not get in the way.
fn metric(broker: &Broker, series: &str) -> f64 {
    let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 9), broker.addr);
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn set_rcvbuf(stream: &TcpStream, size: libc::c_int) {
    // SAFETY: setsockopt on our own socket with a pointer to a live c_int.
    unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

const UPGRADE: &[u8] =
    b"GET /amp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
Sec-WebSocket-Protocol: amp.v1\r\n\r\n";

/// Sends the upgrade request and reads the response head; false when the connection was
/// closed (or answered otherwise) instead.
fn upgrade(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    if s.write_all(UPGRADE).is_err() {
        return false;
    }
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return false,
        }
    }
    head.starts_with(b"HTTP/1.1 101 ")
}

/// One unmasked server frame (small ones only), or None on timeout or EOF.
fn read_server_frame(s: &mut TcpStream) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).ok()?;
    let len = match head[1] & 0x7F {
        126 => {
            let mut b = [0u8; 2];
            s.read_exact(&mut b).ok()?;
            usize::from(u16::from_be_bytes(b))
        }
        127 => return None,
        n => usize::from(n),
    };
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).ok()?;
    Some((head[0] & 0x0F, payload))
}

fn login(broker: &Broker, name: &str) -> Client {
    Client::login(broker, "acme", name, &format!("{name}-token"))
}

/// How long an AMP ping takes to be answered.
fn ping_rtt(c: &mut Client, n: u64) -> Duration {
    let t = Instant::now();
    let answer = c.request(json!({"op":"ping","id":format!("p{n}")}));
    assert_eq!(answer["re"], format!("p{n}"), "{answer}");
    t.elapsed()
}

const FLOODERS: usize = 3;

fn ping_flood_from_a_reader_that_never_reads(limits: Value, expect_code: Option<u16>) {
    let nats = NatsServer::start();
    let mut config = open_config(&["honest"]);
    config["limits"] = limits;
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");
    let rss0 = rss_bytes(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let mut attackers = Vec::new();
    let mut floods = Vec::new();
    for _ in 0..FLOODERS {
        let mut attacker = TcpStream::connect(broker.addr).expect("connect");
        assert!(upgrade(&mut attacker), "upgrade");
        set_rcvbuf(&attacker, 4096);
        attacker
            .set_write_timeout(Some(Duration::from_millis(200)))
            .expect("timeout");
        let stop = stop.clone();
        let mut s = attacker.try_clone().expect("clone");
        attackers.push(attacker);
        floods.push(std::thread::spawn(move || {
            let burst: Vec<u8> = (0..500)
                .flat_map(|_| client_frame(0x9, &[b'p'; 125]))
                .collect();
            let (mut sent, started) = (0usize, Instant::now());
            while !stop.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(4) {
                match s.write(&burst) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => break,
                }
            }
            sent
        }));
    }
    let mut honest = login(&broker, "honest");
    let (mut peak, mut worst, mut n) = (rss0, Duration::ZERO, 0);
    while !floods.iter().all(|f| f.is_finished()) {
        peak = peak.max(rss_bytes(pid));
        n += 1;
        worst = worst.max(ping_rtt(&mut honest, n));
        std::thread::sleep(Duration::from_millis(50));
    }
    let sent: usize = floods
        .into_iter()
        .map(|f| f.join().expect("flood thread"))
        .sum();
    peak = peak.max(rss_bytes(pid));
    let growth = peak.saturating_sub(rss0);
    eprintln!(
        "ping flood: {} MiB of pings sent by {FLOODERS} connections in 4 s; broker RSS {} -> peak {} MiB (+{} MiB); \
         honest ping worst {worst:?}",
        sent >> 20,
        rss0 >> 20,
        peak >> 20,
        growth >> 20
    );
    assert!(growth < 64 << 20, "broker RSS grew {} MiB", growth >> 20);
    // The attackers are closed: their sockets are dropped after the close timeout at the
    // latest.
    stop.store(true, Ordering::SeqCst);
    for attacker in &mut attackers {
        let closed = wait_until(Duration::from_secs(20), || {
            attacker
                .write(&client_frame(0x9, b"x"))
                .is_err_and(|e| e.kind() != std::io::ErrorKind::TimedOut)
        });
        assert!(closed, "a flooding connection is still open");
    }
    if let Some(code) = expect_code {
        let series = format!("amp_ws_closes_total{{code=\"{code}\"}}");
        assert!(
            metric(&broker, &series) >= 1.0,
            "{series}; log:\n{}",
            broker.log()
        );
    }
    n += 1;
    ping_rtt(&mut honest, n);
}

/// Item: every byte queued for a connection counts against its bound. With the default
/// frame allowance the flood is read at 1,000 frames/s and the session ends at its hello
/// timeout; memory stays flat either way.
#[test]
fn ping_flood_before_hello_from_a_client_that_never_reads_keeps_memory_bounded() {
    ping_flood_from_a_reader_that_never_reads(json!({}), None);
}

/// With the frame allowance out of the way, the pongs fill the output bound and the
/// session is closed 1008 `slow consumer`.
#[test]
fn unthrottled_ping_flood_fills_the_output_bound_and_is_closed_slow_consumer() {
    ping_flood_from_a_reader_that_never_reads(
        json!({"max_frames_per_s": 1_000_000, "frame_burst": 1_000_000,
               "max_outbound_bytes": 1_048_576}),
        Some(1008),
    );
}

/// A logged-in session that sends AMP pings and reads nothing is closed `slow consumer`
/// when a reply does not fit its queue; that reply, and those to pings it sent before
/// the close reached the broker, never reach it. `amp_frames_out_total` counted each
/// reply as the broker queued it, sent or not: as many `ok`s as pings.
#[test]
fn replies_a_session_shed_as_a_slow_consumer_never_took_are_not_counted_as_sent() {
    let nats = NatsServer::start();
    let mut config = open_config(&["flooder"]);
    config["limits"] = json!({"max_frames_per_s": 1_000_000, "frame_burst": 1_000_000,
                              "max_outbound_bytes": 65_536});
    let broker = Broker::start(&nats.url(), &config);
    let narrow = common::connect_narrow(Ipv4Addr::LOCALHOST, broker.addr);
    let client = Client::connect_over(&broker, narrow).hello("acme", "flooder", "flooder-token");
    let oks = r#"amp_frames_out_total{op="ok"}"#;
    let pings = r#"amp_frames_in_total{op="ping"}"#;
    let (oks0, pings0) = (metric(&broker, oks), metric(&broker, pings));
    let mut ws = client.into_websocket();
    ws.get_mut()
        .set_write_timeout(Some(Duration::from_millis(200)))
        .expect("timeout");
    // Each reply echoes the id, as long as one may be: the queue fills in fewer pings.
    let ping = json!({"op":"ping","id":"p".repeat(64)}).to_string();
    let shed = wait_until(Duration::from_secs(30), || {
        for _ in 0..500 {
            if ws.write(Message::text(ping.as_str())).is_err() {
                break;
            }
        }
        let _ = ws.flush();
        metric(&broker, "amp_ws_slow_consumers_total") >= 1.0
    });
    assert!(shed, "never closed as a slow consumer");
    // Once the core has heard the session is gone, it takes no more of its pings.
    assert!(wait_until(Duration::from_secs(10), || {
        metric(&broker, "amp_sessions") == 0.0
    }));
    let (sent, answered) = (metric(&broker, oks) - oks0, metric(&broker, pings) - pings0);
    assert!(answered > 0.0, "no ping reached the broker");
    assert!(
        sent < answered,
        "{sent} replies counted as sent for {answered} pings, the one that did not fit too"
    );
}

/// Item: one session streaming frames that get no reply must not hold up the loop.
#[test]
fn ack_flood_from_one_session_does_not_delay_other_sessions_or_new_connections() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["flooder", "honest"]));
    let flooder = login(&broker, "flooder").into_websocket();
    let mut honest = login(&broker, "honest");
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let mut ws = flooder;
        ws.get_mut()
            .set_write_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        std::thread::spawn(move || {
            let mut sent = 0u64;
            let frame = r#"{"op":"ack","seq":1}"#;
            while !stop.load(Ordering::SeqCst) {
                for _ in 0..256 {
                    if ws.write(Message::text(frame)).is_err() {
                        break;
                    }
                    sent += 1;
                }
                let _ = ws.flush();
            }
            sent
        })
    };
    // Let the flood get going.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let (mut worst_ping, mut worst_challenge, mut n) = (Duration::ZERO, Duration::ZERO, 0);
    while started.elapsed() < Duration::from_secs(3) {
        n += 1;
        worst_ping = worst_ping.max(ping_rtt(&mut honest, n));
        if n % 5 == 0 {
            let t = Instant::now();
            let c = Client::connect(&broker);
            worst_challenge = worst_challenge.max(t.elapsed());
            drop(c);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    let sent = flood.join().expect("flood thread");
    eprintln!(
        "ack flood: {sent} acks sent in {:?}; honest ping worst {worst_ping:?} over {n}; \
         new connection's challenge worst {worst_challenge:?}",
        started.elapsed() + Duration::from_millis(300)
    );
    assert!(
        worst_ping < Duration::from_millis(250),
        "a ping took {worst_ping:?}"
    );
    assert!(
        worst_challenge < Duration::from_millis(250),
        "a challenge took {worst_challenge:?}"
    );
}

/// Item: a per-address connection cap. Connections past it are accepted and closed at
/// once; another address is served meanwhile.
#[test]
fn connections_past_the_per_address_cap_are_refused_while_another_address_is_served() {
    const CAP: usize = 256; // the default
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["honest"]));
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..CAP + 20 {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 1), broker.addr);
        if upgrade(&mut s) {
            held.push(s);
        } else {
            refused += 1;
        }
    }
    eprintln!(
        "{} of {} connections from 127.0.0.1 upgraded, {refused} refused",
        held.len(),
        CAP + 20
    );
    // The test's own health check also counted against 127.0.0.1 but is closed by now.
    assert!(
        held.len() <= CAP && held.len() >= CAP - 2,
        "{} upgraded",
        held.len()
    );
    assert!(refused >= 20, "{refused} refused");
    let mut other = connect_from(Ipv4Addr::new(127, 0, 0, 2), broker.addr);
    assert!(upgrade(&mut other), "a second address is served");
    assert!(
        metric(
            &broker,
            "amp_ws_connections_refused_total{reason=\"per_ip\"}"
        ) >= 20.0
    );
    // Room again once some close.
    held.truncate(CAP - 10);
    assert!(wait_until(Duration::from_secs(10), || {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 1), broker.addr);
        upgrade(&mut s)
    }));
}

/// Item: a global budget for buffered input and output. Many clients each holding a
/// large half-sent frame: the largest holders are closed 1008 `memory budget` and the
/// total stays within the budget; an honest session is served throughout.
#[test]
fn half_sent_large_frames_past_the_memory_budget_are_shed() {
    const BUDGET: usize = 4 << 20;
    const CLIENTS: usize = 16;
    const HELD: usize = 600 << 10;
    let nats = NatsServer::start();
    let mut config = open_config(&["honest"]);
    config["limits"] = json!({"max_buffered_bytes": BUDGET, "hello_timeout_s": 60});
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");
    let rss0 = rss_bytes(pid);
    let mut honest = login(&broker, "honest");
    let frame = client_frame(0x1, &vec![b'a'; 1 << 20]);
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let mut s = TcpStream::connect(broker.addr).expect("connect");
        assert!(upgrade(&mut s), "upgrade {i}");
        let _ = s.write_all(&frame[..HELD]);
        clients.push(s);
        ping_rtt(&mut honest, i as u64);
    }
    // Every byte sent has been read: either held or shed.
    let settled = wait_until(Duration::from_secs(10), || {
        let shed = metric(&broker, "amp_ws_memory_sheds_total") as usize;
        let held = metric(&broker, "amp_ws_buffered_bytes") as usize;
        held + shed * HELD >= CLIENTS * HELD - (CLIENTS << 12)
    });
    let shed = metric(&broker, "amp_ws_memory_sheds_total") as usize;
    let buffered = metric(&broker, "amp_ws_buffered_bytes") as usize;
    let rss = rss_bytes(pid).saturating_sub(rss0);
    eprintln!(
        "{CLIENTS} clients x {} KiB half-sent: {shed} shed, {} KiB buffered (budget {} KiB), \
         RSS +{} MiB",
        HELD >> 10,
        buffered >> 10,
        BUDGET >> 10,
        rss >> 20
    );
    assert!(
        settled,
        "the broker did not read the input; log:\n{}",
        broker.log()
    );
    assert!(buffered <= BUDGET, "{buffered} bytes buffered");
    assert!(shed >= CLIENTS - BUDGET / HELD, "{shed} shed");
    // The shed ones got a close frame with 1008 `memory budget` (after their challenge).
    let mut closes = 0;
    for s in &mut clients {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        while let Some((opcode, payload)) = read_server_frame(s) {
            if opcode == 0x8 {
                assert_eq!(payload[..2], 1008u16.to_be_bytes());
                assert_eq!(&payload[2..], b"memory budget");
                closes += 1;
                break;
            }
        }
    }
    assert_eq!(closes, shed, "every shed client got its close frame");
    ping_rtt(&mut honest, 99);
}

/// Connection churn: one address connecting and dropping in a loop gets its burst, then
/// its rate (`limits.connects_per_ip_per_s`); the rest are closed at accept, before any
/// request head or challenge is spent on them, and another address is unaffected.
#[test]
fn connection_churn_from_one_address_is_held_to_its_connect_rate() {
    let nats = NatsServer::start();
    let mut config = open_config(&["honest"]);
    config["limits"] = json!({"connects_per_ip_per_s": 20, "connect_burst_per_ip": 40});
    let broker = Broker::start(&nats.url(), &config);
    let started = Instant::now();
    let mut upgraded = 0;
    for _ in 0..200 {
        let mut s = connect_from(Ipv4Addr::new(127, 0, 0, 2), broker.addr);
        if upgrade(&mut s) {
            upgraded += 1;
        }
    }
    let allowed = 40.0 + 20.0 * started.elapsed().as_secs_f64();
    eprintln!(
        "{upgraded} of 200 churned connections upgraded in {:?} (allowance {allowed:.0})",
        started.elapsed()
    );
    assert!(upgraded >= 40, "the burst is served: {upgraded}");
    assert!(
        f64::from(upgraded) <= allowed + 1.0,
        "{upgraded} upgraded, allowance {allowed:.0}"
    );
    assert!(metric(&broker, "amp_ws_connections_refused_total{reason=\"rate\"}") >= 1.0);
    let mut other = connect_from(Ipv4Addr::new(127, 0, 0, 3), broker.addr);
    assert!(upgrade(&mut other), "another address is served");
}

#[test]
fn connections_waiting_while_descriptors_ran_out_are_served_once_some_free_up() {
    // Past the process's descriptor limit `accept` fails; the listener's readiness is
    // edge triggered, so the connections already waiting were left unanswered until yet
    // another one arrived.
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().expect("dir");
    let script = dir.path().join("amp-broker-few-descriptors");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nulimit -n 48 || exit 3\nexec {} \"$@\"\n",
            env!("CARGO_BIN_EXE_amp-broker")
        ),
    )
    .expect("script");
    std::process::Command::new("chmod")
        .args(["+x", &script.display().to_string()])
        .status()
        .expect("chmod");
    let broker = Broker::start_bin(&script, &nats.url(), &open_config(&["a"]));
    let mut held: Vec<TcpStream> = (0..80)
        .map(|_| TcpStream::connect(broker.addr).expect("connect"))
        .collect();
    // The broker takes what its descriptors allow (asking it over HTTP would be one more
    // connection, which is what used to unstick it); the rest wait in the backlog.
    let fd_dir = format!("/proc/{}/fd", broker.pid().expect("pid"));
    let open = || std::fs::read_dir(&fd_dir).map_or(0, Iterator::count);
    assert!(
        wait_until(Duration::from_secs(5), || open() >= 46),
        "the broker holds {} descriptors",
        open()
    );
    let mut last = held.pop().expect("the last one");
    held.truncate(10);
    drop(held);
    last.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    last.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let mut answer = [0u8; 64];
    let n = last.read(&mut answer).unwrap_or(0);
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 200"),
        "the waiting connection was never answered: {:?}",
        String::from_utf8_lossy(&answer[..n])
    );
}

/// Logs `name` in over a connection from `from`; false when the connection is refused,
/// closed or the hello is not answered `ok` within 10 s.
fn raw_login(from: Ipv4Addr, broker: &Broker, name: &str) -> Option<TcpStream> {
    let mut s = connect_from(from, broker.addr);
    if !upgrade(&mut s) {
        return None;
    }
    let hello = json!({"op":"hello","id":"h","ns":"acme","name":name,
                       "auth":{"type":"token","token":format!("{name}-token")}});
    s.write_all(&client_frame(0x1, hello.to_string().as_bytes()))
        .ok()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let (opcode, payload) = read_server_frame(&mut s)?;
        if opcode != 0x1 {
            continue;
        }
        let frame: Value = serde_json::from_slice(&payload).ok()?;
        if frame["re"] == "h" {
            return (frame["op"] == "ok").then_some(s);
        }
    }
    None
}

/// Whether a logged-in raw connection still answers an AMP ping.
fn raw_ping(s: &mut TcpStream) -> bool {
    let ping = json!({"op":"ping","id":"p"});
    if s.write_all(&client_frame(0x1, ping.to_string().as_bytes()))
        .is_err()
    {
        return false;
    }
    while let Some((opcode, payload)) = read_server_frame(s) {
        if opcode == 0x1 {
            let frame: Value = serde_json::from_slice(&payload).unwrap_or_default();
            if frame["re"] == "p" {
                return frame["op"] == "ok";
            }
        }
    }
    false
}

/// Connections that upgrade and never say hello fill the whole table from one address
/// (its per-address cap allows it) and refill it as slots free: a client from another
/// address still logs in, because a new connection pushes out the oldest connection not
/// yet logged in of the address holding the most of them, and logged-in sessions are
/// never pushed out.
#[test]
fn connections_that_never_say_hello_cannot_keep_others_out() {
    const TABLE: usize = 40;
    let nats = NatsServer::start();
    let mut config = open_config(&["honest"]);
    config["limits"] = json!({"max_sessions": TABLE, "hello_timeout_s": 60,
                              "max_sessions_per_participant": TABLE});
    let broker = Broker::start(&nats.url(), &config);
    let attacker = Ipv4Addr::new(127, 0, 0, 2);
    let mut logged_in: Vec<TcpStream> = (0..5)
        .map(|_| raw_login(Ipv4Addr::new(127, 0, 0, 3), &broker, "honest").expect("login"))
        .collect();
    let mut squatters = Vec::new();
    for _ in 0..TABLE + 10 {
        let mut s = connect_from(attacker, broker.addr);
        if upgrade(&mut s) {
            squatters.push(s);
        }
    }
    eprintln!("{} squatting connections upgraded", squatters.len());
    for round in 0..5 {
        let s = raw_login(Ipv4Addr::new(127, 0, 0, 4), &broker, "honest");
        assert!(s.is_some(), "round {round}: an honest client was kept out");
        logged_in.extend(s);
        // The attacker takes back what it lost.
        for _ in 0..3 {
            let mut s = connect_from(attacker, broker.addr);
            if upgrade(&mut s) {
                squatters.push(s);
            }
        }
    }
    for (i, s) in logged_in.iter_mut().enumerate() {
        assert!(raw_ping(s), "logged-in session {i} was pushed out");
    }
    assert!(
        metric(&broker, "amp_ws_connections_evicted_total") >= 5.0,
        "log:\n{}",
        broker.log()
    );
}

/// Clients that upgrade, never say hello, send pings and never read: each one's pongs
/// count against a small bound of its own (64 KiB before the hello, whatever
/// `max_outbound_bytes` says), and past the memory budget the connections holding the
/// most, output included, are closed, so a new client is never turned away for memory
/// they hold.
#[test]
fn pongs_nobody_reads_before_hello_cannot_fill_the_memory_budget() {
    const BUDGET: usize = 8 << 20;
    const FLOODERS: usize = 24;
    let nats = NatsServer::start();
    let mut config = open_config(&["honest"]);
    config["limits"] = json!({"max_buffered_bytes": BUDGET, "hello_timeout_s": 60,
                              "max_outbound_bytes": 64 << 20,
                              "max_frames_per_s": 1_000_000, "frame_burst": 1_000_000});
    let broker = Broker::start(&nats.url(), &config);
    // 80,000 pings each: 10 MB of pongs apiece, more than the kernel buffers hold.
    let pings: Vec<u8> = (0..80_000)
        .flat_map(|_| client_frame(0x9, &[b'p'; 125]))
        .collect();
    let mut flooders = Vec::new();
    for _ in 0..FLOODERS {
        let mut s = connect_with(Ipv4Addr::new(127, 0, 0, 2), broker.addr, Some(4096));
        assert!(upgrade(&mut s), "upgrade");
        s.set_write_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        // Closed part way (slow consumer) is the outcome wanted; either way it stops.
        let _ = s.write_all(&pings);
        flooders.push(s);
    }
    // Every flooder is closed, for its pongs or for the budget. (Before, the pongs
    // filled the budget, which then turned away every new connection, the one asking
    // for these metrics included.)
    let closed = wait_until(Duration::from_secs(20), || {
        metric(&broker, "amp_ws_slow_consumers_total")
            + metric(&broker, "amp_ws_memory_sheds_total")
            >= FLOODERS as f64
    });
    assert!(closed, "the flooders hold on; log:\n{}", broker.log());
    let mut served = 0;
    for _ in 0..10 {
        if raw_login(Ipv4Addr::new(127, 0, 0, 3), &broker, "honest").is_some() {
            served += 1;
        }
    }
    let refused = metric(
        &broker,
        "amp_ws_connections_refused_total{reason=\"memory\"}",
    );
    let buffered = metric(&broker, "amp_ws_buffered_bytes");
    eprintln!(
        "{served} of 10 honest logins served; {refused} refused for memory; {buffered} bytes buffered"
    );
    assert_eq!(served, 10, "log:\n{}", broker.log());
    assert_eq!(refused, 0.0);
    assert!(buffered <= BUDGET as f64, "{buffered} bytes buffered");
    // Nobody logged in: no warning a peer without a credential could repeat at will
    // (one each before, 24 here).
    let log = broker.log();
    let warnings = log.lines().filter(|l| l.contains("closed 1008")).count();
    assert_eq!(warnings, 0, "log:\n{log}");
}

/// The broker child's peak resident set.
fn peak_rss_bytes(pid: u32) -> usize {
    status_bytes(pid, "VmHWM:")
}

#[test]
fn a_burst_of_presence_changes_to_watchers_that_do_not_read_stays_within_the_memory_budget() {
    // A peer broker draining its sessions, or a broker gone whose entries expire together,
    // changes thousands of entries at once; every change is a frame to every watcher.
    // Before, one read of them was handled whole before any frame met the memory budget:
    // 655 MiB more at the peak here, against a budget of 16.
    const BUDGET: usize = 16 << 20;
    const WATCHERS: usize = 200;
    const CHANGES: usize = 8_000;
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["watcher", "honest"]));
    config["limits"] = json!({"max_buffered_bytes": BUDGET});
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");

    let mut watchers = Vec::new();
    for _ in 0..WATCHERS {
        let mut w = login(&broker, "watcher");
        assert_eq!(w.request(json!({"op":"watch"}))["op"], "ok");
        w.stop_reading();
        watchers.push(w);
    }
    let mut honest = login(&broker, "honest");
    assert_eq!(honest.request(json!({"op":"watch"}))["op"], "ok");
    let reader = std::thread::spawn(move || {
        let mut seen = std::collections::HashSet::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while seen.len() < CHANGES && Instant::now() < deadline {
            match honest.next_op("presence", Duration::from_secs(10)) {
                Some(f) => {
                    let name = f["name"].as_str().unwrap_or_default();
                    if name.starts_with('p') {
                        seen.insert(name.to_string());
                    }
                }
                None => break,
            }
        }
        seen.len()
    });
    let peak_before = peak_rss_bytes(pid);

    // The changes come all at once, as after a moment in which the broker did not run
    // (an edge node's scheduler, a swap storm): stopped while they are written.
    broker.signal(libc::SIGSTOP);
    let mut peer = amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
        .expect("connect");
    let pad = "x".repeat(200);
    for i in 0..CHANGES {
        let value = json!({"name": format!("p{i}"), "labels": {"pad": pad}}).to_string();
        peer.publish(
            &format!("$KV.AMP_REGISTRY_acme.p{i}"),
            None,
            None,
            value.as_bytes(),
        )
        .expect("publish");
    }
    peer.flush(Duration::from_secs(10)).expect("flush");
    let mut js = amp_broker::jetstream::Context::new(peer).with_timeout(Duration::from_secs(5));
    let stored = wait_until(Duration::from_secs(20), || {
        js.stream_info("KV_AMP_REGISTRY_acme")
            .is_ok_and(|i| i.state.last_seq >= CHANGES as u64)
    });
    broker.signal(libc::SIGCONT);
    assert!(stored, "the changes are stored");

    let heard = reader.join().expect("reader");
    let grew = peak_rss_bytes(pid).saturating_sub(peak_before);

    eprintln!(
        "the honest watcher heard {heard} of {CHANGES} changes; the broker's peak resident \
         set grew {} MiB (budget {} MiB)",
        grew >> 20,
        BUDGET >> 20
    );
    assert_eq!(heard, CHANGES, "log:\n{}", broker.log());
    assert!(
        grew < 4 * BUDGET,
        "peak resident set grew {grew} bytes with a budget of {BUDGET}"
    );
    drop(watchers);
}

#[test]
fn complete_messages_read_in_one_turn_stay_within_the_memory_budget() {
    // Messages decoded from the sockets wait for the broker; before, only those partly
    // read counted in the memory budget, and one loop turn read up to 1 MiB from every
    // connection with input (512 KiB for its readiness event, as much again to continue
    // it) before the broker took any of them.
    const BUDGET: usize = 8 << 20;
    const SESSIONS: usize = 200;
    const EACH: usize = 256 << 10;
    let nats = NatsServer::start();
    let mut config = open_config(&["streamer"]);
    config["limits"] = json!({"max_buffered_bytes": BUDGET});
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");
    // Acks of nothing outstanding, 16 KiB each with the padding JSON allows: no answer.
    let ack = format!(
        "{{\"op\":\"ack\",\"seq\":1}}{}",
        " ".repeat((16 << 10) - 20)
    );
    let frame = client_frame(0x1, ack.as_bytes());
    let burst: Vec<u8> = std::iter::repeat_n(&frame[..], EACH / ack.len())
        .flatten()
        .copied()
        .collect();
    let mut sessions: Vec<TcpStream> = (0..SESSIONS)
        .map(|i| {
            raw_login(Ipv4Addr::new(127, 0, 0, 4), &broker, "streamer")
                .unwrap_or_else(|| panic!("login {i}"))
        })
        .collect();
    assert!(raw_ping(&mut sessions[0]), "the padded ack is taken");
    let peak_before = peak_rss_bytes(pid);

    // Stopped while the messages are written: the kernel holds what it takes of them,
    // and the broker finds them all ready at once.
    broker.signal(libc::SIGSTOP);
    let mut written = vec![0usize; SESSIONS];
    for (s, done) in sessions.iter_mut().zip(&mut written) {
        s.set_nonblocking(true).expect("nonblocking");
        while let Ok(n) = s.write(&burst[*done..]) {
            *done += n;
            if n == 0 || *done == burst.len() {
                break;
            }
        }
    }
    let ready: usize = written.iter().sum();
    broker.signal(libc::SIGCONT);
    for (s, done) in sessions.iter_mut().zip(&written) {
        s.set_nonblocking(false).expect("blocking");
        s.write_all(&burst[*done..]).expect("write the rest");
    }
    for (i, s) in sessions.iter_mut().enumerate() {
        assert!(raw_ping(s), "session {i} is still served");
    }
    let grew = peak_rss_bytes(pid).saturating_sub(peak_before);
    eprintln!(
        "{SESSIONS} sessions sent {} KiB each, {} MiB of it ready at once; the broker's \
         peak resident set grew {} MiB (budget {} MiB)",
        burst.len() >> 10,
        ready >> 20,
        grew >> 20,
        BUDGET >> 20
    );
    assert!(
        grew < 2 * BUDGET,
        "peak resident set grew {grew} bytes with a budget of {BUDGET}"
    );
}

/// Writes `entries` registry entries `p0`, `p1`, ... with a label of `pad` bytes, as
/// another broker would, and waits until `asker`'s `who` lists each.
fn fill_registry(nats: &NatsServer, asker: &mut Client, entries: usize, pad: usize) {
    let mut peer = amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
        .expect("connect");
    let pad = "x".repeat(pad);
    for i in 0..entries {
        let value = json!({"name": format!("p{i}"), "labels": {"pad": pad}}).to_string();
        peer.publish(
            &format!("$KV.AMP_REGISTRY_acme.p{i}"),
            None,
            None,
            value.as_bytes(),
        )
        .expect("publish");
    }
    peer.flush(Duration::from_secs(10)).expect("flush");
    let listed = wait_until(Duration::from_secs(20), || {
        let answer = asker.request(json!({"op":"who"}));
        let names = answer["participants"].as_array().map_or(0, |p| {
            p.iter()
                .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with('p')))
                .count()
        });
        names == entries
    });
    assert!(listed, "the registry lists all {entries} entries");
}

#[test]
fn who_answers_to_many_sessions_in_one_turn_stay_within_the_memory_budget() {
    // A `who` is a frame of some 20 bytes whose answer lists the whole registry, up to a
    // session's outbound bound (4 MiB by default). Frames read in one turn were handled
    // whole before any budget saw their answers: every session's answer was queued at
    // once, the memory budget met only at the flush after them.
    const BUDGET: usize = 16 << 20;
    const SESSIONS: usize = 200;
    const ENTRIES: usize = 1_500;
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["watcher", "honest"]));
    // One participant, whose sessions share its listing rate: raised so that each is listed.
    config["limits"] = json!({"max_buffered_bytes": BUDGET, "presence_listed_per_s": 100_000_000});
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");

    let mut sessions: Vec<Client> = (0..SESSIONS).map(|_| login(&broker, "watcher")).collect();
    let mut honest = login(&broker, "honest");
    // Entries of 2 KB: one `who` answer is about 3 MB, within the outbound bound.
    fill_registry(&nats, &mut honest, ENTRIES, 2_000);
    for s in &mut sessions {
        s.stop_reading();
    }
    let who = "amp_frames_in_total{op=\"who\"}";
    let asked = metric(&broker, who);
    let peak_before = peak_rss_bytes(pid);

    // Every `who` ready at once, as after a moment in which the broker did not run.
    broker.signal(libc::SIGSTOP);
    for s in &mut sessions {
        s.send(&json!({"op":"who","id":"w"}));
    }
    broker.signal(libc::SIGCONT);
    let taken = wait_until(Duration::from_secs(60), || {
        metric(&broker, who) >= asked + SESSIONS as f64
    });
    assert!(taken, "every `who` is taken; log:\n{}", broker.log());
    let answer = honest.request(json!({"op":"who"}));
    assert_eq!(
        answer["participants"].as_array().map(Vec::len),
        Some(ENTRIES + 2),
        "the honest session is still answered"
    );
    let grew = peak_rss_bytes(pid).saturating_sub(peak_before);
    eprintln!(
        "{SESSIONS} sessions asked `who` at once; {} of them shed; the broker's peak \
         resident set grew {} MiB (budget {} MiB)",
        metric(&broker, "amp_ws_memory_sheds_total"),
        grew >> 20,
        BUDGET >> 20
    );
    assert!(
        grew < 4 * BUDGET,
        "peak resident set grew {grew} bytes with a budget of {BUDGET}"
    );
}

#[test]
fn a_flood_of_who_answers_does_not_hold_up_other_sessions_nats_traffic() {
    // Frames wait while the output is over the memory budget, and so do NATS events. Were
    // the sessions' frames always taken first in a round, each round's would fill the
    // budget while any were left, and a PubAck would wait behind every frame read before
    // it (and NATS events pile up, read while the flush left room but never taken). The
    // two take turns at going first.
    const SESSIONS: usize = 100;
    const EACH: usize = 60;
    const ENTRIES: usize = 300;
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["watcher", "honest"]));
    // Answers of some 20 KB, 26 to a budget: a round takes 26, a turn of 64 rounds some
    // 1,700 of the 6,000.
    // One participant, whose sessions share its listing rate: raised so that each is listed.
    config["limits"] =
        json!({"max_buffered_bytes": 512 << 10, "presence_listed_per_s": 100_000_000});
    let broker = Broker::start(&nats.url(), &config);

    let mut flooders: Vec<Client> = (0..SESSIONS).map(|_| login(&broker, "watcher")).collect();
    let mut first = login(&broker, "honest");
    let mut last = login(&broker, "honest");
    fill_registry(&nats, &mut first, ENTRIES, 20);

    // All read in one turn, in the order written: a `send` (answered once its PubAck is
    // in), the flood, and a `ping` behind the flood (answered when the flood is through).
    broker.signal(libc::SIGSTOP);
    first.send(&json!({"op":"send","id":"s","to":"watcher","body":"hi"}));
    for f in &mut flooders {
        for i in 0..EACH {
            f.send(&json!({"op":"who","id":format!("w{i}")}));
        }
    }
    last.send(&json!({"op":"ping","id":"p"}));
    broker.signal(libc::SIGCONT);
    let answer = first.answer_to("s");
    assert_eq!(answer["op"], "ok", "{answer}");
    let early = last.next_frame(Duration::from_millis(1));
    assert!(
        early.is_none(),
        "the send was answered only after the whole flood read after it: {early:?}"
    );
    assert_eq!(last.answer_to("p")["op"], "ok", "the flood is answered");
    drop(flooders);
}

#[test]
fn watch_snapshots_asked_by_many_sessions_in_one_turn_stay_within_the_memory_budget() {
    // A `watch` is answered with the first burst of its snapshot at once (up to 256 KiB),
    // the next once the session's output is written. Before, the first bursts of every
    // `watch` read in one turn were queued together. Those the budget holds back wait for
    // a later round, and every snapshot still goes through to its end.
    const BUDGET: usize = 2 << 20;
    const SESSIONS: usize = 200;
    // Entries of 500 bytes: some 650 KB, three bursts.
    const ENTRIES: usize = 1_200;
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["watcher", "honest"]));
    // One participant, whose sessions share its listing rate: raised so that each is listed.
    config["limits"] = json!({"max_buffered_bytes": BUDGET, "presence_listed_per_s": 100_000_000});
    let broker = Broker::start(&nats.url(), &config);
    let pid = broker.pid().expect("pid");

    let mut sessions: Vec<Client> = (0..SESSIONS).map(|_| login(&broker, "watcher")).collect();
    let mut honest = login(&broker, "honest");
    fill_registry(&nats, &mut honest, ENTRIES, 500);
    let present = ENTRIES + 2;
    let peak_before = peak_rss_bytes(pid);

    broker.signal(libc::SIGSTOP);
    for s in &mut sessions {
        s.send(&json!({"op":"watch","id":"w"}));
    }
    broker.signal(libc::SIGCONT);
    let readers: Vec<_> = sessions
        .into_iter()
        .map(|mut s| {
            std::thread::spawn(move || {
                let mut told = 0;
                while told < present {
                    match s.next_frame(Duration::from_secs(20)) {
                        Some(f) if f["op"] == "presence" => told += 1,
                        Some(f) if f["op"] == "_closed" => break,
                        Some(_) => {}
                        None => break,
                    }
                }
                told
            })
        })
        .collect();
    let told: Vec<usize> = readers
        .into_iter()
        .map(|r| r.join().expect("reader"))
        .collect();
    let grew = peak_rss_bytes(pid).saturating_sub(peak_before);
    let whole = told.iter().filter(|&&n| n == present).count();
    eprintln!(
        "{whole} of {SESSIONS} sessions heard the whole snapshot; the broker's peak resident \
         set grew {} MiB (budget {} MiB)",
        grew >> 20,
        BUDGET >> 20
    );
    assert_eq!(whole, SESSIONS, "told: {told:?}");
    assert!(
        grew < 4 * BUDGET,
        "peak resident set grew {grew} bytes with a budget of {BUDGET}"
    );
}

#[test]
fn a_registry_resync_that_finds_every_entry_gone_stays_within_the_memory_budget() {
    // After an outage longer than half the entries' TTL the registry watch reads the
    // bucket again, and every name its mirror held that the bucket no longer has goes
    // `down` at the end of that read: one event, a frame per name to every watcher. The
    // budget is checked between events, so the whole fan-out was queued in the core at
    // once and then copied to the sessions before any budget saw it. Anyone who may
    // write the bucket (or a fleet of brokers gone during the outage) makes the names.
    const BUDGET: usize = 16 << 20;
    const WATCHERS: usize = 200;
    const ENTRIES: usize = 5_000;
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let mut config = open_to_any_name(open_config(&["watcher", "honest"]));
    // One participant, whose sessions share its listing rate: raised so that each watches.
    config["limits"] = json!({"max_buffered_bytes": BUDGET, "registry_ttl_s": 2,
                              "presence_listed_per_s": 100_000_000});
    let broker = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let pid = broker.pid().expect("pid");

    let mut honest = login(&broker, "honest");
    fill_registry(&nats, &mut honest, ENTRIES, 0);
    // Every watcher hears its whole snapshot, so that every name's `down` is for it.
    // Its answer waits among the frames (200 snapshots at once take a while on a loaded
    // machine, longer than `request` waits).
    let snapshot = |mut c: Client| {
        c.send(&json!({"op":"watch","id":"w"}));
        let mut told = 0;
        while told < ENTRIES {
            match c.next_op("presence", Duration::from_secs(30)) {
                Some(f) if f["name"].as_str().is_some_and(|n| n.starts_with('p')) => told += 1,
                Some(_) => {}
                None => panic!("a snapshot stopped after {told} names"),
            }
        }
        c
    };
    let readers: Vec<_> = (0..WATCHERS)
        .map(|_| {
            let c = login(&broker, "watcher");
            std::thread::spawn(move || snapshot(c))
        })
        .collect();
    let mut watchers: Vec<Client> = readers
        .into_iter()
        .map(|r| r.join().expect("watcher"))
        .collect();
    for w in &mut watchers {
        w.stop_reading();
    }
    let honest = snapshot(honest);
    let reader = std::thread::spawn(move || {
        let mut honest = honest;
        let mut gone = std::collections::HashSet::new();
        while gone.len() < ENTRIES {
            match honest.next_op("presence", Duration::from_secs(30)) {
                Some(f) if f["state"] == "down" => {
                    let name = f["name"].as_str().unwrap_or_default();
                    if name.starts_with('p') {
                        gone.insert(name.to_string());
                    }
                }
                Some(_) => {}
                None => break,
            }
        }
        gone.len()
    });
    let peak_before = peak_rss_bytes(pid);

    relay.cut();
    let mut js = nats.jetstream();
    js.purge_stream("KV_AMP_REGISTRY_acme", &Default::default())
        .expect("purge the registry");
    // Away for more than half the TTL (1 s): the watch reads the bucket again rather
    // than resume. Time is the condition here, nothing to wait on.
    std::thread::sleep(Duration::from_secs(2));
    relay.restore();

    let heard = reader.join().expect("reader");
    let grew = peak_rss_bytes(pid).saturating_sub(peak_before);
    eprintln!(
        "the honest watcher heard {heard} of {ENTRIES} names go down; {} watchers shed; the \
         broker's peak resident set grew {} MiB (budget {} MiB)",
        metric(&broker, "amp_ws_memory_sheds_total"),
        grew >> 20,
        BUDGET >> 20
    );
    assert_eq!(heard, ENTRIES, "log:\n{}", broker.log());
    assert_eq!(
        metric(&broker, "amp_registry_resyncs_total"),
        2.0,
        "the bucket was read again; log:\n{}",
        broker.log()
    );
    assert!(
        grew < 4 * BUDGET,
        "peak resident set grew {grew} bytes with a budget of {BUDGET}"
    );
    drop(watchers);
}
