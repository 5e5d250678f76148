//! Faults against real nats-server: restart, failover, discovered servers, lame duck mode,
//! a stopped (stale) server, a full reconnect buffer, garbage from the server.

mod common;

use amp_broker::nats::{Client, Error, Event, Options, RequestError};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);

fn options(urls: &str) -> Options {
    let mut o = Options::new(urls)
        .with_reconnect_delay(Duration::from_millis(20), Duration::from_millis(250));
    o.no_randomize = true;
    o
}

/// Pumps until an event matches; returns it.
fn wait_for(c: &mut Client, what: &str, mut f: impl FnMut(&Event) -> bool) -> Event {
    let mut found = None;
    let ok = c
        .run_until(WAIT, |e| {
            if f(e) {
                found = Some(e.clone());
                true
            } else {
                false
            }
        })
        .expect("pump");
    assert!(ok, "no {what} event within {WAIT:?}");
    found.expect("event")
}

fn server_id(c: &Client) -> String {
    c.connection()
        .server_info()
        .expect("info")
        .server_id
        .clone()
}

#[test]
fn server_restart_reconnects_restores_subscriptions_and_delivers_buffered_publishes() {
    let mut server = common::NatsServer::start();
    let mut c = Client::connect(options(&server.url())).expect("connect");
    let sid = c.subscribe("restart.>", None).expect("sub");
    c.flush(WAIT).expect("flush");

    // A request in flight when the server goes away fails with its own error.
    let mut silent = Client::connect(options(&server.url())).expect("connect");
    silent.subscribe("restart.silent", None).expect("sub");
    silent.flush(WAIT).expect("flush");
    let now = std::time::Instant::now();
    let req = c
        .connection_mut()
        .request("restart.silent", None, b"?", Duration::from_secs(30), now)
        .expect("request");
    c.flush(WAIT).expect("request written");

    server.kill();
    wait_for(&mut c, "Disconnected", |e| {
        matches!(e, Event::Disconnected { .. })
    });
    let failed = c.wait_response(req, std::time::Instant::now() + WAIT);
    assert_eq!(
        failed.expect_err("request lost"),
        RequestError::Disconnected
    );

    for i in 0..5u8 {
        c.publish("restart.buffered", None, None, &[i])
            .expect("buffered");
    }
    assert!(c.connection().reconnect_buffered() > 0);
    server.restart();
    wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    assert_eq!(c.connection().reconnect_buffered(), 0);

    let mut got = Vec::new();
    for _ in 0..5 {
        let m = c
            .next_message(sid, WAIT)
            .expect("pump")
            .expect("buffered message");
        got.push(m.payload[0]);
    }
    assert_eq!(
        got,
        [0, 1, 2, 3, 4],
        "buffered publishes delivered in order"
    );

    // The restored subscription also sees other publishers.
    let mut other = Client::connect(options(&server.url())).expect("connect");
    other
        .publish("restart.after", None, None, b"x")
        .expect("pub");
    other.flush(WAIT).expect("flush");
    let m = c
        .next_message(sid, WAIT)
        .expect("pump")
        .expect("after restart");
    assert_eq!(m.subject, "restart.after");
    assert_eq!(c.connection().stats().reconnects, 1);
}

#[test]
fn failover_moves_to_the_next_server_in_the_list() {
    let mut a = common::NatsServer::start();
    let b = common::NatsServer::start();
    let mut c = Client::connect(options(&format!("{},{}", a.url(), b.url()))).expect("connect");
    assert_eq!(
        c.connection().connected_server().map(|s| s.port),
        Some(a.port)
    );
    let sid = c.subscribe("fo", None).expect("sub");
    c.flush(WAIT).expect("flush");
    a.kill();
    let event = wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    assert!(matches!(event, Event::Reconnected { server } if server.port == b.port));
    let mut other = Client::connect(options(&b.url())).expect("connect b");
    other.publish("fo", None, None, b"on b").expect("pub");
    other.flush(WAIT).expect("flush");
    let m = c
        .next_message(sid, WAIT)
        .expect("pump")
        .expect("message on b");
    assert_eq!(m.payload, b"on b");
}

#[test]
fn connect_urls_from_a_cluster_are_used_to_fail_over() {
    let (pa, pb) = (common::free_port(), common::free_port());
    let cluster = |name: &str, own: u16, peer: u16| {
        format!(
            "server_name: {name}\n\
             cluster {{ name: c1, listen: 127.0.0.1:{own}, routes: [nats://127.0.0.1:{peer}] }}"
        )
    };
    let mut a = common::NatsServer::with_config(&cluster("a", pa, pb));
    let b = common::NatsServer::with_config(&cluster("b", pb, pa));
    // Only A is configured; B must be learned from A's INFO.
    let mut c = Client::connect(options(&a.url())).expect("connect");
    let b_port = b.port;
    let deadline = std::time::Instant::now() + WAIT;
    while !c
        .connection()
        .discovered_servers()
        .iter()
        .any(|s| s.port == b_port)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "B not discovered: {:?}",
            c.connection().servers()
        );
        c.run_until(Duration::from_millis(50), |_| false)
            .expect("pump");
    }
    a.kill();
    let event = wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    assert!(matches!(event, Event::Reconnected { server } if server.port == b_port));
    drop(b);
}

