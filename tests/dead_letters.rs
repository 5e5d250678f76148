//! Dead letters (README "Dead letters", mig-nats.md section 6), end to end on a real
//! nats-server with workers and submitters over WebSocket: a task failed with no attempts
//! left is stored in `AMP_DLQ_<ns>` with its body, last error and attempts, whether the
//! worker's last `fail` or the last lease running out spent them; `dead_letters` lists a
//! job's letters to their submitter and the job's workers only; `redrive` submits one
//! again, once.

mod common;

use std::time::Duration;

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use common::jobs::{login, login_serving};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(15);

fn config() -> Value {
    let mut c = open_config(&["app", "w1", "bob", "nobody"]);
    let p = &mut c["namespaces"]["acme"]["participants"];
    // bob may submit to `render` but not serve it; nobody may do neither.
    p["bob"]["permissions"]["serve"] = json!([]);
    p["nobody"]["permissions"]["serve"] = json!([]);
    p["nobody"]["permissions"]["submit"] = json!([]);
    c["namespaces"]["acme"]["jobs"] =
        json!({"render": {"lease_s": 1, "offer_ms": 5000, "max_attempts": 2}});
    c
}

fn task_result(app: &mut Client, broker: &Broker) -> Value {
    let Some(m) = app.next_op("message", WAIT) else {
        panic!("no task_result; broker log:\n{}", broker.log());
    };
    assert_eq!(m["kind"], "task_result", "{m}");
    let ack = app.request(json!({"op":"ack","seq":m["seq"]}));
    assert_eq!(ack["op"], "ok", "{ack}");
    m
}

/// Offered and claimed: the offer.
fn claim(w: &mut Client, task: &str) -> Value {
    let offer = w.next_op("offer", WAIT).expect("offer");
    assert_eq!(offer["task"], task, "{offer}");
    let r = w.request(json!({"op":"claim","task":task}));
    assert_eq!(r["op"], "ok", "{r}");
    offer
}

fn letters(c: &mut Client, from: Option<u64>) -> Value {
    let mut req = json!({"op":"dead_letters","job":"render"});
    if let Some(seq) = from {
        req["from"] = json!({"seq": seq});
    }
    let r = c.request(req);
    assert_eq!(r["op"], "ok", "{r}");
    r
}

