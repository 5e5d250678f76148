//! Streams and buckets found at start-up: adopted when they keep the broker's guarantees
//! (every adopted value other than the broker's logged), refused naming the field when
//! they do not, and judged the same way when another broker creates one first. The inbox
//! and tasks streams refuse new writes when full instead of evicting what they accepted.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use amp_broker::broker::binding::{self, StreamSettings};
use amp_broker::jetstream::{AckPolicy, ConsumerAction, Context, DiscardPolicy};
use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn a_tasks_stream_that_drops_tasks_by_age_stops_start_up_naming_max_age() {
    let nats = NatsServer::start();
    let mut tasks = binding::tasks_stream_config("acme", StreamSettings::default());
    tasks.max_age = Some(Duration::from_secs(3600));
    nats.jetstream()
        .create_stream(&tasks)
        .expect("tasks stream");
    let err = Broker::start_expecting_failure(&nats.url(), &open_config(&["a"]));
    assert!(
        err.contains("existing stream AMP_TASKS_acme cannot be used: field `max_age` is 3600 s but the broker needs no limit"),
        "{err}"
    );
}

#[test]
fn every_adopted_value_other_than_the_brokers_is_logged() {
    let nats = NatsServer::start();
    let inbox = binding::inbox_stream_config(
        "acme",
        86_400,
        10_000,
        StreamSettings {
            duplicate_window_s: 300,
            ..StreamSettings::default()
        },
    );
    nats.jetstream()
        .create_stream(&inbox)
        .expect("inbox stream");
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    let log = broker.log();
    for line in [
        "stream AMP_INBOX_acme adopted as it is: `max_age` is 86400 s where the broker would create none",
        "stream AMP_INBOX_acme adopted as it is: `duplicate_window` is 300 s where the broker would create 120 s",
    ] {
        assert!(log.contains(line), "{line} not in\n{log}");
    }
    assert!(
        !log.contains("stream AMP_TOPICS_acme adopted as it is"),
        "{log}"
    );
}

/// When [`interposing_proxy`] runs its action: before it passes on the bytes that name
/// its marker, or after, before any that follow.
#[derive(Clone, Copy, PartialEq)]
enum When {
    Before,
    After,
}

/// Forwards connections to `target`; before (or after, `when`) it passes on each of the
/// first `times` messages that name `marker` it runs `action`: another broker's request
/// landing between two of ours.
fn interposing_proxy(
    target: String,
    marker: &'static [u8],
    when: When,
    times: usize,
    action: impl Fn() + Send + Sync + 'static,
) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("proxy port");
    let port = listener.local_addr().expect("proxy addr").port();
    let action = Arc::new(action);
    let fired = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for inbound in listener.incoming() {
            let Ok(inbound) = inbound else { continue };
            let Ok(outbound) = TcpStream::connect(&target) else {
                continue;
            };
            let (Ok(mut from_server), Ok(mut to_client)) =
                (outbound.try_clone(), inbound.try_clone())
            else {
                continue;
            };
            std::thread::spawn(move || std::io::copy(&mut from_server, &mut to_client));
            let (action, fired) = (action.clone(), fired.clone());
            std::thread::spawn(move || {
                let (mut from_client, mut to_server) = (inbound, outbound);
                let mut buf = vec![0; 64 * 1024];
                // The end of the last read: a marker split between two reads is found.
                let mut tail: Vec<u8> = Vec::new();
                while let Ok(n) = from_client.read(&mut buf) {
                    if n == 0 {
                        return;
                    }
                    tail.extend_from_slice(&buf[..n]);
                    let named = tail.windows(marker.len()).any(|w| w == marker);
                    let keep = tail.len().saturating_sub(marker.len());
                    tail.drain(..keep);
                    if named {
                        // Found once: not again in what is kept of it.
                        tail.clear();
                    }
                    let fire = named && fired.fetch_add(1, Ordering::SeqCst) < times;
                    if fire && when == When::Before {
                        action();
                    }
                    if to_server.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    if fire && when == When::After {
                        action();
                    }
                }
            });
        }
    });
    port
}

