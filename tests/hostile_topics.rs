//! Topics against hostile or careless participants: durable names that must not collide,
//! caps on subscriptions and durables with their refusals, durables that expire when
//! their subscriber does not come back, and the order of a resumed durable subscription.

mod common;

use std::time::{Duration, Instant};

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(400);

fn publish(c: &mut Client, topic: &str, body: Value) -> u64 {
    let ok = c.request(json!({"op":"publish","topic":topic,"body":body}));
    assert_eq!(ok["op"], "ok", "{ok}");
    ok["seq"].as_u64().expect("seq")
}

fn seqs(c: &mut Client, n: usize) -> Vec<u64> {
    (0..n)
        .map(|i| {
            let e = c
                .next_op("event", WAIT)
                .unwrap_or_else(|| panic!("event {i} of {n}"));
            e["seq"].as_u64().expect("seq")
        })
        .collect()
}

fn subscribe_durable(c: &mut Client, topic: &str, sub: &str) -> Value {
    c.request(json!({"op":"subscribe","topic":topic,"sub":sub,"durable":true,"from":"all"}))
}

fn ack(c: &mut Client, sub: &str, seq: u64) {
    let ok = c.request(json!({"op":"ack","sub":sub,"seq":seq}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

/// Says `bye` and waits for the broker to close, so the session's end has been handled.
fn bye(mut c: Client) {
    assert_eq!(c.request(json!({"op":"bye"}))["op"], "ok");
    assert_eq!(c.closed_with(WAIT), Some(1000), "closed after bye");
}

fn topics_config(names: &[&str], topics: Value) -> Value {
    let mut config = open_config(names);
    config["namespaces"]["acme"]["topics"] = topics;
    config
}

fn admin(nats: &NatsServer) -> amp_broker::nats::Client {
    amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
        .expect("connect to nats-server")
}

fn js(admin: &mut amp_broker::nats::Client, subject: &str, body: &[u8]) -> Value {
    let m = admin
        .request(subject, None, body, WAIT)
        .expect("JetStream answers");
    serde_json::from_slice(&m.payload).expect("JSON")
}

/// Names of the durable consumers on the namespace's topics stream.
fn durables(admin: &mut amp_broker::nats::Client) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        let page = js(
            admin,
            "$JS.API.CONSUMER.NAMES.AMP_TOPICS_acme",
            json!({"offset": names.len()}).to_string().as_bytes(),
        );
        let got: Vec<String> = page["consumers"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let total = page["total"].as_u64().unwrap_or(0) as usize;
        let empty = got.is_empty();
        names.extend(got);
        if empty || names.len() >= total {
            break;
        }
    }
    names.retain(|n| !n.starts_with("eph_"));
    names
}

#[test]
fn durable_names_of_different_participants_never_collide() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["pub", "a", "a_b"]));
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let published: Vec<u64> = (0..4).map(|i| publish(&mut p, "t.x", json!(i))).collect();

    // `a` with sub `b_c` reads and acknowledges every event, then leaves.
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert_eq!(subscribe_durable(&mut a, "t.>", "b_c")["op"], "ok");
    let got = seqs(&mut a, 4);
    assert_eq!(got, published);
    for &seq in &got {
        ack(&mut a, "b_c", seq);
    }
    bye(a);

    // `a_b` with sub `c` has a subscription of its own: every event, from the start.
    let mut ab = Client::login(&broker, "acme", "a_b", "a_b-token");
    assert_eq!(subscribe_durable(&mut ab, "t.>", "c")["op"], "ok");
    let mut got = Vec::new();
    while let Some(e) = ab.next_op("event", if got.len() < 4 { WAIT } else { QUIET }) {
        got.push(e["seq"].as_u64().expect("seq"));
    }
    assert_eq!(got, published, "a_b/c got only its own events");

    // And each resumes its own: `a` has nothing left, `a_b` has its four unacked.
    bye(ab);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert_eq!(subscribe_durable(&mut a, "t.>", "b_c")["op"], "ok");
    assert!(a.next_op("event", QUIET).is_none(), "a acked everything");
    let mut ab = Client::login(&broker, "acme", "a_b", "a_b-token");
    assert_eq!(subscribe_durable(&mut ab, "t.>", "c")["op"], "ok");
    assert_eq!(seqs(&mut ab, 4), published);

    let mut admin = admin(&nats);
    let mut names = durables(&mut admin);
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    for n in &names {
        assert!(
            n.len() <= 160
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'),
            "{n} is a plain token"
        );
    }
    assert!(names.iter().any(|n| n.contains("a_b") && n.ends_with("_c")));
    assert!(names.iter().any(|n| n.ends_with("_b_c")));
}

