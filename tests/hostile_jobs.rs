//! Hostile participants against jobs, ids, the registry and hello: a broker process on a
//! real nats-server, attackers and victims over real WebSockets.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use amp_broker::jetstream::Context;
use amp_broker::jetstream::kv::KvOperation;
use common::NatsServer;
use common::amp::{Broker, Client};
use common::jobs::{config, login, login_serving, status};
use serde_json::json;

/// Messages ever stored in the registry bucket of `acme` (puts and deletes).
fn registry_writes(js: &mut Context) -> u64 {
    js.stream_info("KV_AMP_REGISTRY_acme")
        .map(|i| i.state.last_seq)
        .unwrap_or(0)
}

/// The client's side of the WebSocket closing handshake, then the socket is dropped.
fn close_cleanly(c: Client) {
    let mut ws = c.into_websocket();
    let _ = ws.close(None);
    while ws.read().is_ok() {}
}

#[test]
fn hello_close_churn_leaves_one_registry_refresh_per_participant() {
    // TTL 6 s: the broker refreshes each entry every 2 s.
    let refresh = Duration::from_secs(2);
    let nats = NatsServer::start();
    let mut c = config(&["a"], 30, 5000);
    c["limits"] = json!({"registry_ttl_s": 6});
    let broker = Broker::start(&nats.url(), &c);
    let mut js = nats.jetstream();

    let cycles = 200;
    let started = Instant::now();
    for _ in 0..cycles {
        close_cleanly(login(&broker, "a"));
    }
    let churn = started.elapsed();
    let stay = login(&broker, "a");
    // Every chain started by the churn has fired at least once by now: those that found
    // the participant present re-armed themselves.
    std::thread::sleep(refresh + Duration::from_millis(500));
    let before = registry_writes(&mut js);
    std::thread::sleep(refresh * 2);
    let puts = registry_writes(&mut js) - before;
    eprintln!(
        "{cycles} hello/close cycles in {churn:?}: {puts} registry writes in two refresh intervals"
    );
    assert!(
        (1..=3).contains(&puts),
        "one refresh per participant per interval: {puts} writes in two intervals"
    );

    // Gone: its delete, and no refresh after it.
    close_cleanly(stay);
    let kv = js.kv_bind("AMP_REGISTRY_acme").expect("registry bucket");
    assert!(
        common::wait_until(Duration::from_secs(5), || js
            .kv_entry(&kv, "a")
            .is_ok_and(|e| e.operation == KvOperation::Delete)),
        "the delete is written"
    );
    let after_delete = registry_writes(&mut js);
    std::thread::sleep(refresh + Duration::from_millis(500));
    assert_eq!(
        registry_writes(&mut js),
        after_delete,
        "no refresh once the last session is gone"
    );
}

#[test]
fn status_answers_only_the_submitter_and_the_current_holder() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["a", "b", "w1", "w2"], 30, 5000));
    let mut a = login(&broker, "a");
    let mut b = login(&broker, "b");
    let mut w2 = login(&broker, "w2");
    let r = a.request(json!({"op":"submit","job":"render","body":{"secret":42}}));
    assert_eq!(r["op"], "ok", "{r}");
    let task = r["task"].as_str().expect("generated task id").to_string();

    let refused = b.request(json!({"op":"status","task":task}));
    assert_eq!(
        refused["code"], "forbidden",
        "another participant: {refused}"
    );
    let text = refused.to_string();
    for secret in ["secret", "render", "queued", "acme/a"] {
        assert!(
            !text.contains(secret),
            "the refusal reveals nothing: {text}"
        );
    }
    assert_eq!(
        b.request(json!({"op":"status","task":"no-such-task"}))["code"],
        "not_found"
    );
    assert_eq!(status(&mut a, &task)["state"], "queued");

    // The holder may ask while it holds the lease; a worker that does not hold it may not.
    let mut w1 = login_serving(&broker, "w1", 1);
    let offer = w1.next_op("offer", Duration::from_secs(10)).expect("offer");
    assert_eq!(offer["task"], task.as_str());
    let refused = w1.request(json!({"op":"status","task":task}));
    assert_eq!(
        refused["code"], "forbidden",
        "an offer is no lease: {refused}"
    );
    let claim = w1.request(json!({"op":"claim","task":task}));
    assert_eq!(claim["op"], "ok", "{claim}");
    assert_eq!(status(&mut w1, &task)["holder"], "acme/w1");
    assert_eq!(
        w2.request(json!({"op":"status","task":task}))["code"],
        "forbidden"
    );
    let done = w1.request(json!({"op":"complete","task":task,"result":{"r":1}}));
    assert_eq!(done["op"], "ok", "{done}");
    assert_eq!(
        w1.request(json!({"op":"status","task":task}))["code"],
        "forbidden",
        "no longer the holder once finished"
    );
    assert_eq!(status(&mut a, &task)["state"], "completed");
}

