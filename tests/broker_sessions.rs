//! AMP sessions end to end: the broker binary on a real nats-server, participants over real
//! WebSockets.

mod common;

use std::time::Duration;

use amp_broker::broker::binding::{self, StreamSettings};
use amp_broker::jetstream::MsgTtl;
use amp_broker::nats::{Client as NatsClient, Options};
use common::NatsServer;
use common::amp::{Broker, Client, http_get, metric, open_config, open_to_any_name};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

fn setup(names: &[&str]) -> (NatsServer, Broker) {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(names));
    (nats, broker)
}

#[test]
fn hello_with_a_token_opens_a_session_and_ping_answers() {
    let (_nats, broker) = setup(&["w1"]);
    let mut c = Client::connect(&broker);
    assert_eq!(c.challenge["amp"], "1");
    assert_eq!(c.nonce.len(), 32);
    let ok = c.request(
        json!({"op":"hello","ns":"acme","name":"w1","auth":{"type":"token","token":"w1-token"}}),
    );
    assert_eq!(ok["op"], "ok");
    assert_eq!(ok["participant"], "acme/w1");
    assert_eq!(ok["heartbeat_s"], 10);
    assert_eq!(ok["max_frame"], 1_048_576);
    assert!(ok["session"].is_string());
    let pong = c.request(json!({"op":"ping","id":"p1"}));
    assert_eq!(pong, json!({"op":"ok","re":"p1"}));
}

#[test]
fn failed_hellos_answer_unauthenticated_and_close_1008_without_saying_why() {
    let (_nats, broker) = setup(&["w1"]);
    let attempts = [
        json!({"op":"hello","id":"h","ns":"acme","name":"w1","auth":{"type":"token","token":"wrong"}}),
        json!({"op":"hello","id":"h","ns":"acme","name":"nobody","auth":{"type":"token","token":"nobody-token"}}),
        json!({"op":"hello","id":"h","ns":"other","name":"w1","auth":{"type":"token","token":"w1-token"}}),
        json!({"op":"ping","id":"h"}),
    ];
    let mut messages = Vec::new();
    for frame in attempts {
        let mut c = Client::connect(&broker);
        let answer = c.request(frame.clone());
        assert_eq!(answer["op"], "error", "{frame}");
        assert_eq!(answer["code"], "unauthenticated", "{frame}");
        messages.push(answer["message"].clone());
        assert_eq!(c.closed_with(WAIT), Some(1008), "{frame}");
    }
    assert!(
        messages.windows(2).all(|w| w[0] == w[1]),
        "same words for every failure: {messages:?}"
    );

    let mut c = Client::connect(&broker);
    c.send_text("not json");
    let answer = c.next_frame(WAIT).expect("answer");
    assert_eq!(answer["code"], "bad_frame", "{answer}");
    assert_eq!(c.closed_with(WAIT), Some(1008));
}

