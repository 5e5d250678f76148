//! Hostile configuration: values chosen to overflow time and size arithmetic must stop the
//! broker at load with the member named, never start a broker that aborts in its first session.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::amp::open_config;
use common::{NatsServer, free_port};
use serde_json::{Value, json};

/// Runs `amp-broker serve` with `config`; if it exits within a few seconds returns its exit
/// code and stderr. A broker that keeps running is given one WebSocket session, so a value
/// that was accepted shows what it does to that session, then killed.
fn serve_with(nats: &NatsServer, config: &Value) -> Result<(i32, String), String> {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("config.json");
    std::fs::write(&path, config.to_string()).expect("write config");
    let log_path = dir.path().join("broker.log");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(env!("CARGO_BIN_EXE_amp-broker"))
        .args([
            "serve",
            "--nats",
            &nats.url(),
            "--listen",
            &addr,
            "--config",
        ])
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).expect("log"))
        .spawn()
        .expect("spawn amp-broker");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut probed = false;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Ok((status.code().unwrap_or(-1), log));
        }
        let healthy = common::amp::http_get(addr.parse().expect("addr"), "/healthz")
            .is_some_and(|(status, _)| status == 200);
        if healthy && !probed {
            probed = true;
            // The challenge is sent when the session opens, so this is the first session.
            let _ = tungstenite::connect(format!("ws://{addr}/amp"));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the broker started with this configuration (session probed: {probed}); log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn with_limits(limits: Value) -> Value {
    let mut config = open_config(&["a"]);
    config["limits"] = limits;
    config
}

#[test]
fn an_overflowing_hello_timeout_is_refused_at_load_naming_the_member() {
    let nats = NatsServer::start();
    let outcome = serve_with(&nats, &with_limits(json!({"hello_timeout_s": u64::MAX})));
    let (code, log) = outcome.expect("the broker must refuse the configuration");
    assert_ne!(code, 0, "{log}");
    assert!(
        log.contains("limits.hello_timeout_s: must be at most 3600"),
        "{log}"
    );
}

#[test]
fn every_overflowing_duration_is_refused_at_load_naming_the_member() {
    let nats = NatsServer::start();
    let huge = u64::MAX;
    let mut lease = open_config(&["a"]);
    lease["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": huge}});
    let mut ack_wait = open_config(&["a"]);
    ack_wait["namespaces"]["acme"]["inbox"] = json!({"ack_wait_s": huge});
    let mut max_age = open_config(&["a"]);
    max_age["namespaces"]["acme"]["topics"] = json!({"max_age_s": huge});
    let cases = [
        (
            with_limits(json!({"heartbeat_s": huge})),
            "limits.heartbeat_s: must be at most 3600",
        ),
        (
            with_limits(json!({"registry_ttl_s": huge})),
            "limits.registry_ttl_s: must be at most 86400",
        ),
        (
            lease,
            "namespaces.acme.jobs.render.lease_s: must be at most 86400",
        ),
        (
            ack_wait,
            "namespaces.acme.inbox.ack_wait_s: must be at most 86400",
        ),
        (
            max_age,
            "namespaces.acme.topics.max_age_s: must be at most 315360000",
        ),
    ];
    for (config, expected) in cases {
        let (code, log) = serve_with(&nats, &config).expect(expected);
        assert_ne!(code, 0, "{log}");
        assert!(log.contains(expected), "{expected}: {log}");
    }
}
