//! Jobs under faults, end to end: broker processes on a real nats-server, workers and
//! submitters over real WebSockets. A heartbeat that comes just after its lease ran out,
//! and the nats-server restarting under a broker with tasks in every state.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use common::jobs::{config, login, login_serving, status};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);
/// A submitter's inbox pull lost in a NATS restart is replaced after two missed idle
/// heartbeats (10 s), so a `task_result` may take that much longer to arrive.
const RESULT_WAIT: Duration = Duration::from_secs(25);

fn millis(rfc3339: &str) -> i128 {
    amp_broker::rfc3339::parse_nanos(rfc3339).expect("RFC 3339 time") / 1_000_000
}

/// The next `message` to the submitter, which must be a `task_result`; on a timeout the
/// broker's log says why.
fn task_result(app: &mut Client, broker: &Broker) -> Value {
    let Some(m) = app.next_op("message", RESULT_WAIT) else {
        panic!("no task_result; broker log:\n{}", broker.log());
    };
    assert_eq!(m["kind"], "task_result", "{m}");
    m
}

/// Who held each lease of the task, in order, from its history.
fn lease_holders(task: &Value) -> Vec<String> {
    task["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter(|h| h["state"] == "leased")
        .filter_map(|h| h["by"].as_str().map(str::to_string))
        .collect()
}

#[test]
fn a_heartbeat_just_after_the_lease_ran_out_gets_lease_lost_and_the_next_holders_result_stands() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1", "w2"], 1, 5000));
    let mut app = login(&broker, "app");
    // Both idle, w1 longest: the first offer goes to w1, and once w1's lease has ended
    // w2 is the longest idle.
    let mut w1 = login_serving(&broker, "w1", 1);
    let mut w2 = login_serving(&broker, "w2", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"L","body":"work"}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = w1.next_op("offer", WAIT).expect("offer");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("L"), &json!(1))
    );
    let claim = w1.request(json!({"op":"claim","task":"L"}));
    assert_eq!(claim["op"], "ok", "{claim}");
    let lease_until = claim["lease_until"]
        .as_str()
        .expect("lease_until")
        .to_string();
    // The lease (1 s) was granted before its answer came: a moment past the answer plus a
    // second, it has run out. Waited out on the monotonic clock: a step of the machine's
    // wall clock (a VM's clock sync) made a wait for the wall time to pass `lease_until`
    // end early, and the heartbeat came while the lease still ran.
    let lapsed = std::time::Instant::now() + Duration::from_millis(1_001);

    // w1 goes quiet until just past lease_until, then heartbeats at once: whether or not
    // the broker has noticed the expiry yet, the lease is gone and is not extended.
    assert!(common::wait_until(WAIT, || std::time::Instant::now() >= lapsed));
    let late = w1.request(json!({"op":"heartbeat","task":"L","progress":{"pct":90}}));
    assert_eq!(late["op"], "error", "{late}");
    assert_eq!(late["code"], "lease_lost", "{late}");
    assert!(late.get("lease_until").is_none(), "{late}");
    let revoked = w1.next_op("revoked", WAIT).expect("revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"L","reason":"lease_expired"})
    );
    let s = status(&mut app, "L");
    if s["holder"] == "acme/w1" {
        assert_eq!(s["lease_until"], lease_until.as_str(), "not extended: {s}");
    }

    // JetStream redelivers after the lease: the second attempt goes to w2.
    let offer = w2.next_op("offer", WAIT).expect("re-offer");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("L"), &json!(2))
    );
    assert_eq!(
        w2.request(json!({"op":"claim","task":"L"}))["op"],
        "ok",
        "w2 claims"
    );
    for frame in [
        json!({"op":"heartbeat","task":"L"}),
        json!({"op":"complete","task":"L","result":"stale"}),
    ] {
        let r = w1.request(frame.clone());
        assert_eq!(r["code"], "lease_lost", "{frame} while w2 holds: {r}");
    }
    let s = status(&mut app, "L");
    assert_eq!(
        (&s["state"], &s["holder"]),
        (&json!("leased"), &json!("acme/w2"))
    );
    assert_eq!(s["attempt"], 2);
    let k = w2.request(json!({"op":"complete","task":"L","result":"w2 result"}));
    assert_eq!(k["op"], "ok", "{k}");
    let late = w1.request(json!({"op":"complete","task":"L","result":"stale"}));
    assert_eq!(late["code"], "lease_lost", "w1 complete after w2's: {late}");

    let msg = task_result(&mut app, &broker);
    assert_eq!(
        msg["body"],
        json!({"task":"L","state":"completed","attempts":2,"result":"w2 result"})
    );
    app.send(&json!({"op":"ack","seq":msg["seq"]}));
    let s = status(&mut app, "L");
    assert_eq!(s["state"], "completed");
    assert_eq!(s["result"], "w2 result");
    assert_eq!(s["attempt"], 2);
    assert_eq!(lease_holders(&s), ["acme/w1", "acme/w2"]);
    let states: Vec<&str> = s["history"]
        .as_array()
        .expect("history")
        .iter()
        .filter_map(|h| h["state"].as_str())
        .collect();
    assert_eq!(
        states,
        [
            "queued",
            "offered",
            "leased",
            "queued",
            "offered",
            "leased",
            "completed"
        ]
    );
    // w1 never saw the task again.
    assert!(w1.next_op("offer", Duration::from_millis(200)).is_none());
}

