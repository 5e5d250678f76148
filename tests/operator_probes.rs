//! The operator's probes and metrics against the broker binary and a real nats-server:
//! `/livez` stays 200 while NATS is down and fails after the loop stalled, `/readyz`
//! follows NATS and JetStream like `/healthz`, and `/metrics` carries the build,
//! process, byte, state and round-trip families.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::NatsServer;
use common::amp::{Broker, Client, http_get, open_config};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(20);

fn status(broker: &Broker, path: &str) -> Option<u16> {
    http_get(broker.addr, path).map(|(s, _)| s)
}

fn metrics(broker: &Broker) -> String {
    let (code, body) = http_get(broker.addr, "/metrics").expect("metrics answer");
    assert_eq!(code, 200);
    body
}

/// The value of the sample `series` (name plus labels exactly as rendered).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

fn signal(broker: &Broker, name: &str) {
    let pid = broker.pid().expect("broker runs");
    let ok = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{name} {pid}");
}

#[test]
fn livez_stays_up_while_nats_is_down_and_readyz_follows_nats() {
    let mut nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    assert_eq!(status(&broker, "/livez"), Some(200));
    assert!(common::wait_until(WAIT, || status(&broker, "/readyz") == Some(200)));
    assert_eq!(status(&broker, "/healthz"), Some(200));

    nats.stop();
    assert!(common::wait_until(WAIT, || status(&broker, "/readyz") == Some(503)));
    let (code, reason) = http_get(broker.addr, "/readyz").expect("readyz answers");
    assert_eq!(code, 503, "{reason}");
    assert!(reason.contains("NATS"), "{reason}");
    assert_eq!(status(&broker, "/healthz"), Some(503));
    assert_eq!(status(&broker, "/livez"), Some(200), "alive without NATS");

    nats.start_again();
    assert!(common::wait_until(WAIT, || status(&broker, "/readyz") == Some(200)));
    assert_eq!(status(&broker, "/livez"), Some(200));
}

#[test]
fn a_stalled_loop_fails_livez_until_it_keeps_time_again() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    assert_eq!(status(&broker, "/livez"), Some(200));

    signal(&broker, "STOP");
    // The kernel completes the handshake and buffers the request while the process is
    // stopped; the answer comes from the first turns after it resumes.
    let mut probe = TcpStream::connect(broker.addr).expect("connect while stopped");
    probe
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        probe,
        "GET /livez HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .expect("request while stopped");
    // The stall itself: longer than the 2 s lag bound plus the 1 s tick.
    std::thread::sleep(Duration::from_secs(4));
    signal(&broker, "CONT");
    let mut answer = String::new();
    let _ = probe.read_to_string(&mut answer);
    assert!(
        answer.starts_with("HTTP/1.1 503 "),
        "first probe after the stall: {answer}"
    );
    assert!(answer.contains("stalled"), "{answer}");
    let text = metrics(&broker);
    assert!(sample(&text, "amp_event_loop_stalls_total").is_some_and(|n| n >= 1.0));
    assert!(sample(&text, "amp_event_loop_max_lag_seconds").is_some_and(|s| s > 2.0));

    assert!(
        common::wait_until(WAIT, || status(&broker, "/livez") == Some(200)),
        "live again once the loop has kept time: {:?}",
        http_get(broker.addr, "/livez")
    );
}

#[test]
fn metrics_carry_build_process_bytes_states_and_round_trips() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");

    let before = metrics(&broker);
    let build = before
        .lines()
        .find(|l| l.starts_with("amp_build_info{"))
        .expect("amp_build_info");
    assert!(
        build.starts_with(&format!(
            "amp_build_info{{version=\"{}\",git_commit=\"",
            env!("CARGO_PKG_VERSION")
        )),
        "{build}"
    );
    assert!(build.ends_with("\"} 1"), "{build}");
    assert!(before.contains("# TYPE process_cpu_seconds_total counter\n"));
    assert!(sample(&before, "process_resident_memory_bytes").is_some_and(|v| v > 1e6));
    assert!(sample(&before, "process_cpu_seconds_total").is_some_and(|v| v >= 0.0));
    assert!(sample(&before, "process_open_fds").is_some_and(|v| v >= 5.0));
    assert!(sample(&before, "amp_ws_connections_by_state{state=\"open\"}") == Some(2.0));
    assert!(sample(&before, "amp_ws_outbound_queued_bytes").is_some());
    let ws_in = sample(&before, "amp_ws_bytes_total{direction=\"in\"}").expect("ws in");
    let ws_out = sample(&before, "amp_ws_bytes_total{direction=\"out\"}").expect("ws out");
    let nats_in = sample(&before, "amp_nats_bytes_total{direction=\"in\"}").expect("nats in");
    let nats_out = sample(&before, "amp_nats_bytes_total{direction=\"out\"}").expect("nats out");
    let publishes = "amp_nats_request_duration_seconds_count{op=\"stream_publish\"}";
    let sent_before = sample(&before, publishes).expect("stream_publish series");

    let body = "x".repeat(2000);
    let ok = a.request(json!({"op":"send","to":"b","body":body}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let message = b.next_op("message", WAIT).expect("delivered");
    b.send(&json!({"op":"ack","seq":message["seq"]}));

    let after = metrics(&broker);
    let grew = |series: &str, was: f64, by: f64| {
        let now = sample(&after, series).unwrap_or(0.0);
        assert!(now >= was + by, "{series}: {was} -> {now}");
    };
    grew("amp_ws_bytes_total{direction=\"in\"}", ws_in, 2000.0);
    grew("amp_ws_bytes_total{direction=\"out\"}", ws_out, 2000.0);
    grew("amp_nats_bytes_total{direction=\"in\"}", nats_in, 2000.0);
    grew("amp_nats_bytes_total{direction=\"out\"}", nats_out, 2000.0);
    grew(publishes, sent_before, 1.0);
    let bucket = "amp_nats_request_duration_seconds_bucket{op=\"stream_publish\",le=\"+Inf\"}";
    assert_eq!(sample(&after, bucket), sample(&after, publishes));
    assert!(
        sample(
            &after,
            "amp_nats_request_duration_seconds_sum{op=\"stream_publish\"}"
        )
        .is_some_and(|s| s > 0.0)
    );
}
