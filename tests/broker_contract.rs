//! The parts of the contract visible outside the WebSocket: what the broker stores in
//! JetStream (stream and consumer configs, headers, envelope), close codes, the hello
//! timeout, slow consumers and start-up refusal of an incompatible stream.

mod common;

use std::time::Duration;

use amp_broker::jetstream::MsgSelector;
use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn stored_messages_carry_the_envelope_and_the_amp_headers() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let ok = a.request(json!({"op":"send","to":"b","body":{"n":1},"headers":{"traceparent":tp,"x":"y"},"idem":"k"}));
    let seq = ok["seq"].as_u64().expect("seq");
    let ev = a.request(json!({"op":"publish","topic":"orders.eu","body":[1]}));

    let mut js = nats.jetstream();
    let stored = js
        .get_msg("AMP_INBOX_acme", &MsgSelector::Sequence(seq))
        .expect("stored message");
    assert_eq!(stored.subject, "amp.acme.inbox.b");
    assert_eq!(stored.header("AMP-From"), Some("acme/a"));
    assert_eq!(stored.header("AMP-Kind"), Some("message"));
    assert_eq!(stored.header("traceparent"), Some(tp));
    assert!(
        stored
            .header("Nats-Msg-Id")
            .is_some_and(|id| !id.is_empty())
    );
    let env: Value = serde_json::from_slice(&stored.payload).expect("envelope is JSON");
    assert_eq!(env["from"], "acme/a");
    assert_eq!(env["to"], "acme/b");
    assert_eq!(env["body"], json!({"n":1}));
    assert_eq!(env["headers"]["x"], "y");
    assert_eq!(env["id"], stored.header("Nats-Msg-Id").expect("id"));

    let event = js
        .get_msg(
            "AMP_TOPICS_acme",
            &MsgSelector::Sequence(ev["seq"].as_u64().expect("seq")),
        )
        .expect("event");
    assert_eq!(event.subject, "amp.acme.topic.orders.eu");
    assert_eq!(event.header("AMP-Kind"), Some("event"));
    assert_eq!(
        serde_json::from_slice::<Value>(&event.payload).expect("json")["topic"],
        "orders.eu"
    );

    let inbox = js.stream_info("AMP_INBOX_acme").expect("inbox stream");
    assert_eq!(inbox.config.subjects, ["amp.acme.inbox.*"]);
    let tasks = serde_json::to_value(js.stream_info("AMP_TASKS_acme").expect("tasks").config)
        .expect("json");
    assert_eq!(tasks["retention"], "workqueue");
    let registry = js
        .stream_info("KV_AMP_REGISTRY_acme")
        .expect("registry bucket");
    assert_eq!(registry.config.allow_msg_ttl, Some(true));
    assert!(
        registry
            .config
            .subject_delete_marker_ttl
            .is_some_and(|d| !d.is_zero())
    );
    js.stream_info("KV_AMP_TASK_STATE")
        .expect("task store bucket");
    let consumer = js
        .consumer_info("AMP_INBOX_acme", "inbox_a")
        .expect("a's inbox consumer");
    assert_eq!(consumer.config.max_ack_pending, Some(64));
    assert_eq!(consumer.config.ack_wait, Some(Duration::from_secs(30)));
    assert_eq!(
        consumer.config.filter_subject.as_deref(),
        Some("amp.acme.inbox.a")
    );
}

#[test]
fn binary_frames_close_1003_and_oversized_ones_1009() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["limits"] = json!({"max_frame": 4096});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    a.send_binary(b"\x00\x01");
    assert_eq!(a.closed_with(WAIT), Some(1003));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    a.send(&json!({"op":"send","id":"big","to":"a","body":"x".repeat(5000)}));
    assert_eq!(a.closed_with(WAIT), Some(1009));
}

#[test]
fn a_silent_client_is_closed_after_the_hello_timeout() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["limits"] = json!({"hello_timeout_s": 1});
    let broker = Broker::start(&nats.url(), &config);
    let mut c = Client::connect(&broker);
    assert_eq!(c.closed_with(WAIT), Some(1008));
}

#[test]
fn a_client_that_does_not_read_is_held_to_its_bound_without_slowing_others() {
    let nats = NatsServer::start();
    let mut config = open_config(&["pub", "slow", "fast"]);
    config["limits"] = json!({"max_outbound_bytes": 1 << 20, "heartbeat_s": 1});
    let broker = Broker::start(&nats.url(), &config);
    let mut p = Client::login(&broker, "acme", "pub", "pub-token");
    let mut slow = Client::login(&broker, "acme", "slow", "slow-token");
    let mut fast = Client::login(&broker, "acme", "fast", "fast-token");
    slow.request(json!({"op":"subscribe","topic":"flood"}));
    fast.request(json!({"op":"subscribe","topic":"flood"}));
    slow.stop_reading();
    let reader = std::thread::spawn(move || {
        (0..300)
            .take_while(|_| fast.next_op("event", WAIT).is_some())
            .count()
    });
    // Far more than the kernel buffers between the broker and the client can hold.
    let body = "y".repeat(100_000);
    for _ in 0..300 {
        assert_eq!(
            p.request(json!({"op":"publish","topic":"flood","body":body}))["op"],
            "ok"
        );
    }
    assert_eq!(
        reader.join().expect("reader"),
        300,
        "the reading client got every event"
    );
    // The events the silent client did not take wait in JetStream: the broker pulls
    // its subscription no faster than it writes what it pulled, so nothing passes the
    // bound and no session is closed a slow consumer. Its silence (no pong for 3 x
    // heartbeat_s) closes it (1001); the close frame waits behind what the client never
    // read, so the broker's own count is the witness.
    let metric = |m: &str, line: &str| m.lines().any(|l| l == line);
    assert!(common::wait_until(WAIT, || {
        common::amp::http_get(broker.addr, "/metrics").is_some_and(|(_, m)| {
            metric(&m, "amp_ws_slow_consumers_total 0")
                && metric(&m, "amp_ws_closes_total{code=\"1001\"} 1")
        })
    }));
    drop(slow);
}

