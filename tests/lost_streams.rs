//! Streams and buckets deleted while the broker runs (an operator, anyone with JetStream
//! rights in the account): the request that finds one gone is answered `unavailable` with
//! `retry_after_ms`, the broker makes that one again with its start-up configuration, and
//! `/readyz` answers 503 naming it until it is back. Its consumers come back by their own
//! lost-consumer paths, without a restart.

mod common;

use std::time::Duration;

use amp_broker::jetstream::{Context, StreamConfig};
use common::NatsServer;
use common::amp::{Broker, Client, http_get, open_config};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);

/// Deletes `stream` and puts a stream on one of its subjects, so that it cannot be made
/// again (subjects overlap) until [`unblock`]: the not-ready time is long enough to see.
/// Only where no consumer of the stream finds it gone first: one asks for it at once.
fn delete_and_block(js: &mut Context, stream: &str, subject: &str) {
    assert!(
        js.delete_stream(stream).expect("delete"),
        "{stream} deleted"
    );
    let blocker = StreamConfig {
        name: "BLOCKER".into(),
        subjects: vec![subject.into()],
        ..StreamConfig::default()
    };
    js.create_stream(&blocker).expect("blocker");
}

fn unblock(js: &mut Context) {
    assert!(js.delete_stream("BLOCKER").expect("delete blocker"));
}