#[test]
fn failures_with_no_attempt_left_are_dead_lettered_listed_to_the_right_people_and_redriven_once() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config());
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);

    // Attempt 1 fails asking for a retry, attempt 2 fails again: no attempt left.
    let body = json!({"frame": 7, "text": "caf\u{e9}"});
    let r = app.request(json!({"op":"submit","job":"render","task":"F","body":body,
                               "headers":{"traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}));
    assert_eq!(r["op"], "ok", "{r}");
    for attempt in 1..=2 {
        assert_eq!(claim(&mut w1, "F")["attempt"], attempt);
        let f = w1.request(json!({"op":"fail","task":"F","retry":true,
                                  "error":{"code":"gpu_lost","message":format!("attempt {attempt}")}}));
        assert_eq!(f["op"], "ok", "{f}");
    }
    let m = task_result(&mut app, &broker);
    assert_eq!(m["body"]["state"], "failed", "{m}");

    // A worker's `fail` with retry false before the last attempt is its own verdict: no
    // letter.
    let r = app.request(json!({"op":"submit","job":"render","task":"V","body":1}));
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "V");
    let f = w1.request(json!({"op":"fail","task":"V","retry":false,
                              "error":{"code":"bad_input","message":"no"}}));
    assert_eq!(f["op"], "ok", "{f}");
    assert_eq!(task_result(&mut app, &broker)["body"]["state"], "failed");

    // The last lease running out spends the last attempt too (max_attempts 1).
    let r = app
        .request(json!({"op":"submit","job":"render","task":"X","body":"lost","max_attempts":1}));
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "X");
    let revoked = w1.next_op("revoked", WAIT).expect("lease runs out");
    assert_eq!(revoked["task"], "X");
    let m = task_result(&mut app, &broker);
    assert_eq!(m["body"]["error"]["code"], "attempts_exhausted", "{m}");

    // The submitter lists both letters, oldest first, with what failed them.
    let page = letters(&mut app, None);
    let list = page["letters"].as_array().expect("letters").clone();
    let tasks: Vec<&str> = list.iter().filter_map(|l| l["task"].as_str()).collect();
    assert_eq!(tasks, ["F", "X"], "{page}");
    assert!(page.get("next").is_none(), "{page}");
    let f = &list[0];
    assert_eq!(f["body"], body);
    assert_eq!(
        f["headers"]["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert_eq!((&f["attempts"], &f["max_attempts"]), (&json!(2), &json!(2)));
    assert_eq!(f["error"]["code"], "gpu_lost");
    assert_eq!(f["error"]["message"], "attempt 2");
    assert_eq!(f["submitted_by"], "acme/app");
    let seq_f = f["seq"].as_u64().expect("seq");
    let seq_x = list[1]["seq"].as_u64().expect("seq");
    assert!(seq_x > seq_f);
    let after = letters(&mut app, Some(seq_f + 1));
    assert_eq!(
        after["letters"].as_array().map(Vec::len),
        Some(1),
        "{after}"
    );

    // The job's worker sees them; another submitter does not, and cannot redrive them;
    // someone who may neither submit nor serve is refused.
    assert_eq!(
        letters(&mut w1, None)["letters"].as_array().map(Vec::len),
        Some(2)
    );
    let mut bob = login(&broker, "bob");
    assert_eq!(letters(&mut bob, None)["letters"], json!([]));
    let r = bob.request(json!({"op":"redrive","job":"render","seq":seq_f}));
    assert_eq!(r["code"], "not_found", "{r}");
    let mut nobody = login(&broker, "nobody");
    let r = nobody.request(json!({"op":"dead_letters","job":"render"}));
    assert_eq!(r["code"], "forbidden", "{r}");
    let r = nobody.request(json!({"op":"redrive","job":"render","seq":seq_f}));
    assert_eq!(r["code"], "forbidden", "{r}");
    let r = app.request(json!({"op":"redrive","job":"render","seq":seq_x + 100}));
    assert_eq!(r["code"], "not_found", "{r}");
    let r = app.request(json!({"op":"redrive","job":"render","seq":0}));
    assert_eq!(r["code"], "schema", "{r}");

    // Redrive: a new task with the same body and headers, answered to the redriver; a
    // repeated redrive of the same letter is the same task, not a second one.
    let r = app.request(json!({"op":"redrive","job":"render","seq":seq_f}));
    assert_eq!(r["op"], "ok", "{r}");
    let task = r["task"].as_str().expect("task").to_string();
    assert_ne!(task, "F");
    let again = app.request(json!({"op":"redrive","job":"render","seq":seq_f}));
    assert_eq!(
        (&again["task"], &again["dup"]),
        (&json!(task), &json!(true)),
        "{again}"
    );
    let offer = claim(&mut w1, &task);
    assert_eq!(offer["body"], body, "{offer}");
    assert_eq!(offer["attempt"], 1);
    let k = w1.request(json!({"op":"complete","task":task,"result":{"ok":true}}));
    assert_eq!(k["op"], "ok", "{k}");
    let m = task_result(&mut app, &broker);
    assert_eq!(
        (&m["body"]["task"], &m["body"]["state"]),
        (&json!(task), &json!("completed")),
        "{m}"
    );
    let metrics = common::amp::http_get(broker.addr, "/metrics")
        .expect("metrics")
        .1;
    assert!(
        metrics.contains("amp_jobs_dead_letters_total 2"),
        "{metrics}"
    );
}

/// A worker sees every letter of its job and may submit too: redriving another's letter
/// first made it the redrive's submitter, and the letter's own submitter was refused
/// (`conflict`, the derived task id taken) for good. Each redriver now gets a task of its
/// own, still one per letter and redriver.
#[test]
fn a_worker_redriving_a_letter_first_does_not_take_it_from_its_submitter() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config());
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"L","body":1,"max_attempts":1}));
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "L");
    let f = w1.request(json!({"op":"fail","task":"L","retry":true,
                              "error":{"code":"e","message":"no"}}));
    assert_eq!(f["op"], "ok", "{f}");
    task_result(&mut app, &broker);
    let seq = letters(&mut app, None)["letters"][0]["seq"]
        .as_u64()
        .expect("seq");
    let theirs = w1.request(json!({"op":"redrive","job":"render","seq":seq}));
    assert_eq!(theirs["op"], "ok", "{theirs}");
    let mine = app.request(json!({"op":"redrive","job":"render","seq":seq}));
    assert_eq!(
        (&mine["op"], &mine["dup"]),
        (&json!("ok"), &json!(false)),
        "{mine}"
    );
    assert_ne!(mine["task"], theirs["task"]);
    let again = app.request(json!({"op":"redrive","job":"render","seq":seq}));
    assert_eq!(
        (&again["task"], &again["dup"]),
        (&mine["task"], &json!(true)),
        "{again}"
    );
}