/// Sends `frame` until it is answered by something other than `unavailable` (what a client
/// does after an outage, with the same task id); returns that answer.
fn until_available(c: &mut Client, frame: Value) -> Value {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let r = c.request(frame.clone());
        if r["code"] != "unavailable" || std::time::Instant::now() > deadline {
            return r;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Claims and completes every task offered until `tasks` are all done; returns the
/// attempt each was done in.
fn work_all(w: &mut Client, tasks: &[&str]) -> BTreeMap<String, u64> {
    let mut done = BTreeMap::new();
    while done.len() < tasks.len() {
        let offer = w.next_op("offer", WAIT).expect("an offer");
        let task = offer["task"].as_str().expect("task").to_string();
        assert!(tasks.contains(&task.as_str()), "unexpected {offer}");
        let c = w.request(json!({"op":"claim","task":task}));
        assert_eq!(c["op"], "ok", "claim {task}: {c}");
        let k = w.request(json!({"op":"complete","task":task,"result":format!("done {task}")}));
        assert_eq!(k["op"], "ok", "complete {task}: {k}");
        let attempt = offer["attempt"].as_u64().expect("attempt");
        assert!(
            done.insert(task, attempt).is_none(),
            "offered again after completion"
        );
    }
    done
}

fn healthz_is(broker: &Broker, status: u16) -> bool {
    common::wait_until(WAIT, || {
        common::amp::http_get(broker.addr, "/healthz").is_some_and(|(s, _)| s == status)
    })
}

/// Tasks in every state, then the nats-server restarts: at once (`outage` false) or after
/// a few seconds down with requests timing out meanwhile.
fn restart_mid_run(outage: bool) {
    let mut nats = NatsServer::start();
    let mut cfg = open_config(&["app", "w1"]);
    // Leases and offers of `render` outlive the restart; a `quick` lease does not.
    cfg["namespaces"]["acme"]["jobs"] = json!({
        "render": {"lease_s": 20, "offer_ms": 30_000, "max_attempts": 3},
        "quick": {"lease_s": 2, "offer_ms": 30_000, "max_attempts": 3},
    });
    let broker = Broker::start(&nats.url(), &cfg);
    let mut app = login(&broker, "app");
    let mut w1 = Client::connect(&broker);
    let ok = w1.request(json!({
        "op":"hello","ns":"acme","name":"w1","auth":{"type":"token","token":"w1-token"},
        "serve":[{"job":"render","slots":2},{"job":"quick","slots":1}]
    }));
    assert_eq!(ok["op"], "ok", "{ok}");
    let submit = |app: &mut Client, job: &str, task: &str| {
        let r = app.request(json!({"op":"submit","job":job,"task":task,"body":task}));
        assert_eq!(r["op"], "ok", "submit {task}: {r}");
    };
    let offered = |w1: &mut Client, task: &str| {
        let offer = w1.next_op("offer", WAIT).expect("offer");
        assert_eq!(
            (&offer["task"], &offer["attempt"]),
            (&json!(task), &json!(1))
        );
    };

    // Before: one task completed, one leased, one offered, three queued behind the two
    // busy slots, and a `quick` lease that will run out.
    submit(&mut app, "render", "done");
    assert_eq!(work_all(&mut w1, &["done"])["done"], 1);
    submit(&mut app, "render", "leased");
    offered(&mut w1, "leased");
    let claim = w1.request(json!({"op":"claim","task":"leased"}));
    assert_eq!(claim["op"], "ok", "{claim}");
    submit(&mut app, "render", "offered");
    offered(&mut w1, "offered");
    for t in ["q1", "q2", "q3"] {
        submit(&mut app, "render", t);
    }
    submit(&mut app, "quick", "expires");
    offered(&mut w1, "expires");
    assert_eq!(
        w1.request(json!({"op":"claim","task":"expires"}))["op"],
        "ok"
    );
    assert_eq!(status(&mut app, "leased")["state"], "leased");
    assert_eq!(status(&mut app, "offered")["state"], "offered");
    assert_eq!(status(&mut app, "q3")["state"], "queued");

    if outage {
        nats.kill();
        assert!(healthz_is(&broker, 503));
        // Accepted or not during the outage, a submit retried with its task id lands once.
        let during =
            app.request(json!({"op":"submit","job":"render","task":"during","body":"during"}));
        assert!(
            during["op"] == "ok" || during["code"] == "unavailable",
            "{during}"
        );
        nats.start_again();
    } else {
        nats.restart();
    }
    assert!(healthz_is(&broker, 200));

    // Sessions stayed up through the restart.
    assert_eq!(app.request(json!({"op":"ping"}))["op"], "ok");
    assert_eq!(w1.request(json!({"op":"ping"}))["op"], "ok");
    let r = until_available(
        &mut app,
        json!({"op":"submit","job":"render","task":"during","body":"during"}),
    );
    assert_eq!(r["op"], "ok", "{r}");

    // The render lease held through the restart: heartbeat (extends it) and complete.
    let h = until_available(&mut w1, json!({"op":"heartbeat","task":"leased"}));
    assert_eq!(h["op"], "ok", "heartbeat after the restart: {h}");
    let until = |v: &Value| millis(v["lease_until"].as_str().expect("lease_until"));
    assert!(until(&h) > until(&claim), "{h} extends {claim}");
    let k = until_available(
        &mut w1,
        json!({"op":"complete","task":"leased","result":"done leased"}),
    );
    assert_eq!(k["op"], "ok", "complete after the restart: {k}");
    // The offer made before the restart can still be claimed.
    let c = until_available(&mut w1, json!({"op":"claim","task":"offered"}));
    assert_eq!(c["op"], "ok", "claim after the restart: {c}");
    let k = until_available(
        &mut w1,
        json!({"op":"complete","task":"offered","result":"done offered"}),
    );
    assert_eq!(k["op"], "ok", "{k}");

    // What was queued before, submitted during and after, and the lease that ran out,
    // all get offered.
    submit(&mut app, "render", "after");
    let rest = work_all(&mut w1, &["q1", "q2", "q3", "during", "after", "expires"]);
    let revoked = w1
        .next_op("revoked", WAIT)
        .expect("the quick lease revoked");
    assert_eq!(
        revoked,
        json!({"op":"revoked","task":"expires","reason":"lease_expired"})
    );
    assert_eq!(rest["expires"], 2, "the lease that ran out came back");
    assert!(
        rest.iter().all(|(t, &a)| t == "expires" || a == 1),
        "{rest:?}"
    );

    // Every task completed exactly once, with one task_result each.
    let all = [
        "done", "leased", "offered", "q1", "q2", "q3", "during", "after", "expires",
    ];
    let mut results = BTreeMap::new();
    while results.len() < all.len() {
        let m = task_result(&mut app, &broker);
        assert_eq!(m["kind"], "task_result", "{m}");
        app.send(&json!({"op":"ack","seq":m["seq"]}));
        let task = m["body"]["task"].as_str().expect("task").to_string();
        assert_eq!(m["body"]["state"], "completed", "{m}");
        assert_eq!(m["body"]["result"], format!("done {task}"), "{m}");
        assert!(
            results.insert(task, m["seq"].clone()).is_none(),
            "one result per task"
        );
    }
    assert!(
        app.next_op("message", Duration::from_millis(300)).is_none(),
        "no repeated result"
    );
    for task in all {
        let s = status(&mut app, task);
        assert_eq!(s["state"], "completed", "{s}");
        let leases = if task == "expires" { 2 } else { 1 };
        assert_eq!(s["attempt"], leases, "{s}");
        let history = s["history"].as_array().expect("history");
        let count = |state: &str| history.iter().filter(|h| h["state"] == state).count();
        assert_eq!((count("leased"), count("completed")), (leases, 1), "{s}");
    }
}

#[test]
fn a_nats_restart_mid_run_loses_no_task_and_every_task_completes_exactly_once() {
    restart_mid_run(false);
}

#[test]
fn a_nats_outage_of_seconds_mid_run_loses_no_task_and_every_task_completes_exactly_once() {
    restart_mid_run(true);
}

/// Sends each frame without waiting, then collects the answers in order.
fn pipelined(c: &mut Client, frames: &[Value]) -> Vec<Value> {
    for (i, f) in frames.iter().enumerate() {
        let mut f = f.clone();
        f["id"] = json!(format!("p{i}"));
        c.send(&f);
    }
    (0..frames.len())
        .map(|i| c.answer_to(&format!("p{i}")))
        .collect()
}

#[test]
fn a_claim_and_a_complete_answered_unavailable_in_an_outage_succeed_when_retried() {
    let mut nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1"], 30, 60_000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 2);
    for task in ["claimed", "finished"] {
        let r = app.request(json!({"op":"submit","job":"render","task":task,"body":task}));
        assert_eq!(r["op"], "ok", "{r}");
        let offer = w1.next_op("offer", WAIT).expect("offer");
        assert_eq!(offer["task"], task);
    }
    assert_eq!(
        w1.request(json!({"op":"claim","task":"finished"}))["op"],
        "ok"
    );

    // Both changes wait in the broker's reconnect buffer, time out as `unavailable`, and
    // reach the task store once the server is back: the retries must see them as theirs.
    nats.kill();
    // Sent once the broker knows the server is gone, so they wait in its reconnect buffer.
    assert!(healthz_is(&broker, 503));
    let answers = pipelined(
        &mut w1,
        &[
            json!({"op":"claim","task":"claimed"}),
            json!({"op":"complete","task":"finished","result":"done finished"}),
        ],
    );
    for a in &answers {
        assert_eq!(a["code"], "unavailable", "{a}");
    }
    nats.start_again();
    let claim = until_available(&mut w1, json!({"op":"claim","task":"claimed"}));
    assert_eq!(claim["op"], "ok", "retried claim: {claim}");
    assert!(claim["lease_until"].is_string(), "{claim}");
    let k = until_available(
        &mut w1,
        json!({"op":"complete","task":"finished","result":"done finished"}),
    );
    assert_eq!(k["op"], "ok", "retried complete: {k}");
    let k = w1.request(json!({"op":"complete","task":"claimed","result":"done claimed"}));
    assert_eq!(k["op"], "ok", "{k}");
    assert!(
        w1.next_op("revoked", Duration::from_millis(300)).is_none(),
        "nothing revoked"
    );

    let mut results = BTreeMap::new();
    while results.len() < 2 {
        let m = task_result(&mut app, &broker);
        app.send(&json!({"op":"ack","seq":m["seq"]}));
        let task = m["body"]["task"].as_str().expect("task").to_string();
        assert_eq!(m["body"]["result"], format!("done {task}"), "{m}");
        assert!(
            results.insert(task, m["seq"].clone()).is_none(),
            "one result per task"
        );
    }
    for task in ["claimed", "finished"] {
        let s = status(&mut app, task);
        assert_eq!(
            (&s["state"], &s["attempt"]),
            (&json!("completed"), &json!(1)),
            "{s}"
        );
        assert_eq!(lease_holders(&s), ["acme/w1"], "{s}");
    }
}

#[test]
fn a_claim_answered_unavailable_that_landed_later_and_is_never_retried_runs_out_and_the_task_comes_back()
 {
    let mut nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1"], 3, 1000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"G","body":"g"}));
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(w1.next_op("offer", WAIT).expect("offer")["attempt"], 1);

    nats.kill();
    assert!(healthz_is(&broker, 503));
    // The claim times out as `unavailable` (the offer lapses meanwhile) and reaches the
    // task store only after the restart; the worker gives the task up.
    let claim = w1.request(json!({"op":"claim","task":"G"}));
    assert_eq!(claim["code"], "unavailable", "{claim}");
    nats.start_again();

    // The lease the late claim took runs out and the task comes back as attempt 2.
    let offer = w1
        .next_op("offer", Duration::from_secs(20))
        .expect("re-offer");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("G"), &json!(2))
    );
    assert_eq!(w1.request(json!({"op":"claim","task":"G"}))["op"], "ok");
    let k = w1.request(json!({"op":"complete","task":"G","result":"second"}));
    assert_eq!(k["op"], "ok", "{k}");
    let m = task_result(&mut app, &broker);
    assert_eq!(
        m["body"],
        json!({"task":"G","state":"completed","attempts":2,"result":"second"})
    );
    let s = status(&mut app, "G");
    assert_eq!(lease_holders(&s), ["acme/w1", "acme/w1"], "{s}");
}