#[test]
fn generated_task_ids_share_no_predictable_structure() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["a"], 30, 5000));
    let mut a = login(&broker, "a");
    let n = 1000;
    for i in 0..n {
        a.send(&json!({"op":"submit","id":format!("s{i}"),"job":"render","body":i}));
    }
    let ids: Vec<String> = (0..n)
        .map(|i| {
            let r = a.answer_to(&format!("s{i}"));
            assert_eq!(r["op"], "ok", "{r}");
            r["task"].as_str().expect("task id").to_string()
        })
        .collect();
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), n, "all distinct");
    for id in &ids {
        assert!(
            id.len() == 26
                && id
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b)),
            "26 characters of lowercase base32: {id}"
        );
    }
    let longest = ids
        .windows(2)
        .map(|w| {
            w[0].bytes()
                .zip(w[1].bytes())
                .take_while(|(x, y)| x == y)
                .count()
        })
        .max()
        .unwrap_or(0);
    eprintln!("longest common prefix of consecutive ids: {longest}");
    assert!(
        longest < 6,
        "consecutive ids share a {longest}-character prefix"
    );
}

#[test]
fn a_task_id_of_another_participant_answers_conflict_whatever_its_state() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["a", "b", "w1"], 30, 5000));
    let mut a = login(&broker, "a");
    let mut b = login(&broker, "b");
    let submit = json!({"op":"submit","job":"render","task":"T-a","body":{"frame":1}});
    let r = a.request(submit.clone());
    assert_eq!((&r["op"], &r["dup"]), (&json!("ok"), &json!(false)), "{r}");

    // Same job and body, other job, other body: one answer, and it names no detail.
    let squat = |b: &mut Client, frame: serde_json::Value| {
        let mut e = b.request(frame);
        assert_eq!(e["code"], "conflict", "{e}");
        e.as_object_mut().map(|o| o.remove("re"));
        e
    };
    let queued = squat(&mut b, submit.clone());
    let other_body = squat(
        &mut b,
        json!({"op":"submit","job":"render","task":"T-a","body":{"frame":2}}),
    );
    assert_eq!(queued, other_body, "the answer does not depend on the body");
    let text = queued.to_string();
    assert!(!text.contains("body") && !text.contains("job"), "{text}");

    let r = a.request(submit.clone());
    assert_eq!(
        (&r["op"], &r["dup"]),
        (&json!("ok"), &json!(true)),
        "the submitter's own resubmit: {r}"
    );
    let mut cancel = b.request(json!({"op":"cancel","task":"T-a"}));
    assert_eq!(cancel["code"], "forbidden", "{cancel}");
    cancel.as_object_mut().map(|o| o.remove("re"));

    // Finished: B still hears the same, A still hears dup.
    let mut w1 = login_serving(&broker, "w1", 1);
    let offer = w1.next_op("offer", Duration::from_secs(10)).expect("offer");
    assert_eq!(offer["task"], "T-a");
    assert_eq!(w1.request(json!({"op":"claim","task":"T-a"}))["op"], "ok");
    assert_eq!(
        w1.request(json!({"op":"complete","task":"T-a"}))["op"],
        "ok"
    );
    assert_eq!(status(&mut a, "T-a")["state"], "completed");
    assert_eq!(
        squat(&mut b, submit.clone()),
        queued,
        "the state is not revealed"
    );
    let mut late = b.request(json!({"op":"cancel","task":"T-a"}));
    late.as_object_mut().map(|o| o.remove("re"));
    assert_eq!(late, cancel, "nor through cancel");
    let r = a.request(submit);
    assert_eq!(r["dup"], true, "{r}");
}