#[test]
fn dead_letter_pages_are_paced_as_listings_are() {
    // Each page reads up to 200 stored letters one after another; at the frame rate, with
    // a thousand requests in flight, one session kept JetStream reading without pause.
    let nats = NatsServer::start();
    let mut c = config();
    c["limits"] = json!({"presence_listed_per_s": 1000});
    let broker = Broker::start(&nats.url(), &c);
    let mut app = login(&broker, "app");
    for i in 0..20 {
        app.send(&json!({"op":"dead_letters","id":format!("d{i}"),"job":"render"}));
    }
    let (mut ok, mut limited) = (0, 0);
    for i in 0..20 {
        let r = app.answer_to(&format!("d{i}"));
        match r["op"].as_str() {
            Some("ok") => ok += 1,
            _ => {
                assert_eq!(r["code"], "rate_limited", "{r}");
                assert!(r["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{r}");
                limited += 1;
            }
        }
    }
    // A second's worth (1,000 letters, five pages) at once, at most one more meanwhile.
    assert!(
        (5..=7).contains(&ok),
        "{ok} pages answered, {limited} refused"
    );
}

/// The letter reads the task's message back with `STREAM.MSG.GET`, whose answer carries
/// it base64-encoded: for a task of 790 KB or more, past the server's `max_payload`. The
/// broker took that answer for a protocol error and dropped its NATS connection; the
/// letter was never stored, and the NAK that retries it brought the message back a second
/// later to drop the connection again, on one broker after another.
#[test]
fn a_large_task_out_of_attempts_is_dead_lettered_without_dropping_the_connection() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config());
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let blob = "b".repeat(850_000);
    let r = app.request(json!({"op":"submit","job":"render","task":"BIG",
                               "body":{"blob":blob},"max_attempts":1}));
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "BIG");
    let f = w1.request(json!({"op":"fail","task":"BIG","retry":true,
                              "error":{"code":"oom","message":"too big for me"}}));
    assert_eq!(f["op"], "ok", "{f}");
    let m = task_result(&mut app, &broker);
    assert_eq!(m["body"]["state"], "failed", "{m}");
    let page = letters(&mut app, None);
    let list = page["letters"].as_array().expect("letters");
    assert_eq!(list.len(), 1, "{}", broker.log());
    assert_eq!(list[0]["task"], "BIG");
    assert_eq!(
        list[0]["body"]["blob"].as_str().map(str::len),
        Some(850_000)
    );
    assert_eq!(
        common::amp::metric(&broker, "amp_nats_reconnects_total"),
        Some(0.0),
        "{}",
        broker.log()
    );
}