#[test]
fn a_stream_another_broker_creates_first_with_other_settings_is_judged_as_found() {
    let nats = NatsServer::start();
    let url = nats.url();
    let marker = b"STREAM.CREATE.AMP_TASKS_acme ";
    let port = interposing_proxy(nats.addr(), marker, When::Before, 1, move || {
        let mut js = Context::new(
            amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&url))
                .expect("connect"),
        );
        let mut other = binding::tasks_stream_config("acme", StreamSettings::default());
        other.max_consumers = Some(500);
        js.create_stream(&other).expect("the other broker's stream");
    });
    let broker = Broker::start(&format!("nats://127.0.0.1:{port}"), &open_config(&["a"]));
    let log = broker.log();
    assert!(
        log.contains("adopted stream AMP_TASKS_acme ($JS.API)"),
        "{log}"
    );
    assert!(
        log.contains("stream AMP_TASKS_acme adopted as it is: `max_consumers` is 500"),
        "{log}"
    );
}

#[test]
fn inbox_and_tasks_streams_of_earlier_releases_get_discard_new() {
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let s = StreamSettings::default();
    for mut earlier in [
        binding::inbox_stream_config("acme", 0, 10_000, s),
        binding::tasks_stream_config("acme", s),
    ] {
        earlier.discard = Some(DiscardPolicy::Old);
        js.create_stream(&earlier).expect("earlier stream");
    }
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    for stream in ["AMP_INBOX_acme", "AMP_TASKS_acme"] {
        let info = js.stream_info(stream).expect("stream");
        assert_eq!(info.config.discard, Some(DiscardPolicy::New), "{stream}");
        assert!(
            broker
                .log()
                .contains(&format!("stream {stream}: discard set to new")),
            "{}",
            broker.log()
        );
    }
}

#[test]
fn a_tasks_duplicate_window_reaching_past_the_shortest_kept_record_is_lowered() {
    // A task id is free again once its finished record expired (300 s after at the
    // least), and its next use's message has the same message id: an operator's longer
    // window took it for a duplicate of the last use's, and the submit was answered `ok`
    // for a task never queued.
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let day = StreamSettings {
        duplicate_window_s: 86_400,
        ..StreamSettings::default()
    };
    js.create_stream(&binding::tasks_stream_config("acme", day))
        .expect("tasks stream");
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    let info = js.stream_info("AMP_TASKS_acme").expect("stream");
    assert_eq!(
        info.config.duplicate_window,
        Some(Duration::from_secs(binding::TASKS_DUPLICATE_WINDOW_MAX_S))
    );
    let log = broker.log();
    assert!(
        log.contains("stream AMP_TASKS_acme: duplicate_window lowered to 240 s"),
        "{log}"
    );
}

#[test]
fn a_tasks_duplicate_window_shorter_than_the_brokers_is_raised() {
    // A submit's retry inside the broker's 120 s window is a duplicate of its first
    // message; an operator's 30 s window stored it twice. Start-up stopped on it.
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let short = StreamSettings {
        duplicate_window_s: 30,
        ..StreamSettings::default()
    };
    js.create_stream(&binding::tasks_stream_config("acme", short))
        .expect("tasks stream");
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    assert_eq!(
        window(&mut js, "AMP_TASKS_acme"),
        Some(Duration::from_secs(120))
    );
    let log = broker.log();
    assert!(
        log.contains("WARN  stream AMP_TASKS_acme: duplicate_window raised to 120 s"),
        "{log}"
    );
}

#[test]
fn inbox_and_dead_letter_windows_made_under_shorter_leases_are_raised() {
    // A finished task's message whose ack was lost comes back one lease after its last
    // delivery and publishes the result and letter again; kept at 120 s, the window let a
    // 300 s lease's repeat through as a second result.
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let s = StreamSettings::default();
    js.create_stream(&binding::inbox_stream_config("acme", 0, 10_000, s))
        .expect("inbox stream");
    js.create_stream(&binding::dlq_stream_config("acme", 3600, 0, s))
        .expect("dead-letter stream");
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": 300}});
    let broker = Broker::start(&nats.url(), &config);
    for stream in ["AMP_INBOX_acme", "AMP_DLQ_acme"] {
        let info = js.stream_info(stream).expect("stream");
        assert_eq!(
            info.config.duplicate_window,
            Some(Duration::from_secs(390)),
            "{stream}"
        );
        let line = format!(
            "stream {stream}: duplicate_window raised to 390 s, the longest lease_s and 90 s"
        );
        assert!(broker.log().contains(&line), "{}", broker.log());
    }
}