#[test]
fn an_incompatible_existing_stream_stops_start_up_naming_the_field() {
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let mut config =
        amp_broker::jetstream::StreamConfig::new("AMP_TASKS_acme", &["amp.acme.job.*"]);
    config.retention = serde_json::from_value(json!("limits")).ok();
    js.create_stream(&config).expect("pre-existing stream");
    let err = Broker::start_expecting_failure(&nats.url(), &open_config(&["a"]));
    assert!(
        err.contains("AMP_TASKS_acme") && err.contains("retention"),
        "{err}"
    );
}

#[test]
fn sigterm_drains_sessions_with_going_away_and_exits_zero() {
    let nats = NatsServer::start();
    let mut broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    a.request(json!({"op":"send","to":"b","body":1}));
    let m = b.next_op("message", WAIT).expect("delivery");
    b.send(&json!({"op":"ack","seq":m["seq"]}));
    // Once the ping is answered the broker has taken the ack; the drain must deliver it.
    assert_eq!(b.request(json!({"op":"ping"}))["op"], "ok");
    let status = broker.terminate().expect("exit status");
    assert!(status.success(), "{status}");
    assert_eq!(a.closed_with(WAIT), Some(1001));
    assert_eq!(b.closed_with(WAIT), Some(1001));
    let mut js = nats.jetstream();
    let consumer = js
        .consumer_info("AMP_INBOX_acme", "inbox_b")
        .expect("consumer");
    assert_eq!(
        consumer.num_ack_pending, 0,
        "the ack taken just before the signal reached JetStream"
    );
}

#[test]
fn a_missing_or_invalid_configuration_stops_start_up_with_the_reason() {
    let nats = NatsServer::start();
    let err = Broker::start_expecting_failure(
        &nats.url(),
        &json!({"namespaces":{"acme":{"participants":{"a":{}}}}}),
    );
    assert!(
        err.contains("namespaces.acme.participants.a") && err.contains("credential"),
        "{err}"
    );
    let err = Broker::start_expecting_failure(&nats.url(), &json!({"limits":{"max_frames":1}}));
    assert!(err.contains("unknown field `max_frames`"), "{err}");
}

#[test]
fn a_password_in_the_nats_url_is_not_printed_when_nats_cannot_be_reached() {
    let closed = format!("nats://alice:hunter2@127.0.0.1:{}", common::free_port());
    let err = Broker::start_expecting_failure(&closed, &open_config(&["a"]));
    assert!(err.contains("cannot reach NATS"), "{err}");
    assert!(err.contains("alice:<redacted>@127.0.0.1"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

/// Spec 2.7 copies `headers.traceparent` to the stored NATS header `traceparent`. One
/// that no NATS header can carry (a control character: the schema refuses only CR and
/// LF) was stored without it, the send and publish answered `ok`; now such a frame is
/// refused `schema` naming the member, as a submit's was (naming only `/headers`), and
/// gives its rate back. A value that is not W3C trace context but can be carried is kept
/// as it is: the spec asks for the copy, not for a format.
#[test]
fn a_traceparent_no_nats_header_can_carry_is_refused_naming_it() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    // The submit's charge and one each for the send and the publish that are stored.
    config["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"msgs_per_s": 0.01, "burst": 3});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let bad = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{1}";
    for frame in [
        json!({"op":"submit","job":"render","body":1,"headers":{"traceparent":bad}}),
        json!({"op":"send","to":"b","body":1,"headers":{"traceparent":bad}}),
        json!({"op":"publish","topic":"t.x","body":1,"headers":{"traceparent":bad}}),
    ] {
        let refused = a.request(frame.clone());
        assert_eq!(
            (refused["code"].as_str(), refused["path"].as_str()),
            (Some("schema"), Some("/headers/traceparent")),
            "{frame}: {refused}"
        );
    }
    let kept = "not trace context";
    let ok = a.request(json!({"op":"send","to":"b","body":1,"headers":{"traceparent":kept}}));
    let seq = ok["seq"].as_u64().unwrap_or_else(|| panic!("{ok}"));
    let stored = nats
        .jetstream()
        .get_msg("AMP_INBOX_acme", &MsgSelector::Sequence(seq))
        .expect("stored message");
    assert_eq!(stored.header("traceparent"), Some(kept));
    let ok = a.request(json!({"op":"publish","topic":"t.x","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
}
