//! Inbox consumers against JetStream's consumer limits, on a real nats-server: since 2.15
//! a stream that sets no `max_consumers` holds at most 1,000 consumers, and every
//! participant that ever logged in keeps its durable inbox consumer. The broker sets the
//! inbox stream's limit itself (`inbox.max_consumers`), raises it on a stream an earlier
//! version created without one, and tells a participant whose consumer JetStream refuses
//! instead of leaving it without deliveries. A crowd logging in at once (a broker's
//! restart) gets its consumers a few at a time, each asked for once.

mod common;

use std::time::Duration;

use amp_broker::broker::binding::{self, StreamSettings};
use amp_broker::jetstream::{ConsumerAction, Context};
use amp_broker::nats::{Client as NatsClient, Options};
use common::amp::{Broker, Client, http_get, metric, open_config, token_hash};
use common::{NatsServer, wait_until};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);
const OPEN_TOKEN: &str = "open-token";

/// Named participants `a` and `b`, and any other name through the namespace's `open`
/// entry (token [`OPEN_TOKEN`]).
fn open_namespace_config() -> Value {
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["open"] = json!({
        "token_sha256": token_hash(OPEN_TOKEN),
        "permissions": {"send": [">"]},
    });
    config
}

fn has_inbox_consumer(js: &mut Context, name: &str) -> bool {
    js.consumer_info("AMP_INBOX_acme", &binding::inbox_consumer(name))
        .is_ok()
}