/// A broker with a 600 s lease starts on an inbox with a 120 s window, and each of its
/// first `times` updates of that window is followed, before anything more of its reaches
/// the server, by the update another broker (a 300 s lease) made from its read of the
/// 120 s: the window taken back to 390 s. Returns once start-up and those updates are
/// done.
fn start_with_raises_taken_back(times: usize) -> (NatsServer, Broker) {
    let nats = NatsServer::start();
    let read = binding::inbox_stream_config("acme", 0, 10_000, StreamSettings::default());
    nats.jetstream().create_stream(&read).expect("inbox stream");
    let url = nats.url();
    let (lowered, was_lowered) = std::sync::mpsc::channel();
    let marker = b"STREAM.UPDATE.AMP_INBOX_acme ";
    let port = interposing_proxy(nats.addr(), marker, When::After, times, move || {
        let mut js = Context::new(
            amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&url))
                .expect("connect"),
        );
        // Our raise, just passed on, lands first.
        let raised = Some(Duration::from_secs(690));
        let landed = || window(&mut js, "AMP_INBOX_acme") == raised;
        assert!(common::wait_until(WAIT, landed));
        let mut stale = read.clone();
        stale.duplicate_window = Some(Duration::from_secs(390));
        js.update_stream(&stale).expect("the other broker's update");
        lowered.send(()).expect("the test waits");
    });
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": 600}});
    let broker = Broker::start(&format!("nats://127.0.0.1:{port}"), &config);
    for _ in 0..times {
        was_lowered
            .recv_timeout(WAIT)
            .expect("lowered by the other broker");
    }
    (nats, broker)
}

#[test]
fn a_window_raise_another_brokers_stale_update_lowered_is_made_again() {
    // Both brokers read 120 s; the 300 s lease's update from that read landed after the
    // 600 s lease's raise and left 390 s: an ack lost under the 600 s lease gave a second
    // result (review finding 5).
    let (nats, broker) = start_with_raises_taken_back(1);
    assert_eq!(
        window(&mut nats.jetstream(), "AMP_INBOX_acme"),
        Some(Duration::from_secs(690)),
        "{}",
        broker.log()
    );
}

#[test]
fn a_window_raise_taken_back_at_every_update_is_left_after_three_with_a_warning() {
    // Bounded: the stream is then judged as after a raise the server refused.
    let (nats, broker) = start_with_raises_taken_back(3);
    assert_eq!(
        window(&mut nats.jetstream(), "AMP_INBOX_acme"),
        Some(Duration::from_secs(390))
    );
    let log = broker.log();
    let raise =
        "stream AMP_INBOX_acme: duplicate_window raised to 690 s, the longest lease_s and 90 s";
    assert_eq!(log.matches(&format!("INFO  {raise}")).count(), 3, "{log}");
    let warning = format!(
        "WARN  {raise}, 3 times, each taken back by another update of the stream; left as it is"
    );
    assert!(log.contains(&warning), "{log}");
}

/// Sets an operator's byte limit on `stream`, everything else kept.
fn bound(js: &mut Context, stream: &str, max_bytes: i64) {
    let mut config = js.stream_info(stream).expect("stream").config;
    config.max_bytes = Some(max_bytes);
    js.update_stream(&config).expect("bounded");
}

fn stored(js: &mut Context, stream: &str) -> (u64, u64) {
    let state = js.stream_info(stream).expect("stream").state;
    (state.first_seq, state.messages)
}

#[test]
fn a_full_inbox_refuses_new_sends_and_keeps_what_it_accepted() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut js = nats.jetstream();
    bound(&mut js, "AMP_INBOX_acme", 4096);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let body = "x".repeat(500);
    let mut accepted = 0;
    let refused = loop {
        assert!(
            accepted < 50,
            "50 sends of 500 bytes into 4 KiB all accepted"
        );
        let answer = a.request(json!({"op":"send","to":"b","body":format!("{accepted}{body}")}));
        if answer["op"] != "ok" {
            break answer;
        }
        accepted += 1;
    };
    assert_eq!(refused["code"], "unavailable", "{refused}");
    let text = refused["message"].as_str().unwrap_or_default();
    assert!(
        text.contains("JetStream cannot store the message now"),
        "{text}"
    );
    assert!(accepted > 0);
    assert_eq!(stored(&mut js, "AMP_INBOX_acme"), (1, accepted));
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let first = b.next_op("message", WAIT).expect("the first message kept");
    assert_eq!(first["body"], format!("0{body}"));
}

