//! Many brokers on one clustered JetStream: three nats-server nodes on loopback, R3
//! streams, two brokers each given all three URLs. Sends and tasks run while the node
//! leading the inbox and task streams is SIGKILLed and, later, restarted.
//!
//! CI runs 2,000 sends and 200 tasks. The full run:
//! `AMP_CLUSTER_SENDS=10000 AMP_CLUSTER_TASKS=1000 cargo test --release --test cluster_failover -- --nocapture`

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amp_broker::nats;
use common::NatsServer;
use common::amp::{Broker, Client, open_config};
use serde_json::{Value, json};

fn sized(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Three clustered nodes `n0`..`n2`.
fn cluster() -> Vec<NatsServer> {
    let ports: Vec<u16> = (0..3).map(|_| common::free_port()).collect();
    (0..3)
        .map(|i| {
            let routes: Vec<String> = ports
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| format!("nats-route://127.0.0.1:{p}"))
                .collect();
            NatsServer::with_config(&format!(
                "server_name: n{i}\ncluster {{\n  name: amp\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\n",
                ports[i],
                routes.join(", ")
            ))
        })
        .collect()
}

fn js(client: &mut nats::Client, subject: &str, body: &Value) -> Value {
    let payload = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    client
        .request(subject, None, &payload, Duration::from_secs(5))
        .ok()
        .and_then(|m| serde_json::from_slice(&m.payload).ok())
        .unwrap_or(Value::Null)
}

fn leader(client: &mut nats::Client, stream: &str) -> Option<String> {
    let info = js(
        client,
        &format!("$JS.API.STREAM.INFO.{stream}"),
        &Value::Null,
    );
    info["cluster"]["leader"].as_str().map(String::from)
}

/// When each send was answered, and how.
#[derive(Default)]
struct SendLog {
    acked: BTreeSet<u64>,
    /// (when, ok) for every answer.
    answers: Vec<(Instant, bool)>,
}

