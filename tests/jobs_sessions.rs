//! Jobs end to end: broker processes on a real nats-server, submitters and workers over
//! real WebSockets.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use amp_broker::nats::{Client as NatsClient, Options};
use common::NatsServer;
use common::amp::{Broker, Client};
use common::jobs::{config, login, login_serving, status};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn a_task_travels_from_submit_through_offer_claim_and_complete_to_the_submitters_inbox() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1"], 30, 5000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);

    let r = app.request(json!({"op":"submit","job":"render","task":"T1","body":{"frame":1}}));
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!((&r["task"], &r["dup"]), (&json!("T1"), &json!(false)));
    let offer = w1.next_op("offer", WAIT).expect("offer");
    assert_eq!(offer["task"], "T1");
    assert_eq!(offer["from"], "acme/app");
    assert_eq!(offer["attempt"], 1);
    assert_eq!(status(&mut app, "T1")["state"], "offered");

    let who = app.request(json!({"op":"who","job":"render"}));
    let entry = who["participants"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "w1").cloned());
    if let Some(entry) = entry {
        assert_eq!(entry["serve"]["render"], 1, "{entry}");
    }

    let c = w1.request(json!({"op":"claim","task":"T1"}));
    assert_eq!(c["op"], "ok", "{c}");
    assert!(c["lease_until"].as_str().is_some_and(|t| t.ends_with('Z')));
    let h = w1.request(json!({"op":"heartbeat","task":"T1","progress":{"pct":10}}));
    assert_eq!(h["op"], "ok", "{h}");
    let s = status(&mut app, "T1");
    assert_eq!(
        (&s["state"], &s["holder"]),
        (&json!("leased"), &json!("acme/w1"))
    );
    let k = w1.request(json!({"op":"complete","task":"T1","result":[1,2,3]}));
    assert_eq!(k["op"], "ok", "{k}");

    let msg = app.next_op("message", WAIT).expect("task_result");
    assert_eq!(msg["kind"], "task_result");
    assert_eq!(msg["to"], "acme/app");
    assert_eq!(
        msg["body"],
        json!({"task":"T1","state":"completed","attempts":1,"result":[1,2,3]})
    );
    let s = status(&mut app, "T1");
    assert_eq!(s["state"], "completed");
    let states: Vec<&str> = s["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|h| h["state"].as_str())
        .collect();
    assert_eq!(states, ["queued", "offered", "leased", "completed"]);
    let again = w1.request(json!({"op":"complete","task":"T1"}));
    assert_eq!(again["code"], "lease_lost");
    let r = app.request(json!({"op":"submit","job":"render","task":"T1","body":{"frame":1}}));
    assert_eq!(r["dup"], true, "{r}");
    let r = app.request(json!({"op":"submit","job":"render","task":"T1","body":{"frame":2}}));
    assert_eq!(r["code"], "conflict", "{r}");
}

#[test]
fn of_two_sessions_claiming_one_task_at_once_exactly_one_wins() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1", "w2"], 30, 5000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let mut w2 = login_serving(&broker, "w2", 1);
    app.request(json!({"op":"submit","job":"render","task":"R","body":1}));
    // Both send their claim before reading any answer.
    w1.send(&json!({"op":"claim","id":"c","task":"R"}));
    w2.send(&json!({"op":"claim","id":"c","task":"R"}));
    let answers: Vec<Value> = [&mut w1, &mut w2]
        .into_iter()
        .map(|w| {
            let deadline = Instant::now() + WAIT;
            loop {
                let f = w.next_frame(WAIT).expect("a frame");
                if f["re"] == "c" {
                    break f;
                }
                assert!(Instant::now() < deadline);
            }
        })
        .collect();
    // The claims may arrive before the offer: resend from whoever got the offer.
    let mut winners = answers.iter().filter(|a| a["op"] == "ok").count();
    if winners == 0 {
        for w in [&mut w1, &mut w2] {
            if w.next_op("offer", Duration::from_millis(1500)).is_some() {
                let a = w.request(json!({"op":"claim","task":"R"}));
                assert_eq!(a["op"], "ok");
                winners += 1;
            }
        }
    }
    assert_eq!(winners, 1, "{answers:?}");
    let s = status(&mut app, "R");
    assert_eq!(s["state"], "leased");
    assert_eq!(s["attempt"], 1);
}