#[test]
fn lame_duck_mode_moves_the_client_to_another_server() {
    let ldm = "lame_duck_grace_period: 1s\nlame_duck_duration: 30s";
    let a = common::NatsServer::with_config(ldm);
    let b = common::NatsServer::with_config(ldm);
    let mut c = Client::connect(options(&format!("{},{}", a.url(), b.url()))).expect("connect");
    let first = server_id(&c);
    let sid = c.subscribe("ldm", None).expect("sub");
    c.flush(WAIT).expect("flush");

    let status = Command::new(common::nats_server_bin())
        .arg("--signal")
        .arg(format!("ldm={}", a.pid().expect("pid")))
        .status()
        .expect("signal ldm");
    assert!(status.success());
    wait_for(&mut c, "LameDuck", |e| matches!(e, Event::LameDuck));
    let event = wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    assert!(matches!(event, Event::Reconnected { server } if server.port == b.port));
    assert_ne!(server_id(&c), first);
    c.publish("ldm", None, None, b"moved").expect("pub");
    let m = c
        .next_message(sid, WAIT)
        .expect("pump")
        .expect("subscription on b");
    assert_eq!(m.payload, b"moved");
}

#[test]
fn a_server_that_stops_answering_is_detected_as_stale() {
    let server = common::NatsServer::start();
    let pid = server.pid().expect("pid") as i32;
    let o = options(&server.url()).with_ping_interval(Duration::from_millis(200), 2);
    let mut c = Client::connect(o).expect("connect");
    // SAFETY: kill(2) on the pid of a child this test started; no memory is shared.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let started = std::time::Instant::now();
    let event = wait_for(&mut c, "Disconnected", |e| {
        matches!(e, Event::Disconnected { .. })
    });
    let took = started.elapsed();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(
        matches!(&event, Event::Disconnected { reason } if reason.contains("stale")),
        "{event:?}"
    );
    assert!(took < Duration::from_secs(3), "{took:?}");
    wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    c.flush(WAIT).expect("usable again");
}

#[test]
fn reconnect_buffer_refuses_publishes_when_full_and_delivers_the_accepted_ones() {
    let mut server = common::NatsServer::start();
    let mut o = options(&server.url());
    o.reconnect_buffer_size = 1024;
    let mut c = Client::connect(o).expect("connect");
    let sid = c.subscribe("buf", None).expect("sub");
    c.flush(WAIT).expect("flush");
    server.kill();
    wait_for(&mut c, "Disconnected", |e| {
        matches!(e, Event::Disconnected { .. })
    });
    let mut accepted = 0u32;
    let err = loop {
        match c.publish("buf", None, None, &accepted.to_be_bytes()) {
            Ok(()) => accepted += 1,
            Err(e) => break e,
        }
        assert!(accepted < 1000, "buffer never filled");
    };
    assert_eq!(err, Error::ReconnectBufferFull { capacity: 1024 });
    assert!(accepted > 10);
    server.restart();
    wait_for(&mut c, "Reconnected", |e| {
        matches!(e, Event::Reconnected { .. })
    });
    for i in 0..accepted {
        let m = c.next_message(sid, WAIT).expect("pump").expect("buffered");
        assert_eq!(m.payload, i.to_be_bytes());
    }
    assert!(
        c.next_message(sid, Duration::from_millis(200))
            .expect("pump")
            .is_none()
    );
}

#[test]
fn garbage_from_a_server_closes_the_connection_with_a_protocol_error() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let fake = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.write_all(b"INFO {\"server_id\":\"fake\",\"max_payload\":1024}\r\n")
            .expect("info");
        let mut buf = [0u8; 4096];
        let mut seen = Vec::new();
        while !seen.ends_with(b"PING\r\n") {
            let n = s.read(&mut buf).expect("read");
            assert!(n > 0, "client hung up before PING");
            seen.extend_from_slice(&buf[..n]);
        }
        s.write_all(b"PONG\r\nMSG not a valid line at all\r\n\x00\x01garbage\r\n")
            .expect("garbage");
        // Hold the socket until the client drops it.
        let _ = s.read(&mut buf);
    });
    let mut o = options(&format!("nats://{addr}"));
    o.allow_reconnect = false;
    let mut c = Client::connect(o).expect("handshake with the fake server");
    let event = wait_for(&mut c, "Disconnected", |e| {
        matches!(e, Event::Disconnected { .. })
    });
    assert!(
        matches!(&event, Event::Disconnected { reason } if reason.contains("protocol error")),
        "{event:?}"
    );
    wait_for(&mut c, "Closed", |e| matches!(e, Event::Closed { .. }));
    assert!(c.connection().is_closed());
    fake.join().expect("fake server");
}

#[test]
fn a_server_that_stops_reading_fills_the_bounded_write_buffer_with_a_defined_error() {
    let server = common::NatsServer::start();
    let pid = server.pid().expect("pid") as i32;
    let mut o = options(&server.url());
    o.max_write_buffer = 1024 * 1024;
    let mut c = Client::connect(o).expect("connect");
    // SAFETY: kill(2) on the pid of a child this test started; no memory is shared.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let chunk = vec![b'w'; 60 * 1024];
    let mut result = Ok(());
    for _ in 0..10_000 {
        // Non-blocking publishes; the pump writes what the socket takes.
        result = c.connection_mut().publish("fill", None, None, &chunk);
        if result.is_err() {
            break;
        }
        c.run_until(Duration::from_millis(1), |_| false)
            .expect("pump");
    }
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_eq!(
        result,
        Err(Error::WriteBufferFull {
            capacity: 1024 * 1024
        })
    );
    c.flush(WAIT).expect("drains once the server reads again");
}
