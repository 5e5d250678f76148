//! Jobs end to end: tasks per second from `submit` to the `task_result` in the
//! submitter's inbox, acknowledged (submit -> offer -> claim -> complete -> result -> ack),
//! with 1, 4 and 16 workers on one broker process and one nats-server, and the JetStream
//! operations spent per task: the broker's `amp_jobs_jetstream_ops_total` (the jobs
//! engine's own) and every message the broker sent to nats-server as the server counts
//! them (its `/connz` `in_msgs`: the engine's operations plus the inbox's pulls and acks of
//! the `task_result`s). The baseline in the same run is the inbox: messages per second from
//! `send` to an acknowledged delivery, with the same number in flight.
//!
//!     cargo bench --bench jobs_throughput        (JOBS_BENCH_TASKS, default 2000;
//!                                                 JOBS_BENCH_WORKERS, default 1,4,16)
//!     JOBS_BENCH_OLD_BROKER=path/to/amp-broker cargo bench --bench jobs_throughput
//!
//! With `JOBS_BENCH_OLD_BROKER` each jobs run is made with that build of the broker too,
//! right before this one, and the ratio of the two is printed. `JOBS_BENCH_BROKER` runs
//! another binary as "this build" (e.g. a release broker under a debug harness). Each run
//! also reports the CPU time nats-server and the broker spent per task (`/proc`), which a
//! loaded machine disturbs far less than tasks per second.
//!
//! `BENCH_CPUS=split` runs nats-server on CPU 0 alone and the broker and the clients on
//! the other CPUs (as in `broker_load`).
//!
//! Without `--bench` (as `cargo test --all-targets` runs it) it is a smoke run of 20 tasks.
//!
//! `AMP_BROKER_WRAPPER="valgrind --tool=callgrind --instr-atstart=no"` profiles the
//! broker over the tasks only, as in `broker_load`.
//!
//! Absolute figures drift on shared machines; the ratios within one run are the result.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::amp::{Broker, http_get, open_config};
use common::load_client::LoadSession;
use common::{NatsServer, free_port};
use serde_json::{Value, json};

const IN_FLIGHT: usize = 256;
const WAIT: Duration = Duration::from_secs(30);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn metric(broker: &Broker, name: &str) -> f64 {
    let (_, body) = http_get(broker.addr, "/metrics").expect("metrics");
    body.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}

fn login(broker: &Broker, name: &str, wait: Duration) -> LoadSession {
    LoadSession::login(broker, "acme", name, &format!("{name}-token"), wait)
}

/// The members of the frames the bench's clients read.
#[derive(serde::Deserialize)]
struct Frame<'a> {
    op: &'a str,
    re: Option<&'a str>,
    /// An offer's task id, as the JSON string it came in.
    #[serde(borrow)]
    task: Option<&'a serde_json::value::RawValue>,
    seq: Option<u64>,
}

fn frame(text: &[u8]) -> Frame<'_> {
    serde_json::from_slice(text)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(text)))
}