fn refused_for_a_while(answer: &Value) {
    assert_eq!(answer["op"], "error", "{answer}");
    assert_eq!(answer["code"], "unavailable", "{answer}");
    assert!(
        answer["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0),
        "{answer}"
    );
}

/// Waits for `/readyz` to answer `code` with a body containing `text`; the last answer.
fn readyz_becomes(broker: &Broker, code: u16, text: &str) -> Option<(u16, String)> {
    let mut last = None;
    let seen = common::wait_until(WAIT, || {
        last = http_get(broker.addr, "/readyz");
        last.as_ref()
            .is_some_and(|(c, body)| *c == code && body.contains(text))
    });
    seen.then_some(()).and(last.clone()).or_else(|| {
        panic!("/readyz never answered {code} with {text:?}; last {last:?}");
    })
}

#[test]
fn an_inbox_stream_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let ok = a.request(json!({"op":"send","to":"b","body":{"n":1}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let m = b.next_op("message", WAIT).expect("first message");
    b.send(&json!({"op":"ack","seq":m["seq"]}));

    let mut js = nats.jetstream();
    delete_and_block(&mut js, "AMP_INBOX_acme", "amp.acme.inbox.nobody");
    let refused = a.request(json!({"op":"send","to":"b","body":{"n":2}}));
    refused_for_a_while(&refused);
    let (_, body) = readyz_becomes(&broker, 503, "AMP_INBOX_acme").unwrap_or_default();
    assert!(body.contains("AMP_INBOX_acme"), "{body}");
    assert_eq!(http_get(broker.addr, "/healthz").map(|(c, _)| c), Some(503));

    unblock(&mut js);
    readyz_becomes(&broker, 200, "");
    let info = js.stream_info("AMP_INBOX_acme").expect("made again");
    assert_eq!(
        info.config.discard,
        Some(amp_broker::jetstream::DiscardPolicy::New)
    );
    assert!(
        info.config.max_consumers.is_some_and(|n| n > 0),
        "{:?}",
        info.config
    );
    let ok = a.request(json!({"op":"send","to":"b","body":{"n":3}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    // b's inbox consumer went with the stream; it is made again and reads on.
    let m = b
        .next_op("message", WAIT)
        .expect("a message after the stream came back");
    assert_eq!(m["body"]["n"], 3, "{m}");
}

#[test]
fn a_topics_stream_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &open_config(&["a", "b"]));
    let mut a = Client::login(&broker, "acme", "a", "a-token");
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    let publish = |n: u64| json!({"op":"publish","topic":"t.x","body":{"n":n}});

    let mut js = nats.jetstream();
    delete_and_block(&mut js, "AMP_TOPICS_acme", "amp.acme.topic.nobody");
    refused_for_a_while(&a.request(publish(1)));
    readyz_becomes(&broker, 503, "AMP_TOPICS_acme");
    unblock(&mut js);
    readyz_becomes(&broker, 200, "");

    let ok = b.request(json!({"op":"subscribe","topic":"t.x","sub":"s"}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert_eq!(a.request(publish(2))["op"], "ok");
    let e = b.next_op("event", WAIT).expect("an event");
    assert_eq!(e["body"]["n"], 2, "{e}");

    // Deleted under a subscription, whose lost consumer has it made again at once.
    assert!(js.delete_stream("AMP_TOPICS_acme").expect("delete"));
    assert!(common::wait_until(WAIT, || js
        .stream_info("AMP_TOPICS_acme")
        .is_ok()));
    // Stored at the sequence the subscription had reached in the old stream: it must
    // still follow the new stream from its start, not resume after that sequence.
    let ok = a.request(publish(3));
    assert_eq!(ok["op"], "ok", "{ok}");
    let e = b
        .next_op("event", WAIT)
        .expect("an event after the stream came back");
    assert_eq!(e["body"]["n"], 3, "{e}");
}

#[test]
fn a_tasks_stream_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &common::jobs::config(&["c", "w"], 30, 5000));
    let mut c = common::jobs::login(&broker, "c");

    // Nobody serves the job yet: no consumer of the stream finds it gone first (it makes
    // it again by itself), so the submit does.
    let mut js = nats.jetstream();
    delete_and_block(&mut js, "AMP_TASKS_acme", "amp.acme.job.nobody");
    let submit = json!({"op":"submit","id":"s1","job":"render","task":"T1","body":{"n":1}});
    refused_for_a_while(&c.request(submit.clone()));
    readyz_becomes(&broker, 503, "AMP_TASKS_acme");
    // A worker that comes meanwhile has its consumer refused, and asks again.
    let mut w = common::jobs::login_serving(&broker, "w", 1);

    unblock(&mut js);
    readyz_becomes(&broker, 200, "");
    let ok = c.request(submit);
    assert_eq!(ok["op"], "ok", "{ok}");
    let offer = w.next_op("offer", WAIT).expect("the task offered");
    assert_eq!(offer["task"], "T1", "{offer}");
}

#[test]
fn a_registry_bucket_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let mut config = open_config(&["a", "b"]);
    config["limits"] = json!({"registry_ttl_s": 4});
    let broker = Broker::start(&nats.url(), &config);
    let _a = Client::login(&broker, "acme", "a", "a-token");

    let mut js = nats.jetstream();
    delete_and_block(
        &mut js,
        "KV_AMP_REGISTRY_acme",
        "$KV.AMP_REGISTRY_acme.nobody",
    );
    // b's entry is written at its hello, and finds the bucket gone.
    let mut b = Client::login(&broker, "acme", "b", "b-token");
    readyz_becomes(&broker, 503, "KV_AMP_REGISTRY_acme");

    unblock(&mut js);
    readyz_becomes(&broker, 200, "");
    js.stream_info("KV_AMP_REGISTRY_acme")
        .expect("the bucket made again");
    // Both entries are written again at their refresh, and the watch reads them: it
    // starts over when the bucket is back, not after three missed heartbeats (15 s).
    let listed = common::wait_until(Duration::from_secs(8), || {
        let who = b.request(json!({"op":"who"}));
        let mut names: Vec<&str> = who["participants"]
            .as_array()
            .map(|p| p.iter().filter_map(|e| e["name"].as_str()).collect())
            .unwrap_or_default();
        names.sort_unstable();
        names == ["a", "b"]
    });
    assert!(listed, "the registry never listed both again");
}

/// The dead-letter stream, written only when a task runs out of attempts: its letter
/// store found it gone (no responders) and the task was tried again every second, but
/// nothing made the stream again; `dead_letters` listed nothing as if there were no
/// letters, and `/readyz` said ready.
#[test]
fn a_dead_letter_stream_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let mut config = common::jobs::config(&["c", "w"], 30, 5000);
    config["namespaces"]["acme"]["jobs"]["render"]["max_attempts"] = json!(1);
    let broker = Broker::start(&nats.url(), &config);
    let mut c = common::jobs::login(&broker, "c");
    let mut w = common::jobs::login_serving(&broker, "w", 1);

    let mut js = nats.jetstream();
    delete_and_block(&mut js, "AMP_DLQ_acme", "amp.acme.dlq.nobody");
    let ok = c.request(json!({"op":"submit","job":"render","task":"F","body":{"n":1}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let offer = w.next_op("offer", WAIT).expect("the task offered");
    assert_eq!(offer["task"], "F", "{offer}");
    let r = w.request(json!({"op":"claim","task":"F"}));
    assert_eq!(r["op"], "ok", "{r}");
    let r = w.request(json!({"op":"fail","task":"F","error":{"code":"bad","message":"no"}}));
    assert_eq!(r["op"], "ok", "{r}");
    readyz_becomes(&broker, 503, "AMP_DLQ_acme");
    refused_for_a_while(&c.request(json!({"op":"dead_letters","job":"render"})));

    unblock(&mut js);
    readyz_becomes(&broker, 200, "");
    js.stream_info("AMP_DLQ_acme").expect("made again");
    // The task message is delivered again, and its letter stored this time.
    let mut last = Value::Null;
    let listed = common::wait_until(WAIT, || {
        last = c.request(json!({"op":"dead_letters","job":"render"}));
        last["letters"].as_array().is_some_and(|l| l.len() == 1)
    });
    assert!(listed, "the letter was never stored: {last}");
    assert_eq!(last["letters"][0]["task"], "F", "{last}");
}

/// The budget bucket every task budget is counted in: a submit that read it found no
/// stream and was refused, every later one the same, until a restart.
#[test]
fn a_budget_bucket_deleted_while_the_broker_runs_is_made_again() {
    let nats = NatsServer::start();
    let mut config = common::jobs::config(&["c"], 30, 5000);
    config["namespaces"]["acme"]["participants"]["c"]["policy"] =
        json!({"tasks_per_window": 100, "window_s": 3600});
    let broker = Broker::start(&nats.url(), &config);
    let mut c = common::jobs::login(&broker, "c");

    let mut js = nats.jetstream();
    delete_and_block(&mut js, "KV_AMP_BUDGET", "$KV.AMP_BUDGET.nobody");
    let submit = json!({"op":"submit","job":"render","task":"T1","body":{"n":1}});
    let refused = c.request(submit.clone());
    assert_eq!(refused["code"], "unavailable", "{refused}");
    readyz_becomes(&broker, 503, "KV_AMP_BUDGET");

    unblock(&mut js);
    readyz_becomes(&broker, 200, "");
    js.stream_info("KV_AMP_BUDGET").expect("made again");
    let ok = c.request(submit);
    assert_eq!(ok["op"], "ok", "{ok}");
}