#[test]
fn a_participant_after_the_first_thousand_still_gets_its_messages() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_namespace_config());
    let mut js = nats.jetstream();
    // A thousand participants that logged in once: their durables stay.
    for i in 0..1000 {
        let config = binding::inbox_consumer_config("acme", &format!("p{i}"), 30, 64);
        js.create_consumer("AMP_INBOX_acme", &config, ConsumerAction::Create)
            .unwrap_or_else(|e| panic!("consumer {i}: {e}"));
    }
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut late = Client::login(&broker, "acme", "late", OPEN_TOKEN);
    let ok = a.request(json!({"op":"send","id":"s1","to":"late","body":"after a thousand"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let msg = late.next_op("message", WAIT).unwrap_or_else(|| {
        panic!(
            "no delivery to the 1,001st participant; broker log:\n{}",
            broker.log()
        )
    });
    assert_eq!(msg["body"], "after a thousand");
    let inbox = js.stream_info("AMP_INBOX_acme").expect("inbox stream");
    assert_eq!(
        serde_json::to_value(&inbox.config).expect("json")["max_consumers"],
        10_000
    );
}

#[test]
fn a_refused_inbox_consumer_is_reported_and_the_messages_come_once_there_is_room() {
    let nats = NatsServer::start();
    // Not open, so its listed participants' consumers are made at their first hello.
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["inbox"] = json!({"max_consumers": 2});
    let broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    // A consumer the broker did not make (an operator's, or one left by a participant
    // no longer listed) takes the room kept for `b`.
    let old = binding::inbox_consumer_config("acme", "old", 30, 64);
    js.create_consumer("AMP_INBOX_acme", &old, ConsumerAction::Create)
        .expect("old consumer");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert!(
        wait_until(WAIT, || has_inbox_consumer(&mut js, "a")),
        "a's inbox consumer"
    );

    // The stream is full: b's consumer is refused, and b is told so.
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let told = b.next_op("error", WAIT).expect("b is told");
    assert_eq!(told["code"], "unavailable", "{told}");
    assert!(told.get("re").is_none(), "{told}");
    let text = told["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("inbox") && text.contains("maximum consumers limit reached"),
        "{text}"
    );
    // A second session of b, while it lasts, is told at its hello.
    let mut b2 = Client::login(&broker, "acme", "b", "b-token");
    let told = b2
        .next_op("error", WAIT)
        .expect("b's second session is told");
    assert_eq!(told["code"], "unavailable", "{told}");

    // What is sent to b meanwhile is kept.
    let ok = a.request(json!({"op":"send","id":"s1","to":"b","body":"kept"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert!(b.next_op("message", Duration::from_millis(300)).is_none());

    // Room again (an operator removed the old durable): the broker's next request
    // succeeds and the message arrives.
    assert!(
        js.delete_consumer("AMP_INBOX_acme", &binding::inbox_consumer("old"))
            .expect("delete the old consumer")
    );
    let (mut first, mut second) = (None, None);
    assert!(
        wait_until(Duration::from_secs(20), || {
            first = first
                .take()
                .or_else(|| b.next_op("message", Duration::from_millis(50)));
            second = second
                .take()
                .or_else(|| b2.next_op("message", Duration::from_millis(50)));
            first.is_some() || second.is_some()
        }),
        "the kept message after room was made; broker log:\n{}",
        broker.log()
    );
    let msg = first.or(second).expect("one delivery");
    assert_eq!(msg["body"], "kept");
    assert!(broker.log().contains("inbox consumer created after"));
}

/// Names not listed (an `open` entry lets any name in) cannot take the inbox consumers
/// a namespace keeps for its listed participants: before, anyone holding the open
/// token could log in under as many made-up names as the stream's `max_consumers`, and
/// every listed participant logging in for the first time afterwards got no inbox.
#[test]
fn made_up_names_cannot_take_the_inboxes_kept_for_listed_participants() {
    let nats = NatsServer::start();
    let mut config = open_namespace_config();
    config["namespaces"]["acme"]["inbox"] = json!({"max_consumers": 4});
    let broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    // Room for 4: a and b are listed, so made-up names get the other two (one after the
    // other, so which two is known).
    let mut made_up: Vec<Client> = Vec::new();
    for i in 0..3 {
        made_up.push(Client::login(&broker, "acme", &format!("x{i}"), OPEN_TOKEN));
        if i < 2 {
            let name = format!("x{i}");
            assert!(
                wait_until(WAIT, || has_inbox_consumer(&mut js, &name)),
                "{name}'s inbox"
            );
        }
    }
    let told = made_up[2]
        .next_op("error", WAIT)
        .expect("the third made-up name is told");
    assert_eq!(told["code"], "unavailable", "{told}");
    let text = told["message"].as_str().unwrap_or_default();
    assert!(text.contains("names not listed have the rest"), "{text}");
    assert!(!has_inbox_consumer(&mut js, "x2"));
    // The listed participant logging in for the first time gets its inbox.
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","id":"s1","to":"b","body":"for b"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let msg = b
        .next_op("message", WAIT)
        .unwrap_or_else(|| panic!("no delivery to listed b; broker log:\n{}", broker.log()));
    assert_eq!(msg["body"], "for b");
    // A made-up name that has its inbox keeps it when it comes back.
    drop(made_up.remove(0));
    let mut x0 = Client::login(&broker, "acme", "x0", OPEN_TOKEN);
    let ok = a.request(json!({"op":"send","id":"s2","to":"x0","body":"back"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let msg = x0.next_op("message", WAIT).expect("x0's message");
    assert_eq!(msg["body"], "back");
}

#[test]
fn an_inbox_stream_without_a_consumer_limit_gets_one_and_an_operators_limit_stays() {
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    // As the broker's earlier versions created it: no max_consumers.
    let mut earlier = binding::inbox_stream_config("acme", 0, 1, StreamSettings::default());
    earlier.max_consumers = None;
    js.create_stream(&earlier).expect("earlier inbox stream");
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    let info = js.stream_info("AMP_INBOX_acme").expect("inbox stream");
    assert_eq!(info.config.max_consumers, Some(10_000));
    assert!(
        broker
            .log()
            .contains("adopted stream AMP_INBOX_acme ($JS.API), its max_consumers set to 10000"),
        "{}",
        broker.log()
    );
    drop(broker);

    let mut tuned = info.config.clone();
    tuned.max_consumers = Some(20_000);
    js.update_stream(&tuned).expect("an operator's limit");
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    let info = js.stream_info("AMP_INBOX_acme").expect("inbox stream");
    assert_eq!(info.config.max_consumers, Some(20_000));
    assert!(
        broker
            .log()
            .contains("adopted stream AMP_INBOX_acme ($JS.API)\n")
    );
}

fn inbox_consumers_waiting(broker: &Broker) -> Option<f64> {
    metric(broker, "amp_inbox_consumers_waiting")
}

#[test]
fn a_login_storm_asks_for_each_inbox_consumer_once_and_every_inbox_is_delivered() {
    const N: usize = 3000;
    let nats = NatsServer::start();
    let mut config = open_namespace_config();
    config["namespaces"]["acme"]["inbox"] = json!({"max_consumers": N + 16});
    // One address holding every connection, all waiting for their hello at once: as
    // behind a proxy, where both per-address caps and the waiting share are raised.
    config["limits"] = json!({"max_connections_per_ip": N + 16, "connect_burst_per_ip": N + 16,
        "max_waiting_connections": N + 16, "hello_timeout_s": 60});
    let broker = Broker::start(&nats.url(), &config);
    let mut spy = NatsClient::connect(Options::new(&nats.url())).expect("spy");
    let creates = spy
        .subscribe("$JS.API.CONSUMER.CREATE.AMP_INBOX_acme.>", None)
        .expect("subscribe");
    spy.flush(WAIT).expect("flush");
    // Read while the crowd logs in: a spy that only read afterwards held some 2 MB
    // unread for seconds, and nats-server may cut a reader that slow.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spying = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut asked = std::collections::HashMap::<String, u32>::new();
            loop {
                match spy.next_message(creates, Duration::from_millis(500)) {
                    Ok(Some(m)) => *asked.entry(m.subject).or_default() += 1,
                    Ok(None) if done.load(std::sync::atomic::Ordering::Relaxed) => break,
                    Ok(None) => {}
                    Err(e) => panic!("the spy's connection: {e}"),
                }
            }
            asked
        })
    };

    // Every socket first, then every hello at once: the crowd a restarted broker sees.
    let mut sessions: Vec<Client> = (0..N).map(|_| Client::connect(&broker)).collect();
    for (i, c) in sessions.iter_mut().enumerate() {
        c.send(
            &json!({"op":"hello","id":"h","ns":"acme","name":format!("p{i}"),
            "auth":{"type":"token","token":OPEN_TOKEN}}),
        );
    }
    for c in &mut sessions {
        let ok = c.answer_to("h");
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    let mut js = nats.jetstream();
    assert!(
        wait_until(Duration::from_secs(90), || js
            .consumer_names("AMP_INBOX_acme")
            .is_ok_and(|n| n.len() == N + 2)),
        "every participant's inbox consumer (and listed a's and b's, kept from the start)"
    );
    assert!(
        wait_until(WAIT, || inbox_consumers_waiting(&broker) == Some(0.0)),
        "inbox consumers still waiting: {:?}",
        inbox_consumers_waiting(&broker)
    );
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let asked = spying.join().expect("spy");
    assert_eq!(asked.len(), N, "one creation per participant");
    let again: Vec<_> = asked.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        again.is_empty(),
        "asked more than once: {:?}",
        &again[..again.len().min(5)]
    );
    assert!(
        !broker.log().contains("inbox consumer request failed"),
        "{}",
        broker.log()
    );
    // Every inbox is read: a message to the first and to the last arrives.
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    for i in [0, N - 1] {
        let ok = a.request(json!({"op":"send","id":format!("s{i}"),"to":format!("p{i}"),"body":i}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let msg = sessions[i].next_op("message", WAIT).expect("delivery");
        assert_eq!(msg["body"], i);
    }
}

#[test]
fn inboxes_asked_for_while_nats_is_away_are_all_made_once_it_is_back() {
    // More than the creations out at once (32): a slot kept by a request that failed with
    // the connection would leave some participant without an inbox for good.
    const N: usize = 80;
    let mut nats = NatsServer::start();
    let mut config = open_namespace_config();
    config["limits"] = json!({"max_connections_per_ip": N + 16, "connect_burst_per_ip": N + 16});
    let broker = Broker::start(&nats.url(), &config);
    let health = |want: u16| {
        wait_until(WAIT, || {
            http_get(broker.addr, "/readyz").is_some_and(|(s, _)| s == want)
        })
    };
    // The hellos go out, and NATS goes away while their creations are being sent: some
    // are lost with the connection, the rest wait for the next one.
    let mut sessions: Vec<Client> = (0..N).map(|_| Client::connect(&broker)).collect();
    for (i, c) in sessions.iter_mut().enumerate() {
        c.send(
            &json!({"op":"hello","id":"h","ns":"acme","name":format!("q{i}"),
            "auth":{"type":"token","token":OPEN_TOKEN}}),
        );
    }
    nats.kill();
    for c in &mut sessions {
        let ok = c.answer_to("h");
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    assert!(health(503), "NATS is away");

    nats.start_again();
    assert!(health(200), "NATS is back");
    assert!(
        wait_until(Duration::from_secs(60), || inbox_consumers_waiting(&broker)
            == Some(0.0)),
        "inbox consumers still waiting: {:?}; broker log:\n{}",
        inbox_consumers_waiting(&broker),
        broker.log()
    );
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    for i in [0, N / 2, N - 1] {
        let ok = a.request(json!({"op":"send","id":format!("s{i}"),"to":format!("q{i}"),"body":i}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let msg = sessions[i]
            .next_op("message", WAIT)
            .unwrap_or_else(|| panic!("no delivery to q{i}; broker log:\n{}", broker.log()));
        assert_eq!(msg["body"], i);
    }
}

/// A participant a reload lists in an open namespace has its room kept from the reload
/// on, before it ever logs in.
#[test]
fn a_participant_a_reload_lists_keeps_its_inbox_from_made_up_names() {
    let nats = NatsServer::start();
    let mut config = open_namespace_config();
    config["namespaces"]["acme"]["inbox"] = json!({"max_consumers": 4});
    let broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    let mut with_c = config.clone();
    with_c["namespaces"]["acme"]["participants"]["c"] = json!({
        "token_sha256": token_hash("c-token"),
        "permissions": {"send": [">"]},
    });
    broker.reload(&with_c, "reloaded");
    assert!(
        wait_until(WAIT, || has_inbox_consumer(&mut js, "c")),
        "c's inbox consumer made at the reload; broker log:\n{}",
        broker.log()
    );
    // a, b and c are listed: one made-up name gets the last place, the next is refused.
    let _x0 = Client::login(&broker, "acme", "x0", OPEN_TOKEN);
    assert!(wait_until(WAIT, || has_inbox_consumer(&mut js, "x0")));
    let mut x1 = Client::login(&broker, "acme", "x1", OPEN_TOKEN);
    let told = x1.next_op("error", WAIT).expect("x1 is told");
    assert_eq!(told["code"], "unavailable", "{told}");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut c = Client::login(&broker, "acme", "c", "c-token");
    let ok = a.request(json!({"op":"send","id":"s1","to":"c","body":"for c"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let msg = c.next_op("message", WAIT).expect("c's message");
    assert_eq!(msg["body"], "for c");
}

/// An open namespace takes any name: each that came once left its registry delete marker
/// in the bucket for good (a new subject per name, replayed by every broker's registry
/// watch at each start). The marker now expires as the entry would have.
#[test]
fn names_that_came_once_leave_nothing_in_the_registry() {
    let nats = NatsServer::start();
    let mut config = open_namespace_config();
    config["limits"] = json!({"registry_ttl_s": 2});
    let broker = Broker::start(&nats.url(), &config);
    for i in 0..20 {
        let c = Client::login(&broker, "acme", &format!("once{i}"), OPEN_TOKEN);
        drop(c);
    }
    let mut js = nats.jetstream();
    let kv = binding::registry_stream_config("acme", 2, Default::default()).name;
    let mut last = None;
    let gone = common::wait_until(Duration::from_secs(30), || {
        let state = js.stream_info(&kv).map(|i| i.state);
        let empty = state
            .as_ref()
            .is_ok_and(|s| s.messages == 0 && s.first_seq > 1);
        last = Some(format!("{state:?}"));
        empty
    });
    assert!(gone, "the registry still holds the names: {last:?}");
}

#[test]
fn an_inbox_consumer_deleted_under_a_live_session_is_made_again() {
    // An operator's `nats consumer rm`, or a replica set that lost an R1 consumer with its
    // node: the inbox's pulls were answered 503 (nobody serves the consumer) once a second
    // for as long as the participant stayed, and nothing it was sent reached it.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    // One acknowledged, one still out: made again from the inbox's start (the only start
    // that keeps every message not acknowledged, wherever it was out), so both come again.
    for body in ["acked", "out"] {
        let ok = a.request(json!({"op":"send","to":"b","body":body}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let msg = b.next_op("message", WAIT).expect("a message");
        assert_eq!(msg["body"], body);
        if body == "acked" {
            b.send(&json!({"op":"ack","seq":msg["seq"]}));
        }
    }
    delete_inbox_consumer(&nats, &broker, "b");
    let ok = a.request(json!({"op":"send","to":"b","body":"after"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut got = Vec::new();
    while got.len() < 3 {
        let msg = b
            .next_op("message", Duration::from_secs(20))
            .unwrap_or_else(|| {
                panic!(
                    "{got:?} reached b after its consumer was deleted; broker log:\n{}",
                    broker.log()
                )
            });
        got.push(msg["body"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(got, ["acked", "out", "after"]);
    assert!(has_inbox_consumer(&mut nats.jetstream(), "b"));
    assert!(b.next_op("message", Duration::from_millis(500)).is_none());
    // The consumer made again is the one a later first login asks for: used as it is,
    // on this broker and on another.
    drop(b);
    let two = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    for (broker, body) in [(&broker, "again"), (&two, "elsewhere")] {
        let mut b = Client::login(broker, "acme", "b", "b-token");
        let ok = a.request(json!({"op":"send","to":"b","body":body}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let mut bodies = Vec::new();
        while bodies.last().map(String::as_str) != Some(body) {
            let m = b
                .next_op("message", WAIT)
                .unwrap_or_else(|| panic!("{bodies:?}, not `{body}`; log:\n{}", broker.log()));
            b.send(&json!({"op":"ack","seq":m["seq"]}));
            bodies.push(m["body"].as_str().unwrap_or_default().to_string());
        }
    }
}

/// Deletes `name`'s inbox consumer as an operator would, the broker held still until
/// the consumer's store is gone: nats-server can hand a consumer made again a moment
/// after its delete the deleted one's last saved state (its pending messages too),
/// which would hide what the broker's own choice of start does.
fn delete_inbox_consumer(nats: &NatsServer, broker: &Broker, name: &str) {
    let consumer = binding::inbox_consumer(name);
    let store = nats
        .dir()
        .join("js/jetstream/$G/streams/AMP_INBOX_acme/obs")
        .join(&consumer);
    broker.signal(libc::SIGSTOP);
    let deleted = nats
        .jetstream()
        .delete_consumer("AMP_INBOX_acme", &consumer);
    let gone = wait_until(WAIT, || !store.exists());
    broker.signal(libc::SIGCONT);
    assert!(deleted.expect("delete"), "{consumer} was there");
    assert!(gone, "{} still there", store.display());
}

/// Bodies of the messages reaching `client` up to and including `last`, each acked.
fn bodies_until(client: &mut Client, last: &str, broker: &Broker) -> Vec<String> {
    let mut bodies = Vec::new();
    while bodies.last().map(String::as_str) != Some(last) {
        let m = client
            .next_op("message", Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{bodies:?}, not `{last}`; log:\n{}", broker.log()));
        client.send(&json!({"op":"ack","seq":m["seq"]}));
        bodies.push(m["body"].as_str().unwrap_or_default().to_string());
    }
    bodies
}

#[test]
fn a_message_nakd_with_delay_survives_its_consumers_loss() {
    // The re-made consumer started past the highest sequence handed out here; a message
    // NAK'd with a delay was held by no session, so nothing delivered it again.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    for body in ["later", "acked"] {
        let ok = a.request(json!({"op":"send","to":"b","body":body}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let m = b.next_op("message", WAIT).expect("a message");
        assert_eq!(m["body"], body);
        let done = if body == "later" {
            b.request(json!({"op":"nak","seq":m["seq"],"delay_ms":60_000}))
        } else {
            b.request(json!({"op":"ack","seq":m["seq"]}))
        };
        assert_eq!(done["op"], "ok", "{done}");
    }
    delete_inbox_consumer(&nats, &broker, "b");
    let ok = a.request(json!({"op":"send","to":"b","body":"after"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let got = bodies_until(&mut b, "after", &broker);
    assert!(
        got.contains(&"later".to_string()),
        "lost the NAK'd one: {got:?}"
    );
}

#[test]
fn an_unacked_message_on_a_crashed_broker_survives_the_consumer_remade_by_another() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut two = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b_two = Client::login(&two, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","to":"b","body":"held"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let held = b_two.next_op("message", WAIT).expect("held on two");
    assert_eq!(held["body"], "held");
    // Two dies holding it: nothing hands it back before its ack wait (30 s).
    two.kill();
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","to":"b","body":"acked"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let m = b.next_op("message", WAIT).expect("acked");
    assert_eq!(m["body"], "acked");
    let done = b.request(json!({"op":"ack","seq":m["seq"]}));
    assert_eq!(done["op"], "ok", "{done}");
    delete_inbox_consumer(&nats, &broker, "b");
    let ok = a.request(json!({"op":"send","to":"b","body":"after"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let got = bodies_until(&mut b, "after", &broker);
    assert!(
        got.contains(&"held".to_string()),
        "lost the one the crashed broker held: {got:?}; log:\n{}",
        broker.log()
    );
}

#[test]
fn an_inbox_stream_made_anew_is_delivered_from_its_start() {
    // The consumer re-made after the stream's loss started past the old stream's last
    // sequence: every message of the new stream up to there was skipped, for good.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    for n in 0..5 {
        let ok = a.request(json!({"op":"send","to":"b","body":n}));
        assert_eq!(ok["op"], "ok", "{ok}");
        let m = b.next_op("message", WAIT).expect("a message");
        let done = b.request(json!({"op":"ack","seq":m["seq"]}));
        assert_eq!(done["op"], "ok", "{done}");
    }
    let mut js = nats.jetstream();
    assert!(
        js.delete_stream("AMP_INBOX_acme")
            .expect("delete the stream")
    );
    // Another broker's start makes the stream again.
    let _two = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let ok = a.request(json!({"op":"send","to":"b","body":"new"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert_eq!(ok["seq"], 1, "{ok}");
    let m = b
        .next_op("message", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("the new stream's first message; log:\n{}", broker.log()));
    assert_eq!(m["body"], "new");
}

#[test]
fn a_confirmed_ack_that_timed_out_can_be_sent_again() {
    // The delivery was forgotten before JetStream answered: the `unavailable` answer
    // says "safe to retry", and the retry answered `not_found`.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","to":"b","body":"hi"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let m = b.next_op("message", WAIT).expect("a message");
    let nats_pid = nats.pid().expect("nats-server pid");
    let pid = i32::try_from(nats_pid).expect("pid");
    // SAFETY: kill(2) with the pid of the nats-server this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // Until every thread is stopped, one may still confirm the ack (CI on a loaded
    // machine: `{"op":"ok","re":"r2"}` where `unavailable` was due).
    assert!(
        common::wait_until(WAIT, || common::stopped(nats_pid)),
        "nats-server {pid} did not stop"
    );
    let first = b.request(json!({"op":"ack","seq":m["seq"]}));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(first["code"], "unavailable", "{first}");
    let again = b.request_once_heard(json!({"op":"ack","seq":m["seq"]}));
    assert_eq!(again["op"], "ok", "{again}");
    assert!(
        b.next_op("message", Duration::from_millis(500)).is_none(),
        "acknowledged, it came again"
    );
}

#[test]
fn an_inbox_consumer_of_someone_elses_messages_delivers_none_of_them() {
    // A consumer named `inbox_b` that JetStream will not update (here its start; an
    // operator's mistake or a stray account user) is used as it is: its filter was
    // never looked at, and b's sessions were given a's messages.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut stray = binding::inbox_consumer_config("acme", "a", 30, 64)
        .deliver_from(amp_broker::jetstream::DeliverFrom::Sequence(1));
    stray.durable_name = Some(binding::inbox_consumer("b"));
    nats.jetstream()
        .create_consumer("AMP_INBOX_acme", &stray, ConsumerAction::Create)
        .expect("the stray consumer");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = b.request(json!({"op":"send","to":"a","body":"for a only"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let m = a.next_op("message", WAIT).expect("a's message");
    assert_eq!(m["body"], "for a only");
    let leaked = b.next_op("message", Duration::from_secs(1));
    assert!(leaked.is_none(), "b was given a's message: {leaked:?}");
}
