//! The WebSocket transport over real sockets with a real WebSocket client: upgrade and
//! subprotocol rules, plain HTTP endpoints and their limits, frames and close codes,
//! heartbeats, slow-consumer isolation and drain.

mod common;
mod ws_support;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use amp_broker::amp::SCHEMA_JSON;
use amp_broker::ws::WsConfig;
use common::client_frame;
use tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
use tungstenite::protocol::frame::{CloseFrame, Frame};
use tungstenite::{Bytes, Message};
use ws_support::{
    Client, TlsClient, connect, connect_from, http, raw_upgrade, read_frame, start, start_tls,
    tls_connect, upgrade_over,
};

fn wait(cond: impl FnMut() -> bool) -> bool {
    common::wait_until(Duration::from_secs(10), cond)
}

/// Reads until a close frame arrives; returns its code and reason.
fn read_close(client: &mut ws_support::Client) -> (u16, String) {
    loop {
        match client.read() {
            Ok(Message::Close(Some(f))) => return (f.code.into(), f.reason.as_str().to_owned()),
            Ok(Message::Close(None)) => return (1005, String::new()),
            Ok(_) => {}
            Err(e) => panic!("no close frame: {e}"),
        }
    }
}

#[test]
fn upgrade_selects_amp_v1_and_text_round_trips() {
    let server = start(WsConfig::default());
    let (mut client, response) = connect(&server, Some("amp.v1")).expect("upgrade");
    assert_eq!(response.status(), 101);
    assert_eq!(
        response
            .headers()
            .get("Sec-WebSocket-Protocol")
            .map(|v| v.as_bytes()),
        Some(&b"amp.v1"[..])
    );
    client
        .send(Message::text("{\"op\":\"ping\",\"id\":\"1\"}"))
        .expect("send");
    assert_eq!(
        client.read().expect("echo"),
        Message::text("{\"op\":\"ping\",\"id\":\"1\"}")
    );
    // Past the small output bound of a connection not logged in.
    login(&mut client);
    let big = "b".repeat(200_000);
    client.send(Message::text(big.clone())).expect("send big");
    assert_eq!(client.read().expect("echo big"), Message::text(big));
}

#[test]
fn client_offering_no_subprotocol_is_accepted_without_the_header() {
    let server = start(WsConfig::default());
    let (mut client, response) = connect(&server, None).expect("upgrade");
    assert!(response.headers().get("Sec-WebSocket-Protocol").is_none());
    client.send(Message::text("x")).expect("send");
    assert_eq!(client.read().expect("echo"), Message::text("x"));
}

#[test]
fn client_offering_only_other_subprotocols_gets_http_400() {
    let server = start(WsConfig::default());
    match connect(&server, Some("chat, amp.v2")) {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status(), 400),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("upgrade accepted"),
    }
}

