//! The broker's log against the binary and a real nats-server: with `--log-format json`
//! every line is one JSON object with a time, a level and a message, the hello line carries
//! the session and participant as fields, and no token a client sent appears anywhere.

mod common;

use std::time::Duration;

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

fn lines(log: &str) -> Vec<Value> {
    log.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn json_log_lines_carry_ids_and_never_the_token() {
    let nats = NatsServer::start();
    let mut broker = Broker::start_with(
        &nats.url(),
        &open_config(&["a"]),
        &["--log-format", "json", "--log-level", "debug"],
    );
    let mut a = Client::connect(&broker);
    let ok = a.request(json!({"op":"hello","ns":"acme","name":"a",
        "auth":{"type":"token","token":"a-token"}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut wrong = Client::connect(&broker);
    let refused = wrong.request(json!({"op":"hello","ns":"acme","name":"a",
        "auth":{"type":"token","token":"wrong-secret-token"}}));
    assert_eq!(refused["op"], "error", "{refused}");

    let hello = |log: &str| {
        lines(log)
            .into_iter()
            .find(|l| l["msg"] == "hello" && l["participant"] == "acme/a")
    };
    assert!(
        common::wait_until(WAIT, || hello(&broker.log()).is_some()),
        "no hello line; log:\n{}",
        broker.log()
    );
    assert!(
        common::wait_until(WAIT, || broker.log().contains("hello refused")),
        "no refusal line; log:\n{}",
        broker.log()
    );
    let status = broker.terminate();
    assert!(status.is_some_and(|s| s.success()), "exit {status:?}");

    let log = broker.log();
    let all = lines(&log);
    assert!(all.len() >= 4, "{log}");
    for l in &all {
        let ts = l["ts"].as_str().unwrap_or_default();
        assert!(
            ts.len() == 24 && ts.ends_with('Z') && ts.as_bytes()[19] == b'.',
            "ts {ts}"
        );
        assert!(
            ["error", "warn", "info", "debug", "trace"]
                .contains(&l["level"].as_str().unwrap_or("")),
            "{l}"
        );
        assert!(l["msg"].is_string(), "{l}");
    }
    let hello = hello(&log).expect("hello line");
    assert_eq!(hello["level"], "info");
    assert_eq!(hello["session"], ok["session"], "{hello}");
    let refused = all
        .iter()
        .find(|l| l["msg"] == "hello refused")
        .expect("refusal line");
    assert_eq!(refused["participant"], "acme/a", "{refused}");
    assert!(refused["peer"].is_string(), "{refused}");
    assert!(log.contains("listening on ws://"), "{log}");
    assert!(!log.contains("a-token"), "{log}");
    assert!(!log.contains("wrong-secret-token"), "{log}");
}

/// The end of a session is one line as its start is: at `info` with the session and
/// the participant for one that logged in, saying who closed it and how; nothing at
/// `info` for a connection that never logged in (anyone can make those).
#[test]
fn a_sessions_end_is_logged_with_its_participant_and_close_code() {
    let nats = NatsServer::start();
    let mut broker = Broker::start_with(
        &nats.url(),
        &open_config(&["a", "b", "c"]),
        &["--log-format", "json"],
    );
    let a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    // Gone without a close frame.
    drop(Client::login(&broker, "acme", "c", "c-token"));
    let mut ws = a.into_websocket();
    use tungstenite::protocol::{CloseFrame, frame::coding::CloseCode};
    let normal = CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    };
    ws.close(Some(normal)).expect("close");
    let _ = ws.flush();
    assert_eq!(b.request(json!({"op":"bye"}))["op"], "ok");
    assert_eq!(b.closed_with(WAIT), Some(1000));
    drop(Client::connect(&broker));

    let ended = |log: &str| -> Vec<Value> {
        lines(log)
            .into_iter()
            .filter(|l| {
                l["msg"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("session ended"))
            })
            .collect()
    };
    assert!(
        common::wait_until(WAIT, || ended(&broker.log()).len() >= 3),
        "no end lines; log:\n{}",
        broker.log()
    );
    let status = broker.terminate();
    assert!(status.is_some_and(|s| s.success()), "exit {status:?}");
    let log = broker.log();
    let ended = ended(&log);
    let of = |p: &str| ended.iter().find(|l| l["participant"] == p);
    let a_end = of("acme/a").unwrap_or_else(|| panic!("no end line for a:\n{log}"));
    assert_eq!(a_end["msg"], "session ended: 1000 by the peer", "{a_end}");
    assert_eq!(a_end["level"], "info");
    assert!(a_end["session"].is_string(), "{a_end}");
    let b_end = of("acme/b").unwrap_or_else(|| panic!("no end line for b:\n{log}"));
    assert_eq!(b_end["msg"], "session ended: 1000 bye", "{b_end}");
    let c_end = of("acme/c").unwrap_or_else(|| panic!("no end line for c:\n{log}"));
    assert_eq!(
        c_end["msg"], "session ended: 1006 connection lost",
        "{c_end}"
    );
    // Each once, and none for the connection that never said hello (it is at `debug`).
    assert_eq!(ended.len(), 3, "{log}");
}
