//! Jobs under faults, end to end: broker processes on a real nats-server, workers and
//! submitters over real WebSockets. A heartbeat that comes just after its lease ran out,
//! and the nats-server restarting under a broker with tasks in every state.

mod common;

use std::time::{Duration, SystemTime};

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

fn config(names: &[&str], lease_s: u64, offer_ms: u64) -> Value {
    let mut c = open_config(names);
    c["namespaces"]["acme"]["jobs"] =
        json!({"render": {"lease_s": lease_s, "offer_ms": offer_ms, "max_attempts": 3}});
    c
}

fn login(broker: &Broker, name: &str) -> Client {
    Client::login(broker, "acme", name, &format!("{name}-token"))
}

fn login_serving(broker: &Broker, name: &str, slots: u32) -> Client {
    let mut c = Client::connect(broker);
    let ok = c.request(json!({
        "op":"hello","ns":"acme","name":name,
        "auth":{"type":"token","token":format!("{name}-token")},
        "serve":[{"job":"render","slots":slots}]
    }));
    assert_eq!(ok["op"], "ok", "hello: {ok}");
    c
}

fn status(c: &mut Client, task: &str) -> Value {
    let r = c.request(json!({"op":"status","task":task}));
    assert_eq!(r["op"], "ok", "status: {r}");
    r["task"].clone()
}

fn millis(rfc3339: &str) -> i128 {
    amp_broker::rfc3339::parse_nanos(rfc3339).expect("RFC 3339 time") / 1_000_000
}

fn wall_millis() -> i128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i128)
}

/// Who held each lease of the task, in order, from its history.
fn lease_holders(task: &Value) -> Vec<String> {
    task["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter(|h| h["state"] == "leased")
        .filter_map(|h| h["by"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn a_heartbeat_just_after_the_lease_ran_out_gets_lease_lost_and_the_next_holders_result_stands() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1", "w2"], 1, 5000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"L","body":"work"}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = w1.next_op("offer", WAIT).expect("offer");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("L"), &json!(1))
    );
    let claim = w1.request(json!({"op":"claim","task":"L"}));
    assert_eq!(claim["op"], "ok", "{claim}");
    let lease_until = claim["lease_until"]
        .as_str()
        .expect("lease_until")
        .to_string();
    let until_ms = millis(&lease_until);
    // Joins after the claim, so it has been idle longest when the task comes back.
    let mut w2 = login_serving(&broker, "w2", 1);

    // w1 goes quiet until just past lease_until, then heartbeats at once: whether or not
    // the broker has noticed the expiry yet, the lease is gone and is not extended.
    assert!(common::wait_until(WAIT, || wall_millis() > until_ms));
    let late = w1.request(json!({"op":"heartbeat","task":"L","progress":{"pct":90}}));
    assert_eq!(late["op"], "error", "{late}");
    assert_eq!(late["code"], "lease_lost", "{late}");
    assert!(late.get("lease_until").is_none(), "{late}");
    let revoked = w1.next_op("revoked", WAIT).expect("revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"L","reason":"lease_expired"})
    );
    let s = status(&mut app, "L");
    if s["holder"] == "acme/w1" {
        assert_eq!(s["lease_until"], lease_until.as_str(), "not extended: {s}");
    }

    // JetStream redelivers after the lease: the second attempt goes to w2.
    let offer = w2.next_op("offer", WAIT).expect("re-offer");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("L"), &json!(2))
    );
    assert_eq!(
        w2.request(json!({"op":"claim","task":"L"}))["op"],
        "ok",
        "w2 claims"
    );
    for frame in [
        json!({"op":"heartbeat","task":"L"}),
        json!({"op":"complete","task":"L","result":"stale"}),
    ] {
        let r = w1.request(frame.clone());
        assert_eq!(r["code"], "lease_lost", "{frame} while w2 holds: {r}");
    }
    let s = status(&mut app, "L");
    assert_eq!(
        (&s["state"], &s["holder"]),
        (&json!("leased"), &json!("acme/w2"))
    );
    assert_eq!(s["attempt"], 2);
    let k = w2.request(json!({"op":"complete","task":"L","result":"w2 result"}));
    assert_eq!(k["op"], "ok", "{k}");
    let late = w1.request(json!({"op":"complete","task":"L","result":"stale"}));
    assert_eq!(late["code"], "lease_lost", "w1 complete after w2's: {late}");

    let msg = app.next_op("message", WAIT).expect("task_result");
    assert_eq!(
        msg["body"],
        json!({"task":"L","state":"completed","attempts":2,"result":"w2 result"})
    );
    app.send(&json!({"op":"ack","seq":msg["seq"]}));
    let s = status(&mut app, "L");
    assert_eq!(s["state"], "completed");
    assert_eq!(s["result"], "w2 result");
    assert_eq!(s["attempt"], 2);
    assert_eq!(lease_holders(&s), ["acme/w1", "acme/w2"]);
    let states: Vec<&str> = s["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|h| h["state"].as_str())
        .collect();
    assert_eq!(
        states,
        [
            "queued",
            "offered",
            "leased",
            "queued",
            "offered",
            "leased",
            "completed"
        ]
    );
    // w1 never saw the task again.
    assert!(w1.next_op("offer", Duration::from_millis(200)).is_none());
}