#[test]
fn a_message_reaches_an_online_recipient_with_the_broker_stamped_sender() {
    let (_nats, broker) = setup(&["a", "b"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","to":"b","body":{"hello":[1,2]},"headers":{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert_eq!(ok["dup"], false);
    let seq = ok["seq"].as_u64().expect("seq");
    let msg = b.next_op("message", WAIT).expect("delivery");
    assert_eq!(msg["seq"], seq);
    assert_eq!(msg["from"], "acme/a");
    assert_eq!(msg["to"], "acme/b");
    assert_eq!(msg["body"], json!({"hello":[1,2]}));
    assert_eq!(msg["delivery"], 1);
    assert_eq!(msg["kind"], "message");
    assert_eq!(
        msg["headers"]["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert!(
        msg["ts"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.len() == 24),
        "{msg}"
    );
    let acked = b.request(json!({"op":"ack","id":"a1","seq":seq}));
    assert_eq!(acked, json!({"op":"ok","re":"a1"}));
}

/// A participant's last session ends with a message unacknowledged: it is handed back
/// at once and comes first to the participant's next session, however soon that comes.
/// Before, the hand-back (`-NAK`) went out before the ended inbox pull was unsubscribed:
/// JetStream gave the message straight back to that pull, whose deliveries nobody read
/// any more, and it came again only after the 30 s ack wait (the test below failed once
/// in a full run that way, when the old session's end was seen before the new hello).
#[test]
fn an_unacked_message_of_a_participants_last_session_comes_at_once_to_its_next() {
    let (_nats, broker) = setup(&["a", "b"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    for round in 0..3 {
        let seq = a.request(json!({"op":"send","to":"b","body":round}))["seq"]
            .as_u64()
            .expect("seq");
        let m = b.next_op("message", WAIT).expect("delivery");
        assert_eq!(m["seq"].as_u64(), Some(seq));
        // The session ends (and the broker has seen it end) with the message unacked.
        assert_eq!(b.request(json!({"op":"bye"}))["op"], "ok");
        assert_eq!(b.closed_with(WAIT), Some(1000));
        b = Client::login(&broker, "acme", "b", "b-token");
        let again = b
            .next_op("message", Duration::from_secs(5))
            .unwrap_or_else(|| panic!("round {round}: message {seq} did not come again at once"));
        assert_eq!(again["seq"].as_u64(), Some(seq));
        b.send(&json!({"op":"ack","seq":seq}));
    }
}

#[test]
fn messages_wait_for_an_offline_recipient_and_unacked_ones_come_again_on_the_next_session() {
    let (_nats, broker) = setup(&["a", "b"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let first = a.request(json!({"op":"send","to":"b","body":"one"}))["seq"]
        .as_u64()
        .expect("seq");
    let second = a.request(json!({"op":"send","to":"b","body":null}))["seq"]
        .as_u64()
        .expect("seq");

    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let m1 = b.next_op("message", WAIT).expect("first");
    let m2 = b.next_op("message", WAIT).expect("second");
    assert_eq!(
        (m1["seq"].as_u64(), m2["seq"].as_u64()),
        (Some(first), Some(second))
    );
    assert_eq!(m2["body"], json!(null));
    b.send(&json!({"op":"ack","seq":first}));
    let confirmed = b.request(json!({"op":"ping"}));
    assert_eq!(confirmed["op"], "ok");
    drop(b);

    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let again = b.next_op("message", WAIT).expect("redelivery");
    assert_eq!(again["seq"], second);
    assert_eq!(again["delivery"], 2);
    assert!(
        b.next_op("message", Duration::from_millis(500)).is_none(),
        "the acked one stays acked"
    );
}

/// `a` sends `n` messages of `body` to `b`, pipelined, and waits for the last answer.
fn send_to_b(broker: &Broker, n: usize, body: &str) {
    let mut a = Client::login(broker, "acme", "a", "a-token");
    for i in 0..n {
        a.send(&json!({"op":"send","id":format!("s{i}"),"to":"b","body":body}));
    }
    let last = a.answer_to(&format!("s{}", n - 1));
    assert_eq!(last["op"], "ok", "{last}");
}

#[test]
fn large_messages_waiting_in_an_inbox_do_not_lock_their_recipient_out() {
    // 64 messages of 200 kB: the inbox window (64 unacknowledged messages) of them is
    // three times the session's outbound bound (4 MiB). Before, every login of the
    // recipient over a link slower than loopback was pulled all 64 at once and closed
    // as a slow consumer: a sender could lock a participant out of its own inbox.
    const MESSAGES: u64 = 64;
    let (nats, broker) = setup(&["a", "b"]);
    let body = "x".repeat(200_000);
    send_to_b(&broker, MESSAGES as usize, &body);

    let mut js = nats.jetstream();
    // A receive buffer small from the handshake on (the kernel holds little for it),
    // and nothing read for a while: long enough for the broker to pull every message.
    let tcp = common::connect_with(std::net::Ipv4Addr::LOCALHOST, broker.addr, Some(4096));
    let mut b = Client::connect_over(&broker, tcp).hello("acme", "b", "b-token");
    let inbox = amp_broker::broker::binding::inbox_consumer("b");
    let pulled = |js: &mut amp_broker::jetstream::Context| {
        js.consumer_info("AMP_INBOX_acme", &inbox)
            .map_or(0, |i| i.delivered.stream_seq)
    };
    common::wait_until(Duration::from_secs(3), || pulled(&mut js) >= MESSAGES);
    eprintln!("pulled while the client did not read: {}", pulled(&mut js));
    let mut seqs = Vec::new();
    for i in 0..MESSAGES {
        let m = b
            .next_op("message", WAIT)
            .unwrap_or_else(|| panic!("message {i}: {:?}", b.next_op("_closed", WAIT)));
        assert_eq!(m["body"].as_str().map(str::len), Some(body.len()));
        b.send(&json!({"op":"ack","seq":m["seq"]}));
        seqs.push(m["seq"].as_u64().expect("seq"));
    }
    assert_eq!(seqs, (1..=MESSAGES).collect::<Vec<_>>());
}

#[test]
fn a_session_that_does_not_read_does_not_draw_its_siblings_inbox_onto_itself() {
    // b has two sessions: one reads (and acknowledges nothing yet), one reads nothing.
    // Each delivery goes to the session with the fewest unacknowledged, so they take
    // turns. Before, the inbox pulled again for both as soon as either session had
    // written its output, the reading one always had, and the silent one was sent half
    // of 64 messages of 400 kB and closed `slow consumer`. Now a session that has not
    // written its share is held out of the next pull; the silent one is closed by its
    // silence (no pong for 3 x heartbeat_s) and what it held comes to the reading one.
    const MESSAGES: usize = 64;
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["limits"] = json!({"heartbeat_s": 2});
    let broker = Broker::start(&nats.url(), &config);
    let tcp = common::connect_with(std::net::Ipv4Addr::LOCALHOST, broker.addr, Some(4096));
    let silent = Client::connect_over(&broker, tcp).hello("acme", "b", "b-token");
    let mut reading = Client::login(&broker, "acme", "b", "b-token");
    // Read while the messages are sent: a session answers the broker's pings only when
    // read, and 64 sends of 400 kB can take longer than 3 x heartbeat_s on a loaded
    // machine. Read only once they were all answered, the reading session was closed
    // for its silence as well ("idle timeout", 12 of 64 messages got).
    let body = "x".repeat(400_000);
    std::thread::scope(|s| {
        s.spawn(|| send_to_b(&broker, MESSAGES, &body));
        let mut seqs = std::collections::BTreeSet::new();
        while seqs.len() < MESSAGES {
            let Some(m) = reading.next_op("message", Duration::from_secs(30)) else {
                let closed = reading.next_op("_closed", Duration::ZERO);
                panic!("{} of {MESSAGES} messages; {closed:?}", seqs.len());
            };
            seqs.insert(m["seq"].as_u64().expect("seq"));
        }
    });
    let metrics = http_get(broker.addr, "/metrics").expect("metrics").1;
    assert!(
        metrics
            .lines()
            .any(|l| l == "amp_ws_slow_consumers_total 0"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("amp_ws_"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(silent);
}

#[test]
fn a_session_stuck_on_other_output_does_not_hold_its_siblings_inbox() {
    // A session that stops reading but stays alive (its writer still sends, so it is
    // never idle), its output held below its bound by topic events: once it had one inbox
    // delivery, every inbox pull of its participant waited for it to write its output,
    // so the reading sibling got one pull's share per 15 s (the pull's wait for credit).
    // Now a pull goes once any session the inbox may use has written its output, and
    // sessions still holding an earlier pull's share get none of it.
    const MESSAGES: usize = 300;
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["limits"] = json!({"max_outbound_bytes": 64 << 20});
    let broker = Broker::start(&nats.url(), &config);
    let tcp = common::connect_with(std::net::Ipv4Addr::LOCALHOST, broker.addr, Some(4096));
    let mut stuck = Client::connect_over(&broker, tcp).hello("acme", "b", "b-token");
    let ok = stuck.request(json!({"op":"subscribe","topic":"t.>"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let event = "x".repeat(500_000);
    for i in 0..40 {
        a.send(&json!({"op":"publish","id":format!("p{i}"),"topic":"t.x","body":event}));
    }
    assert_eq!(a.answer_to("p39")["op"], "ok");
    // More than kernel buffers take stays queued for it.
    assert!(common::wait_until(WAIT, || metric(
        &broker,
        "amp_ws_outbound_queued_bytes"
    )
    .is_some_and(|b| b > f64::from(4 << 20))));
    let mut reading = Client::login(&broker, "acme", "b", "b-token");
    send_to_b(&broker, MESSAGES, "small");
    // What went to the stuck session waits out its ack wait (30 s).
    let mut got = 0;
    while got < MESSAGES - 64 {
        let Some(m) = reading.next_op("message", Duration::from_secs(8)) else {
            panic!("the reading session got {got} of {MESSAGES} messages");
        };
        reading.send(&json!({"op":"ack","seq":m["seq"]}));
        got += 1;
    }
    drop(stuck);
}

/// `a` sends `b` a message that `late` gets and leaves unacknowledged, and once its ack
/// wait has run out JetStream's redelivery goes to `early` (`late` held one more when it
/// came, so now they hold as many and the first session takes it): the message's
/// sequence.
fn give_to_late_then_to_early(a: &mut Client, early: &mut Client, late: &mut Client) -> u64 {
    let mut send = |body: &str| {
        let ok = a.request(json!({"op":"send","to":"b","body":body}));
        ok["seq"].as_u64().unwrap_or_else(|| panic!("{ok}"))
    };
    let filler = send("filler");
    let m = early.next_op("message", WAIT).expect("the filler");
    assert_eq!(m["seq"].as_u64(), Some(filler));
    let seq = send("moved");
    let m = late.next_op("message", WAIT).expect("delivery 1");
    assert_eq!(
        (m["seq"].as_u64(), m["delivery"].as_u64()),
        (Some(seq), Some(1))
    );
    assert_eq!(early.request(json!({"op":"ack","seq":filler}))["op"], "ok");
    let m = early.next_op("message", WAIT).expect("delivery 2");
    assert_eq!(
        (m["seq"].as_u64(), m["delivery"].as_u64()),
        (Some(seq), Some(2))
    );
    seq
}

/// A session whose delivery ran out its ack wait and went to a sibling session here
/// still holds the message (its client may be done with it, and JetStream takes an ack
/// of a stream sequence from any of its deliveries): its `ack` answered `not_found`,
/// where the same session on another broker than the sibling's was answered `ok`.
/// Its `nak` and its end leave the sibling's delivery alone.
#[test]
fn a_delivery_given_again_to_a_sibling_session_is_still_the_first_ones_to_ack() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["inbox"] = json!({"ack_wait_s": 2});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut early = Client::login(&broker, "acme", "b", "b-token");
    let mut late = Client::login(&broker, "acme", "b", "b-token");

    let seq = give_to_late_then_to_early(&mut a, &mut early, &mut late);
    let acked = late.request(json!({"op":"ack","seq":seq}));
    assert_eq!(acked["op"], "ok", "{acked}");
    let again = early.request(json!({"op":"ack","seq":seq}));
    assert_eq!(again["op"], "ok", "{again}");
    assert!(
        early.next_op("message", Duration::from_secs(3)).is_none(),
        "acknowledged, it came again"
    );

    // A nak of it, or the session's end, would hand back what the sibling now holds.
    let seq = give_to_late_then_to_early(&mut a, &mut early, &mut late);
    let naked = late.request(json!({"op":"nak","seq":seq}));
    assert_eq!(naked["op"], "ok", "{naked}");
    assert_eq!(late.request(json!({"op":"bye"}))["op"], "ok");
    assert_eq!(late.closed_with(WAIT), Some(1000));
    let taken = early.next_op("message", Duration::from_millis(500));
    assert!(
        taken.is_none(),
        "taken from the session holding it: {taken:?}"
    );
    assert_eq!(early.request(json!({"op":"ack","seq":seq}))["op"], "ok");
}

/// A confirmed ack of such a moved delivery that JetStream did not answer in time
/// (`unavailable`, nats-server stopped) can be sent again, as one of a delivery the
/// session holds can (`inbox_consumers::a_confirmed_ack_that_timed_out_can_be_sent_again`).
#[test]
fn a_confirmed_ack_of_a_moved_delivery_that_timed_out_can_be_sent_again() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["inbox"] = json!({"ack_wait_s": 2});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut early = Client::login(&broker, "acme", "b", "b-token");
    let mut late = Client::login(&broker, "acme", "b", "b-token");
    let seq = give_to_late_then_to_early(&mut a, &mut early, &mut late);
    let nats_pid = nats.pid().expect("nats-server pid");
    let pid = i32::try_from(nats_pid).expect("pid");
    // SAFETY: kill(2) with the pid of the nats-server this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // kill(2) only queues the signal: one of its threads could still answer the ack.
    assert!(
        common::wait_until(WAIT, || common::stopped(nats_pid)),
        "not stopped"
    );
    let first = late.request(json!({"op":"ack","seq":seq}));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    assert_eq!(first["code"], "unavailable", "{first}");
    let again = late.request_once_heard(json!({"op":"ack","seq":seq}));
    assert_eq!(again["op"], "ok", "{again}");
}

#[test]
fn nak_redelivers_and_idem_resends_answer_the_same_seq() {
    let (_nats, broker) = setup(&["a", "b"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let one = a.request(json!({"op":"send","to":"b","body":1,"idem":"k1"}));
    let again = a.request(json!({"op":"send","to":"b","body":1,"idem":"k1"}));
    assert_eq!(one["dup"], false);
    assert_eq!(again["dup"], true);
    assert_eq!(one["seq"], again["seq"]);
    let m = b.next_op("message", WAIT).expect("delivery");
    b.send(&json!({"op":"nak","seq":m["seq"]}));
    let m2 = b.next_op("message", WAIT).expect("redelivery after nak");
    assert_eq!(m2["seq"], m["seq"]);
    assert_eq!(m2["delivery"], 2);
    assert!(
        b.next_op("message", Duration::from_millis(300)).is_none(),
        "the resend was not stored twice"
    );
}

#[test]
fn send_errors_name_the_member_and_leave_the_session_open() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b", "c"]);
    config["namespaces"]["acme"]["participants"]["a"]["permissions"]["send"] = json!(["b"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let e = a.request(json!({"op":"send","to":"c","body":1}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("forbidden"), Some("/to")),
        "{e}"
    );
    let e = a.request(json!({"op":"send","to":"nobody","body":1}));
    assert_eq!(
        e["code"], "forbidden",
        "not permitted comes before not known: {e}"
    );
    let e = a.request(json!({"op":"send","to":"b","body":1,"from":"acme/c"}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("schema"), Some("/from")),
        "{e}"
    );
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let e = b.request(json!({"op":"send","to":"nobody","body":1}));
    assert_eq!(
        (e["code"].as_str(), e["path"].as_str()),
        (Some("not_found"), Some("/to")),
        "{e}"
    );
    let e = a.request(json!({"op":"ack","id":"x","seq":999}));
    assert_eq!(e["code"], "not_found", "{e}");
    assert_eq!(a.request(json!({"op":"ping"}))["op"], "ok");
}

#[test]
fn bye_answers_then_closes_normally() {
    let (_nats, broker) = setup(&["a"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert_eq!(
        a.request(json!({"op":"bye","id":"z"})),
        json!({"op":"ok","re":"z"})
    );
    assert_eq!(a.closed_with(WAIT), Some(1000));
}

#[test]
fn http_endpoints_answer_health_schema_and_404() {
    let (_nats, broker) = setup(&["a"]);
    let (status, body) = http_get(broker.addr, "/healthz").expect("healthz");
    assert_eq!((status, body.trim()), (200, "ok"));
    let (status, schema) = http_get(broker.addr, "/amp/schema").expect("schema");
    assert_eq!(status, 200);
    assert_eq!(schema, amp_broker::amp::SCHEMA_JSON);
    assert_eq!(http_get(broker.addr, "/nope").map(|r| r.0), Some(404));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    a.request(json!({"op":"send","to":"a","body":1}));
    a.request(json!({"op":"send","to":"nobody","body":1}));
    let (status, metrics) = http_get(broker.addr, "/metrics").expect("metrics");
    assert_eq!(status, 200);
    for line in [
        "amp_nats_connected 1",
        "amp_sessions 1",
        "amp_frames_in_total{op=\"send\"} 2",
        "amp_frames_in_total{op=\"hello\"} 1",
        "amp_frames_out_total{op=\"challenge\"} 1",
        "amp_errors_total{code=\"not_found\"} 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "missing `{line}` in\n{metrics}"
        );
    }
    assert!(
        metrics.contains("amp_jetstream_request_seconds_count"),
        "{metrics}"
    );
    assert!(metrics.contains("amp_nats_reconnects_total"), "{metrics}");
}

#[test]
fn watch_reports_up_and_down_and_who_lists_present_participants() {
    let (_nats, broker) = setup(&["a", "b"]);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert_eq!(
        a.request(json!({"op":"watch","id":"w"})),
        json!({"op":"ok","re":"w"})
    );
    let own = a.next_op("presence", WAIT).expect("a sees itself");
    assert_eq!(
        (own["name"].as_str(), own["state"].as_str()),
        (Some("a"), Some("up")),
        "{own}"
    );
    let b = Client::login(&broker, "acme", "b", "b-token");
    let up = a.next_op("presence", WAIT).expect("b up");
    assert_eq!(
        (up["name"].as_str(), up["state"].as_str()),
        (Some("b"), Some("up")),
        "{up}"
    );
    assert_eq!(up["entry"]["name"], "b");
    assert!(
        up["entry"]["since"].is_string() && up["entry"]["broker"].is_string(),
        "{up}"
    );
    let who = a.request(json!({"op":"who"}));
    let mut names: Vec<&str> = who["participants"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["a", "b"]);
    drop(b);
    let down = a.next_op("presence", WAIT).expect("b down");
    assert_eq!(
        (down["name"].as_str(), down["state"].as_str()),
        (Some("b"), Some("down")),
        "{down}"
    );
}

/// Writes `count` registry entries of participants elsewhere straight to the bucket and
/// waits until the broker's view (asked through `a`) has them all. Their names are not
/// listed: the namespace needs an `open` entry ([`open_to_any_name`]).
fn register_others(nats: &NatsServer, a: &mut Client, count: usize) {
    let mut js = amp_broker::jetstream::Context::new(
        amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
            .expect("connect"),
    );
    let bucket = js
        .kv_bind("KV_AMP_REGISTRY_acme".trim_start_matches("KV_"))
        .expect("registry bucket");
    for i in 0..count {
        // The last one serves a job, so `who` with it says when the view has them all.
        let serve = if i + 1 == count {
            json!({"probe": 1})
        } else {
            json!({})
        };
        let entry = json!({"broker":"elsewhere","labels":{},"load":{},"name":format!("p{i:04}"),
                           "serve":serve,"since":"2026-12-06T00:00:00.000Z"});
        js.kv_put(&bucket, &format!("p{i:04}"), entry.to_string().as_bytes())
            .expect("put an entry");
    }
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let who = a.request(json!({"op":"who","job":"probe"}));
        if who["participants"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
        {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the broker's view never had them: {who}"
        );
        let wait = who["retry_after_ms"].as_u64().unwrap_or(50);
        std::thread::sleep(Duration::from_millis(wait));
    }
}

#[test]
fn who_and_watch_list_at_most_their_share_of_participants_a_second() {
    // Each `who` of 2,000 participants is one small frame for the client and 2,000
    // entries for the broker to write out: at the frame rate alone, a session could have
    // it list millions a second.
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["a", "w"]));
    config["limits"] = json!({"presence_listed_per_s": 10000});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    register_others(&nats, &mut a, 2000);
    let mut w = Client::login(&broker, "acme", "w", "w-token");
    // A client that reads every answer before it asks again: never a slow consumer.
    let started = std::time::Instant::now();
    let answers: Vec<Value> = (0..50).map(|_| w.request(json!({"op":"who"}))).collect();
    let elapsed = started.elapsed();
    let listed = answers.iter().filter(|a| a["op"] == "ok").count();
    // A full second's worth (10,000 = 5 listings) may go at once, and one more may
    // start it into debt; then 5 a second.
    let allowed = 6 + (elapsed.as_secs_f64() * 5.0).ceil() as usize;
    assert!(
        listed <= allowed,
        "{listed} of 50 `who`s listed 2,002 participants each in {elapsed:?}"
    );
    let refused = answers
        .iter()
        .find(|a| a["op"] == "error")
        .expect("refusals");
    assert_eq!(refused["code"], "rate_limited", "{refused}");
    let wait = refused["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(wait > 0 && wait <= 1000, "{refused}");
    // `watch` counts too; after the wait it is listed again.
    let watch = w.request(json!({"op":"watch"}));
    assert_eq!(watch["code"], "rate_limited", "{watch}");
    std::thread::sleep(Duration::from_millis(
        watch["retry_after_ms"].as_u64().unwrap_or(1000),
    ));
    assert_eq!(w.request(json!({"op":"watch"}))["op"], "ok");
    assert_eq!(w.next_op("presence", WAIT).expect("an up")["state"], "up");
}

#[test]
fn a_watch_of_more_presence_than_the_outbound_bound_holds_is_sent_in_bursts() {
    // 2,000 participants present (entries other brokers wrote), a session's outbound
    // bound of 64 KiB: the watch's `up`s take about five times that. Sent at once they
    // closed the watcher as a slow consumer.
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["a", "w"]));
    config["limits"] = json!({"max_outbound_bytes": 65536});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    const OTHERS: usize = 2000;
    register_others(&nats, &mut a, OTHERS);
    let mut w = Client::login(&broker, "acme", "w", "w-token");
    assert_eq!(w.request(json!({"op":"watch","id":"x"}))["op"], "ok");
    let mut names = std::collections::BTreeSet::new();
    while names.len() < OTHERS + 2 {
        let Some(f) = w.next_op("presence", WAIT) else {
            panic!("watch stopped after {} of {} ups", names.len(), OTHERS + 2);
        };
        assert_eq!(f["state"], "up", "{f}");
        assert!(
            names.insert(f["name"].as_str().unwrap_or_default().to_string()),
            "{f}"
        );
    }
    // `who` cannot list them in one frame under that bound: the asker is told so.
    let who = w.request(json!({"op":"who"}));
    assert_eq!(
        (who["op"].as_str(), who["code"].as_str()),
        (Some("error"), Some("too_large")),
        "{who}"
    );
    // The session is still open, and changes follow the snapshot.
    drop(a);
    let down = w.next_op("presence", WAIT).expect("a's down");
    assert_eq!(
        (down["name"].as_str(), down["state"].as_str()),
        (Some("a"), Some("down"))
    );
    assert_eq!(w.request(json!({"op":"ping"}))["op"], "ok");
}

/// An operator may set `limits.max_buffered_bytes` (all connections) below
/// `max_outbound_bytes` (one session). A session sent more than that budget at once is
/// shed (1008 `memory budget`) as the connection holding the most, so a single answer or
/// burst the broker builds must stay within both.
fn within_a_small_memory_budget() -> (NatsServer, Broker, Client) {
    let nats = NatsServer::start();
    let mut config = open_to_any_name(open_config(&["a", "w"]));
    config["limits"] = json!({"max_buffered_bytes": 65536});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    // About 210 KB of entries: within the 4 MiB outbound bound, past the budget.
    register_others(&nats, &mut a, 2000);
    // A peer whose kernel takes little: what the broker queues for it stays queued.
    let narrow = common::connect_narrow(std::net::Ipv4Addr::LOCALHOST, broker.addr);
    let w = Client::connect_over(&broker, narrow).hello("acme", "w", "w-token");
    (nats, broker, w)
}

#[test]
fn a_who_answer_past_the_memory_budget_is_refused_as_too_large() {
    // Before, the answer was queued whole and the asker shed.
    let (_nats, broker, mut w) = within_a_small_memory_budget();
    w.send(&json!({"op":"who","id":"w1"}));
    let who = w.next_frame(WAIT);
    let who = who.unwrap_or_else(|| json!({"op": "nothing within the wait"}));
    assert_eq!(
        (who["op"].as_str(), who["code"].as_str()),
        (Some("error"), Some("too_large")),
        "{who}; sheds: {:?}",
        metric(&broker, "amp_ws_memory_sheds_total")
    );
    assert_eq!(w.request(json!({"op":"ping"}))["op"], "ok");
    // `who` with a `job` lists fewer, and is answered.
    let probe = w.request(json!({"op":"who","job":"probe"}));
    assert_eq!(probe["participants"].as_array().map(Vec::len), Some(1));
}

#[test]
fn a_watch_snapshot_comes_in_bursts_within_the_memory_budget() {
    // Bursts of a quarter of the outbound bound (256 KiB at most): before, the first one
    // alone passed the budget and the watcher was shed.
    let (_nats, broker, mut w) = within_a_small_memory_budget();
    assert_eq!(w.request(json!({"op":"watch"}))["op"], "ok");
    let mut names = std::collections::BTreeSet::new();
    while names.len() < 2002 {
        let Some(f) = w.next_op("presence", WAIT) else {
            panic!(
                "watch stopped after {} ups; sheds: {:?}",
                names.len(),
                metric(&broker, "amp_ws_memory_sheds_total")
            );
        };
        names.insert(f["name"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(w.request(json!({"op":"ping"}))["op"], "ok");
}

#[test]
fn two_brokers_share_inboxes_and_presence() {
    let nats = NatsServer::start();
    let config = open_config(&["a", "b"]);
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&one, "acme", "a", "a-token");
    a.request(json!({"op":"watch"}));
    let mut b = Client::login(&two, "acme", "b", "b-token");
    let up = a.next_op("presence", WAIT).and_then(|f| {
        if f["name"] == "a" {
            a.next_op("presence", WAIT)
        } else {
            Some(f)
        }
    });
    let up = up.expect("b's presence on the other broker");
    assert_eq!(
        (up["name"].as_str(), up["state"].as_str()),
        (Some("b"), Some("up")),
        "{up}"
    );
    assert_ne!(up["entry"]["broker"], one_broker_id(&a));
    let sent = a.request(json!({"op":"send","to":"b","body":"across"}));
    let got = b.next_op("message", WAIT).expect("delivery across brokers");
    assert_eq!(got["seq"], sent["seq"]);
    assert_eq!(got["from"], "acme/a");
}

/// The next presence frame about `name`, others skipped.
fn presence_of(w: &mut Client, name: &str, timeout: Duration) -> Option<serde_json::Value> {
    let until = std::time::Instant::now() + timeout;
    while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
        let f = w.next_op("presence", left)?;
        if f["name"] == name {
            return Some(f);
        }
    }
    None
}

/// Waits until the wall clock is past the `since` of presence `up` by more than two
/// brokers' clocks can differ: each reads up to 2 ms behind it (its anchor and the time
/// since are both whole milliseconds). A session a broker starts after that is the
/// entry's latest, and its `broker` the entry's; one started within the same millisecond
/// by a broker whose id sorts lower leaves the entry as shown, and no watcher hears of
/// it.
fn past_since(up: &Value) {
    let since = up["entry"]["since"]
        .as_str()
        .and_then(amp_broker::rfc3339::parse_system_time)
        .unwrap_or_else(|| panic!("no since: {up}"));
    let later = since + Duration::from_millis(5);
    assert!(common::wait_until(WAIT, || std::time::SystemTime::now() > later));
}

fn who_lists(c: &mut Client, name: &str) -> bool {
    let who = c.request(json!({"op":"who"}));
    who["participants"]
        .as_array()
        .is_some_and(|ps| ps.iter().any(|p| p["name"] == name))
}

#[test]
fn a_participant_leaving_one_broker_stays_present_through_its_session_on_another() {
    // One key per participant, written by whichever broker wrote last: a reconnect that
    // lands on another broker before the old session ends (the spec allows the overlap;
    // behind a load balancer it is the usual case). The old broker's delete, when its
    // session ended, removed the new broker's entry: watchers everywhere heard `down`
    // for a participant still connected, and `who` left it out until the next refresh.
    let nats = NatsServer::start();
    let config = open_config(&["w", "b"]);
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut old = Client::login(&one, "acme", "b", "b-token");
    let up = presence_of(&mut w, "b", WAIT).expect("b up");
    assert_eq!(up["state"], "up", "{up}");
    past_since(&up);
    let _new = Client::login(&two, "acme", "b", "b-token");
    let Some(moved) = presence_of(&mut w, "b", WAIT) else {
        panic!(
            "no presence of b's entry from broker two; broker one:\n{}\nbroker two:\n{}",
            one.log(),
            two.log()
        );
    };
    assert_ne!(moved["entry"]["broker"], one_broker_id(&w), "{moved}");
    assert_eq!(old.request(json!({"op":"bye"}))["op"], "ok");
    // The entry now describes b's session on broker two alone (its `since`): an
    // `update` at most.
    let heard = presence_of(&mut w, "b", Duration::from_secs(3));
    assert!(
        heard
            .as_ref()
            .is_none_or(|f| f["state"] == "update" && f["entry"]["broker"] != one_broker_id(&w)),
        "b is still connected to broker two: {heard:?}"
    );
    assert!(who_lists(&mut w, "b"));
}

#[test]
fn a_participant_whose_entry_was_deleted_under_it_is_written_again_at_once() {
    // A broker of an earlier release (which knows no sections) deleting the key, or a lost
    // refresh letting it expire: the broker whose session lives on writes the entry again
    // when its watch sees it go, instead of at its next refresh (up to
    // `registry_ttl_s`/3 later).
    let nats = NatsServer::start();
    let mut config = open_config(&["w", "b"]);
    config["limits"] = json!({"registry_ttl_s": 60});
    let one = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let _b = Client::login(&one, "acme", "b", "b-token");
    presence_of(&mut w, "b", WAIT).expect("b up");
    let mut js = nats.jetstream();
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    js.kv_delete(&kv, "b").expect("delete");
    let down = presence_of(&mut w, "b", WAIT).expect("the delete");
    assert_eq!(down["state"], "down", "{down}");
    let up = presence_of(&mut w, "b", Duration::from_secs(2)).expect("b written again");
    assert_eq!(up["state"], "up", "{up}");
    assert_eq!(up["entry"]["broker"], one_broker_id(&w), "{up}");
    assert!(who_lists(&mut w, "b"));
}

#[test]
fn a_participant_on_two_brokers_stays_up_until_its_last_session_on_either_closes() {
    // One key per participant, whichever broker wrote last: when that broker's session
    // ends, its delete stands and every watcher hears `down` (then `up` again once the
    // other broker rewrites it), though the participant never left.
    let nats = NatsServer::start();
    let mut config = open_config(&["w", "p"]);
    config["limits"] = json!({"registry_ttl_s": 60});
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&two, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut on_two = Client::login(&two, "acme", "p", "p-token");
    let up = presence_of(&mut w, "p", WAIT).expect("p up");
    past_since(&up);
    let mut on_one = Client::login(&one, "acme", "p", "p-token");
    presence_of(&mut w, "p", WAIT).expect("p's entry from broker one");
    assert_eq!(on_one.request(json!({"op":"bye"}))["op"], "ok");
    let heard = presence_of(&mut w, "p", Duration::from_secs(3));
    assert!(
        heard.as_ref().is_none_or(|f| f["state"] != "down"),
        "p is still connected to broker two: {heard:?}"
    );
    assert!(who_lists(&mut w, "p"));
    assert_eq!(on_two.request(json!({"op":"bye"}))["op"], "ok");
    let down = presence_of(&mut w, "p", WAIT).expect("p down");
    assert_eq!(down["state"], "down", "{down}");
}

/// The next presence frame about `name` that `done` holds for, others skipped.
fn presence_until(w: &mut Client, name: &str, done: impl Fn(&Value) -> bool) -> Value {
    let until = std::time::Instant::now() + WAIT;
    let mut last = None;
    while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
        match presence_of(w, name, left) {
            Some(f) if done(&f) => return f,
            Some(f) => last = Some(f),
            None => break,
        }
    }
    panic!("no such presence of {name}; the last: {last:?}");
}

#[test]
fn a_registry_key_that_is_no_participants_name_is_never_told() {
    // Anyone who may publish on `$KV.AMP_REGISTRY_<ns>.>` in the broker's account put
    // keys every broker mirrored and told every watcher as `up`, without bound.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["w", "p"]));
    let mut w = Client::login(&broker, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut raw = NatsClient::connect(Options::new(&nats.url())).expect("connect");
    for key in ["ceo", "x.y"] {
        let entry = json!({"name": key, "broker": "forged", "serve": {}, "load": {}, "labels": {}});
        let ack = raw
            .request(
                &format!("$KV.AMP_REGISTRY_acme.{key}"),
                None,
                entry.to_string().as_bytes(),
                WAIT,
            )
            .expect("stored");
        let ack: Value = serde_json::from_slice(&ack.payload).expect("ack");
        assert!(ack["seq"].is_u64(), "{ack}");
    }
    // The watch delivers in stream order: the forgeries come before p's entry.
    let _p = Client::login(&broker, "acme", "p", "p-token");
    let mut told = Vec::new();
    while told.last() != Some(&json!("p")) {
        let f = w.next_op("presence", WAIT).expect("p's presence");
        told.push(f["name"].clone());
    }
    assert!(
        !told.contains(&json!("ceo")) && !told.contains(&json!("x.y")),
        "{told:?}"
    );
    assert!(!who_lists(&mut w, "ceo"));
    let refused = metric(&broker, "amp_registry_keys_refused_total{reason=\"name\"}");
    assert_eq!(refused, Some(2.0));
}

#[test]
fn what_a_participant_serves_on_two_brokers_is_summed_in_its_one_entry() {
    // Each broker's refresh rewrote the one entry with its own `serve`, `load` and
    // `broker`: what it said of the jobs served followed the last writer.
    let nats = NatsServer::start();
    let mut config = open_config(&["w", "app", "p"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"offer_ms": 30000}});
    // Refreshed every second.
    config["limits"] = json!({"registry_ttl_s": 3});
    let one = Broker::start(&nats.url(), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&two, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut on_one = Client::login(&one, "acme", "p", "p-token");
    let ok = on_one.request(json!({"op":"serve","job":"render","slots":2}));
    assert_eq!(ok["op"], "ok", "{ok}");
    presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 2);
    // A lease held on broker one.
    let mut app = Client::login(&one, "acme", "app", "app-token");
    let ok = app.request(json!({"op":"submit","job":"render","task":"T1","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert_eq!(on_one.next_op("offer", WAIT).expect("offer")["task"], "T1");
    let ok = on_one.request(json!({"op":"claim","task":"T1"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    presence_until(&mut w, "p", |f| f["entry"]["load"]["render"] == 1);
    let mut on_two = Client::login(&two, "acme", "p", "p-token");
    let ok = on_two.request(json!({"op":"serve","job":"render","slots":3}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let both = presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 5);
    assert_eq!(both["state"], "update", "{both}");
    assert_eq!(both["entry"]["load"]["render"], 1, "{both}");
    assert_eq!(
        both["entry"]["broker"],
        one_broker_id(&w),
        "the latest session: {both}"
    );
    assert!(both["entry"].get("brokers").is_none(), "{both}");
    let who = w.request(json!({"op":"who","job":"render"}));
    let listed = who["participants"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "p").cloned());
    assert_eq!(listed.as_ref(), Some(&both["entry"]), "{who}");
    // Broker two's refreshes leave broker one's part standing.
    assert!(
        presence_of(&mut w, "p", Duration::from_secs(2)).is_none(),
        "an entry that did not change"
    );
    assert_eq!(on_one.request(json!({"op":"bye"}))["op"], "ok");
    let left = presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 3);
    assert_eq!(left["state"], "update", "{left}");
    assert_eq!(left["entry"]["load"]["render"], 0, "{left}");
    assert!(who_lists(&mut w, "p"));
    drop(on_two);
    let down = presence_of(&mut w, "p", WAIT).expect("p down");
    assert_eq!(down["state"], "down", "{down}");
}

#[test]
fn an_entry_a_broker_of_an_earlier_release_wrote_is_kept_as_its_section() {
    // A rolling upgrade: a broker that knows no sections writes p's whole entry as its
    // own. The new broker, where p is present too, writes its section again at once and
    // keeps the old broker's part (read as that broker's section).
    let nats = NatsServer::start();
    let mut config = open_config(&["w", "p"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    config["limits"] = json!({"registry_ttl_s": 60});
    let one = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut p = Client::login(&one, "acme", "p", "p-token");
    let ok = p.request(json!({"op":"serve","job":"render","slots":2}));
    assert_eq!(ok["op"], "ok", "{ok}");
    presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 2);
    let mut js = nats.jetstream();
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    let old = json!({"broker":"old","labels":{},"load":{"render":1},"name":"p",
                     "serve":{"render":4},"since":"2026-01-01T00:00:00.000Z"});
    js.kv_put(&kv, "p", old.to_string().as_bytes())
        .expect("put");
    let both = presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 6);
    assert_eq!(both["entry"]["load"]["render"], 1, "{both}");
    assert_eq!(both["entry"]["since"], "2026-01-01T00:00:00.000Z", "{both}");
    assert_eq!(both["entry"]["broker"], one_broker_id(&w), "{both}");
    // p's last session on the new broker ends: the old broker's part stands alone.
    assert_eq!(p.request(json!({"op":"bye"}))["op"], "ok");
    let left = presence_until(&mut w, "p", |f| f["entry"]["serve"]["render"] == 4);
    assert_eq!(left["entry"]["broker"], "old", "{left}");
}

fn one_broker_id(c: &Client) -> serde_json::Value {
    c.challenge["broker"].clone()
}

#[test]
fn a_dead_brokers_participants_go_down_through_the_registry_ttl() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["limits"] = json!({"registry_ttl_s": 2});
    let one = Broker::start(&nats.url(), &config);
    let mut two = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&one, "acme", "a", "a-token");
    let _b = Client::login(&two, "acme", "b", "b-token");
    a.request(json!({"op":"watch"}));
    let mut seen_b = false;
    while let Some(f) = a.next_op("presence", WAIT) {
        if f["name"] == "b" {
            seen_b = f["state"] == "up";
            break;
        }
    }
    assert!(seen_b, "b is up before its broker dies");
    two.kill();
    // Other presence (a's own `up` may arrive late) is skipped; b must go down in time.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut down = None;
    while down.is_none() && std::time::Instant::now() < deadline {
        down = a
            .next_op("presence", Duration::from_secs(1))
            .filter(|f| f["name"] == "b");
    }
    let down = down.expect("b's presence changes after its broker dies");
    assert_eq!(down["state"], "down", "{down}");
}

#[test]
fn a_broker_cut_off_from_nats_while_a_participant_left_hears_its_down_once_back() {
    // Broker one reaches NATS through a relay. While the link is cut, b leaves broker
    // two and its key's delete ages out of the stream (the delete lives one TTL, a marker
    // another): the watch, which resumed after the last revision it had seen, never saw
    // it, and one's mirror kept b for good.
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let mut config = open_config(&["w", "b"]);
    config["limits"] = json!({"registry_ttl_s": 2});
    let one = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let two = Broker::start(&nats.url(), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    let mut b = Client::login(&two, "acme", "b", "b-token");
    let up = presence_of(&mut w, "b", WAIT).expect("b up");
    assert_eq!(up["state"], "up", "{up}");
    relay.cut();
    assert_eq!(b.request(json!({"op":"bye"}))["op"], "ok");
    // The cut lasts until nothing of b is left in the bucket.
    let mut js = nats.jetstream();
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while js.kv_entry(&kv, "b").is_ok() {
        assert!(
            std::time::Instant::now() < until,
            "b's delete never aged out"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    relay.restore();
    let down = presence_of(&mut w, "b", Duration::from_secs(15));
    assert_eq!(
        down.as_ref().map(|d| d["state"].clone()),
        Some(json!("down")),
        "b left while broker one was away: {down:?}"
    );
    assert!(!who_lists(&mut w, "b"), "b is gone");
    // Away longer than half the TTL: the bucket was read again.
    assert_eq!(metric(&one, "amp_registry_resyncs_total"), Some(2.0));
}

#[test]
fn a_short_nats_outage_resumes_the_registry_watch_without_reading_every_entry() {
    // Every reconnect made each broker's registry watch read every key of the bucket
    // again (a fleet of brokers reconnecting at once: brokers x participants messages),
    // though an outage shorter than the entries' TTL leaves every change made meanwhile,
    // deletes too, in the stream for a consumer resumed after the last revision seen.
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    // A resume is allowed within half the TTL: 15 s, not the default's 7.5 s, which a
    // loaded machine's reconnect has overrun (a whole read, 202 of 200).
    let mut config = open_to_any_name(open_config(&["w"]));
    config["limits"] = json!({"registry_ttl_s": 30});
    let one = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    const OTHERS: usize = 200;
    register_others(&nats, &mut w, OTHERS);
    w.request(json!({"op":"watch"}));
    presence_of(&mut w, "p0000", WAIT).expect("p0000 in the snapshot");
    relay.cut();
    // Changed while broker one is away: one participant leaves, another comes.
    let mut js = nats.jetstream();
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    js.kv_delete(&kv, "p0000").expect("delete");
    let entry = json!({"broker":"elsewhere","labels":{},"load":{},"name":"q",
                       "serve":{},"since":"2026-12-06T00:00:00.000Z"});
    js.kv_put(&kv, "q", entry.to_string().as_bytes())
        .expect("put");
    relay.restore();
    let down = presence_of(&mut w, "p0000", Duration::from_secs(15)).expect("p0000 down");
    assert_eq!(down["state"], "down", "{down}");
    let up = presence_of(&mut w, "q", WAIT).expect("q up");
    assert_eq!(up["state"], "up", "{up}");
    assert_eq!(metric(&one, "amp_nats_reconnects_total"), Some(1.0));
    // What the watch's consumer after the reconnect delivered (the newest generation).
    let stream = "KV_AMP_REGISTRY_acme";
    let newest = js
        .consumer_names(stream)
        .expect("consumers")
        .into_iter()
        .max_by_key(|c| c.rsplit('_').next().and_then(|g| g.parse::<u64>().ok()))
        .expect("the watch's consumer");
    let delivered = js
        .consumer_info(stream, &newest)
        .expect("consumer info")
        .delivered
        .consumer_seq;
    // Under load this has failed twice (a whole read): the log says why the watch reset.
    assert!(
        delivered < 10,
        "the watch after a short outage read {delivered} entries of {OTHERS}; broker log:\n{}",
        one.log()
    );
    assert_eq!(
        metric(&one, "amp_registry_resyncs_total"),
        Some(1.0),
        "the first read of the bucket only; broker log:\n{}",
        one.log()
    );
    assert!(!who_lists(&mut w, "p0000"));
    assert!(who_lists(&mut w, "q"));
}

#[test]
fn a_registry_bucket_whose_markers_outlive_less_than_its_entries_still_tells_a_resumed_watch() {
    // The bucket was made when `registry_ttl_s` was 2, so its expiry markers live 2 s;
    // the broker, now at 30, was adopting it as it was and resuming its watch after
    // outages of up to 15 s: past a marker that had aged out meanwhile. p's expiry never
    // reached broker one's mirror, and p stayed listed for good.
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let made_at_two = binding::registry_stream_config("acme", 2, StreamSettings::default());
    js.create_stream(&made_at_two).expect("registry bucket");
    let relay = common::relay::Relay::start(&nats.addr());
    let mut config = open_to_any_name(open_config(&["w"]));
    config["limits"] = json!({"registry_ttl_s": 30});
    let one = Broker::start(&format!("nats://{}", relay.addr()), &config);
    let mut w = Client::login(&one, "acme", "w", "w-token");
    w.request(json!({"op":"watch"}));
    // q, present on a broker that stays, keeps the stream's first sequence before p's, so
    // the server starts a resumed consumer where it is asked to; p, present on a broker
    // that died, expires 3 s after its last write.
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    let entry = |name: &str| {
        json!({"broker":"elsewhere","labels":{},"load":{},"name":name,
               "serve":{},"since":"2026-12-06T00:00:00.000Z"})
        .to_string()
    };
    js.kv_put(&kv, "q", entry("q").as_bytes()).expect("put");
    js.kv_put_ttl(
        &kv,
        "p",
        entry("p").as_bytes(),
        MsgTtl::After(Duration::from_secs(3)),
    )
    .expect("put");
    let up = presence_of(&mut w, "p", WAIT).expect("p up");
    assert_eq!(up["state"], "up", "{up}");
    relay.cut();
    // The cut lasts until p's marker has been there longer than the 2 s it was made to
    // live (gone, with the bucket as it was made): far less than half of 30 s.
    let until = std::time::Instant::now() + Duration::from_secs(15);
    let mut marker_seen: Option<std::time::Instant> = None;
    loop {
        assert!(std::time::Instant::now() < until, "p's entry never expired");
        match js.kv_entry(&kv, "p") {
            Ok(e) if !e.is_deleted() => {}
            Ok(_) => {
                let seen = *marker_seen.get_or_insert_with(std::time::Instant::now);
                if seen.elapsed() > Duration::from_secs(3) {
                    break;
                }
            }
            Err(_) if marker_seen.is_some() => break,
            Err(e) => panic!("p's entry: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    relay.restore();
    let down = presence_of(&mut w, "p", Duration::from_secs(15));
    assert_eq!(
        down.as_ref().map(|d| d["state"].clone()),
        Some(json!("down")),
        "p expired while broker one was away: {down:?}"
    );
    assert!(!who_lists(&mut w, "p"), "p is gone");
    assert_eq!(
        metric(&one, "amp_registry_resyncs_total"),
        Some(1.0),
        "the watch resumed: the first read of the bucket only; broker log:\n{}",
        one.log()
    );
    let log = one.log();
    assert!(
        log.contains(
            "stream KV_AMP_REGISTRY_acme: subject_delete_marker_ttl raised to registry_ttl_s"
        ),
        "{log}"
    );
}

#[test]
fn the_publish_path_is_rate_limited_with_an_honest_retry_after() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"msgs_per_s": 1, "burst": 2});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    assert_eq!(
        a.request(json!({"op":"send","to":"b","body":1}))["op"],
        "ok"
    );
    assert_eq!(
        a.request(json!({"op":"publish","topic":"t","body":1}))["op"],
        "ok"
    );
    for frame in [
        json!({"op":"send","to":"b","body":1}),
        json!({"op":"publish","topic":"t","body":1}),
        json!({"op":"submit","job":"render","body":1}),
    ] {
        let e = a.request(frame.clone());
        assert_eq!(e["code"], "rate_limited", "{frame}: {e}");
        let wait = e["retry_after_ms"].as_u64().expect("retry_after_ms");
        assert!(wait > 0 && wait <= 1000, "{e}");
    }
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    assert_eq!(
        b.request(json!({"op":"send","to":"a","body":1}))["op"],
        "ok",
        "others are not limited"
    );
}

#[test]
fn a_send_refused_as_too_large_spends_no_rate() {
    // The rate was taken before the stored envelope was measured against the server's
    // `max_payload`: a refused send used up the sender's budget.
    let nats = NatsServer::with_config("max_payload: 65536");
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"msgs_per_s": 0.01, "burst": 1});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let big = "x".repeat(70_000);
    let refused = a.request(json!({"op":"send","to":"b","body":big}));
    assert_eq!(refused["code"], "too_large", "{refused}");
    let ok = a.request(json!({"op":"send","to":"b","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn a_publish_refused_as_too_large_spends_no_rate() {
    // As a send's did before 04df7f1: the rate was taken before the stored envelope was
    // measured against the server's `max_payload`.
    let nats = NatsServer::with_config("max_payload: 65536");
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"msgs_per_s": 0.01, "burst": 1});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let big = "x".repeat(70_000);
    let refused = a.request(json!({"op":"publish","topic":"t.x","body":big}));
    assert_eq!(refused["code"], "too_large", "{refused}");
    let ok = a.request(json!({"op":"publish","topic":"t.x","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

/// A submit or redrive the jobs engine refuses having made nothing gave its budget back
/// (`broker_budget::a_submit_the_engine_refuses_spends_nothing_of_the_budget`) but kept
/// its rate charge, unlike a refused send or publish: with a burst of 1, the conflict
/// left none for the submits after it.
#[test]
fn a_submit_the_engine_refuses_gives_its_rate_back() {
    let nats = NatsServer::with_config("max_payload: 65536");
    let mut config = open_config(&["app", "a"]);
    config["namespaces"]["acme"]["participants"]["app"]["policy"] =
        json!({"msgs_per_s": 0.01, "burst": 1});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {}});
    let broker = Broker::start(&nats.url(), &config);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut c = Client::login(&broker, "acme", "app", "app-token");
    let r = a.request(json!({"op":"submit","job":"render","task":"T","body":1}));
    assert_eq!(r["op"], "ok", "{r}");
    let bad = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{1}";
    for (frame, code) in [
        (
            json!({"op":"submit","job":"render","task":"T","body":1}),
            "conflict",
        ),
        (
            json!({"op":"submit","job":"render","body":1,"headers":{"traceparent":bad}}),
            "schema",
        ),
        // Past max_payload only once its envelope is made.
        (
            json!({"op":"submit","job":"render","body":"x".repeat(65_500)}),
            "too_large",
        ),
        (
            json!({"op":"redrive","job":"render","seq":999}),
            "not_found",
        ),
    ] {
        let e = c.request(frame.clone());
        assert_eq!(e["code"], code, "{frame}: {e}");
    }
    let r = c.request(json!({"op":"submit","job":"render","body":2}));
    assert_eq!(r["op"], "ok", "the rate is whole after refusals: {r}");
    let e = c.request(json!({"op":"submit","job":"render","body":3}));
    assert_eq!(e["code"], "rate_limited", "{e}");
}

/// A send or publish JetStream answered with a refusal stored nothing (spec 2.6: it
/// changes nothing a later request can observe), yet kept its rate charge: with a burst
/// of 2, the two refused while the streams were full left none for the retries once an
/// operator made room.
#[test]
fn a_send_or_publish_jetstream_refuses_gives_its_rate_back() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"msgs_per_s": 0.01, "burst": 2});
    let broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    let limit = |js: &mut amp_broker::jetstream::Context, stream: &str, max_bytes: i64| {
        let mut config = js.stream_info(stream).expect("stream").config;
        config.max_bytes = Some(max_bytes);
        config.discard = Some(amp_broker::jetstream::DiscardPolicy::New);
        js.update_stream(&config).expect("an operator's tuning");
    };
    limit(&mut js, "AMP_INBOX_acme", 256);
    limit(&mut js, "AMP_TOPICS_acme", 256);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let body = "x".repeat(1000);
    let send = json!({"op":"send","to":"b","body":body,"idem":"k"});
    let publish = json!({"op":"publish","topic":"t.x","body":body,"idem":"k"});
    for frame in [&send, &publish] {
        let refused = a.request(frame.clone());
        assert_eq!(refused["code"], "unavailable", "{frame}: {refused}");
    }
    limit(&mut js, "AMP_INBOX_acme", -1);
    limit(&mut js, "AMP_TOPICS_acme", -1);
    for frame in [&send, &publish] {
        let ok = a.request(frame.clone());
        assert_eq!(ok["op"], "ok", "{frame}: {ok}");
    }
}

/// A stream JetStream stores no more in (an operator's `max_bytes` with discard `new`
/// here; a full disk or account limit alike) refuses a `send` as `unavailable`, saying so,
/// where it answered `internal` as if the broker had failed; nothing is stored, and the
/// sender may retry later with the same `idem`.
#[test]
fn a_send_jetstream_has_no_room_for_is_refused_as_unavailable() {
    let (nats, broker) = setup(&["a", "b"]);
    let mut js = amp_broker::jetstream::Context::new(
        amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
            .expect("connect"),
    )
    .with_timeout(WAIT);
    let mut config = js.stream_info("AMP_INBOX_acme").expect("inbox").config;
    config.max_bytes = Some(4096);
    config.discard = Some(amp_broker::jetstream::DiscardPolicy::New);
    js.update_stream(&config).expect("an operator's tuning");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let body = "x".repeat(1000);
    let refused = (0..20)
        .map(|i| a.request(json!({"op":"send","to":"b","body":body,"idem":format!("k{i}")})))
        .find(|answer| answer["op"] != "ok")
        .expect("a send refused once the stream is full");
    assert_eq!(refused["code"], "unavailable", "{refused}");
    let text = refused["message"].as_str().unwrap_or_default();
    assert!(text.contains("cannot store"), "{text}");
}

/// One participant's sessions on a broker are at most its share of `max_sessions`: one
/// credential from many addresses could otherwise hold every session the broker takes.
#[test]
fn a_participant_holds_at_most_its_share_of_the_brokers_sessions() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["limits"] = json!({"max_sessions_per_participant": 3});
    let broker = Broker::start(&nats.url(), &config);
    let mut held: Vec<Client> = (0..3)
        .map(|_| Client::login(&broker, "acme", "a", "a-token"))
        .collect();
    let mut fourth = Client::connect(&broker);
    let refused = fourth.request(
        json!({"op":"hello","ns":"acme","name":"a","auth":{"type":"token","token":"a-token"}}),
    );
    assert_eq!(refused["code"], "rate_limited", "{refused}");
    assert!(refused["retry_after_ms"].as_u64().is_some(), "{refused}");
    let text = refused["message"].as_str().unwrap_or_default();
    assert!(text.contains("at most 3 sessions"), "{text}");
    assert_eq!(fourth.closed_with(WAIT), Some(1008));
    // Another participant is not held back; a place is back when a session ends.
    let _b = Client::login(&broker, "acme", "b", "b-token");
    assert_eq!(held[0].request(json!({"op":"bye"}))["op"], "ok");
    assert_eq!(held.remove(0).closed_with(WAIT), Some(1000));
    let _again = Client::login(&broker, "acme", "a", "a-token");
}

/// Consumers by name, with the pulls waiting for each at the server.
type Waiting = Vec<(String, u64)>;

fn waiting_pulls(js: &mut amp_broker::jetstream::Context, stream: &str) -> Waiting {
    let names = js.consumer_names(stream).unwrap_or_default();
    let mut waiting: Waiting = names
        .into_iter()
        .map(|c| {
            let n = js
                .consumer_info(stream, &c)
                .map_or(u64::MAX, |i| i.num_waiting);
            (c, n)
        })
        .collect();
    waiting.sort();
    waiting
}

/// An inbox's and a durable subscription's pulls answered on subjects their
/// subscriptions still covered after a reconnect: each subscription came back with the
/// connection, so the pull from before the drop, still held by the server, was live
/// again next to the one sent after it. Two pulls for one loop until the old one expired
/// (20 s): what the loop counted as one window was two.
#[test]
fn after_a_reconnect_inboxes_and_subscriptions_hold_no_pull_from_before_it() {
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let one = Broker::start(
        &format!("nats://{}", relay.addr()),
        &open_config(&["a", "b"]),
    );
    let mut b = Client::login(&one, "acme", "b", "b-token");
    let ok = b.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let mut js = nats.jetstream();
    let one_each = |js: &mut amp_broker::jetstream::Context| {
        let mut inbox = waiting_pulls(js, "AMP_INBOX_acme");
        inbox.retain(|(c, _)| c == "inbox_b");
        let topics = waiting_pulls(js, "AMP_TOPICS_acme");
        (inbox, topics)
    };
    let all_one = |(inbox, topics): &(Waiting, Waiting)| {
        inbox.len() == 1 && topics.len() == 1 && inbox.iter().chain(topics).all(|(_, n)| *n == 1)
    };
    assert!(
        common::wait_until(WAIT, || all_one(&one_each(&mut js))),
        "{:?}",
        one_each(&mut js)
    );
    relay.cut();
    relay.restore();
    assert!(common::wait_until(WAIT, || {
        metric(&one, "amp_nats_reconnects_total") == Some(1.0)
    }));
    // A publish answered through the broker's connection after the reconnect: the server
    // has had the pulls the reconnect sent by then.
    let mut a = Client::login(&one, "acme", "a", "a-token");
    let ok = a.request(json!({"op":"publish","topic":"other.x","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let waiting = one_each(&mut js);
    assert!(
        all_one(&waiting),
        "one pull each for b's inbox and subscription: {waiting:?}"
    );
    // Both still deliver.
    let ok = a.request(json!({"op":"publish","topic":"d.x","body":2}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let event = b.next_op("event", WAIT).expect("the event");
    assert_eq!(event["body"], 2, "{event}");
    let ok = a.request(json!({"op":"send","to":"b","body":3}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let msg = b.next_op("message", WAIT).expect("the message");
    assert_eq!(msg["body"], 3, "{msg}");
}