#[test]
fn a_broker_killed_mid_lease_lets_another_broker_reoffer_the_task_after_the_lease() {
    let nats = NatsServer::start();
    let cfg = config(&["app", "w1", "w2"], 2, 5000);
    let mut a = Broker::start(&nats.url(), &cfg);
    let b = Broker::start(&nats.url(), &cfg);
    let mut app = login(&b, "app");
    let mut w1 = login_serving(&a, "w1", 1);
    app.request(json!({"op":"submit","job":"render","task":"K","body":"work"}));
    let offer = w1.next_op("offer", WAIT).expect("offer on broker A");
    assert_eq!(offer["task"], "K");
    assert_eq!(w1.request(json!({"op":"claim","task":"K"}))["op"], "ok");
    a.kill();
    let killed = Instant::now();
    let mut w2 = login_serving(&b, "w2", 1);
    let offer = w2.next_op("offer", WAIT).expect("re-offer on broker B");
    assert!(
        killed.elapsed() >= Duration::from_millis(1000),
        "not before the lease ran out"
    );
    assert_eq!(offer["attempt"], 2);
    assert_eq!(w2.request(json!({"op":"claim","task":"K"}))["op"], "ok");
    assert_eq!(
        w2.request(json!({"op":"complete","task":"K","result":"done"}))["op"],
        "ok"
    );
    let s = status(&mut app, "K");
    assert_eq!(s["state"], "completed");
    assert_eq!(s["attempt"], 2);
    let holders: Vec<&str> = s["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter(|h| h["state"] == "leased")
        .filter_map(|h| h["by"].as_str())
        .collect();
    assert_eq!(holders, ["acme/w1", "acme/w2"]);
}

/// An offer is not written to the task store, so a broker killed with one out leaves the
/// record as it was: the message comes back after its AckWait and another broker offers
/// it, as the same attempt, and the dead offer is nowhere in the history.
#[test]
fn a_broker_killed_with_an_offer_out_lets_another_broker_offer_the_task_again() {
    let nats = NatsServer::start();
    let cfg = config(&["app", "w1", "w2"], 2, 60_000);
    let mut a = Broker::start(&nats.url(), &cfg);
    let b = Broker::start(&nats.url(), &cfg);
    let mut app = login(&b, "app");
    let mut w1 = login_serving(&a, "w1", 1);
    app.request(json!({"op":"submit","job":"render","task":"O","body":"work"}));
    let offer = w1.next_op("offer", WAIT).expect("offer on broker A");
    assert_eq!(offer["task"], "O");
    assert_eq!(status(&mut app, "O")["state"], "offered", "asked through B");
    a.kill();
    let killed = Instant::now();
    assert_eq!(
        status(&mut app, "O")["state"],
        "queued",
        "nobody holds an offer now"
    );
    let mut w2 = login_serving(&b, "w2", 1);
    let offer = w2
        .next_op("offer", WAIT)
        .expect("offered again by broker B");
    assert!(
        killed.elapsed() >= Duration::from_millis(500),
        "not before the AckWait of A's delivery ran out"
    );
    assert_eq!(offer["attempt"], 1, "an offer spends no attempt");
    assert_eq!(w2.request(json!({"op":"claim","task":"O"}))["op"], "ok");
    assert_eq!(
        w2.request(json!({"op":"complete","task":"O","result":"done"}))["op"],
        "ok"
    );
    let s = status(&mut app, "O");
    assert_eq!(
        (&s["state"], &s["attempt"]),
        (&json!("completed"), &json!(1))
    );
    let history: Vec<(&str, &str)> = s["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|h| {
            (
                h["state"].as_str().unwrap_or(""),
                h["by"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        history,
        [
            ("queued", "acme/app"),
            ("offered", "acme/w2"),
            ("leased", "acme/w2"),
            ("completed", "acme/w2")
        ]
    );
}

#[test]
fn cancelling_a_leased_task_revokes_it_and_the_submitter_hears_cancelled() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1", "other"], 30, 5000));
    let mut app = login(&broker, "app");
    let mut other = login(&broker, "other");
    let mut w1 = login_serving(&broker, "w1", 1);
    app.request(json!({"op":"submit","job":"render","task":"C","body":1}));
    w1.next_op("offer", WAIT).expect("offer");
    assert_eq!(w1.request(json!({"op":"claim","task":"C"}))["op"], "ok");
    assert_eq!(
        other.request(json!({"op":"cancel","task":"C"}))["code"],
        "forbidden"
    );
    assert_eq!(app.request(json!({"op":"cancel","task":"C"}))["op"], "ok");
    let revoked = w1.next_op("revoked", WAIT).expect("revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"C","reason":"cancelled"})
    );
    let msg = app.next_op("message", WAIT).expect("task_result");
    assert_eq!(msg["body"]["state"], "cancelled");
    assert_eq!(
        w1.request(json!({"op":"complete","task":"C"}))["code"],
        "lease_lost"
    );
    assert_eq!(
        app.request(json!({"op":"status","task":"none"}))["code"],
        "not_found"
    );
}

#[test]
fn two_brokers_and_four_workers_complete_ten_thousand_tasks_exactly_once_with_even_load() {
    const TASKS: usize = 10_000;
    let nats = NatsServer::start();
    let names = ["app", "w1", "w2", "w3", "w4"];
    let cfg = config(&names, 30, 5000);
    let a = Broker::start(&nats.url(), &cfg);
    let b = Broker::start(&nats.url(), &cfg);
    let mut app = login(&a, "app");
    // Submit everything first (pipelined), so the work is spread by the brokers alone.
    let (mut sent, mut acked) = (0, 0);
    while acked < TASKS {
        while sent < TASKS && sent - acked < 256 {
            app.send(&json!({"op":"submit","id":format!("s{sent}"),"job":"render","task":format!("t{sent}"),"body":sent}));
            sent += 1;
        }
        let f = app.next_frame(WAIT).expect("submit answers");
        if f["op"] == "ok" && f["re"].as_str().is_some_and(|r| r.starts_with('s')) {
            acked += 1;
        } else {
            assert_ne!(f["op"], "error", "{f}");
        }
    }
    // Everyone is connected before anyone serves, so nobody starts ahead.
    let mut clients: Vec<Client> = ["w1", "w2", "w3", "w4"]
        .into_iter()
        .enumerate()
        .map(|(i, name)| login(if i % 2 == 0 { &a } else { &b }, name))
        .collect();
    for c in &mut clients {
        c.send(&json!({"op":"serve","id":"v","job":"render","slots":4}));
    }
    let workers: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let mut done = Vec::new();
                let mut n = 0u64;
                while let Some(f) = c.next_frame(Duration::from_secs(3)) {
                    if f["op"] != "offer" {
                        continue;
                    }
                    let task = f["task"].as_str().unwrap_or_default().to_string();
                    n += 1;
                    let r = c.request(json!({"op":"claim","id":format!("c{n}"),"task":task}));
                    assert_eq!(r["op"], "ok", "claim: {r}");
                    c.send(&json!({"op":"complete","id":format!("k{n}"),"task":task,"result":n}));
                    done.push(task);
                }
                done
            })
        })
        .collect();
    let per_worker: Vec<Vec<String>> = workers
        .into_iter()
        .map(|h| h.join().expect("worker"))
        .collect();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for t in per_worker.iter().flatten() {
        *seen.entry(t.as_str()).or_default() += 1;
    }
    assert_eq!(seen.len(), TASKS, "every task offered");
    assert!(seen.values().all(|&n| n == 1), "each offered exactly once");
    let even = TASKS as f64 / 4.0;
    for (i, w) in per_worker.iter().enumerate() {
        let off = (w.len() as f64 - even).abs() / even;
        assert!(off <= 0.2, "worker {} did {} of {TASKS}", i + 1, w.len());
    }
    // The task store's own account: every task completed once, after exactly one lease,
    // and no lease opened while another was open.
    let mut store = NatsClient::connect(Options::new(&nats.url())).expect("connect");
    for i in 0..TASKS {
        let record = task_record(&mut store, &format!("t{i}"));
        assert_eq!(record["state"], "completed", "{record}");
        let history = record["history"].as_array().expect("history");
        let count = |state: &str| history.iter().filter(|h| h["state"] == state).count();
        assert_eq!(count("completed"), 1, "{record}");
        assert_eq!(count("leased"), 1, "{record}");
        assert_no_overlapping_leases(history);
    }
}