/// `amp_jobs_jetstream_ops_total` from the broker's `/metrics`.
fn jetstream_ops(broker: &Broker) -> u64 {
    let (_, text) = common::amp::http_get(broker.addr, "/metrics").expect("metrics");
    text.lines()
        .find_map(|l| l.strip_prefix("amp_jobs_jetstream_ops_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("jobs counter")
}

#[test]
fn a_job_consumer_that_disappears_is_created_again_without_spinning_and_the_queue_carries_on() {
    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config(&["app", "w1"], 30, 5000));
    let mut app = login(&broker, "app");
    let mut w1 = login_serving(&broker, "w1", 1);
    let r = app.request(json!({"op":"submit","job":"render","task":"A","body":"a"}));
    assert_eq!(r["op"], "ok", "{r}");
    w1.next_op("offer", WAIT).expect("offer");
    assert_eq!(w1.request(json!({"op":"claim","task":"A"}))["op"], "ok");

    // The only slot is busy, so no pull is out when the consumer goes; the next one,
    // after the complete, finds nobody serving it.
    let mut admin = amp_broker::nats::Client::connect(amp_broker::nats::Options::new(&nats.url()))
        .expect("connect");
    let deleted = admin
        .request(
            "$JS.API.CONSUMER.DELETE.AMP_TASKS_acme.job_render",
            None,
            b"",
            WAIT,
        )
        .expect("consumer delete");
    let deleted: Value = serde_json::from_slice(&deleted.payload).expect("JSON");
    assert_eq!(deleted["success"], true, "{deleted}");
    let ops_before = jetstream_ops(&broker);
    let k = w1.request(json!({"op":"complete","task":"A","result":"done A"}));
    assert_eq!(k["op"], "ok", "{k}");
    let r = app.request(json!({"op":"submit","job":"render","task":"B","body":"b"}));
    assert_eq!(r["op"], "ok", "{r}");

    let offer = w1
        .next_op("offer", WAIT)
        .expect("B offered once the consumer is back");
    assert_eq!(
        (&offer["task"], &offer["attempt"]),
        (&json!("B"), &json!(1))
    );
    let ops = jetstream_ops(&broker) - ops_before;
    assert!(ops < 100, "{ops} JetStream operations: the pull loop spun");
    assert_eq!(w1.request(json!({"op":"claim","task":"B"}))["op"], "ok");
    let k = w1.request(json!({"op":"complete","task":"B","result":"done B"}));
    assert_eq!(k["op"], "ok", "{k}");
    let mut results = BTreeMap::new();
    while results.len() < 2 {
        let m = task_result(&mut app, &broker);
        app.send(&json!({"op":"ack","seq":m["seq"]}));
        let task = m["body"]["task"].as_str().expect("task").to_string();
        assert_eq!(m["body"]["result"], format!("done {task}"), "{m}");
        assert!(results.insert(task, ()).is_none(), "one result per task");
    }
    for task in ["A", "B"] {
        let s = status(&mut app, task);
        assert_eq!(
            (&s["state"], &s["attempt"]),
            (&json!("completed"), &json!(1)),
            "{s}"
        );
    }
}

/// Waiting pulls at the server for the job `render`'s consumer.
fn waiting_pulls(js: &mut amp_broker::jetstream::Context) -> u64 {
    js.consumer_info("AMP_TASKS_acme", "job_render")
        .map(|i| i.num_waiting)
        .unwrap_or(u64::MAX)
}

/// A job queue's pulls answered on subjects its subscription still covered after a
/// reconnect: the subscription came back with the connection, so a pull from before the
/// drop was live again at the server next to the one the broker sent after it, and
/// the queue held two pulls for one free slot until the old one expired (10 s), taking
/// a second task it had no slot for.
#[test]
fn after_a_reconnect_a_job_queue_holds_no_pull_from_before_it() {
    let nats = NatsServer::start();
    let relay = common::relay::Relay::start(&nats.addr());
    let broker = Broker::start(
        &format!("nats://{}", relay.addr()),
        &config(&["app", "w"], 30, 5000),
    );
    let mut app = login(&broker, "app");
    let mut w = login_serving(&broker, "w", 1);
    let mut js = nats.jetstream();
    assert!(common::wait_until(WAIT, || waiting_pulls(&mut js) == 1));
    relay.cut();
    relay.restore();
    assert!(common::wait_until(WAIT, || {
        common::amp::metric(&broker, "amp_nats_reconnects_total") == Some(1.0)
    }));
    let r = app.request(json!({"op":"submit","job":"render","task":"R1","body":"x"}));
    assert_eq!(r["op"], "ok", "{r}");
    let offer = w.next_op("offer", WAIT).expect("offer");
    assert_eq!(offer["task"], "R1");
    let r = w.request(json!({"op":"claim","task":"R1"}));
    assert_eq!(r["op"], "ok", "{r}");
    // The one slot is taken: nothing of this broker waits at the server any more (the
    // pull from before the reconnect would have lived on for up to 10 s).
    assert!(
        common::wait_until(Duration::from_secs(3), || waiting_pulls(&mut js) == 0),
        "pulls still waiting with no free slot: {}",
        waiting_pulls(&mut js)
    );
    let r = w.request(json!({"op":"complete","task":"R1","result":1}));
    assert_eq!(r["op"], "ok", "{r}");
    assert_eq!(task_result(&mut app, &broker)["body"]["state"], "completed");
}
