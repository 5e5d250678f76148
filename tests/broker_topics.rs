//! Topics end to end: publish, subscribe with every `from`, wildcards, unsubscribe and
//! durable subscriptions resumed after a reconnect.

mod common;

use std::time::Duration;

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);
const QUIET: Duration = Duration::from_millis(400);

fn setup() -> (NatsServer, Broker) {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["pub", "sub"]));
    (nats, broker)
}

fn publish(c: &mut Client, topic: &str, body: Value) -> u64 {
    let ok = c.request(json!({"op":"publish","topic":topic,"body":body}));
    assert_eq!(ok["op"], "ok", "{ok}");
    ok["seq"].as_u64().expect("seq")
}

fn events(c: &mut Client, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            c.next_op("event", WAIT)
                .unwrap_or_else(|| panic!("event {i} of {n}"))
        })
        .collect()
}

#[test]
fn subscribers_get_new_events_in_order_with_wildcards() {
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    publish(&mut p, "orders.eu.created", json!("before"));
    let ok = s.request(json!({"op":"subscribe","topic":"orders.*.created","sub":"eu"}));
    assert_eq!(ok, json!({"op":"ok","re":ok["re"],"sub":"eu"}));
    let seqs: Vec<u64> = (0..5)
        .map(|i| {
            publish(
                &mut p,
                if i % 2 == 0 {
                    "orders.eu.created"
                } else {
                    "orders.us.created"
                },
                json!(i),
            )
        })
        .collect();
    publish(&mut p, "orders.eu.deleted", json!("not matched"));
    let got = events(&mut s, 5);
    assert_eq!(
        got.iter()
            .map(|e| e["seq"].as_u64().unwrap_or(0))
            .collect::<Vec<_>>(),
        seqs
    );
    assert_eq!(got[1]["topic"], "orders.us.created");
    assert_eq!(got[0]["from"], "acme/pub");
    assert_eq!(got[0]["sub"], "eu");
    assert_eq!(got[3]["body"], json!(3));
    assert!(s.next_op("event", QUIET).is_none(), "nothing else matched");
}

#[test]
fn from_all_last_seq_and_time_replay_the_stream() {
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let a1 = publish(&mut p, "t.a", json!(1));
    let b1 = publish(&mut p, "t.b", json!(2));
    // Timestamps have millisecond precision: keep the cut clear of both neighbours.
    std::thread::sleep(Duration::from_millis(20));
    let middle = amp_broker::rfc3339::format_system_time(std::time::SystemTime::now());
    std::thread::sleep(Duration::from_millis(20));
    let a2 = publish(&mut p, "t.a", json!(3));

    s.request(json!({"op":"subscribe","topic":"t.*","sub":"all","from":"all"}));
    let all: Vec<u64> = events(&mut s, 3)
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    assert_eq!(all, [a1, b1, a2]);

    s.request(json!({"op":"subscribe","topic":"t.*","sub":"last","from":"last"}));
    let mut last: Vec<u64> = events(&mut s, 2)
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    last.sort_unstable();
    assert_eq!(last, [b1, a2], "the last event of each topic");

    s.request(json!({"op":"subscribe","topic":"t.*","sub":"seq","from":{"seq":b1}}));
    let from_seq: Vec<u64> = events(&mut s, 2)
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    assert_eq!(from_seq, [b1, a2]);

    s.request(json!({"op":"subscribe","topic":"t.*","sub":"time","from":{"time":middle}}));
    let from_time: Vec<u64> = events(&mut s, 1)
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    assert_eq!(from_time, [a2]);
    assert!(s.next_op("event", QUIET).is_none());
}

#[test]
fn unsubscribe_stops_events_and_unknown_subscriptions_are_not_found() {
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let ok = s.request(json!({"op":"subscribe","topic":"x.>"}));
    let sub = ok["sub"].as_str().expect("generated sub name").to_string();
    publish(&mut p, "x.1", json!(1));
    assert_eq!(events(&mut s, 1)[0]["sub"], sub.as_str());
    let again = s.request(json!({"op":"subscribe","topic":"x.>","sub":sub}));
    assert_eq!(
        (again["code"].as_str(), again["path"].as_str()),
        (Some("conflict"), Some("/sub")),
        "{again}"
    );
    assert_eq!(
        s.request(json!({"op":"unsubscribe","id":"u","sub":sub})),
        json!({"op":"ok","re":"u"})
    );
    publish(&mut p, "x.2", json!(2));
    assert!(s.next_op("event", QUIET).is_none());
    let e = s.request(json!({"op":"unsubscribe","sub":sub}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("not_found"), Some("/sub")),
        "{e}"
    );
}