/// SIGSTOPs a process for as long as it lives: JetStream takes requests and answers none.
struct Frozen(u32);

impl Frozen {
    fn new(pid: u32) -> Frozen {
        signal(pid, "-STOP");
        assert!(
            common::wait_until(Duration::from_secs(5), || common::stopped(pid)),
            "nats-server {pid} did not stop"
        );
        Frozen(pid)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

#[test]
fn a_session_holds_at_most_its_share_of_requests_in_flight() {
    // Every request a session sends holds one of the broker's NATS request slots until
    // JetStream answers (or 4 s pass): with the server slow, one session at the frame rate
    // held thousands, and a few such held them all for everyone.
    let nats = NatsServer::start();
    let mut c = config(&["a", "b"], 30, 5000);
    c["limits"] = json!({"max_requests_in_flight": 64});
    let broker = Broker::start(&nats.url(), &c);
    let mut a = login(&broker, "a");
    let frozen = Frozen::new(nats.pid().expect("nats-server pid"));
    for i in 0..300 {
        a.send(&json!({"op":"send","id":format!("s{i}"),"to":"b","body":i}));
    }
    // The 236 past the cap are answered at once, while JetStream answers nothing.
    let mut refused = 0;
    while refused < 236 {
        let f = a
            .next_frame(Duration::from_secs(2))
            .unwrap_or_else(|| panic!("{refused} of 236 refused while the server was frozen"));
        assert_eq!(f["code"], "rate_limited", "{f}");
        assert!(f["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{f}");
        refused += 1;
    }
    drop(frozen);
    // The 64 taken go through (or time out), and the session goes on.
    for i in 0..64 {
        let f = a.answer_to(&format!("s{i}"));
        assert!(f["op"] == "ok" || f["code"] == "unavailable", "{f}");
    }
    let ok = a.request(json!({"op":"send","to":"b","body":"after"}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn submit_bodies_waiting_for_jetstream_are_bounded_in_bytes() {
    // A submit keeps its whole task message until the task store's create is answered
    // (up to 4 s). Requests in flight are capped in number, not in bytes: with JetStream
    // slow, pipelined submits of large bodies held 1,024 x 1 MiB per session, outside
    // every memory bound. Now they share a quarter of `max_buffered_bytes`.
    let nats = NatsServer::start();
    let mut c = config(&["a", "b"], 30, 5000);
    c["limits"] = json!({"max_buffered_bytes": 8 << 20});
    let broker = Broker::start(&nats.url(), &c);
    let mut a = login(&broker, "a");
    let mut b = login(&broker, "b");
    let body = "x".repeat(200_000);
    let frozen = Frozen::new(nats.pid().expect("nats-server pid"));
    // 40 x 200 kB = 8 MB against a 2 MiB share: about 10 are held, the rest refused.
    for i in 0..40 {
        a.send(&json!({"op":"submit","id":format!("s{i}"),"job":"render","body":body}));
    }
    let mut refused = HashSet::new();
    while let Some(f) = a.next_frame(Duration::from_secs(2)) {
        assert_eq!(f["code"], "unavailable", "{f}");
        assert!(f["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{f}");
        refused.insert(f["re"].as_str().unwrap_or_default().to_string());
    }
    assert!(
        (25..=32).contains(&refused.len()),
        "{} of 40 refused while the server was frozen",
        refused.len()
    );
    drop(frozen);
    // The held ones go through (or time out), and the room is back.
    let taken: Vec<_> = (0..40)
        .map(|i| format!("s{i}"))
        .filter(|id| !refused.contains(id))
        .collect();
    for id in &taken {
        let f = a.answer_to(id);
        assert!(f["op"] == "ok" || f["code"] == "unavailable", "{f}");
    }
    let ok = b.request(json!({"op":"submit","job":"render","body":body}));
    assert_eq!(ok["op"], "ok", "{ok}");
}

#[test]
fn submits_waiting_for_a_budget_reservation_are_capped_per_participant() {
    let nats = NatsServer::start();
    let mut c = config(&["a"], 30, 5000);
    c["namespaces"]["acme"]["participants"]["a"]["policy"] =
        json!({"tasks_per_window": 100_000, "window_s": 3600});
    c["limits"] = json!({"max_held_submits": 8});
    let broker = Broker::start(&nats.url(), &c);
    let mut a = login(&broker, "a");

    // The first submit starts a reservation that JetStream, frozen, never answers: every
    // submit waits for it, up to the cap.
    let frozen = Frozen::new(nats.pid().expect("nats pid"));
    let (cap, extra) = (8, 24);
    let sent = Instant::now();
    for i in 0..cap + extra {
        a.send(&json!({"op":"submit","id":format!("s{i}"),"job":"render","body":i}));
    }
    let mut refused = Vec::new();
    while refused.len() < extra {
        let Some(f) = a.next_frame(Duration::from_secs(3)) else {
            break;
        };
        refused.push(f);
    }
    let waited = sent.elapsed();
    drop(frozen);
    eprintln!(
        "{} of {} submits answered within {waited:?} while the budget could not be read",
        refused.len(),
        cap + extra
    );
    assert_eq!(
        refused.len(),
        extra,
        "those past the cap are answered at once: {refused:?}"
    );
    for (i, f) in refused.iter().enumerate() {
        assert_eq!(f["re"], format!("s{}", cap + i), "{f}");
        assert_eq!(f["code"], "unavailable", "{f}");
        assert!(f["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{f}");
    }
    // The held ones are answered once the reservation settles (here: it timed out).
    for i in 0..cap {
        let r = a.answer_to(&format!("s{i}"));
        assert!(r["op"] == "ok" || r["code"] == "unavailable", "{r}");
    }
}

#[test]
fn a_participant_holds_at_most_its_share_of_requests_in_flight_over_all_its_sessions() {
    // The per-session cap alone let one participant open more sessions and hold
    // `max_requests_in_flight` in each: 64 sessions at the default held every NATS
    // request slot of the broker while JetStream was slow.
    let nats = NatsServer::start();
    let mut c = config(&["a", "b"], 30, 5000);
    c["limits"] = json!({"max_requests_in_flight": 64, "max_participant_requests_in_flight": 100});
    let broker = Broker::start(&nats.url(), &c);
    let mut sessions: Vec<_> = (0..3).map(|_| login(&broker, "a")).collect();
    let mut other = login(&broker, "b");
    let frozen = Frozen::new(nats.pid().expect("nats-server pid"));
    for (k, s) in sessions.iter_mut().enumerate() {
        for i in 0..64 {
            s.send(&json!({"op":"send","id":format!("s{k}-{i}"),"to":"b","body":i}));
        }
    }
    // 192 sent, each session within its own cap; 92 of them past the participant's,
    // refused at once (the 100 taken wait for the server).
    let mut answered = [0; 3];
    let deadline = Instant::now() + Duration::from_secs(3);
    while answered.iter().sum::<usize>() < 92 && Instant::now() < deadline {
        for (k, s) in sessions.iter_mut().enumerate() {
            while let Some(f) = s.next_frame(Duration::from_millis(10)) {
                assert_eq!(f["code"], "rate_limited", "{f}");
                let message = f["message"].as_str().unwrap_or_default();
                assert!(message.contains("participant"), "{f}");
                answered[k] += 1;
            }
        }
    }
    assert_eq!(answered.iter().sum::<usize>(), 92, "refused: {answered:?}");
    // Another participant's requests are not counted against it.
    other.send(&json!({"op":"send","id":"b0","to":"b","body":0}));
    drop(frozen);
    let f = other.answer_to("b0");
    assert!(f["op"] == "ok" || f["code"] == "unavailable", "{f}");
    // Every request taken is answered, and the count comes back down: the participant
    // can have its whole share in flight again.
    for (k, s) in sessions.iter_mut().enumerate() {
        while answered[k] < 64 {
            let f = s.next_frame(Duration::from_secs(15)).expect("an answer");
            assert!(f["op"] == "ok" || f["code"] == "unavailable", "{f}");
            answered[k] += 1;
        }
    }
    drop(sessions);
    let mut a = login(&broker, "a");
    let frozen = Frozen::new(nats.pid().expect("nats-server pid"));
    for i in 0..64 {
        a.send(&json!({"op":"send","id":format!("t{i}"),"to":"b","body":i}));
    }
    assert!(
        a.next_frame(Duration::from_millis(500)).is_none(),
        "nothing refused: the participant's count came back down"
    );
    drop(frozen);
    for i in 0..64 {
        let f = a.answer_to(&format!("t{i}"));
        assert!(f["op"] == "ok" || f["code"] == "unavailable", "{f}");
    }
}

#[test]
fn tasks_nobody_may_take_do_not_hold_up_the_job() {
    // A task whose `eligible` names nobody present is handed back (NAK) each time it is
    // delivered and stays pending at the consumer; 1,000 of them filled the job
    // consumer's default `max_ack_pending` and no other task of the job was delivered.
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w"], 30, 5000));
    let mut app = login(&broker, "app");
    let stuck = 1_100;
    for batch in (0..stuck).collect::<Vec<_>>().chunks(500) {
        for i in batch {
            app.send(
                &json!({"op":"submit","id":format!("s{i}"),"job":"render","body":i,
                             "eligible":{"names":["nobody"]}}),
            );
        }
        for i in batch {
            let r = app.answer_to(&format!("s{i}"));
            assert_eq!(r["op"], "ok", "{r}");
        }
    }
    let mut w = login_serving(&broker, "w", 1);
    // Let the worker's one slot go through the stuck tasks.
    let deadline = Instant::now() + Duration::from_secs(20);
    let real = app.request(json!({"op":"submit","job":"render","body":"real"}));
    assert_eq!(real["op"], "ok", "{real}");
    let task = real["task"].clone();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let f = w
            .next_frame(left)
            .unwrap_or_else(|| panic!("the task behind {stuck} stuck ones was never offered"));
        if f["op"] == "offer" {
            assert_eq!(f["task"], task, "only the real task is offered: {f}");
            break;
        }
    }
}

const JS_OPS: &str = "amp_jobs_jetstream_ops_total";

/// A holder's heartbeats are written one at a time, in order. Sent all at once they were
/// written all at once against one revision: every one but the first lost the
/// compare-and-set and read the record again, up to eight times each, so 64 pipelined
/// heartbeats cost hundreds of JetStream operations (each carrying the whole record), and
/// the submitter's `cancel`, racing the same revision, could run out of tries.
#[test]
fn pipelined_heartbeats_are_written_one_at_a_time_and_leave_the_submitter_its_cancel() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["a", "w1"], 60, 5000));
    let mut a = login(&broker, "a");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = a.request(json!({"op":"submit","job":"render","body":{}}));
    let task = r["task"].as_str().expect("task").to_string();
    let offer = w1.next_op("offer", Duration::from_secs(10)).expect("offer");
    assert_eq!(offer["task"], task.as_str());
    assert_eq!(w1.request(json!({"op":"claim","task":task}))["op"], "ok");
    let ops = || common::amp::metric(&broker, JS_OPS).unwrap_or(0.0);
    let pad = "p".repeat(2_000);
    let before = ops();
    for i in 0..64 {
        w1.send(&json!({"op":"heartbeat","id":format!("h{i}"),"task":task,
                        "progress":{"i":i,"pad":pad}}));
    }
    for i in 0..64 {
        let r = w1.answer_to(&format!("h{i}"));
        assert_eq!(r["op"], "ok", "{r}");
    }
    let spent = ops() - before;
    eprintln!("64 pipelined heartbeats: {spent} JetStream operations");
    // Each is one write and one in-progress ack (a heartbeat restarts the AckWait).
    assert!(spent <= 136.0, "{spent} operations for 64 heartbeats");
    let mut js = nats.jetstream();
    let kv = js.kv_bind("AMP_TASK_STATE").expect("task store");
    let record = js.kv_entry(&kv, &format!("acme.{task}")).expect("record");
    let record: serde_json::Value = serde_json::from_slice(&record.value).expect("json");
    assert_eq!(
        record["progress"]["i"], 63,
        "the last one sent is the last written"
    );

    for i in 64..128 {
        w1.send(&json!({"op":"heartbeat","id":format!("h{i}"),"task":task,
                        "progress":{"i":i,"pad":pad}}));
    }
    let cancel = a.request(json!({"op":"cancel","task":task}));
    assert_eq!(cancel["op"], "ok", "{cancel}");
    for i in 64..128 {
        let r = w1.answer_to(&format!("h{i}"));
        assert!(r["op"] == "ok" || r["code"] == "lease_lost", "{r}");
    }
    assert_eq!(status(&mut a, &task)["state"], "cancelled");
}

/// A holder's `progress` (or `result`) went into the task record unchecked but for the
/// server's `max_payload`: a worker could fill the record so that no later change (the
/// next claim, a requeue, the submitter's cancel) fitted, and the task cycled for ever.
/// A holder's change now leaves 64 KiB free.
#[test]
fn a_holder_cannot_fill_the_task_record_to_max_payload() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["a", "w1"], 60, 5000));
    let mut a = login(&broker, "a");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = a.request(json!({"op":"submit","job":"render","body":{}}));
    let task = r["task"].as_str().expect("task").to_string();
    w1.next_op("offer", Duration::from_secs(10)).expect("offer");
    assert_eq!(w1.request(json!({"op":"claim","task":task}))["op"], "ok");
    let full = "p".repeat(1_000_000);
    let r = w1.request(json!({"op":"heartbeat","task":task,"progress":full}));
    assert_eq!(r["code"], "too_large", "{r}");
    let r = w1.request(json!({"op":"heartbeat","task":task,"progress":"p".repeat(100_000)}));
    assert_eq!(r["op"], "ok", "{r}");
    let cancel = a.request(json!({"op":"cancel","task":task}));
    assert_eq!(cancel["op"], "ok", "{cancel}");
}

/// Tasks only a busy session here may take came back every half second, however long
/// it stayed busy: a participant serving with one slot it kept leased, submitting a
/// thousand tasks only it may take, had them delivered two thousand times a second, and
/// every free slot's pull of the job went on them. They now back off as tasks nobody
/// here may take do (to 4 s).
#[test]
fn tasks_only_a_busy_session_may_take_back_off() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "evil", "w"], 60, 5000));
    let mut evil = login_serving(&broker, "evil", 1);
    let first = evil.request(json!({"op":"submit","job":"render","body":0,
                                    "eligible":{"names":["evil"]}}));
    let held = first["task"].clone();
    let offer = evil
        .next_op("offer", Duration::from_secs(10))
        .expect("offer");
    assert_eq!(offer["task"], held);
    assert_eq!(evil.request(json!({"op":"claim","task":held}))["op"], "ok");
    let stuck = 1_000;
    for batch in (0..stuck).collect::<Vec<_>>().chunks(500) {
        for i in batch {
            evil.send(
                &json!({"op":"submit","id":format!("s{i}"),"job":"render","body":i,
                              "eligible":{"names":["evil"]}}),
            );
        }
        for i in batch {
            let r = evil.answer_to(&format!("s{i}"));
            assert_eq!(r["op"], "ok", "{r}");
        }
    }
    let mut w = login_serving(&broker, "w", 1);
    // Let the stuck tasks go round a few times.
    std::thread::sleep(Duration::from_secs(3));
    let ops = || common::amp::metric(&broker, JS_OPS).unwrap_or(0.0);
    let before = ops();
    std::thread::sleep(Duration::from_secs(2));
    let per_s = (ops() - before) / 2.0;
    eprintln!("{stuck} tasks only a busy session may take: {per_s} JetStream operations a second");
    assert!(per_s < 3_000.0, "{per_s} operations a second");
    let mut app = login(&broker, "app");
    let real = app.request(json!({"op":"submit","job":"render","body":"real"}));
    let task = real["task"].clone();
    // Within a cycle of the stuck ones (4 s), with room for a loaded machine.
    let offered = w
        .next_op("offer", Duration::from_secs(10))
        .expect("the real task offered");
    assert_eq!(offered["task"], task);
}