/// Spec 2.7: unacknowledged events of a resumed durable subscription come again first, in
/// stream order, then new ones.
fn resume_in_stream_order(events: usize, acked: usize) {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["pub", "sub"]));
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let published: Vec<u64> = (0..events)
        .map(|i| publish(&mut p, "r.x", json!(i)))
        .collect();
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    assert_eq!(subscribe_durable(&mut s, "r.>", "keep")["op"], "ok");
    // The first events, then the acks that make room for more.
    let first = seqs(&mut s, acked.min(events));
    for &seq in &first {
        ack(&mut s, "keep", seq);
    }
    // Whatever the window let through meanwhile stays unacknowledged.
    let mut seen = first.clone();
    while let Some(e) = s.next_op("event", QUIET) {
        seen.push(e["seq"].as_u64().expect("seq"));
    }
    assert_eq!(seen, published[..seen.len()], "first session in order");
    bye(s);

    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    assert_eq!(subscribe_durable(&mut s, "r.>", "keep")["op"], "ok");
    // A client that acks as it reads, so the ack window keeps moving.
    let mut got = Vec::new();
    while got.len() < events - acked {
        let Some(e) = s.next_op("event", WAIT) else {
            panic!("event {} of {}: got {got:?}", got.len(), events - acked)
        };
        let seq = e["seq"].as_u64().expect("seq");
        s.send(&json!({"op":"ack","sub":"keep","seq":seq}));
        got.push(seq);
    }
    assert_eq!(
        got,
        published[acked..],
        "unacked events again, in stream order"
    );
    let new = publish(&mut p, "r.x", json!("new"));
    assert_eq!(seqs(&mut s, 1), [new], "then new ones");
    assert!(s.next_op("event", QUIET).is_none(), "nothing twice");
}

#[test]
fn a_resumed_durable_delivers_unacked_events_in_stream_order() {
    resume_in_stream_order(5, 2);
}

#[test]
fn a_resumed_durable_keeps_stream_order_beyond_one_pull_batch() {
    // 300 events: more than one pull (and one ack window) of 256.
    resume_in_stream_order(300, 2);
}

#[test]
fn the_broker_nats_connection_refuses_subscriptions_beyond_its_bound() {
    let nats = NatsServer::start();
    let mut options = amp_broker::nats::Options::new(&nats.url());
    options.max_subscriptions = 2;
    let mut c = amp_broker::nats::Client::connect(options).expect("connect");
    let a = c.subscribe("a", None).expect("first");
    c.subscribe("b", None).expect("second");
    let e = c.subscribe("c", None).expect_err("third is refused");
    assert!(
        matches!(e, amp_broker::nats::Error::TooManySubscriptions { max: 2 }),
        "{e}"
    );
    c.unsubscribe(a, None).expect("unsubscribe");
    c.subscribe("c", None).expect("room again");
}

fn refusal(answer: &Value) -> (Option<&str>, String) {
    (
        answer["code"].as_str(),
        answer["message"].as_str().unwrap_or_default().to_string(),
    )
}