#[test]
fn topic_permissions_cover_publish_and_every_topic_a_pattern_can_match() {
    let nats = NatsServer::start();
    let mut config = open_config(&["p"]);
    config["namespaces"]["acme"]["participants"]["p"]["permissions"]["publish"] =
        json!(["orders.eu.*"]);
    config["namespaces"]["acme"]["participants"]["p"]["permissions"]["subscribe"] =
        json!(["orders.eu.>"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut c = Client::login(&broker, "acme", "p", "p-token");
    let e = c.request(json!({"op":"publish","topic":"orders.us.created","body":1}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("forbidden"), Some("/topic")),
        "{e}"
    );
    let e = c.request(json!({"op":"subscribe","topic":"orders.*.created"}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("forbidden"), Some("/topic")),
        "{e}"
    );
    assert_eq!(
        c.request(json!({"op":"subscribe","topic":"orders.eu.*"}))["op"],
        "ok"
    );
    assert_eq!(
        c.request(json!({"op":"publish","topic":"orders.eu.created","body":1}))["op"],
        "ok"
    );
}

#[test]
fn a_durable_subscription_resumes_with_unacked_events_first() {
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let ok = s.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true}));
    assert_eq!(ok["sub"], "keep", "{ok}");
    let e1 = publish(&mut p, "d.1", json!(1));
    let e2 = publish(&mut p, "d.2", json!(2));
    let got = events(&mut s, 2);
    assert_eq!(
        got.iter()
            .filter_map(|e| e["seq"].as_u64())
            .collect::<Vec<_>>(),
        [e1, e2]
    );
    assert_eq!(
        s.request(json!({"op":"ack","id":"k","sub":"keep","seq":e1})),
        json!({"op":"ok","re":"k"})
    );
    drop(s);
    let e3 = publish(&mut p, "d.3", json!(3));

    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let ok =
        s.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true,"from":"new"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let got = events(&mut s, 2);
    assert_eq!(
        got.iter()
            .filter_map(|e| e["seq"].as_u64())
            .collect::<Vec<_>>(),
        [e2, e3],
        "unacked first, then new"
    );
    for e in &got {
        s.send(&json!({"op":"ack","sub":"keep","seq":e["seq"]}));
    }
    assert!(s.next_op("event", QUIET).is_none());
    let other = s.request(json!({"op":"subscribe","topic":"other.>","sub":"keep2","durable":true}));
    assert_eq!(other["op"], "ok");
    drop(s);
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let clash = s.request(json!({"op":"subscribe","topic":"d.*","sub":"keep","durable":true}));
    assert_eq!(
        (clash["code"].as_str(), clash["path"].as_str()),
        (Some("conflict"), Some("/sub")),
        "{clash}"
    );
}