/// A task's record straight from the task store.
fn task_record(store: &mut NatsClient, task: &str) -> Value {
    let reply = store
        .request(
            &format!("$JS.API.DIRECT.GET.KV_AMP_TASK_STATE.$KV.AMP_TASK_STATE.acme.{task}"),
            None,
            b"",
            WAIT,
        )
        .expect("direct get");
    assert_eq!(reply.status(), None, "task {task} has a record");
    serde_json::from_slice(&reply.payload).expect("record is JSON")
}

/// Every `leased` entry is closed (by `completed`, `failed`, `queued` or `cancelled`)
/// before the next one, and times never go backwards.
fn assert_no_overlapping_leases(history: &[Value]) {
    let mut open = false;
    let mut last = 0i128;
    for h in history {
        let at = amp_broker::rfc3339::parse_nanos(h["at"].as_str().expect("at")).expect("time");
        assert!(at >= last, "history goes back in time: {history:?}");
        last = at;
        match h["state"].as_str() {
            Some("leased") => {
                assert!(!open, "a lease opened while another was held: {history:?}");
                open = true;
            }
            Some("completed" | "failed" | "queued" | "cancelled") => open = false,
            _ => {}
        }
    }
}

#[test]
fn a_session_serves_a_bounded_number_of_jobs_and_the_next_is_refused_clearly() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["w1"], 30, 5000));
    let mut w1 = login(&broker, "w1");
    let most = amp_broker::broker::jobs::MAX_JOBS_PER_SESSION;
    for i in 0..most {
        let r = w1.request(json!({"op":"serve","job":format!("job{i}"),"slots":1}));
        assert_eq!(r["op"], "ok", "serve job{i}: {r}");
    }
    let r = w1.request(json!({"op":"serve","job":"one-too-many","slots":1}));
    assert_eq!(
        (&r["op"], &r["code"]),
        (&json!("error"), &json!("forbidden")),
        "{r}"
    );
    assert_eq!(r["path"], "/job", "{r}");
    // Jobs already served can still change their slots.
    let r = w1.request(json!({"op":"serve","job":"job0","slots":3}));
    assert_eq!(r["op"], "ok", "{r}");
    let r = w1.request(json!({"op":"serve","job":"one-too-many","slots":0}));
    assert_eq!(
        r["op"], "ok",
        "slots 0 of a job not served changes nothing: {r}"
    );
    let r = w1.request(json!({"op":"serve","job":"one-too-many","slots":1}));
    assert_eq!(r["code"], "forbidden", "and records nothing either: {r}");
}