#[test]
fn a_session_holds_at_most_max_subscriptions_per_session() {
    let nats = NatsServer::start();
    let config = topics_config(&["s"], json!({"max_subscriptions_per_session": 3}));
    let broker = Broker::start(&nats.url(), &config);
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    for i in 0..3 {
        let ok = s.request(json!({"op":"subscribe","topic":"x.>","sub":format!("p{i}")}));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    let e = s.request(json!({"op":"subscribe","topic":"x.>","sub":"p3"}));
    let (code, message) = refusal(&e);
    assert_eq!(code, Some("forbidden"), "{e}");
    assert!(message.contains("at most 3 subscriptions"), "{e}");
    let e = subscribe_durable(&mut s, "x.>", "d");
    assert_eq!(refusal(&e).0, Some("forbidden"), "{e}");
    // Room again after an unsubscribe.
    assert_eq!(
        s.request(json!({"op":"unsubscribe","sub":"p0"}))["op"],
        "ok"
    );
    assert_eq!(subscribe_durable(&mut s, "x.>", "d")["op"], "ok");
}

#[test]
fn a_participant_holds_at_most_max_durables_per_participant_across_sessions() {
    let nats = NatsServer::start();
    let config = topics_config(&["s", "t"], json!({"max_durables_per_participant": 3}));
    let broker = Broker::start(&nats.url(), &config);
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    for i in 0..2 {
        assert_eq!(
            subscribe_durable(&mut s, "x.>", &format!("d{i}"))["op"],
            "ok"
        );
    }
    bye(s);
    // Left behind by the earlier session, they still count.
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    assert_eq!(subscribe_durable(&mut s, "x.>", "d2")["op"], "ok");
    let e = subscribe_durable(&mut s, "x.>", "d3");
    let (code, message) = refusal(&e);
    assert_eq!(code, Some("forbidden"), "{e}");
    assert!(message.contains("at most 3 durable subscriptions"), "{e}");
    // Plain subscriptions and resuming an existing durable are not affected.
    assert_eq!(
        s.request(json!({"op":"subscribe","topic":"x.>","sub":"plain"}))["op"],
        "ok"
    );
    bye(s);
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    assert_eq!(subscribe_durable(&mut s, "x.>", "d0")["op"], "ok");
    // Another participant has its own allowance.
    let mut t = Client::login(&broker, "acme", "t", "t-token");
    assert_eq!(subscribe_durable(&mut t, "x.>", "d3")["op"], "ok");
    // An unsubscribe deletes the durable and makes room, once JetStream has done so.
    assert_eq!(
        s.request(json!({"op":"unsubscribe","sub":"d0"}))["op"],
        "ok"
    );
    let mut admin = admin(&nats);
    let deadline = Instant::now() + WAIT;
    while durables(&mut admin).iter().any(|n| n.ends_with("_s_d0")) {
        assert!(Instant::now() < deadline, "d0 not deleted");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(subscribe_durable(&mut s, "x.>", "d3")["op"], "ok");
}

#[test]
fn a_broker_holds_at_most_max_topic_subscriptions() {
    let nats = NatsServer::start();
    let mut config = open_config(&["s", "t"]);
    config["limits"] = json!({"max_topic_subscriptions": 2});
    let broker = Broker::start(&nats.url(), &config);
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    let mut t = Client::login(&broker, "acme", "t", "t-token");
    assert_eq!(
        s.request(json!({"op":"subscribe","topic":"x.>"}))["op"],
        "ok"
    );
    assert_eq!(subscribe_durable(&mut t, "x.>", "d")["op"], "ok");
    let e = s.request(json!({"op":"subscribe","topic":"y.>"}));
    let (code, message) = refusal(&e);
    assert_eq!(code, Some("forbidden"), "{e}");
    assert!(message.contains("at most 2 topic subscriptions"), "{e}");
    // A session that ends gives its subscriptions back.
    bye(t);
    assert_eq!(
        s.request(json!({"op":"subscribe","topic":"y.>"}))["op"],
        "ok"
    );
}

#[test]
fn the_topics_stream_caps_consumers_and_the_refusal_is_clear() {
    let nats = NatsServer::start();
    let config = topics_config(&["s", "t"], json!({"max_consumers": 2}));
    let broker = Broker::start(&nats.url(), &config);
    let mut admin = admin(&nats);
    let info = js(&mut admin, "$JS.API.STREAM.INFO.AMP_TOPICS_acme", b"");
    assert_eq!(info["config"]["max_consumers"], 2, "{info}");
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    let mut t = Client::login(&broker, "acme", "t", "t-token");
    assert_eq!(subscribe_durable(&mut s, "x.>", "d")["op"], "ok");
    assert_eq!(
        t.request(json!({"op":"subscribe","topic":"x.>"}))["op"],
        "ok"
    );
    let e = subscribe_durable(&mut t, "x.>", "d");
    let (code, message) = refusal(&e);
    assert_eq!(code, Some("forbidden"), "{e}");
    assert!(message.contains("at its maximum of consumers"), "{e}");
}

#[test]
fn durables_of_a_subscriber_that_does_not_come_back_expire() {
    let nats = NatsServer::start();
    let config = topics_config(&["s"], json!({"durable_inactive_s": 1}));
    let broker = Broker::start(&nats.url(), &config);
    let mut admin = admin(&nats);
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    assert_eq!(subscribe_durable(&mut s, "x.>", "gone")["op"], "ok");
    assert_eq!(subscribe_durable(&mut s, "x.>", "kept")["op"], "ok");
    assert_eq!(durables(&mut admin).len(), 2);
    // A durable being read stays, however long.
    let name = durables(&mut admin)
        .into_iter()
        .find(|n| n.ends_with("_kept"))
        .expect("kept");
    let info = js(
        &mut admin,
        &format!("$JS.API.CONSUMER.INFO.AMP_TOPICS_acme.{name}"),
        b"",
    );
    assert_eq!(
        info["config"]["inactive_threshold"],
        json!(1_000_000_000u64),
        "{info}"
    );
    // Both are being read: they outlive the threshold.
    std::thread::sleep(Duration::from_millis(1500));
    let left = durables(&mut admin);
    assert_eq!(left.len(), 2, "read durables do not expire: {left:?}");
    bye(s);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left = durables(&mut admin);
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "durables still there: {left:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn one_participant_cannot_exhaust_the_namespace_consumers() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["x", "y"]));
    // `x` opens durables, session after session, until the broker says no.
    let mut created = 0;
    let mut refused = None;
    'sessions: for _ in 0..10 {
        let mut x = Client::login(&broker, "acme", "x", "x-token");
        for _ in 0..100 {
            let answer = subscribe_durable(&mut x, "x.>", &format!("d{created}"));
            if answer["op"] == "ok" {
                created += 1;
                continue;
            }
            let (code, message) = refusal(&answer);
            assert_eq!(code, Some("forbidden"), "{answer}");
            if message.contains("durable subscriptions") {
                refused = Some(message);
                break 'sessions;
            }
            break;
        }
        bye(x);
    }
    assert_eq!(created, 128, "{refused:?}");
    let mut y = Client::login(&broker, "acme", "y", "y-token");
    assert_eq!(subscribe_durable(&mut y, "x.>", "mine")["op"], "ok");
    assert_eq!(
        y.request(json!({"op":"subscribe","topic":"x.>"}))["op"],
        "ok"
    );
}

#[test]
fn a_durable_subscribed_again_right_after_unsubscribe_is_a_fresh_live_one() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["pub", "s"]));
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "s", "s-token");
    let old = publish(&mut p, "u.x", json!("old"));
    for round in 0..20 {
        let sub = format!("d{round}");
        assert_eq!(subscribe_durable(&mut s, "u.>", &sub)["op"], "ok");
        let unsub = s.request(json!({"op":"unsubscribe","sub":sub}));
        assert_eq!(unsub["op"], "ok", "{unsub}");
        // At once again: a new durable, read from the start, still alive afterwards.
        let again = subscribe_durable(&mut s, "u.>", &sub);
        assert_eq!(again["op"], "ok", "round {round}: {again}");
        let new = publish(&mut p, "u.y", json!(round));
        let mut got = Vec::new();
        while got.last() != Some(&new) {
            let Some(e) = s.next_op("event", WAIT) else {
                panic!("round {round}: got {got:?}, no event {new}")
            };
            if e["sub"] == sub.as_str() {
                got.push(e["seq"].as_u64().expect("seq"));
            }
        }
        assert_eq!(got.first(), Some(&old), "round {round}: {got:?}");
        assert_eq!(s.request(json!({"op":"unsubscribe","sub":sub}))["op"], "ok");
    }
}
