//! Operator signals end to end: SIGHUP re-reads the configuration file under live sessions,
//! SIGUSR2 drains the broker slowly (lame duck). The broker binary on a real nats-server,
//! participants over real WebSockets, signals sent with kill(2).

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::amp::{Broker, Client, open_config};
use common::{NatsServer, wait_until};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

fn ping_ok(c: &mut Client) {
    let ok = c.request(json!({"op":"ping"}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn sighup_closes_the_session_of_a_removed_participant_and_keeps_the_others() {
    let nats = NatsServer::start();
    let config = open_config(&["alice", "bob", "carol"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");
    let mut bob = Client::login(&broker, "acme", "bob", "bob-token");

    let mut without_bob = config.clone();
    without_bob["namespaces"]["acme"]["participants"]
        .as_object_mut()
        .expect("participants")
        .remove("bob");
    broker.reload(&without_bob, "reloaded");

    let closed = bob.next_op("_closed", WAIT).expect("bob's session closes");
    assert_eq!(
        (closed["code"].as_u64(), closed["reason"].as_str()),
        (Some(1008), Some("configuration changed")),
        "{closed}"
    );
    ping_ok(&mut alice);
    let ok = alice.request(json!({"op":"send","to":"carol","body":{"after":"reload"}}));
    assert_eq!(ok["op"], "ok", "alice still sends: {ok}");
    let gone = alice.request(json!({"op":"send","to":"bob","body":1}));
    assert_eq!(
        gone["code"], "not_found",
        "bob is no participant now: {gone}"
    );
}

#[test]
fn sighup_applies_a_removed_permission_from_the_next_frame() {
    let nats = NatsServer::start();
    let config = open_config(&["alice", "bob"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");
    let ok = alice.request(json!({"op":"send","to":"bob","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");

    let mut fewer = config.clone();
    fewer["namespaces"]["acme"]["participants"]["alice"]["permissions"]["send"] = json!([]);
    broker.reload(&fewer, "reloaded");

    let e = alice.request(json!({"op":"send","to":"bob","body":2}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("forbidden"), Some("/to")),
        "{e}"
    );
    ping_ok(&mut alice);
}

/// Deliveries are not frames the participant sends: a subscription made under a
/// `subscribe` permission the reload took away went on delivering every new event (a
/// durable one for as long as its consumer lives). Its session is closed now.
#[test]
fn sighup_ends_sessions_holding_subscriptions_the_new_permissions_do_not_allow() {
    let nats = NatsServer::start();
    let config = open_config(&["alice", "bob", "carol"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");
    let mut bob = Client::login(&broker, "acme", "bob", "bob-token");
    let mut carol = Client::login(&broker, "acme", "carol", "carol-token");
    for (c, durable) in [(&mut alice, false), (&mut bob, true)] {
        let ok = c.request(json!({"op":"subscribe","topic":"hr.>","sub":"h","durable":durable}));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    let ok = carol.request(json!({"op":"subscribe","topic":"news.>","sub":"n"}));
    assert_eq!(ok["op"], "ok", "{ok}");

    let mut fewer = config.clone();
    for name in ["alice", "bob", "carol"] {
        fewer["namespaces"]["acme"]["participants"][name]["permissions"]["subscribe"] =
            json!(["news.>"]);
    }
    broker.reload(&fewer, "reloaded");

    for c in [&mut alice, &mut bob] {
        let closed = c.next_op("_closed", WAIT).expect("the session closes");
        assert_eq!(
            (closed["code"].as_u64(), closed["reason"].as_str()),
            (Some(1008), Some("configuration changed")),
            "{closed}"
        );
    }
    // Carol's subscription is still allowed: she stays and is served.
    let ok = carol.request(json!({"op":"publish","topic":"news.today","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let event = carol.next_op("event", WAIT).expect("carol's event");
    assert_eq!(event["topic"], "news.today", "{event}");
}

#[test]
fn sighup_closes_the_session_whose_token_changed() {
    let nats = NatsServer::start();
    let config = open_config(&["alice", "bob"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");
    let mut bob = Client::login(&broker, "acme", "bob", "bob-token");

    let mut rekeyed = config.clone();
    rekeyed["namespaces"]["acme"]["participants"]["bob"]["token_sha256"] =
        json!(common::amp::token_hash("bob-new-token"));
    broker.reload(&rekeyed, "reloaded");

    assert_eq!(bob.closed_with(WAIT), Some(1008));
    ping_ok(&mut alice);
    let _bob_again = Client::login(&broker, "acme", "bob", "bob-new-token");
    let mut old = Client::connect(&broker);
    let e = old.request(
        json!({"op":"hello","ns":"acme","name":"bob","auth":{"type":"token","token":"bob-token"}}),
    );
    assert_eq!(e["code"], "unauthenticated", "the old token is gone: {e}");
}

#[test]
fn sighup_refuses_an_invalid_file_names_the_member_and_keeps_serving() {
    let nats = NatsServer::start();
    let config = open_config(&["alice", "bob"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");

    let mut invalid = config.clone();
    invalid["namespaces"]["acme"]["participants"]["bob"]["token_sha256"] = json!("not-hex");
    broker.reload(&invalid, "reload refused");
    let log = broker.log();
    assert!(
        log.contains("namespaces.acme.participants.bob.token_sha256"),
        "the member is named; log:\n{log}"
    );
    ping_ok(&mut alice);
    let _bob = Client::login(&broker, "acme", "bob", "bob-token");

    // A member only a restart applies: refused as a whole, named, old file kept.
    let mut bigger = config.clone();
    bigger["limits"] = json!({"max_frame": 4096});
    bigger["namespaces"]["acme"]["participants"]
        .as_object_mut()
        .expect("participants")
        .remove("bob");
    broker.reload(&bigger, "refused");
    let log = broker.log();
    assert!(log.contains("limits.max_frame"), "named; log:\n{log}");
    let _bob = Client::login(&broker, "acme", "bob", "bob-token");
    ping_ok(&mut alice);
}

#[test]
fn sigusr2_refuses_new_connections_spreads_the_closes_and_exits_zero() {
    let nats = NatsServer::start();
    let names: Vec<String> = (0..10).map(|i| format!("p{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut broker =
        Broker::start_with(&nats.url(), &open_config(&refs), &["--drain-timeout", "2"]);
    let clients: Vec<Client> = names
        .iter()
        .map(|n| Client::login(&broker, "acme", n, &format!("{n}-token")))
        .collect();
    let readers: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let code = c.closed_with(Duration::from_secs(15));
                (code, Instant::now())
            })
        })
        .collect();

    let signalled = Instant::now();
    broker.signal(libc::SIGUSR2);
    assert!(
        wait_until(Duration::from_secs(1), || TcpStream::connect(broker.addr)
            .is_err()),
        "the listener closes at once"
    );

    let mut closes: Vec<Instant> = Vec::new();
    for reader in readers {
        let (code, at) = reader.join().expect("reader thread");
        assert_eq!(code, Some(1001), "going away");
        closes.push(at);
    }
    closes.sort();
    let (first, last) = (closes[0], closes[closes.len() - 1]);
    let spread = last.duration_since(first);
    eprintln!("lame duck: {} closes spread over {spread:?}", closes.len());
    assert!(
        spread >= Duration::from_millis(1000),
        "closes spread over the period, got {spread:?}"
    );
    assert!(
        first.duration_since(signalled) >= Duration::from_millis(100),
        "not all at once at the signal"
    );
    let status = broker.wait_exit(WAIT).expect("the broker exits");
    assert!(status.success(), "exit status {status}");
}

/// Labels the operator sets are the operator's word on what a worker may take: one a
/// reload removed went on admitting the worker's open sessions (and any session the
/// participant opened while one was still open) to tasks restricted to it, and its
/// registry entry kept announcing it.
#[test]
fn sighup_applies_changed_labels_to_open_sessions_and_their_offers() {
    let nats = NatsServer::start();
    // Offers outlive the test's wait: a task offered to the wrong worker stays there.
    let mut config = common::jobs::config(&["app", "w1", "w2"], 30, 60_000);
    for w in ["w1", "w2"] {
        config["namespaces"]["acme"]["participants"][w]["labels"] = json!({"clearance":"high"});
    }
    let broker = Broker::start(&nats.url(), &config);
    let mut app = common::jobs::login(&broker, "app");
    // w1 serves first: the longest idle, it is the one chosen among equals.
    let mut w1 = common::jobs::login_serving(&broker, "w1", 1);
    let mut w2 = common::jobs::login_serving(&broker, "w2", 1);

    let mut cleared = config.clone();
    cleared["namespaces"]["acme"]["participants"]["w1"]["labels"] = json!({});
    broker.reload(&cleared, "reloaded");

    let ok = app.request(
        json!({"op":"submit","job":"render","task":"secret","body":1,
                               "eligible":{"labels":{"clearance":"high"}}}),
    );
    assert_eq!(ok["op"], "ok", "{ok}");
    let offer = w2
        .next_op("offer", WAIT)
        .expect("the task goes to w2, the only worker still labelled");
    assert_eq!(offer["task"], "secret", "{offer}");
    // A ping's answer comes after anything the broker sent w1 before it.
    ping_ok(&mut w1);
    let offered = w1.next_op("offer", Duration::ZERO);
    assert!(offered.is_none(), "w1 was offered the task: {offered:?}");

    let labels_of_w1 = |app: &mut Client| {
        let who = app.request(json!({"op":"who","job":"render"}));
        who["participants"]
            .as_array()
            .and_then(|ps| ps.iter().find(|p| p["name"] == "w1"))
            .map(|p| p["labels"].clone())
    };
    // Its registry entry says so too.
    assert!(
        wait_until(WAIT, || labels_of_w1(&mut app) == Some(json!({}))),
        "w1's entry still announces {:?}",
        labels_of_w1(&mut app)
    );
}

/// Removing a listed participant is meant to revoke it. In a namespace with an `open`
/// entry it did the opposite: the name became one anyone with the open credential could
/// take, and with it the inbox (messages still waiting for the participant), durable
/// subscriptions and tasks JetStream keeps under that name. Such a reload is refused now,
/// with the member named.
#[test]
fn sighup_refuses_to_hand_a_delisted_name_to_the_open_entry() {
    let nats = NatsServer::start();
    let mut config = open_config(&["alice", "bob"]);
    config["namespaces"]["acme"]["open"] = json!({
        "token_sha256": common::amp::token_hash("open-token"),
        "permissions": {"send": [">"]},
    });
    let broker = Broker::start(&nats.url(), &config);
    let mut alice = Client::login(&broker, "acme", "alice", "alice-token");
    let ok = alice.request(json!({"op":"send","to":"bob","body":{"for":"bob only"}}));
    assert_eq!(ok["op"], "ok", "{ok}");

    let mut without_bob = config.clone();
    without_bob["namespaces"]["acme"]["participants"]
        .as_object_mut()
        .expect("participants")
        .remove("bob");
    // Either outcome is logged with this prefix.
    broker.reload(&without_bob, "SIGHUP:");

    let mut taker = Client::connect(&broker);
    let e = taker.request(json!({"op":"hello","ns":"acme","name":"bob",
                                "auth":{"type":"token","token":"open-token"}}));
    if e["op"] == "ok" {
        let taken = taker.next_op("message", WAIT);
        panic!("the open credential took bob's name; bob's message went with it: {taken:?}");
    }
    assert_eq!(e["code"], "unauthenticated", "{e}");
    let log = broker.log();
    assert!(
        log.contains("refused") && log.contains("namespaces.acme.participants.bob"),
        "the refusal names the member; log:\n{log}"
    );
    let _bob = Client::login(&broker, "acme", "bob", "bob-token");

    // The revocation the refusal suggests: bob stays listed, under a credential nobody
    // holds. His session closes and his name stays out of the open entry's reach.
    let mut revoked = config.clone();
    revoked["namespaces"]["acme"]["participants"]["bob"]["token_sha256"] =
        json!(common::amp::token_hash("a token nobody was given"));
    broker.reload(&revoked, "reloaded");
    for token in ["bob-token", "open-token"] {
        let mut c = Client::connect(&broker);
        let e = c.request(json!({"op":"hello","ns":"acme","name":"bob",
                                "auth":{"type":"token","token":token}}));
        assert_eq!(e["code"], "unauthenticated", "{token}: {e}");
    }
    ping_ok(&mut alice);
}

/// Spec 2.4: a job's `lease_s` is its consumer's AckWait. The consumer was made once with
/// the `lease_s` of its day, and a reload changed the broker's `lease_s` only: JetStream
/// went on redelivering by the old one (every 30 s under 120 s leases).
#[test]
fn sighup_that_changes_lease_s_updates_the_job_consumers_ack_wait() {
    let nats = NatsServer::start();
    let config = common::jobs::config(&["app", "w1"], 30, 5_000);
    let broker = Broker::start(&nats.url(), &config);
    let _w1 = common::jobs::login_serving(&broker, "w1", 1);
    let mut js = nats.jetstream();
    let mut ack_wait = || {
        js.consumer_info("AMP_TASKS_acme", "job_render")
            .ok()
            .and_then(|info| info.config.ack_wait)
    };
    assert!(
        wait_until(WAIT, || ack_wait() == Some(Duration::from_secs(30))),
        "the job consumer: {:?}",
        ack_wait()
    );
    let mut longer = config.clone();
    longer["namespaces"]["acme"]["jobs"]["render"]["lease_s"] = json!(120);
    broker.reload(&longer, "reloaded");
    assert!(
        wait_until(WAIT, || ack_wait() == Some(Duration::from_secs(120))),
        "AckWait after the reload: {:?}",
        ack_wait()
    );
}

/// A reload that lengthens a lease past the inbox's `max_age` raised the window to the
/// lease and 90 s, which nats-server refuses (over max_age, 10052), logged "a restart
/// raises it"; the restart then stopped at the same refusal.
#[test]
fn sighup_that_lengthens_a_lease_past_the_inbox_max_age_caps_the_window_and_restarts() {
    let nats = NatsServer::start();
    let mut config = common::jobs::config(&["app", "w1"], 30, 5_000);
    config["namespaces"]["acme"]["inbox"] = json!({"max_age_s": 300});
    let mut broker = Broker::start(&nats.url(), &config);
    let mut longer = config.clone();
    longer["namespaces"]["acme"]["jobs"]["render"]["lease_s"] = json!(300);
    broker.reload(
        &longer,
        "stream AMP_DLQ_acme: duplicate_window raised to 390 s",
    );
    let mut js = nats.jetstream();
    let mut window = |stream: &str| {
        js.stream_info(stream)
            .ok()
            .and_then(|info| info.config.duplicate_window)
    };
    assert!(
        wait_until(WAIT, || window("AMP_INBOX_acme")
            == Some(Duration::from_secs(300))),
        "{}",
        broker.log()
    );
    assert!(!broker.log().contains("not raised"), "{}", broker.log());
    broker.restart();
    assert_eq!(window("AMP_INBOX_acme"), Some(Duration::from_secs(300)));
    assert_eq!(window("AMP_DLQ_acme"), Some(Duration::from_secs(390)));
}