#[test]
fn a_new_durable_subscription_starts_where_its_from_says() {
    // Spec 2.3: `from` defaults to `new` and is ignored only when a durable is resumed.
    // Every new durable replayed the whole stream, whatever its `from`.
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let seqs: Vec<u64> = (1..=3).map(|i| publish(&mut p, "t.x", json!(i))).collect();
    let ok = s.request(json!({"op":"subscribe","topic":"t.x","sub":"new","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let ok = s.request(
        json!({"op":"subscribe","topic":"t.x","sub":"seq","durable":true,"from":{"seq":seqs[1]}}),
    );
    assert_eq!(ok["op"], "ok", "{ok}");
    let from_seq = events(&mut s, 2);
    assert!(
        from_seq.iter().all(|e| e["sub"] == "seq"),
        "only the one from seq 2 replays: {from_seq:?}"
    );
    assert_eq!(
        from_seq
            .iter()
            .map(|e| e["seq"].as_u64())
            .collect::<Vec<_>>(),
        vec![Some(seqs[1]), Some(seqs[2])]
    );
    assert!(s.next_op("event", QUIET).is_none(), "nothing more");
    let later = publish(&mut p, "t.x", json!(4));
    let mut got: Vec<(String, u64)> = events(&mut s, 2)
        .iter()
        .map(|e| {
            (
                e["sub"].as_str().unwrap_or_default().to_string(),
                e["seq"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("new".to_string(), later), ("seq".to_string(), later)]
    );
    // A `from` that is no time is refused for a durable too (it was not even read).
    let bad = s.request(
        json!({"op":"subscribe","topic":"t.x","sub":"bad","durable":true,"from":{"time":"yesterday"}}),
    );
    assert_eq!(bad["code"], "schema", "{bad}");
}

#[test]
fn a_durable_subscribe_refused_for_another_topic_leaves_its_reader_alone() {
    // Spec 2.6: a request that fails changes nothing. The take-over came first: the
    // session reading the durable lost it to a subscribe that was then refused.
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s1 = Client::login(&broker, "acme", "sub", "sub-token");
    let mut s2 = Client::login(&broker, "acme", "sub", "sub-token");
    let ok = s1.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    publish(&mut p, "d.a", json!(1));
    let first = events(&mut s1, 1).remove(0);
    let other = s2.request(json!({"op":"subscribe","topic":"d.*","sub":"keep","durable":true}));
    assert_eq!(other["code"], "conflict", "{other}");
    publish(&mut p, "d.b", json!(2));
    let second = s1.next_op("event", WAIT);
    assert_eq!(
        second.as_ref().map(|e| &e["body"]),
        Some(&json!(2)),
        "{second:?}"
    );
    let ok = s1.request(json!({"op":"ack","id":"a1","sub":"keep","seq":first["seq"]}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn durables_subscribed_without_a_name_get_names_of_their_own() {
    // Named `s<n>` from a counter each broker starts at 1: after a restart, or on another
    // broker, a new durable got an old one's name, events and place.
    let (_nats, broker) = setup();
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let a = s.request(json!({"op":"subscribe","topic":"t.a","durable":true}));
    let b = s.request(json!({"op":"subscribe","topic":"t.b","durable":true}));
    let (a, b) = (
        a["sub"].as_str().unwrap_or(""),
        b["sub"].as_str().unwrap_or(""),
    );
    assert!(a.len() > 20 && b.len() > 20 && a != b, "{a} {b}");
}

#[test]
fn a_durable_resumed_after_its_broker_was_killed_gets_the_unacked_event_first() {
    // The killed broker cannot hand event 2 back: it comes again only after its ack wait
    // (30 s), while the consumer would hand the resumed session newer events at once.
    let nats = NatsServer::start();
    let config = open_config(&["pub", "sub"]);
    let mut doomed = Broker::start(&nats.url(), &config);
    let other = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&other, "acme", "pub", "pub-token");
    let sub = json!({"op":"subscribe","topic":"k.>","sub":"keep","durable":true});
    let mut s = Client::login(&doomed, "acme", "sub", "sub-token");
    assert_eq!(s.request(sub.clone())["op"], "ok");
    let (e1, e2) = (
        publish(&mut p, "k.1", json!(1)),
        publish(&mut p, "k.2", json!(2)),
    );
    assert_eq!(events(&mut s, 2).len(), 2);
    let ack = s.request(json!({"op":"ack","sub":"keep","seq":e1}));
    assert_eq!(ack["op"], "ok", "{ack}");
    doomed.kill();

    let mut s = Client::login(&other, "acme", "sub", "sub-token");
    assert_eq!(s.request(sub)["op"], "ok");
    let e3 = publish(&mut p, "k.3", json!(3));
    let got: Vec<u64> = (0..2)
        .filter_map(|_| s.next_op("event", Duration::from_secs(45)))
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    assert_eq!(
        got,
        [e2, e3],
        "the event the killed broker held first, then the new one; log:\n{}",
        other.log()
    );
}

/// Two brokers; `sub`'s durable `keep` read on broker one by `old`, which holds events
/// `held` unacknowledged.
struct Held {
    nats: NatsServer,
    one: Broker,
    two: Broker,
    p: Client,
    old: Client,
    sub: Value,
    held: [u64; 2],
}

fn held_on_broker_one() -> Held {
    let nats = NatsServer::start();
    let config = open_config(&["pub", "sub"]);
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&two, "acme", "pub", "pub-token");
    let sub = json!({"op":"subscribe","topic":"m.>","sub":"keep","durable":true});
    let mut old = Client::login(&one, "acme", "sub", "sub-token");
    assert_eq!(old.request(sub.clone())["op"], "ok");
    let held = [
        publish(&mut p, "m.1", json!(1)),
        publish(&mut p, "m.2", json!(2)),
    ];
    assert_eq!(events(&mut old, 2).len(), 2);
    Held {
        nats,
        one,
        two,
        p,
        old,
        sub,
        held,
    }
}

/// The new session gets the held events, then `later`, within 10 s (an event dropped
/// on the way comes only after its 30 s ack wait).
fn held_then_later_within_10_s(new: &mut Client, held: [u64; 2], later: u64) {
    let started = std::time::Instant::now();
    let got: Vec<u64> = events(new, 3)
        .iter()
        .filter_map(|e| e["seq"].as_u64())
        .collect();
    assert_eq!(got, [held[0], held[1], later]);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the events came only after {:?}",
        started.elapsed()
    );
}

/// The test's own JetStream client, to look at consumers.

#[test]
fn a_durable_resumed_on_another_broker_takes_it_over_from_the_old_session() {
    // The client's old connection to broker one is still open (not yet seen to end): it
    // holds events 1 and 2 unacknowledged. Before, the old session kept reading the
    // durable, its events came to the new one only when it ended (or after their ack
    // wait), and new events went to either.
    let Held {
        nats: _nats,
        one: _one,
        two,
        mut p,
        mut old,
        sub,
        held,
    } = held_on_broker_one();

    let mut new = Client::login(&two, "acme", "sub", "sub-token");
    assert_eq!(new.request(sub)["op"], "ok");
    let later = publish(&mut p, "m.3", json!(3));
    held_then_later_within_10_s(&mut new, held, later);
    // The old session reads it no more.
    publish(&mut p, "m.4", json!(4));
    assert!(events(&mut new, 1)[0]["seq"].as_u64() > Some(later));
    assert!(old.next_op("event", QUIET).is_none());
}

#[test]
fn an_event_the_old_broker_had_read_with_the_take_over_reaches_the_new_session() {
    // Broker one does not run (a loaded node) while the new session subscribes and m.3
    // is published: its old pull, still first in the server's queue, gets m.3, and one
    // read then brings broker one the take-over and m.3 together. It dropped the
    // subscription for the take-over and then the delivery as addressed to nobody, with
    // no nak: m.3 waited out the 30 s ack wait.
    let Held {
        nats,
        one,
        two,
        mut p,
        old: _old,
        sub,
        held,
    } = held_on_broker_one();

    one.signal(libc::SIGSTOP);
    let mut new = Client::login(&two, "acme", "sub", "sub-token");
    assert_eq!(new.request(sub)["op"], "ok");
    let later = publish(&mut p, "m.3", json!(3));
    let mut js = nats.jetstream();
    let consumer = amp_broker::broker::binding::durable_sub_consumer("sub", "keep");
    let delivered = common::wait_until(Duration::from_secs(10), || {
        js.consumer_info("AMP_TOPICS_acme", &consumer)
            .is_ok_and(|i| i.delivered.stream_seq >= later)
    });
    one.signal(libc::SIGCONT);
    assert!(delivered, "m.3 is delivered to a pull");
    held_then_later_within_10_s(&mut new, held, later);
}

/// The highest stream sequence delivered to `sub`'s durable `all`, or when not
/// `durable` to any other consumer of acme's topics.
fn pulled(js: &mut amp_broker::jetstream::Context, durable: bool) -> u64 {
    let name = amp_broker::broker::binding::durable_sub_consumer("sub", "all");
    js.consumer_names("AMP_TOPICS_acme")
        .unwrap_or_default()
        .iter()
        .filter(|c| (**c == name) == durable)
        .filter_map(|c| js.consumer_info("AMP_TOPICS_acme", c).ok())
        .map(|i| i.delivered.stream_seq)
        .max()
        .unwrap_or(0)
}

/// Publishes `n` events of `body` to `r.x`, pipelined 500 at a time (within the
/// requests a session may have in flight).
fn backlog(broker: &Broker, n: usize, body: &str) {
    let mut p = Client::login(broker, "acme", "pub", "pub-token");
    for chunk in (0..n).step_by(500) {
        let last = (chunk + 500).min(n);
        for i in chunk..last {
            p.send(&json!({"op":"publish","id":format!("p{i}"),"topic":"r.x","body":body}));
        }
        let ok = p.answer_to(&format!("p{}", last - 1));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
}

/// Subscribes to the backlog through a client whose receive buffer is small from the
/// handshake on (the kernel holds little for it) and that reads nothing for a while:
/// long enough for the broker to pull the whole backlog if it would. Then reads `n`
/// events (acknowledging them when durable) and returns their sequence numbers.
fn replay_to_a_slow_reader(
    nats: &NatsServer,
    broker: &Broker,
    n: usize,
    durable: bool,
) -> Vec<u64> {
    // Connected before the replay keeps the server busy.
    let mut js = nats.jetstream();
    let tcp = common::connect_with(std::net::Ipv4Addr::LOCALHOST, broker.addr, Some(4096));
    let mut s = Client::connect_over(broker, tcp).hello("acme", "sub", "sub-token");
    let ok = s.request(
        json!({"op":"subscribe","topic":"r.>","sub":"all","from":"all","durable":durable}),
    );
    assert_eq!(ok["op"], "ok", "{ok}");
    common::wait_until(Duration::from_secs(3), || {
        pulled(&mut js, durable) >= n as u64
    });
    eprintln!(
        "pulled while the client did not read: {}",
        pulled(&mut js, durable)
    );
    (0..n)
        .map(|i| {
            let e = s
                .next_op("event", WAIT)
                .unwrap_or_else(|| panic!("event {i} of {n}: {:?}", s.next_op("_closed", QUIET)));
            let seq = e["seq"].as_u64().expect("seq");
            if durable {
                s.send(&json!({"op":"ack","sub":"all","seq":seq}));
            }
            seq
        })
        .collect()
}

#[test]
fn a_replay_comes_as_fast_as_the_client_reads_not_as_fast_as_the_server_sends() {
    // A plain subscription acknowledges nothing, so nothing paced its pulls: a replay of
    // a backlog larger than the session's outbound bound was pulled whole and closed the
    // session as a slow consumer whenever the client read slower than the server sent.
    // Before, at event 9,361 of 12,000; now it pulls as the socket takes them.
    const EVENTS: usize = 12_000;
    let nats = NatsServer::start();
    let mut config = open_config(&["pub", "sub"]);
    config["limits"] = json!({"max_outbound_bytes": 256 << 10,
                              "max_frames_per_s": 100_000, "frame_burst": 100_000});
    let broker = Broker::start(&nats.url(), &config);
    backlog(&broker, EVENTS, &"x".repeat(200));
    let seqs = replay_to_a_slow_reader(&nats, &broker, EVENTS, false);
    assert_eq!(seqs.len(), EVENTS);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in order");
}

#[test]
fn a_replay_of_large_events_is_pulled_by_bytes_not_by_count() {
    // 60 events of 150 kB: a batch (256 events) or a durable window (256 unacknowledged
    // events) of them is twice the session's outbound bound (4 MiB). Before, both the
    // plain and the durable replay closed the session as a slow consumer.
    const EVENTS: usize = 60;
    let (nats, broker) = setup();
    backlog(&broker, EVENTS, &"x".repeat(150_000));
    for durable in [false, true] {
        let seqs = replay_to_a_slow_reader(&nats, &broker, EVENTS, durable);
        assert_eq!(
            seqs,
            (1..=EVENTS as u64).collect::<Vec<_>>(),
            "durable: {durable}"
        );
    }
}

#[test]
fn idempotent_publishes_answer_the_same_seq() {
    let (_nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let a = p.request(json!({"op":"publish","topic":"i.x","body":1,"idem":"once"}));
    let b = p.request(json!({"op":"publish","topic":"i.x","body":1,"idem":"once"}));
    assert_eq!(
        (a["dup"].as_bool(), b["dup"].as_bool()),
        (Some(false), Some(true))
    );
    assert_eq!(a["seq"], b["seq"]);
}

#[test]
fn subscriptions_whose_consumers_are_deleted_are_made_again_where_they_stood() {
    // A plain subscription's consumer lives in memory on one server of a cluster, and
    // goes with it; an operator may delete any. Their pulls were answered 503 once a
    // second for as long as the session lasted, and no event reached it.
    let (nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let ok = s.request(json!({"op":"subscribe","topic":"t.plain","sub":"plain"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let ok = s.request(json!({"op":"subscribe","topic":"t.durable","sub":"d","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let plain = publish(&mut p, "t.plain", json!(1));
    let acked = publish(&mut p, "t.durable", json!(1));
    let out = publish(&mut p, "t.durable", json!(2));
    let mut got: Vec<(String, u64)> = events(&mut s, 3)
        .iter()
        .map(|e| {
            (
                e["sub"].as_str().unwrap_or_default().to_string(),
                e["seq"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            ("d".to_string(), acked),
            ("d".to_string(), out),
            ("plain".to_string(), plain)
        ]
    );
    s.send(&json!({"op":"ack","sub":"d","seq":acked}));
    let mut js = nats.jetstream();
    let consumers = js.consumer_names("AMP_TOPICS_acme").expect("names");
    assert_eq!(consumers.len(), 2, "{consumers:?}");
    for c in &consumers {
        assert!(js.delete_consumer("AMP_TOPICS_acme", c).expect("delete"));
    }
    let later_plain = publish(&mut p, "t.plain", json!(2));
    let later_durable = publish(&mut p, "t.durable", json!(3));
    let mut got: Vec<(String, u64)> = Vec::new();
    while got.len() < 2 {
        let e = s
            .next_op("event", Duration::from_secs(20))
            .unwrap_or_else(|| {
                panic!(
                    "{got:?} after the consumers were deleted; broker log:\n{}",
                    broker.log()
                )
            });
        got.push((
            e["sub"].as_str().unwrap_or_default().to_string(),
            e["seq"].as_u64().unwrap_or_default(),
        ));
    }
    got.sort();
    // The durable's unacknowledged event comes again only if the session had not seen
    // it: it had, so it is not sent twice; the acknowledged one never again.
    assert_eq!(
        got,
        [
            ("d".to_string(), later_durable),
            ("plain".to_string(), later_plain)
        ]
    );
    assert!(s.next_op("event", QUIET).is_none());
    assert_eq!(
        js.consumer_names("AMP_TOPICS_acme").expect("names").len(),
        2
    );
    // The event out is still acknowledged through the consumer made again.
    s.send(&json!({"op":"ack","sub":"d","seq":out}));
    s.send(&json!({"op":"ack","sub":"d","seq":later_durable}));
    let durable = js
        .consumer_names("AMP_TOPICS_acme")
        .expect("names")
        .into_iter()
        .find(|c| c.starts_with("dsub_"))
        .expect("the durable");
    assert!(common::wait_until(WAIT, || js
        .consumer_info("AMP_TOPICS_acme", &durable)
        .is_ok_and(|i| i.num_ack_pending == 0)));
}

#[test]
fn a_subscription_whose_consumer_cannot_be_made_again_tries_until_it_can() {
    // The topics stream itself gone (an operator's mistake, restored from nothing): the
    // subscriptions' consumers cannot be made again until the stream is back, and the
    // stream's sequences start again at 1, below the last event each subscription saw.
    // Before: the one attempt failed and the subscription got nothing more for good; then,
    // made again after its old last sequence, it heard nothing until the new stream passed
    // it.
    let (nats, broker) = setup();
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut s = Client::login(&broker, "acme", "sub", "sub-token");
    let ok = s.request(json!({"op":"subscribe","topic":"t.x","sub":"x"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let ok = s.request(json!({"op":"subscribe","topic":"t.x","sub":"d","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    for i in 0..5 {
        publish(&mut p, "t.x", json!(i));
    }
    let got = events(&mut s, 10);
    for e in got.iter().filter(|e| e["sub"] == "d") {
        s.send(&json!({"op":"ack","sub":"d","seq":e["seq"]}));
    }
    let mut js = nats.jetstream();
    let info = js.stream_info("AMP_TOPICS_acme").expect("stream");
    assert!(js.delete_stream("AMP_TOPICS_acme").expect("delete"));
    // The pull loops find their consumers gone and the stream with them; the broker makes
    // the stream again (`lost_streams.rs`), and the subscriptions' retries find it.
    assert!(common::wait_until(WAIT, || broker
        .log()
        .contains("topics stream unavailable")));
    assert!(common::wait_until(WAIT, || js
        .stream_info("AMP_TOPICS_acme")
        .is_ok_and(|back| back.config.subjects == info.config.subjects)));
    let seq = publish(&mut p, "t.x", json!("after"));
    assert_eq!(seq, 1, "the stream starts again");
    let mut after: Vec<Value> = (0..2)
        .map(|i| {
            s.next_op("event", Duration::from_secs(15))
                .unwrap_or_else(|| {
                    panic!(
                        "event {i} after the stream came back; broker log:\n{}",
                        broker.log()
                    )
                })
        })
        .collect();
    after.sort_by_key(|e| e["sub"].as_str().unwrap_or_default().to_string());
    for (e, sub) in after.iter().zip(["d", "x"]) {
        assert_eq!(
            (&e["sub"], &e["body"], &e["seq"]),
            (&json!(sub), &json!("after"), &json!(1))
        );
    }
    // The durable's ack of the new seq 1 is taken.
    let ok = s.request(json!({"op":"ack","sub":"d","seq":1,"id":"a1"}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn a_durable_subscribe_refused_for_another_topic_on_another_broker_leaves_its_reader_alone() {
    // The take-over message named no topic: broker one ended its session's reading of the
    // durable for a subscribe on broker two that its consumer lookup then refused.
    let nats = NatsServer::start();
    let config = open_config(&["pub", "sub"]);
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&two, "acme", "pub", "pub-token");
    let mut reader = Client::login(&one, "acme", "sub", "sub-token");
    let ok = reader.request(json!({"op":"subscribe","topic":"x.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    publish(&mut p, "x.a", json!(1));
    let first = events(&mut reader, 1).remove(0);
    let mut other = Client::login(&two, "acme", "sub", "sub-token");
    let refused =
        other.request(json!({"op":"subscribe","topic":"x.*","sub":"keep","durable":true}));
    assert_eq!(refused["code"], "conflict", "{refused}");
    publish(&mut p, "x.b", json!(2));
    let second = reader.next_op("event", WAIT);
    assert_eq!(
        second.as_ref().map(|e| &e["body"]),
        Some(&json!(2)),
        "{second:?}"
    );
    let ok = reader.request(json!({"op":"ack","id":"a1","sub":"keep","seq":first["seq"]}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn a_durable_gets_every_event_its_broker_lost_in_reconnects_and_keeps_flowing() {
    // Broker one reaches NATS through a relay. Three times the link goes silent while
    // the server sends broker one's pull a batch, and is then cut: the batch is lost on
    // the way, out to the consumer but never seen. After their ack wait those events
    // came back behind the session's last event, were never sent (`passed`), and each
    // held one of the durable's 256 unacknowledged slots for as long as the session
    // lasted.
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let config = open_config(&["pub", "sub"]);
    let one = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&two, "acme", "pub", "pub-token");
    let mut s = Client::login(&one, "acme", "sub", "sub-token");
    let ok = s.request(json!({"op":"subscribe","topic":"r.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut js = nats.jetstream();
    let consumer = amp_broker::broker::binding::durable_sub_consumer("sub", "keep");
    let mut delivered_through = |seq: u64| {
        common::wait_until(WAIT, || {
            js.consumer_info("AMP_TOPICS_acme", &consumer)
                .is_ok_and(|i| i.delivered.stream_seq >= seq)
        })
    };
    let mut published = vec![publish(&mut p, "r.x", json!("first"))];
    let first = events(&mut s, 1).remove(0);
    assert_eq!(
        s.request(json!({"op":"ack","sub":"keep","seq":first["seq"]}))["op"],
        "ok"
    );
    for round in 1..=3 {
        relay.freeze();
        let lost: Vec<u64> = (0..20)
            .map(|n| publish(&mut p, "r.x", json!({"round": round, "n": n})))
            .collect();
        let last = lost[lost.len() - 1];
        assert!(delivered_through(last), "round {round}: the batch went out");
        relay.cut();
        relay.restore();
        assert!(
            common::wait_until(WAIT, || common::amp::metric(
                &one,
                "amp_nats_reconnects_total"
            ) == Some(f64::from(round))),
            "round {round}: broker one is back"
        );
        published.extend(lost);
        // Pulled again after the reconnect: it reaches the consumer's new pull.
        let after = publish(&mut p, "r.x", json!({"round": round, "after": true}));
        assert!(delivered_through(after), "round {round}: pulled again");
        published.push(after);
    }
    let mut missing: std::collections::BTreeSet<u64> = published[1..].iter().copied().collect();
    // The lost events come again after their 30 s ack wait.
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while !missing.is_empty() && std::time::Instant::now() < until {
        if let Some(e) = s.next_op("event", Duration::from_secs(1)) {
            let seq = e["seq"].as_u64().unwrap_or_default();
            missing.remove(&seq);
            got.push(seq);
            s.send(&json!({"op":"ack","sub":"keep","seq":seq}));
        }
    }
    assert!(
        missing.is_empty(),
        "never delivered: {missing:?}, got {got:?}; broker log:\n{}",
        one.log()
    );
    // Held until the lost ones came again, in stream order (spec 2.3).
    assert_eq!(got, published[1..], "in stream order, each once");
    // The durable flows on, and no event holds an unacknowledged slot. (The publisher's
    // session, unread meanwhile, missed the broker's pings.)
    let mut p = Client::login(&two, "acme", "pub", "pub-token");
    let later = publish(&mut p, "r.x", json!("later"));
    let e = events(&mut s, 1).remove(0);
    assert_eq!(e["seq"].as_u64(), Some(later), "{e}");
    s.send(&json!({"op":"ack","sub":"keep","seq":later}));
    let mut js = nats.jetstream();
    assert!(
        common::wait_until(WAIT, || js
            .consumer_info("AMP_TOPICS_acme", &consumer)
            .is_ok_and(|i| i.num_ack_pending == 0)),
        "events left unacknowledged"
    );
}

#[test]
fn a_durable_consumer_lost_before_its_first_event_is_made_again_where_it_started() {
    // The durable's consumer is deleted before it delivered anything, while broker one's
    // link to NATS is silent, and events are published meanwhile. Made again from the
    // subscribe's `from` ("new"), the consumer started after them: never delivered.
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let config = open_config(&["pub", "sub"]);
    let one = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&two, "acme", "pub", "pub-token");
    let mut s = Client::login(&one, "acme", "sub", "sub-token");
    publish(&mut p, "n.x", json!("before"));
    let ok = s.request(json!({"op":"subscribe","topic":"n.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    relay.freeze();
    let mut js = nats.jetstream();
    let consumer = amp_broker::broker::binding::durable_sub_consumer("sub", "keep");
    assert!(
        js.delete_consumer("AMP_TOPICS_acme", &consumer)
            .expect("delete")
    );
    let missed: Vec<u64> = (0..3).map(|n| publish(&mut p, "n.x", json!(n))).collect();
    relay.cut();
    relay.restore();
    let got: Vec<u64> = (0..3)
        .map(|i| {
            s.next_op("event", Duration::from_secs(20))
                .unwrap_or_else(|| {
                    panic!(
                        "event {i} of {missed:?} after the consumer was made again; broker log:\n{}",
                        one.log()
                    )
                })["seq"]
                .as_u64()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(
        got, missed,
        "from where the first consumer started, in order"
    );
    for seq in &got {
        s.send(&json!({"op":"ack","sub":"keep","seq":seq}));
    }
    let later = publish(&mut p, "n.x", json!("later"));
    assert_eq!(events(&mut s, 1)[0]["seq"].as_u64(), Some(later));
    assert!(s.next_op("event", QUIET).is_none(), "nothing twice");
}