/// What the broker itself stores in a full inbox, a task's `task_result`, waits for room
/// instead of being given up: before, the refusal dropped it and the task message was
/// acked all the same, so the submitter never heard of its task's outcome.
#[test]
fn a_task_result_refused_by_a_full_inbox_is_stored_once_it_has_room() {
    let nats = NatsServer::start();
    let broker = Broker::start(
        &nats.url(),
        &common::jobs::config(&["a", "c", "w1"], 30, 5000),
    );
    let mut js = nats.jetstream();
    bound(&mut js, "AMP_INBOX_acme", 4096);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut w1 = common::jobs::login_serving(&broker, "w1", 1);
    let body = "x".repeat(500);
    let refused = (0..50)
        .map(|n| a.request(json!({"op":"send","to":"c","body":format!("{n}{body}")})))
        .find(|answer| answer["op"] != "ok")
        .expect("50 sends of 500 bytes into 4 KiB all accepted");
    assert_eq!(refused["code"], "unavailable", "{refused}");
    let ok = a.request(json!({"op":"submit","job":"render","task":"T","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let offer = w1.next_op("offer", WAIT).expect("the task offered");
    assert_eq!(offer["task"], "T", "{offer}");
    assert_eq!(w1.request(json!({"op":"claim","task":"T"}))["op"], "ok");
    // Answered once the inbox has answered the result's publish: refused, full.
    let done = w1.request(json!({"op":"complete","task":"T","result":{"px":9}}));
    assert_eq!(done["op"], "ok", "{done}");
    assert_eq!(
        stored(&mut js, "AMP_TASKS_acme").1,
        1,
        "the task message waits to publish its result again"
    );
    bound(&mut js, "AMP_INBOX_acme", -1);
    let result = a.next_op("message", WAIT).expect("the task_result");
    assert_eq!(result["kind"], "task_result", "{result}");
    assert_eq!(result["body"]["task"], "T", "{result}");
    assert_eq!(result["body"]["state"], "completed", "{result}");
    assert_eq!(result["body"]["result"]["px"], 9, "{result}");
    assert!(common::wait_until(WAIT, || stored(
        &mut js,
        "AMP_TASKS_acme"
    )
    .1 == 0));
}

#[test]
fn a_full_tasks_stream_refuses_new_submits_and_keeps_what_it_accepted() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &common::jobs::config(&["a"], 30, 5000));
    let mut js = nats.jetstream();
    bound(&mut js, "AMP_TASKS_acme", 4096);
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let body = "x".repeat(500);
    let mut accepted = 0;
    let refused = loop {
        assert!(
            accepted < 50,
            "50 submits of 500 bytes into 4 KiB all accepted"
        );
        let answer = a.request(
            json!({"op":"submit","job":"render","task":format!("T{accepted}"),"body":body}),
        );
        if answer["op"] != "ok" {
            break answer;
        }
        accepted += 1;
    };
    assert_eq!(refused["code"], "unavailable", "{refused}");
    let text = refused["message"].as_str().unwrap_or_default();
    assert!(text.contains("maximum bytes exceeded"), "{text}");
    assert!(accepted > 0);
    assert_eq!(stored(&mut js, "AMP_TASKS_acme"), (1, accepted));
}

#[test]
fn an_inbox_consumer_that_acks_nothing_is_refused_naming_ack_policy() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "w1"]));
    let mut js = nats.jetstream();
    let mut config = binding::inbox_consumer_config("acme", "w1", 30, 64);
    config.ack_policy = Some(AckPolicy::None);
    js.create_consumer("AMP_INBOX_acme", &config, ConsumerAction::Create)
        .expect("a consumer made by someone else");
    let mut w1 = Client::login(&broker, "acme", "w1", "w1-token");
    let told = w1
        .next_op("error", WAIT)
        .unwrap_or_else(|| panic!("w1 not told; broker log:\n{}", broker.log()));
    assert_eq!(told["code"], "unavailable", "{told}");
    let text = told["message"].as_str().unwrap_or_default();
    assert!(text.contains("your inbox is not delivered"), "{text}");
    assert!(text.contains("`ack_policy`"), "{text}");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let ok = a.request(json!({"op":"send","to":"w1","body":"kept"}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn the_start_up_log_names_every_store_nothing_bounds() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["topics"] = json!({"max_age_s": 3600});
    let broker = Broker::start(&nats.url(), &config);
    let log = broker.log();
    for stream in ["AMP_INBOX_acme", "AMP_TASKS_acme"] {
        let line = format!(
            "stream {stream} has no age, byte or message limit: client input fills it until JetStream's storage is full"
        );
        assert!(log.contains(&line), "{line} not in\n{log}");
    }
    assert!(!log.contains("stream AMP_TOPICS_acme has no"), "{log}");
    assert!(!log.contains("stream AMP_DLQ_acme has no"), "{log}");
}

#[test]
fn a_durable_found_with_another_ack_policy_is_refused_naming_it() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a"]));
    let mut config = binding::durable_sub_config("a", "keep", "amp.acme.topic.d.>", 30, 128, 600);
    config.ack_policy = Some(AckPolicy::None);
    config.ack_wait = None;
    config.max_ack_pending = None;
    nats.jetstream()
        .create_consumer("AMP_TOPICS_acme", &config, ConsumerAction::Create)
        .expect("a consumer made by someone else");
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let answer = a.request(json!({"op":"subscribe","topic":"d.>","sub":"keep","durable":true}));
    assert_eq!(answer["code"], "conflict", "{answer}");
    let text = answer["message"].as_str().unwrap_or_default();
    assert!(text.contains("`ack_policy`"), "{text}");
}