#[test]
fn plain_http_endpoints_answer_and_close() {
    let server = start(WsConfig::default());
    let r = http(&server, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        r.starts_with("HTTP/1.1 200 OK\r\n") && r.ends_with("\r\n\r\nok\n"),
        "{r}"
    );
    server.host.healthy.store(false, Ordering::SeqCst);
    let r = http(&server, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        r.starts_with("HTTP/1.1 503 ") && r.ends_with("nats: not connected\n"),
        "{r}"
    );
    let r = http(&server, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(
        r.contains("\r\n\r\n# TYPE amp_sessions gauge\namp_sessions 0\n"),
        "{r}"
    );
    assert!(
        r.contains("amp_http_responses_total{status=\"200\"} 1\n"),
        "{r}"
    );
    assert!(r.contains("amp_ws_connections 1\n"), "{r}");
    let r = http(&server, "GET /amp/schema HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.contains("Content-Type: application/schema+json\r\n"));
    assert!(r.ends_with(SCHEMA_JSON));
    let r = http(&server, "GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 404 Not Found\r\n"), "{r}");
    let r = http(&server, "GET /amp HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
}

#[test]
fn oversized_heads_get_431_and_malformed_ones_400() {
    let server = start(WsConfig::default());
    let many: String = (0..40).map(|i| format!("X-H{i}: v\r\n")).collect();
    let r = http(&server, &format!("GET /healthz HTTP/1.1\r\n{many}\r\n"));
    assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    // A head past 8 KiB, still being sent when the server answers.
    let r = http(
        &server,
        &format!(
            "GET /healthz HTTP/1.1\r\nX-Big: {}\r\n\r\n",
            "a".repeat(20_000)
        ),
    );
    assert!(r.starts_with("HTTP/1.1 431 "), "{r}");
    let r = http(&server, "BLAH\r\n\r\n");
    assert!(r.starts_with("HTTP/1.1 400 "), "{r}");
}

#[test]
fn slow_request_is_closed_at_the_request_timeout() {
    let cfg = WsConfig {
        request_timeout: Duration::from_millis(300),
        ..WsConfig::default()
    };
    let server = start(cfg);
    let mut s = TcpStream::connect(server.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let t0 = Instant::now();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .expect("partial head");
    let mut buf = Vec::new();
    let n = s.read_to_end(&mut buf).expect("server closes");
    assert_eq!(n, 0, "no response to an incomplete request");
    assert!(t0.elapsed() >= Duration::from_millis(300));
}

#[test]
fn binary_frame_closes_1003() {
    let server = start(WsConfig::default());
    let (mut client, _) = connect(&server, Some("amp.v1")).expect("upgrade");
    client.send(Message::binary(vec![1u8, 2, 3])).expect("send");
    assert_eq!(
        read_close(&mut client),
        (1003, "binary frames are not accepted".into())
    );
    assert!(wait(|| server.seen.closes().contains(&(
        1003,
        "binary frames are not accepted".into(),
        false
    ))));
}

#[test]
fn message_over_max_frame_closes_1009_also_when_fragmented() {
    let cfg = WsConfig {
        max_frame: 4096,
        ..WsConfig::default()
    };
    let server = start(cfg);
    let (mut client, _) = connect(&server, None).expect("upgrade");
    client
        .send(Message::text("a".repeat(4096)))
        .expect("at the limit");
    assert_eq!(client.read().expect("echo").len(), 4096);
    client.send(Message::text("a".repeat(4097))).expect("send");
    assert_eq!(read_close(&mut client).0, 1009);

    let (mut client, _) = connect(&server, None).expect("upgrade");
    let part = |op, fin| Frame::message(Bytes::from(vec![b'x'; 3000]), op, fin);
    client
        .write(Message::Frame(part(OpCode::Data(Data::Text), false)))
        .expect("first part");
    client
        .send(Message::Frame(part(OpCode::Data(Data::Continue), true)))
        .expect("last part");
    assert_eq!(read_close(&mut client).0, 1009);
}

#[test]
fn fragmented_message_within_the_limit_is_reassembled() {
    let server = start(WsConfig::default());
    let (mut client, _) = connect(&server, None).expect("upgrade");
    let part = |s: &'static str, op, fin| Frame::message(Bytes::from_static(s.as_bytes()), op, fin);
    client
        .write(Message::Frame(part("hel", OpCode::Data(Data::Text), false)))
        .expect("1");
    client
        .write(Message::Frame(part(
            "lo ",
            OpCode::Data(Data::Continue),
            false,
        )))
        .expect("2");
    client
        .send(Message::Frame(part(
            "world",
            OpCode::Data(Data::Continue),
            true,
        )))
        .expect("3");
    assert_eq!(client.read().expect("echo"), Message::text("hello world"));
}

#[test]
fn invalid_utf8_text_closes_1007() {
    let server = start(WsConfig::default());
    let (mut client, _) = connect(&server, None).expect("upgrade");
    let frame = Frame::message(
        Bytes::from_static(b"\xff\xfe"),
        OpCode::Data(Data::Text),
        true,
    );
    client.send(Message::Frame(frame)).expect("send");
    assert_eq!(read_close(&mut client).0, 1007);
}

#[test]
fn client_ping_is_answered_with_pong() {
    let server = start(WsConfig::default());
    let (mut client, _) = connect(&server, None).expect("upgrade");
    client
        .send(Message::Ping(Bytes::from_static(b"are you there")))
        .expect("ping");
    assert_eq!(
        client.read().expect("pong"),
        Message::Pong(Bytes::from_static(b"are you there"))
    );
}

#[test]
fn silent_client_gets_pings_then_is_closed_1001_after_three_heartbeats() {
    let hb = Duration::from_millis(200);
    let server = start(WsConfig {
        heartbeat: hb,
        ..WsConfig::default()
    });
    let mut raw = raw_upgrade(server.addr);
    let t0 = Instant::now();
    assert_eq!(read_frame(&mut raw).expect("ping 1"), (0x9, vec![]));
    assert_eq!(read_frame(&mut raw).expect("ping 2"), (0x9, vec![]));
    let (op, payload) = read_frame(&mut raw).expect("close");
    assert_eq!(op, 0x8);
    assert_eq!(&payload[..2], &1001u16.to_be_bytes());
    assert_eq!(&payload[2..], b"idle timeout");
    assert!(
        t0.elapsed() >= hb * 3 - Duration::from_millis(50),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn client_answering_pings_stays_connected_past_three_heartbeats() {
    let hb = Duration::from_millis(300);
    let server = start(WsConfig {
        heartbeat: hb,
        ..WsConfig::default()
    });
    let (mut client, _) = connect(&server, None).expect("upgrade");
    let t0 = Instant::now();
    let mut pings = 0;
    while t0.elapsed() < hb * 6 {
        // Reading answers each ping with a pong.
        match client.read().expect("read") {
            Message::Ping(_) => pings += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(pings >= 5, "{pings} pings");
    client.send(Message::text("still here")).expect("send");
    loop {
        match client.read().expect("read") {
            Message::Ping(_) => {}
            m => {
                assert_eq!(m, Message::text("still here"));
                break;
            }
        }
    }
}

#[test]
fn client_close_handshake_completes_and_is_reported() {
    let server = start(WsConfig::default());
    let (mut client, _) = connect(&server, None).expect("upgrade");
    client
        .close(Some(CloseFrame {
            code: CloseCode::Normal,
            reason: "bye".into(),
        }))
        .expect("close");
    loop {
        match client.read() {
            Ok(Message::Close(Some(f))) => assert_eq!(u16::from(f.code), 1000),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(tungstenite::Error::ConnectionClosed) => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(wait(
        || server.seen.closes() == vec![(1000, "bye".into(), true)]
    ));
    drop(client);
    assert!(wait(
        || http(&server, "GET /metrics HTTP/1.1\r\n\r\n").contains("amp_ws_connections 1\n")
    ));
}

#[test]
fn slow_consumer_is_closed_1008_without_slowing_other_sessions() {
    let cfg = WsConfig {
        max_outbound_bytes: 1 << 20,
        ..WsConfig::default()
    };
    let server = start(cfg);
    let (mut fast, _) = connect(&server, None).expect("upgrade fast");
    let (mut slow, _) = connect(&server, None).expect("upgrade slow");
    slow.send(Message::text("flood")).expect("flood");
    // The fast client keeps round-tripping while the slow one does not read.
    let mut worst = Duration::ZERO;
    let mut rounds = 0;
    while !server.seen.closes().iter().any(|c| c.0 == 1008) {
        let t = Instant::now();
        fast.send(Message::text(format!("r{rounds}")))
            .expect("send");
        assert_eq!(
            fast.read().expect("echo"),
            Message::text(format!("r{rounds}"))
        );
        worst = worst.max(t.elapsed());
        rounds += 1;
        assert!(rounds < 100_000, "slow consumer never closed");
    }
    assert_eq!(
        server
            .seen
            .closes()
            .into_iter()
            .filter(|c| c.0 == 1008)
            .collect::<Vec<_>>(),
        vec![(1008, "slow consumer".into(), false)]
    );
    // Generous for a loaded machine; a stalled loop would stall this client for good.
    assert!(
        worst < Duration::from_secs(3),
        "a round trip took {worst:?}"
    );
    fast.send(Message::text("after")).expect("send");
    assert_eq!(fast.read().expect("echo"), Message::text("after"));
    let metrics = http(&server, "GET /metrics HTTP/1.1\r\n\r\n");
    assert!(
        metrics.contains("amp_ws_slow_consumers_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("amp_ws_closes_total{code=\"1008\"} 1\n"),
        "{metrics}"
    );
}

#[test]
fn drain_flushes_queued_messages_then_closes_1001_and_stops_accepting() {
    let server = start(WsConfig::default());
    let (mut a, _) = connect(&server, None).expect("upgrade a");
    let (mut b, _) = connect(&server, None).expect("upgrade b");
    a.send(Message::text("drain")).expect("send");
    for i in 0..3 {
        assert_eq!(
            a.read().expect("queued"),
            Message::text(format!("before drain {i}"))
        );
    }
    assert_eq!(read_close(&mut a), (1001, "going away".into()));
    assert_eq!(read_close(&mut b), (1001, "going away".into()));
    drop((a, b));
    let addr = server.addr;
    server.join();
    assert!(
        TcpStream::connect(addr).is_err(),
        "listener closed after drain"
    );
}

/// Logs a session in (see `ws_support::start`).
fn login(ws: &mut Client) {
    ws.send(Message::text("login")).expect("send");
    assert_eq!(ws.read().expect("echo"), Message::text("login"));
}

#[test]
fn connections_past_max_connections_are_closed_at_once() {
    let server = start(WsConfig {
        max_connections: 2,
        ..WsConfig::default()
    });
    let (mut a, _) = connect(&server, None).expect("first");
    let (mut b, _) = connect(&server, None).expect("second");
    login(&mut a);
    login(&mut b);
    let mut third = TcpStream::connect(server.addr).expect("tcp connect is accepted by the kernel");
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = third.write_all(b"GET /healthz HTTP/1.1\r\n\r\n");
    let mut buf = Vec::new();
    let n = third.read_to_end(&mut buf).unwrap_or(0);
    assert_eq!(
        n,
        0,
        "closed without an answer: {}",
        String::from_utf8_lossy(&buf)
    );
    a.send(Message::text("unaffected")).expect("send");
    assert_eq!(a.read().expect("echo"), Message::text("unaffected"));
}

#[test]
fn a_connection_past_the_table_pushes_out_the_oldest_one_not_logged_in() {
    let server = start(WsConfig {
        max_connections: 4,
        ..WsConfig::default()
    });
    let (a, b, c) = (
        Ipv4Addr::new(127, 0, 0, 2),
        Ipv4Addr::new(127, 0, 0, 3),
        Ipv4Addr::new(127, 0, 0, 4),
    );
    let mut member = connect_from(&server, a).expect("member");
    login(&mut member);
    let mut oldest = connect_from(&server, b).expect("oldest waiting");
    let mut newer = connect_from(&server, b).expect("newer waiting");
    let mut other = connect_from(&server, c).expect("one waiting from another address");
    // The table is full. A newcomer from b's address is turned away: its own group
    // holds the most waiting connections.
    assert!(connect_from(&server, b).is_err(), "refused");
    // One from a takes the slot of b's oldest waiting connection.
    let mut newcomer = connect_from(&server, a).expect("newcomer");
    assert!(
        oldest.read().is_err(),
        "the oldest connection waiting for its hello is dropped"
    );
    for ws in [&mut member, &mut newer, &mut other, &mut newcomer] {
        ws.send(Message::text("still here")).expect("send");
        assert_eq!(ws.read().expect("echo"), Message::text("still here"));
    }
    assert_eq!(
        server.seen.closes(),
        vec![(1013, "pushed out waiting for its hello".into(), false)]
    );
    let metrics = http(&server, "GET /metrics HTTP/1.1\r\n\r\n");
    // The probe (from 127.0.0.1, nothing waiting there) pushed out one more.
    assert!(
        metrics.contains("amp_ws_connections_evicted_total 2\n"),
        "{metrics}"
    );
}

#[test]
fn with_only_logged_in_sessions_the_table_refuses_newcomers() {
    let server = start(WsConfig {
        max_connections: 1,
        ..WsConfig::default()
    });
    let (mut member, _) = connect(&server, None).expect("member");
    login(&mut member);
    assert!(connect(&server, None).is_err(), "no room: refused");
    member.send(Message::text("kept")).expect("send");
    assert_eq!(member.read().expect("echo"), Message::text("kept"));
}

#[test]
fn a_logged_in_session_that_does_not_read_is_shed_when_the_memory_budget_is_full() {
    // The session's own bound is far away; the budget over all connections is not.
    let server = start(WsConfig {
        max_outbound_bytes: 64 << 20,
        max_buffered_bytes: 1 << 20,
        ..WsConfig::default()
    });
    let (mut honest, _) = connect(&server, None).expect("honest");
    let (mut slow, _) = connect(&server, None).expect("slow");
    login(&mut slow);
    slow.send(Message::text("flood")).expect("flood");
    assert!(
        common::wait_until(Duration::from_secs(20), || server
            .seen
            .closes()
            .iter()
            .any(|c| c.0 == 1008)),
        "never shed: {:?}",
        server.seen.closes()
    );
    assert_eq!(
        server.seen.closes(),
        vec![(1008, "memory budget".into(), false)]
    );
    honest.send(Message::text("after")).expect("send");
    assert_eq!(honest.read().expect("echo"), Message::text("after"));
    let (mut newcomer, _) = connect(&server, None).expect("newcomer is not refused");
    newcomer.send(Message::text("in")).expect("send");
    assert_eq!(newcomer.read().expect("echo"), Message::text("in"));
}

/// A peer picks its close code among 3000-4999: labelled one by one, 64 made-up codes
/// took every label `amp_ws_closes_total` may have, and later codes (1011 after a
/// restart, say) were counted as `other`.
#[test]
fn close_codes_a_peer_picks_share_one_label() {
    let server = start(WsConfig::default());
    for code in 4000..4070u16 {
        let (mut client, _) = connect(&server, Some("amp.v1")).expect("upgrade");
        client
            .close(Some(CloseFrame {
                code: CloseCode::from(code),
                reason: "made up".into(),
            }))
            .expect("close");
        while client.read().is_ok() {}
    }
    assert!(wait(|| {
        http(&server, "GET /metrics HTTP/1.1\r\n\r\n")
            .contains("amp_ws_closes_total{code=\"application\"} 70\n")
    }));
    let metrics = http(&server, "GET /metrics HTTP/1.1\r\n\r\n");
    assert!(!metrics.contains("code=\"40"), "{metrics}");
    assert!(!metrics.contains("code=\"other\""), "{metrics}");
}

/// `/metrics` over TLS from an address of its own; what the probe wrote is added to
/// `sent` (after the answer, which the server renders before it counts the request).
fn tls_metrics(
    server: &ws_support::TestServer,
    config: &std::sync::Arc<rustls::ClientConfig>,
    sent: &mut usize,
) -> String {
    let mut s = tls_connect(server, config.clone(), Ipv4Addr::new(127, 0, 0, 9), false);
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("request");
    s.flush().expect("flush");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    *sent += s.sock.written;
    text
}

fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits until the server has read every byte the clients wrote (`sent`, probes
/// included); then its buffered bytes are what those bytes made it queue. `None` when it
/// does not within 10 s (a connection closed before it read everything).
fn tls_buffered_once_read(
    server: &ws_support::TestServer,
    config: &std::sync::Arc<rustls::ClientConfig>,
    sent: &mut usize,
) -> Option<usize> {
    let mut buffered = 0.0;
    let read_all = wait(|| {
        let before = *sent;
        let m = tls_metrics(server, config, sent);
        buffered = sample(&m, "amp_ws_buffered_bytes");
        sample(&m, "amp_ws_bytes_total{direction=\"in\"}") >= before as f64
    });
    read_all.then_some(buffered as usize)
}

/// A TLS client that upgrades, never logs in and never reads, over a narrow connection.
fn tls_pinger(
    server: &ws_support::TestServer,
    config: &std::sync::Arc<rustls::ClientConfig>,
    sent: &mut usize,
) -> TlsClient {
    let mut s = tls_connect(server, config.clone(), Ipv4Addr::new(127, 0, 0, 2), true);
    upgrade_over(&mut s);
    *sent += s.sock.written;
    s
}

/// Sends `s` 100 pings of 125 bytes at a time until `enough` says so of the server's
/// metrics once it has read them (at most 40 rounds); false if it never did.
fn ping_until(
    server: &ws_support::TestServer,
    config: &std::sync::Arc<rustls::ClientConfig>,
    s: &mut TlsClient,
    sent: &mut usize,
    mut enough: impl FnMut(&str) -> bool,
) -> bool {
    let burst: Vec<u8> = (0..100)
        .flat_map(|_| client_frame(0x9, &[b'p'; 125]))
        .collect();
    for _ in 0..40 {
        let before = s.sock.written;
        s.write_all(&burst).expect("pings");
        s.flush().expect("flush");
        *sent += s.sock.written - before;
        let mut metrics = String::new();
        let read_all = wait(|| {
            let before = *sent;
            metrics = tls_metrics(server, config, sent);
            sample(&metrics, "amp_ws_bytes_total{direction=\"in\"}") >= before as f64
        });
        assert!(read_all, "the server did not read the pings");
        if enough(&metrics) {
            return true;
        }
    }
    false
}

/// Before its hello a connection's output is bounded at 64 KiB, and over TLS that counts
/// the ciphertext waiting for the peer too: before, the pongs moved into TLS (up to 64
/// KiB of it) freed their room in the connection's own queue, so one peer held twice
/// the bound.
#[test]
fn pongs_before_hello_over_tls_count_their_ciphertext_in_the_64_kib_bound() {
    let pki = common::tls::Pki::new();
    let tls = pki.server_files(&pki.server).load().expect("server TLS");
    let server = start_tls(WsConfig::default(), tls);
    let config = pki.client_config(false);
    let mut sent = 0;
    let mut pinger = tls_pinger(&server, &config, &mut sent);
    let mut most = 0.0f64;
    // Until the pongs fill its bound and it is closed for them.
    let closed = ping_until(&server, &config, &mut pinger, &mut sent, |m| {
        most = most.max(sample(m, "amp_ws_buffered_bytes"));
        sample(m, "amp_ws_slow_consumers_total") >= 1.0
    });
    eprintln!("one TLS peer pinging before its hello held up to {most} bytes; closed: {closed}");
    assert!(
        most <= f64::from((64 << 10) + (2 << 10)),
        "{most} bytes held"
    );
    assert!(closed, "never closed for its pongs");
}

/// Connections not logged in are shed first when the memory budget is full, also over
/// TLS where what they hold is ciphertext: before, shedding one freed only its plaintext
/// (its ciphertext counted until the slot was gone, later), so the pass went through all
/// of them and then closed a logged-in session the sheds already made room for.
#[test]
fn tls_connections_not_logged_in_are_shed_before_a_logged_in_session() {
    const BUDGET: usize = 1 << 20;
    const PINGERS: usize = 12;
    let pki = common::tls::Pki::new();
    let tls = pki.server_files(&pki.server).load().expect("server TLS");
    let server = start_tls(
        WsConfig {
            max_buffered_bytes: BUDGET,
            ..WsConfig::default()
        },
        tls,
    );
    let config = pki.client_config(false);
    let mut sent = 0;
    // Each pings until the server holds 40 kB more, as ciphertext the kernel did not
    // take: within the 64 KiB bound before a hello.
    let mut pingers = Vec::new();
    let mut held = 0.0;
    for _ in 0..PINGERS {
        let mut pinger = tls_pinger(&server, &config, &mut sent);
        let start = held;
        let filled = ping_until(&server, &config, &mut pinger, &mut sent, |m| {
            held = sample(m, "amp_ws_buffered_bytes");
            held >= start + 40_000.0
        });
        assert!(filled, "the pongs never waited: {held} bytes held");
        pingers.push(pinger);
    }
    let held = held as usize;
    eprintln!("{PINGERS} TLS peers pinging before their hello hold {held} bytes");
    assert!(held < BUDGET, "{held}");

    // A logged-in session that does not read is sent half their holdings past the
    // budget: shedding some of them makes room for it.
    let stream = tls_connect(&server, config.clone(), Ipv4Addr::new(127, 0, 0, 3), true);
    let (mut session, _) = tungstenite::client(server.url(), stream).expect("upgrade");
    login_over(&mut session);
    let echo = "e".repeat(64 << 10);
    let echoes = (BUDGET - held / 2) / echo.len();
    for _ in 0..echoes {
        session.send(Message::text(echo.clone())).expect("send");
    }
    sent += session.get_ref().sock.written;
    // (Not if the session is closed before its last message is read.)
    tls_buffered_once_read(&server, &config, &mut sent);
    let sheds = sample(
        &tls_metrics(&server, &config, &mut sent),
        "amp_ws_memory_sheds_total",
    );
    eprintln!("{echoes} echoes of 64 KiB queued for the session; {sheds} connections shed");
    for i in 0..echoes {
        match session.read() {
            Ok(Message::Text(t)) => assert_eq!(t.len(), echo.len()),
            other => panic!("echo {i} of {echoes}: {other:?}"),
        }
    }
    assert!(
        sheds >= 1.0 && sheds <= PINGERS as f64,
        "{sheds} sheds for {PINGERS} connections not logged in"
    );
    drop(pingers);
}

fn login_over<S: Read + Write>(ws: &mut tungstenite::WebSocket<S>) {
    ws.send(Message::text("login")).expect("login");
    assert_eq!(ws.read().expect("login echo"), Message::text("login"));
}
