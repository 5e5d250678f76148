//! Restarts under load: nats-server going away under a running broker, and the broker
//! itself killed while messages are in flight.

mod common;

use std::time::{Duration, Instant};

use common::amp::{Broker, Client, http_get, open_config};
use common::{NatsServer, wait_until};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(15);

#[test]
fn sessions_survive_a_nats_restart_and_requests_during_the_outage_are_unavailable() {
    let mut nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    b.request(json!({"op":"subscribe","topic":"news.>","sub":"n"}));

    nats.kill();
    assert!(common::wait_until(WAIT, || http_get(
        broker.addr,
        "/healthz"
    )
    .is_some_and(|(s, _)| s == 503)));
    let during = a.request(json!({"op":"send","to":"b","body":"during","idem":"outage-1"}));
    assert_eq!(during["code"], "unavailable", "{during}");
    assert_eq!(
        a.request(json!({"op":"ping"}))["op"],
        "ok",
        "the session stays up"
    );

    nats.start_again();
    assert!(common::wait_until(WAIT, || http_get(
        broker.addr,
        "/healthz"
    )
    .is_some_and(|(s, _)| s == 200)));
    // The client retries with the same idem key, as the spec asks after `unavailable`.
    let retry = a.request(json!({"op":"send","to":"b","body":"during","idem":"outage-1"}));
    assert_eq!(retry["op"], "ok", "{retry}");
    let after = a.request(json!({"op":"send","to":"b","body":"after"}));
    assert_eq!(after["op"], "ok", "{after}");
    let mut bodies = Vec::new();
    let deadline = Instant::now() + WAIT;
    while bodies.len() < 2 && Instant::now() < deadline {
        if let Some(m) = b.next_op("message", Duration::from_secs(1)) {
            b.send(&json!({"op":"ack","seq":m["seq"]}));
            bodies.push(m["body"].clone());
        }
    }
    assert_eq!(
        bodies,
        [json!("during"), json!("after")],
        "broker log:\n{}",
        broker.log()
    );

    let published = a.request(json!({"op":"publish","topic":"news.x","body":1}));
    assert_eq!(published["op"], "ok", "{published}");
    let event = b
        .next_op("event", WAIT)
        .expect("a plain subscription resumes after the restart");
    assert_eq!(event["seq"], published["seq"]);
}

#[test]
fn a_killed_broker_loses_nothing_acknowledged_and_redelivers_what_was_not_acked() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    // Deliveries held by the dead broker come back after the ack wait.
    config["namespaces"]["acme"]["inbox"] = json!({"ack_wait_s": 2});
    let mut broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let sent: Vec<u64> = (0..10)
        .map(|i| {
            a.request(json!({"op":"send","to":"b","body":i}))["seq"]
                .as_u64()
                .expect("stored")
        })
        .collect();
    let mut acked = Vec::new();
    for i in 0..10 {
        let m = b.next_op("message", WAIT).expect("delivery");
        if i % 2 == 0 {
            let seq = m["seq"].as_u64().expect("seq");
            assert_eq!(b.request(json!({"op":"ack","seq":seq}))["op"], "ok");
            acked.push(seq);
        }
    }
    broker.kill();
    broker.restart();

    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let mut again = Vec::new();
    while let Some(m) = b.next_op("message", WAIT) {
        assert!(m["delivery"].as_u64().is_some_and(|d| d >= 2), "{m}");
        again.push(m["seq"].as_u64().expect("seq"));
        b.send(&json!({"op":"ack","seq":m["seq"]}));
        if again.len() == sent.len() - acked.len() {
            break;
        }
    }
    again.sort_unstable();
    let unacked: Vec<u64> = sent
        .iter()
        .copied()
        .filter(|s| !acked.contains(s))
        .collect();
    assert_eq!(
        again, unacked,
        "every unacknowledged message comes again, no acknowledged one does"
    );
}

#[test]
fn a_broker_restarted_at_once_under_the_same_id_still_watches_the_registry() {
    // The registry watch's consumer was named after the broker id and namespace only. A
    // broker killed and started again under the same id (systemd's restart, a
    // StatefulSet's pod) found its last process's consumer still there (it lives 15 s
    // without interest), was refused its own create, and stopped watching for good:
    // `who` and `watch` knew nobody on other brokers for the life of the process.
    let nats = NatsServer::start();
    let config = open_config(&["w", "p"]);
    let other = Broker::start_with(&nats.url(), &config, &["--broker-id", "b2"]);
    let _p = Client::login(&other, "acme", "p", "p-token");
    let mut first = Broker::start_with(&nats.url(), &config, &["--broker-id", "b1"]);
    let mut w = Client::login(&first, "acme", "w", "w-token");
    assert!(wait_until(WAIT, || lists(&mut w, "p")), "p is on broker b2");
    first.kill();
    let again = Broker::start_with(&nats.url(), &config, &["--broker-id", "b1"]);
    let mut w = Client::login(&again, "acme", "w", "w-token");
    assert!(
        wait_until(WAIT, || lists(&mut w, "p")),
        "the restarted broker never learnt of p on b2"
    );
}

fn lists(c: &mut Client, name: &str) -> bool {
    let who = c.request(json!({"op":"who"}));
    who["participants"]
        .as_array()
        .is_some_and(|ps| ps.iter().any(|p| p["name"] == name))
}