/// The duplicate window `stream` has.
fn window(js: &mut Context, stream: &str) -> Option<Duration> {
    js.stream_info(stream).ok()?.config.duplicate_window
}

#[test]
fn an_inbox_max_age_shorter_than_the_longest_lease_and_90_s_caps_its_window_and_starts() {
    // nats-server refuses a window longer than the stream's max_age (10052): the inbox's
    // window of the longest lease and 90 s (390 s) over a 300 s max_age stopped start-up of
    // a configuration that started under the 120 s window.
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["inbox"] = json!({"max_age_s": 300});
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": 300}});
    let broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    assert_eq!(
        window(&mut js, "AMP_INBOX_acme"),
        Some(Duration::from_secs(300))
    );
    assert_eq!(
        window(&mut js, "AMP_DLQ_acme"),
        Some(Duration::from_secs(390))
    );
    let line = "stream AMP_INBOX_acme: duplicate_window capped at inbox.max_age_s, 300 s, below the 390 s of the longest lease_s and 90 s (jobs: render)";
    assert!(broker.log().contains(line), "{}", broker.log());
}

#[test]
fn an_inbox_max_age_shorter_than_120_s_caps_its_window_and_starts() {
    // Refused by nats-server at the 120 s window already (10052), before any lease counted.
    let nats = NatsServer::start();
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["inbox"] = json!({"max_age_s": 60});
    let _broker = Broker::start(&nats.url(), &config);
    let mut js = nats.jetstream();
    assert_eq!(
        window(&mut js, "AMP_INBOX_acme"),
        Some(Duration::from_secs(60))
    );
}

#[test]
fn a_server_duplicate_window_limit_below_the_longest_lease_and_90_s_keeps_120_s_and_starts() {
    // nats-server's `jetstream { limits { duplicate_window } }` refuses a longer window:
    // start-up, which created the dead letters and raised the inbox to 390 s, stopped.
    let nats = NatsServer::with_jetstream("limits { duplicate_window: \"5m\" }", "");
    let mut js = nats.jetstream();
    js.create_stream(&binding::inbox_stream_config(
        "acme",
        0,
        10_000,
        StreamSettings::default(),
    ))
    .expect("inbox stream");
    let mut config = open_config(&["a"]);
    config["namespaces"]["acme"]["jobs"] = json!({"render": {"lease_s": 300}});
    let broker = Broker::start(&nats.url(), &config);
    for stream in ["AMP_INBOX_acme", "AMP_DLQ_acme"] {
        assert_eq!(
            window(&mut js, stream),
            Some(Duration::from_secs(120)),
            "{stream}"
        );
        let line = format!("stream {stream}: duplicate_window 390 s refused by the server");
        assert!(
            broker.log().contains(&line),
            "{line} not in\n{}",
            broker.log()
        );
    }
}