#[test]
fn a_cluster_loses_no_acknowledged_send_and_leases_no_task_twice_when_its_stream_leader_dies() {
    let sends = sized("AMP_CLUSTER_SENDS", 2000);
    let tasks = sized("AMP_CLUSTER_TASKS", 200);
    let mut nodes = cluster();
    let urls: Vec<String> = nodes.iter().map(NatsServer::url).collect();
    let mut admin = None;
    assert!(
        common::wait_until(Duration::from_secs(30), || {
            let Ok(mut c) = nats::Options::parse_servers(&urls.join(","))
                .map_err(|e| e.to_string())
                .and_then(|o| nats::Client::connect(o).map_err(|e| e.to_string()))
            else {
                return false;
            };
            // Ready when an R3 stream can be placed: all three peers are in.
            let probe = json!({"name": "PROBE", "subjects": ["probe"], "num_replicas": 3});
            let ok = js(&mut c, "$JS.API.STREAM.CREATE.PROBE", &probe)["error"].is_null()
                && js(&mut c, "$JS.API.STREAM.DELETE.PROBE", &Value::Null)["success"] == true;
            admin = Some(c);
            ok
        }),
        "the JetStream cluster did not form; n0 log:\n{}",
        nodes[0].log()
    );
    let mut admin = admin.expect("admin connection");

    let mut config = open_config(&["sender", "receiver", "app", "w1", "w2"]);
    config["namespaces"]["acme"]["jobs"] =
        json!({"render": {"lease_s": 30, "offer_ms": 5000, "max_attempts": 5}});
    config["namespaces"]["acme"]["inbox"] = json!({"ack_wait_s": 5});
    let ring = |first: usize| -> String {
        (0..3)
            .map(|k| urls[(first + k) % 3].clone())
            .collect::<Vec<_>>()
            .join(",")
    };
    let a = Broker::start_with(&ring(0), &config, &["--replicas", "3", "--broker-id", "a"]);
    let b = Broker::start_with(&ring(1), &config, &["--replicas", "3", "--broker-id", "b"]);
    assert_eq!(
        js(
            &mut admin,
            "$JS.API.STREAM.INFO.AMP_INBOX_acme",
            &Value::Null
        )["config"]["num_replicas"],
        3
    );

    let stop = Arc::new(AtomicBool::new(false));
    let acked_count = Arc::new(AtomicUsize::new(0));
    let send_log = Arc::new(Mutex::new(SendLog::default()));
    let received = Arc::new(Mutex::new(BTreeSet::<u64>::new()));
    let results = Arc::new(Mutex::new(BTreeMap::<String, BTreeSet<u64>>::new()));

    let mut sender = Client::login(&a, "acme", "sender", "sender-token");
    let mut receiver = Client::login(&b, "acme", "receiver", "receiver-token");
    let mut app = Client::login(&a, "acme", "app", "app-token");
    let mut workers: Vec<Client> = [(&a, "w1"), (&b, "w2")]
        .into_iter()
        .map(|(broker, name)| {
            let mut w = Client::connect(broker);
            let ok = w.request(json!({
                "op":"hello","ns":"acme","name":name,
                "auth":{"type":"token","token":format!("{name}-token")},
                "serve":[{"job":"render","slots":4}]
            }));
            assert_eq!(ok["op"], "ok", "{ok}");
            w
        })
        .collect();

    let sender_thread = {
        let (log, count) = (send_log.clone(), acked_count.clone());
        std::thread::spawn(move || {
            for i in 0..sends as u64 {
                let idem = format!("s{i}");
                loop {
                    let r =
                        sender.request(json!({"op":"send","to":"receiver","body":i,"idem":idem}));
                    let ok = r["op"] == "ok";
                    let mut log = log.lock().expect("log");
                    log.answers.push((Instant::now(), ok));
                    if ok {
                        log.acked.insert(i);
                        count.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    assert_eq!(r["code"], "unavailable", "{r}");
                    drop(log);
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })
    };
    let receiver_thread = {
        let (stop, received) = (stop.clone(), received.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some(m) = receiver.next_op("message", Duration::from_millis(500)) {
                    receiver.send(&json!({"op":"ack","seq":m["seq"]}));
                    if let Some(i) = m["body"].as_u64() {
                        received.lock().expect("received").insert(i);
                    }
                }
            }
        })
    };
    let app_thread = {
        let (stop, count, results) = (stop.clone(), acked_count.clone(), results.clone());
        std::thread::spawn(move || {
            let mut submitted = 0;
            while !stop.load(Ordering::SeqCst) {
                // Submits are spread over the run of sends, so tasks are in flight at the kill.
                if submitted < tasks && count.load(Ordering::SeqCst) * tasks >= submitted * sends {
                    let task = format!("T{submitted}");
                    let r = app.request(
                        json!({"op":"submit","job":"render","task":task,"body":submitted}),
                    );
                    if r["op"] == "ok" {
                        submitted += 1;
                    } else {
                        assert_eq!(r["code"], "unavailable", "{r}");
                    }
                    continue;
                }
                if let Some(m) = app.next_op("message", Duration::from_millis(100))
                    && m["kind"] == "task_result"
                {
                    app.send(&json!({"op":"ack","seq":m["seq"]}));
                    let task = m["body"]["task"].as_str().unwrap_or_default().to_string();
                    let seq = m["seq"].as_u64().unwrap_or_default();
                    results
                        .lock()
                        .expect("results")
                        .entry(task)
                        .or_default()
                        .insert(seq);
                }
            }
            app
        })
    };
    let worker_threads: Vec<_> = workers
        .drain(..)
        .map(|mut w| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let Some(offer) = w.next_op("offer", Duration::from_millis(200)) else {
                        continue;
                    };
                    let task = offer["task"].clone();
                    if w.request(json!({"op":"claim","task":task}))["op"] != "ok" {
                        continue;
                    }
                    for _ in 0..200 {
                        let r = w.request(json!({"op":"complete","task":task,"result":"done"}));
                        if r["op"] == "ok" || r["code"] != "unavailable" {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })
        })
        .collect();

    // Let a third of the sends through, then kill the node leading both streams.
    assert!(common::wait_until(Duration::from_secs(60), || {
        acked_count.load(Ordering::SeqCst) >= sends / 3
    }));
    let inbox_leader = leader(&mut admin, "AMP_INBOX_acme").expect("inbox leader");
    for _ in 0..20 {
        if leader(&mut admin, "AMP_TASKS_acme").as_deref() == Some(inbox_leader.as_str()) {
            break;
        }
        js(
            &mut admin,
            "$JS.API.STREAM.LEADER.STEPDOWN.AMP_TASKS_acme",
            &json!({"placement": {"preferred": inbox_leader}}),
        );
        common::wait_until(Duration::from_secs(5), || {
            leader(&mut admin, "AMP_TASKS_acme").is_some()
        });
    }
    let tasks_leader = leader(&mut admin, "AMP_TASKS_acme");
    let victim: usize = inbox_leader
        .trim_start_matches('n')
        .parse()
        .expect("node name");
    nodes[victim].kill();
    let killed_at = Instant::now();

    assert!(
        common::wait_until(Duration::from_secs(60), || {
            acked_count.load(Ordering::SeqCst) >= sends * 2 / 3
        }),
        "sends did not resume; broker a log:\n{}",
        a.log()
    );
    nodes[victim].start_again();
    let restarted_at = Instant::now();

    let all_done = common::wait_until(Duration::from_secs(90), || {
        sender_thread.is_finished()
            && received.lock().expect("received").len() >= sends
            && results.lock().expect("results").len() >= tasks
    });
    stop.store(true, Ordering::SeqCst);
    sender_thread.join().expect("sender");
    receiver_thread.join().expect("receiver");
    let mut app = app_thread.join().expect("app");
    for w in worker_threads {
        w.join().expect("worker");
    }

    let log = send_log.lock().expect("log");
    let received = received.lock().expect("received");
    let lost: Vec<&u64> = log.acked.difference(&received).collect();
    if !all_done {
        let results = results.lock().expect("results");
        let missing: Vec<Value> = (0..tasks)
            .map(|t| format!("T{t}"))
            .filter(|t| !results.contains_key(t))
            .map(|t| app.request(json!({"op":"status","task":t})))
            .collect();
        panic!(
            "run did not finish: {} of {sends} received, {} of {tasks} results; \
             without a result: {missing:?}\nbroker a log:\n{}\nbroker b log:\n{}",
            received.len(),
            results.len(),
            a.log(),
            b.log()
        );
    }
    assert_eq!(log.acked.len(), sends);
    assert!(lost.is_empty(), "acknowledged sends lost: {lost:?}");

    let results = results.lock().expect("results");
    let mut double_leases = Vec::new();
    for t in 0..tasks {
        let task = format!("T{t}");
        let seqs = results.get(&task).map(BTreeSet::len).unwrap_or(0);
        assert_eq!(seqs, 1, "{task}: {seqs} task_result messages");
        let status = app.request(json!({"op":"status","task":task}));
        assert_eq!(status["task"]["state"], "completed", "{status}");
        let states: Vec<&str> = status["task"]["history"]
            .as_array()
            .map(|h| h.iter().filter_map(|e| e["state"].as_str()).collect())
            .unwrap_or_default();
        if states.windows(2).any(|w| w == ["leased", "leased"]) {
            double_leases.push((task, states.join(",")));
        }
    }
    assert!(double_leases.is_empty(), "double leases: {double_leases:?}");

    // Failover time: from the kill to the first ok after the first refused send.
    let first_refusal = log
        .answers
        .iter()
        .find(|(at, ok)| *at >= killed_at && !ok)
        .map(|(at, _)| *at);
    let recovered = first_refusal.and_then(|r| {
        log.answers
            .iter()
            .find(|(at, ok)| *at > r && *ok)
            .map(|(at, _)| at.duration_since(killed_at))
    });
    let slowest = log
        .answers
        .windows(2)
        .filter(|w| w[1].0 >= killed_at)
        .map(|w| w[1].0.duration_since(w[0].0))
        .max()
        .unwrap_or_default();
    eprintln!(
        "cluster failover: {sends} sends, {tasks} tasks; killed {inbox_leader} (inbox leader; \
         tasks leader {tasks_leader:?}); refused sends {}; sends ok again {:?} after the kill \
         (longest gap between answers {slowest:?}); restarted after {:?}; 0 lost, 0 double leases",
        log.answers.iter().filter(|(_, ok)| !ok).count(),
        recovered,
        restarted_at.duration_since(killed_at),
    );
    drop((a, b));
}