/// Sends `n` requests built by `request(i)` with at most `IN_FLIGHT` unanswered, acking
/// every inbox `message` that arrives meanwhile; returns when `results_wanted` came.
fn drive(c: &mut LoadSession, n: usize, request: impl Fn(usize) -> String, results_wanted: usize) {
    let (mut sent, mut answered, mut results) = (0usize, 0usize, 0usize);
    while answered < n || results < results_wanted {
        while sent < n && sent - answered < IN_FLIGHT {
            c.queue(request(sent).as_bytes());
            sent += 1;
        }
        let text = c.next_text().expect("progress");
        let f = frame(text);
        match (f.op, f.seq) {
            ("ok", _) => answered += 1,
            ("message", Some(seq)) => {
                results += 1;
                c.queue(format!(r#"{{"op":"ack","seq":{seq}}}"#).as_bytes());
            }
            _ => panic!("unexpected frame {}", String::from_utf8_lossy(text)),
        }
    }
    c.flush();
}

/// A worker serving `render` with 4 slots: claims every offer and completes each task
/// whose claim is answered `ok`, until no frame came for 5 s.
fn work(mut c: LoadSession) {
    c.queue(br#"{"op":"serve","id":"v","job":"render","slots":4}"#);
    let mut n = 0u64;
    while let Some(text) = c.next_text() {
        let f = frame(text);
        let next = match (f.op, f.task, f.re) {
            // The claim's id is the task's, so its answer says what to complete.
            ("offer", Some(task), _) => {
                let t = task.get().trim_matches('"');
                format!(r#"{{"op":"claim","id":"c{t}","task":"{t}"}}"#)
            }
            ("ok", _, Some(re)) if re.starts_with('c') => {
                n += 1;
                let t = &re[1..];
                format!(r#"{{"op":"complete","id":"k{t}","task":"{t}","result":{n}}}"#)
            }
            _ => continue,
        };
        c.queue(next.as_bytes());
    }
}

/// The participants, each allowed everything, with an inbox window of 1,024 and the
/// per-session frame allowance at its maximum: at the default 1,000 frames/s (burst
/// 2,000) the one submitter, sending a `submit` and an `ack` per task, is held to about
/// 500 tasks/s once its burst is spent, and that allowance, not the jobs path, is then
/// what the run measures.
fn bench_config(names: &[&str]) -> Value {
    let mut config = open_config(names);
    config["namespaces"]["acme"]["inbox"] = json!({"inbox_window": 1024});
    config["limits"] = json!({"max_frames_per_s": 1_000_000, "frame_burst": 1_000_000});
    config
}

/// A nats-server with its monitoring port, and that port's address.
fn monitored_nats() -> (NatsServer, SocketAddr) {
    let port = free_port();
    let nats = NatsServer::with_config(&format!("http: 127.0.0.1:{port}"));
    (nats, SocketAddr::from(([127, 0, 0, 1], port)))
}

/// Messages the server received from its clients (the broker is the only one).
fn server_in_msgs(monitor: SocketAddr) -> f64 {
    let (_, body) = http_get(monitor, "/connz").expect("connz");
    let v: Value = serde_json::from_str(&body).expect("connz JSON");
    v["connections"].as_array().map_or(0.0, |c| {
        c.iter().filter_map(|c| c["in_msgs"].as_f64()).sum()
    })
}

struct JobsRun {
    rate: f64,
    engine_ops: f64,
    server_msgs: f64,
    conflicts: f64,
    /// Deliveries offered on the record their message carried, per task.
    spared: f64,
    /// CPU microseconds per task of nats-server and of the broker.
    nats_us: f64,
    broker_us: f64,
    /// CPU microseconds per task of this process: the submitter and the workers.
    clients_us: f64,
}

/// User and system CPU seconds of process `pid` so far (0 where /proc has none).
fn cpu_seconds(pid: Option<u32>) -> f64 {
    let Some(stat) = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
    else {
        return 0.0;
    };
    // Fields after the command name, which ends at the last ')': utime and stime are the
    // 12th and 13th of them, in clock ticks (100 per second on Linux).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (tick(11) + tick(12)) / 100.0
}

fn tasks_per_second(bin: Option<&Path>, workers: usize, tasks: usize) -> JobsRun {
    let split = common::split_cpus();
    split.nats_server();
    let (nats, monitor) = monitored_nats();
    split.the_rest();
    let mut names = vec!["app".to_string()];
    names.extend((1..=workers).map(|i| format!("w{i}")));
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let config = bench_config(&refs);
    let this = std::env::var_os("JOBS_BENCH_BROKER").map(PathBuf::from);
    let broker = match bin.or(this.as_deref()) {
        Some(bin) => Broker::start_bin(bin, &nats.url(), &config),
        None => Broker::start(&nats.url(), &config),
    };
    let mut app = login(&broker, "app", WAIT);
    let handles: Vec<_> = (1..=workers)
        .map(|i| {
            let c = login(&broker, &format!("w{i}"), Duration::from_secs(5));
            std::thread::spawn(move || work(c))
        })
        .collect();
    // A broker that has been running: the tasks are stored more than a quarter second
    // after its job consumer was created, so their first deliveries may be offered on the
    // record they carry (README, Jobs: "JetStream operations per task").
    std::thread::sleep(Duration::from_millis(300));
    let ops_before = metric(&broker, "amp_jobs_jetstream_ops_total");
    let spared_before = metric(&broker, "amp_jobs_record_reads_spared_total");
    let msgs_before = server_in_msgs(monitor);
    let me = Some(std::process::id());
    let cpu_before = (
        cpu_seconds(nats.pid()),
        cpu_seconds(broker.pid()),
        cpu_seconds(me),
    );
    let pid = broker.pid().map(|p| p.to_string()).unwrap_or_default();
    common::amp::profile(&pid, true);
    let started = Instant::now();
    drive(
        &mut app,
        tasks,
        |i| format!(r#"{{"op":"submit","id":"s{i}","job":"render","body":{{"n":{i}}}}}"#),
        tasks,
    );
    let elapsed = started.elapsed();
    common::amp::profile(&pid, false);
    let ops = metric(&broker, "amp_jobs_jetstream_ops_total") - ops_before;
    let msgs = server_in_msgs(monitor) - msgs_before;
    let per_task_us = |s: f64| s * 1e6 / tasks as f64;
    let nats_us = per_task_us(cpu_seconds(nats.pid()) - cpu_before.0);
    let broker_us = per_task_us(cpu_seconds(broker.pid()) - cpu_before.1);
    let clients_us = per_task_us(cpu_seconds(me) - cpu_before.2);
    let conflicts = metric(&broker, "amp_jobs_cas_conflicts_total");
    let spared =
        (metric(&broker, "amp_jobs_record_reads_spared_total") - spared_before) / tasks as f64;
    drop(app);
    for h in handles {
        let _ = h.join();
    }
    JobsRun {
        rate: tasks as f64 / elapsed.as_secs_f64(),
        engine_ops: ops / tasks as f64,
        server_msgs: msgs / tasks as f64,
        conflicts,
        spared,
        nats_us,
        broker_us,
        clients_us,
    }
}

fn messages_per_second(messages: usize) -> f64 {
    let split = common::split_cpus();
    split.nats_server();
    let nats = NatsServer::start();
    split.the_rest();
    let config = bench_config(&["app"]);
    let broker = Broker::start(&nats.url(), &config);
    let mut app = login(&broker, "app", WAIT);
    let started = Instant::now();
    drive(
        &mut app,
        messages,
        |i| format!(r#"{{"op":"send","id":"m{i}","to":"app","body":{{"n":{i}}}}}"#),
        messages,
    );
    messages as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: a smoke run then.
    let full = std::env::args().any(|a| a == "--bench");
    let tasks = env_usize("JOBS_BENCH_TASKS", if full { 2000 } else { 20 });
    let baseline = messages_per_second(tasks);
    println!(
        "baseline: inbox send -> delivery -> ack: {baseline:.0} messages/s ({tasks} messages); \
         {}",
        common::split_cpus().describe()
    );
    let old = std::env::var_os("JOBS_BENCH_OLD_BROKER").map(PathBuf::from);
    let report = |label: &str, workers: usize, r: &JobsRun| {
        println!(
            "jobs ({label}), {workers:>2} workers x 4 slots: {:.0} tasks/s = {:.2} x baseline; \
             {:.2} JetStream operations per task by the jobs engine, {:.2} messages per task \
             from the broker to nats-server; {:.2} record reads spared per task; {} \
             compare-and-set conflicts; CPU per task: nats-server {:.0} us, broker {:.0} us, \
             bench clients {:.0} us",
            r.rate,
            r.rate / baseline,
            r.engine_ops,
            r.server_msgs,
            r.spared,
            r.conflicts,
            r.nats_us,
            r.broker_us,
            r.clients_us
        );
    };
    let worker_counts: Vec<usize> = std::env::var("JOBS_BENCH_WORKERS")
        .ok()
        .map(|v| v.split(',').filter_map(|w| w.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 16]);
    for workers in worker_counts {
        let before = old
            .as_deref()
            .map(|bin| tasks_per_second(Some(bin), workers, tasks));
        let now = tasks_per_second(None, workers, tasks);
        if let Some(before) = &before {
            report("old", workers, before);
        }
        report("this build", workers, &now);
        if let Some(before) = &before {
            let cpu = |r: &JobsRun| r.nats_us + r.broker_us;
            println!(
                "jobs, {workers:>2} workers: this build / old = {:.2} x tasks/s, {:.2} x the \
                 CPU per task (nats-server and broker)",
                now.rate / before.rate,
                cpu(&now) / cpu(before)
            );
        }
    }
}