#[test]
fn the_task_store_keeps_one_revision_per_task_and_lets_finished_ones_expire() {
    // A worker's heartbeats with large `progress` stayed in the task store 64 revisions
    // over (the bucket's history), and no record ever left it: honest traffic and one
    // hostile worker alike filled the server's file store, and then every write of every
    // stream refused.
    let nats = NatsServer::start();
    let mut c = config(&["app", "w"], 30, 5000);
    c["namespaces"]["acme"]["jobs"]["render"]["keep_finished_s"] = json!(300);
    let broker = Broker::start(&nats.url(), &c);
    let mut app = login(&broker, "app");
    let mut w = login_serving(&broker, "w", 1);
    let ok = app.request(json!({"op":"submit","job":"render","task":"big","body":1}));
    assert_eq!(ok["op"], "ok", "{ok}");
    let offer = w.next_op("offer", Duration::from_secs(10)).expect("offer");
    assert_eq!(offer["task"], "big");
    assert_eq!(w.request(json!({"op":"claim","task":"big"}))["op"], "ok");
    let progress = "p".repeat(100_000);
    for i in 0..12 {
        let ok = w.request(json!({"op":"heartbeat","task":"big","progress":{"i":i,"p":progress}}));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    let mut js = nats.jetstream();
    let bytes = js
        .stream_info("KV_AMP_TASK_STATE")
        .map(|i| i.state.bytes)
        .expect("task store");
    assert!(
        bytes < 300_000,
        "12 heartbeats of 100 kB left {bytes} bytes in the task store"
    );
    let ok = w.request(json!({"op":"complete","task":"big","result":{"r":1}}));
    assert_eq!(ok["op"], "ok", "{ok}");
    assert_eq!(status(&mut app, "big")["state"], "completed");
    // One revision left, which expires: 300 s after the lease (30 s) at least, past
    // anything that may still come for the task.
    let last = js
        .direct_get(
            "KV_AMP_TASK_STATE",
            &amp_broker::jetstream::MsgSelector::LastBySubject(
                "$KV.AMP_TASK_STATE.acme.big".to_string(),
            ),
        )
        .expect("the record");
    assert_eq!(last.header("Nats-TTL"), Some("330s"));
    assert_eq!(last.header("Nats-Rollup"), Some("sub"));
    let messages = js
        .stream_info("KV_AMP_TASK_STATE")
        .map(|i| i.state.messages);
    assert_eq!(messages.ok(), Some(1));
}

#[test]
fn a_job_whose_consumer_jetstream_refuses_tells_its_workers() {
    // The namespace's task stream at its `max_consumers` (an operator's 2 here; 10,000 by
    // default, and nats-server's 1,000 before the broker set one): `serve` was answered
    // `ok` and nothing was ever offered, the broker asking again every 2 s in silence.
    let nats = NatsServer::start();
    let mut js = nats.jetstream();
    let mut tasks = amp_broker::broker::binding::tasks_stream_config(
        "acme",
        amp_broker::broker::binding::StreamSettings::default(),
    );
    tasks.max_consumers = Some(2);
    js.create_stream(&tasks).expect("task stream");
    let broker = Broker::start(&nats.url(), &config(&["w"], 30, 5000));
    let mut w = login(&broker, "w");
    for job in ["a", "b", "c"] {
        let ok = w.request(json!({"op":"serve","job":job,"slots":1}));
        assert_eq!(ok["op"], "ok", "{ok}");
    }
    let told = w
        .next_op("error", WAIT_TOLD)
        .expect("the worker hears its job is not offered");
    assert_eq!(
        (&told["code"], &told["path"]),
        (&json!("unavailable"), &json!("/job")),
        "{told}"
    );
    // Which of the three is left out is the order JetStream's API workers took the
    // creates in, not the order they were sent.
    let message = told["message"].as_str().unwrap_or_default();
    assert!(
        ["a", "b", "c"]
            .iter()
            .any(|job| message.contains(&format!("job `{job}` is not offered"))),
        "{told}"
    );
    // Once, not at every retry.
    assert!(w.next_op("error", Duration::from_secs(3)).is_none());
}

const WAIT_TOLD: Duration = Duration::from_secs(10);