/// A letter holds the task's headers and its record's `eligible` and last error, each of
/// which may be near `max_payload` while the task still fits: left out of the letter, the
/// body alone was not enough. Its publish failed, and the task message was NAKed to try
/// again a second later, for ever, publishing the `task_result` again each time (past
/// JetStream's 2-minute duplicate window, a second result). The letter now leaves out
/// what it must (the body, then `eligible`, then the headers, then the error), says so,
/// and is stored on the first try.
#[test]
fn a_letter_too_large_even_without_its_body_leaves_out_more_and_is_stored_once() {
    let nats = NatsServer::with_config("max_payload: 65536");
    let broker = Broker::start(&nats.url(), &config());
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    // 56 KB of headers in the task message, 25 KB of eligible names in its record.
    let headers: serde_json::Map<String, Value> = (0..7)
        .map(|i| (format!("x-pad-{i}"), json!("h".repeat(8000))))
        .collect();
    let mut names = vec![json!("w1")];
    names.extend((0..380).map(|i| json!(format!("{i:0>64}"))));
    let r = app.request(
        json!({"op":"submit","job":"render","task":"H","body":{"frame":1},
                               "max_attempts":1,"headers":headers,"eligible":{"names":names}}),
    );
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "H");
    let message = "\u{20ac}".repeat(4096);
    let f = w1.request(json!({"op":"fail","task":"H","retry":true,
                              "error":{"code":"gpu_lost","message":message}}));
    assert_eq!(f["op"], "ok", "{f}");
    let m = task_result(&mut app, &broker);
    assert_eq!(m["body"]["state"], "failed", "{m}");

    // Stored before the result went out, without what did not fit, with the error.
    let page = letters(&mut app, None);
    let list = page["letters"].as_array().expect("letters");
    assert_eq!(list.len(), 1, "{page}\nbroker log:\n{}", broker.log());
    let l = &list[0];
    assert_eq!(l["task"], "H");
    assert_eq!(l["body"], Value::Null);
    assert_eq!(l["headers"], json!({}));
    for part in ["body_omitted", "eligible_omitted", "headers_omitted"] {
        assert_eq!(l[part], true, "{part}: {l}");
    }
    assert!(l.get("error_omitted").is_none(), "{l}");
    assert_eq!(l["error"]["code"], "gpu_lost");
    assert_eq!(l["error"]["message"], message);
    let seq = l["seq"].as_u64().expect("seq");
    let r = app.request(json!({"op":"redrive","job":"render","seq":seq}));
    assert_eq!(r["code"], "conflict", "{r}");

    // The task message is terminated: no redelivery stores it or announces it again.
    let mut js = nats.jetstream();
    let gone = common::wait_until(WAIT, || {
        js.stream_info("AMP_TASKS_acme")
            .is_ok_and(|i| i.state.messages == 0)
    });
    assert!(
        gone,
        "the task message stays; broker log:\n{}",
        broker.log()
    );
    let log = broker.log();
    assert!(!log.contains("dead letter not stored"), "{log}");
    // One line for the operator, naming the task, the job and what was left out, and
    // none of the task's content.
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("left out")).collect();
    assert_eq!(lines.len(), 1, "{log}");
    for needed in [
        "WARN",
        "task=acme.H",
        "job=render",
        "body",
        "eligible",
        "headers",
    ] {
        assert!(lines[0].contains(needed), "{needed}: {}", lines[0]);
    }
    assert!(
        !lines[0].contains("hhhh") && !lines[0].contains('\u{20ac}'),
        "{}",
        lines[0]
    );
    assert_eq!(
        common::amp::metric(&broker, "amp_jobs_dead_letters_trimmed_total"),
        Some(1.0)
    );
}

/// A letter that could not be stored leaves the task message NAKed for a redelivery
/// that stores it then, a second later, for as long as the dead-letter stream refuses.
/// Each redelivery published the `task_result` again, and once the submitter's inbox no
/// longer deduplicated its id (JetStream's duplicate window, 120 s; 1 s here) each was a
/// second result. The result is now published once, and the record says so.
#[test]
fn a_dead_letter_refused_past_the_inbox_duplicate_window_leaves_one_task_result() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config());
    let mut js = nats.jetstream();
    let mut inbox = js.stream_info("AMP_INBOX_acme").expect("inbox").config;
    inbox.duplicate_window = Some(Duration::from_secs(1));
    js.update_stream(&inbox).expect("a 1 s duplicate window");
    let dlq = js.stream_info("AMP_DLQ_acme").expect("dead letters").config;
    assert!(js.delete_stream("AMP_DLQ_acme").expect("dead letters gone"));
    // The broker makes a deleted stream again: a stream on one of its subjects keeps it
    // from that.
    let blocker = amp_broker::jetstream::StreamConfig {
        name: "BLOCKER".into(),
        subjects: vec!["amp.acme.dlq.nobody".into()],
        ..Default::default()
    };
    js.create_stream(&blocker).expect("blocker");
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"D","body":1,
                               "max_attempts":1}));
    assert_eq!(r["op"], "ok", "{r}");
    claim(&mut w1, "D");
    let f = w1.request(json!({"op":"fail","task":"D","error":{"code":"x"}}));
    assert_eq!(f["op"], "ok", "{f}");
    assert_eq!(task_result(&mut app, &broker)["body"]["state"], "failed");
    // Redelivered and refused again for 3 s or more: three times the window.
    let tries = || broker.log().matches("dead letter not stored yet").count();
    assert!(
        common::wait_until(WAIT, || tries() >= 5),
        "{}",
        broker.log()
    );
    let second = app.next_op("message", Duration::from_secs(2));
    assert!(second.is_none(), "a second result: {second:?}");
    // The stream back: the next redelivery stores the letter and terminates the message.
    assert!(js.delete_stream("BLOCKER").expect("blocker gone"));
    js.create_stream(&dlq).expect("dead letters back");
    assert!(
        common::wait_until(WAIT, || {
            js.stream_info("AMP_TASKS_acme")
                .is_ok_and(|i| i.state.messages == 0)
        }),
        "{}",
        broker.log()
    );
    let page = letters(&mut app, None);
    assert_eq!(page["letters"][0]["task"], "D", "{page}");
    let second = app.next_op("message", Duration::from_secs(2));
    assert!(second.is_none(), "a second result: {second:?}");
}
