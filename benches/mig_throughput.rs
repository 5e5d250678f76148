//! MIG unary INVOKE against AMP `submit`, on one broker process and one nats-server (with
//! the broker as its auth callout, as MIG callers need): tasks per second and the p50/p99
//! latency of a round trip, with 16 callers each keeping one round trip in flight and 16
//! AMP worker sessions (one slot each, serving both jobs) answering over WebSocket.
//!
//! - AMP baseline: 16 WebSocket participants, each `submit` -> `ok` -> `task_result` in
//!   its inbox -> `ack`, one at a time.
//! - MIG: 16 threads, each with its own connection of the project's blocking NATS client
//!   (`amp_broker::nats::Client`) authenticated through the callout as its own participant,
//!   reply prefix `_INBOX_acme_<name>.`, doing request/reply on
//!   `mig.v0_1.acme.invoke.bench.echo` with `Authorization: Bearer <token>`.
//!
//! Both drive the same jobs engine (a MIG invoke is an AMP task), so the ratio MIG/AMP is
//! what the MIG layer costs: the goal is at least 0.80.
//!
//!     cargo bench --bench mig_throughput        (MIG_BENCH_TASKS, default 2000)
//!
//! Without `--bench` (as `cargo test --all-targets` runs it) it is a smoke run of 20 tasks
//! each way that asserts every one succeeded.
//!
//! Absolute figures drift on shared machines; the ratio within one run is the result.

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use amp_broker::nats::{Client as NatsClient, Options};
use amp_broker::proto::headers::HeaderMap;
use common::amp::{Broker, CalloutServer, Client, http_get, token_hash};
use serde_json::{Value, json};

const CALLERS: usize = 16;
const WORKERS: usize = 16;
const CAPABILITY: &str = "bench.echo";
/// Submits sent so far, so every `submit` frame has its own id.
static SUBMITS: AtomicU64 = AtomicU64::new(0);
const WAIT: Duration = Duration::from_secs(30);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config() -> Value {
    let token = |name: &str| json!(token_hash(&format!("{name}-token")));
    let mut participants = serde_json::Map::new();
    for i in 1..=CALLERS {
        participants.insert(
            format!("app{i}"),
            json!({"token_sha256": token(&format!("app{i}")), "permissions": {"submit": ["render"]}}),
        );
        participants.insert(
            format!("mig{i}"),
            json!({"token_sha256": token(&format!("mig{i}")), "permissions": {"submit": ["echo"]}}),
        );
    }
    participants.insert(
        "worker".into(),
        json!({"token_sha256": token("worker"), "permissions": {"serve": ["render", "echo"]}}),
    );
    json!({
        "mig": {"enabled": true},
        "namespaces": {"acme": {
            "participants": participants,
            "inbox": {"inbox_window": 1024},
            "jobs": {
                "render": {},
                "echo": {"mig": {"id": CAPABILITY}}
            }
        }}
    })
}

/// Worker sessions serving `render` and `echo` with one slot each until `stop`.
fn workers(broker: &Broker, stop: &Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    (0..WORKERS)
        .map(|_| {
            let mut c = Client::connect(broker);
            let ok = c.request(json!({
                "op":"hello","ns":"acme","name":"worker",
                "auth":{"type":"token","token":"worker-token"},
                "serve":[{"job":"render","slots":1},{"job":"echo","slots":1}]
            }));
            assert_eq!(ok["op"], "ok", "worker hello: {ok}");
            let stop = Arc::clone(stop);
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let Some(f) = c.next_frame(Duration::from_millis(200)) else {
                        continue;
                    };
                    if f["op"] == "_closed" {
                        break;
                    }
                    if f["op"] != "offer" {
                        continue;
                    }
                    n += 1;
                    let task = f["task"].clone();
                    let r = c.request(json!({"op":"claim","id":format!("c{n}"),"task":task}));
                    if r["op"] == "ok" {
                        let result = json!({"echo": f["body"]});
                        c.send(&json!({"op":"complete","id":format!("k{n}"),"task":task,"result":result}));
                    }
                }
                n
            })
        })
        .collect()
}

/// `total` split over `CALLERS`.
fn share(total: usize, i: usize) -> usize {
    total / CALLERS + usize::from(i < total % CALLERS)
}

struct Run {
    rate: f64,
    /// Round-trip latencies, sorted.
    latencies: Vec<Duration>,
    nats_us: f64,
    broker_us: f64,
}

impl Run {
    fn percentile(&self, p: usize) -> Duration {
        let n = self.latencies.len();
        self.latencies[(n * p / 100).min(n - 1)]
    }
}

/// Runs `callers` (each returns its latencies) started together; the rate over all, and
/// the callers back.
fn timed<C: Send + 'static>(
    callers: Vec<C>,
    tasks: usize,
    nats: &CalloutServer,
    broker: &Broker,
    run: fn(&mut C, usize, usize) -> Vec<Duration>,
) -> (Run, Vec<C>) {
    let cpu_before = (cpu_seconds(nats.nats.pid()), cpu_seconds(broker.pid()));
    let barrier = Arc::new(std::sync::Barrier::new(callers.len() + 1));
    let handles: Vec<_> = callers
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                let latencies = run(&mut c, i, share(tasks, i));
                (c, latencies)
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    let mut callers = Vec::new();
    let mut latencies = Vec::new();
    for h in handles {
        let (c, l) = h.join().expect("caller thread");
        callers.push(c);
        latencies.extend(l);
    }
    let elapsed = started.elapsed();
    assert_eq!(latencies.len(), tasks, "every round trip succeeded");
    latencies.sort();
    let per_task_us = |s: f64| s * 1e6 / tasks as f64;
    let run = Run {
        rate: tasks as f64 / elapsed.as_secs_f64(),
        latencies,
        nats_us: per_task_us(cpu_seconds(nats.nats.pid()) - cpu_before.0),
        broker_us: per_task_us(cpu_seconds(broker.pid()) - cpu_before.1),
    };
    (run, callers)
}

/// One AMP participant: `n` submits one at a time, each until its `task_result` is in the
/// inbox (then acked).
fn amp_caller(c: &mut Client, i: usize, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let t0 = Instant::now();
        let id = format!("s{i}-{}", SUBMITS.fetch_add(1, Ordering::Relaxed));
        c.send(&json!({"op":"submit","id":id,"job":"render","body":{"n":k}}));
        let (mut answered, mut result) = (false, false);
        while !(answered && result) {
            let f = c.next_frame(WAIT).expect("progress");
            match f["op"].as_str() {
                Some("ok") if f["re"] == id.as_str() => answered = true,
                Some("message") => {
                    assert_eq!(f["kind"], "task_result", "{f}");
                    result = true;
                    c.send(&json!({"op":"ack","seq":f["seq"]}));
                }
                _ => panic!("unexpected frame {f}"),
            }
        }
        out.push(t0.elapsed());
    }
    out
}

struct MigCaller {
    nats: NatsClient,
    headers: HeaderMap,
    name: String,
    /// Invokes sent so far: each gets its own `message_id` (the idempotency key).
    sent: u64,
}

impl MigCaller {
    fn connect(url: &str, name: &str) -> MigCaller {
        let options = Options::new(url)
            .with_user_password(&format!("acme/{name}"), &format!("{name}-token"))
            .with_inbox_prefix(&format!("_INBOX_acme_{name}"));
        let nats = NatsClient::connect(options).expect("MIG caller connects through the callout");
        let mut headers = HeaderMap::new();
        headers
            .insert("Authorization", &format!("Bearer {name}-token"))
            .expect("header");
        MigCaller {
            nats,
            headers,
            name: name.to_string(),
            sent: 0,
        }
    }

    /// The reply to one MIG request, parsed; panics on a transport failure.
    fn call(&mut self, op: &str, body: &Value, timeout: Duration) -> Option<Value> {
        let msg = self
            .nats
            .request(
                &format!("mig.v0_1.acme.{op}"),
                Some(&self.headers),
                body.to_string().as_bytes(),
                timeout,
            )
            .ok()?;
        Some(serde_json::from_slice(&msg.payload).unwrap_or_else(|_| {
            panic!(
                "{op}: reply is not JSON: {:?}",
                String::from_utf8_lossy(&msg.payload)
            )
        }))
    }

    /// Until the broker answers HELLO on this connection (its subscriptions may be newer
    /// than `/healthz`).
    fn await_hello(&mut self) {
        let deadline = Instant::now() + WAIT;
        let body = json!({"header": {"tenant_id": "acme"}, "supported_versions": ["0.1"],
            "requested_bindings": ["nats"]});
        loop {
            if let Some(r) = self.call("hello", &body, Duration::from_secs(1)) {
                assert!(r.get("error").is_none(), "hello: {r}");
                return;
            }
            assert!(Instant::now() < deadline, "MIG HELLO not answered");
        }
    }
}

/// One MIG caller: `n` unary invokes one at a time.
fn mig_caller(c: &mut MigCaller, _: usize, n: usize) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    let subject = format!("invoke.{CAPABILITY}");
    for k in 0..n {
        c.sent += 1;
        let body = json!({
            "header": {"tenant_id": "acme", "message_id": format!("{}-{}", c.name, c.sent)},
            "payload": {"n": k}
        });
        let t0 = Instant::now();
        let r = c.call(&subject, &body, WAIT).expect("invoke answered");
        out.push(t0.elapsed());
        assert!(r.get("error").is_none(), "invoke: {r}");
        assert_eq!(r["payload"], json!({"echo": {"n": k}}), "{r}");
    }
    out
}

/// User and system CPU seconds of process `pid` so far (0 where /proc has none).
fn cpu_seconds(pid: Option<u32>) -> f64 {
    let Some(stat) = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
    else {
        return 0.0;
    };
    // utime and stime: the 12th and 13th fields after the command name, in clock ticks.
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

fn metric_lines(broker: &Broker, prefix: &str) -> Vec<String> {
    let (_, body) = http_get(broker.addr, "/metrics").expect("metrics");
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    // `cargo test --all-targets` runs this without `--bench`: a smoke run then.
    let full = std::env::args().any(|a| a == "--bench");
    let tasks = env_usize("MIG_BENCH_TASKS", if full { 2000 } else { 20 });
    let warmup = if full { 4 * CALLERS } else { 0 };

    let callout = CalloutServer::start();
    let broker = callout.broker(&config(), &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let workers = workers(&broker, &stop);

    let amp: Vec<Client> = (1..=CALLERS)
        .map(|i| {
            Client::login(
                &broker,
                "acme",
                &format!("app{i}"),
                &format!("app{i}-token"),
            )
        })
        .collect();
    let url = callout.nats.url();
    let mut mig: Vec<MigCaller> = (1..=CALLERS)
        .map(|i| MigCaller::connect(&url, &format!("mig{i}")))
        .collect();
    for c in &mut mig {
        c.await_hello();
    }

    // Warm-up rounds of both (not measured), then the measured runs.
    let (mut amp, mut mig) = (amp, mig);
    if warmup > 0 {
        amp = timed(amp, warmup, &callout, &broker, amp_caller).1;
        mig = timed(mig, warmup, &callout, &broker, mig_caller).1;
    }
    let (amp_run, _amp) = timed(amp, tasks, &callout, &broker, amp_caller);
    let (mig_run, _mig) = timed(mig, tasks, &callout, &broker, mig_caller);

    stop.store(true, Ordering::Relaxed);
    let served: u64 = workers.into_iter().map(|h| h.join().expect("worker")).sum();

    let report = |label: &str, r: &Run| {
        println!(
            "{label}: {:.0} tasks/s ({tasks} tasks, {CALLERS} callers x 1 in flight, {WORKERS} \
             workers x 1 slot); round trip p50 {:.2} ms, p99 {:.2} ms; CPU per task: \
             nats-server {:.0} us, broker {:.0} us",
            r.rate,
            ms(r.percentile(50)),
            ms(r.percentile(99)),
            r.nats_us,
            r.broker_us
        );
    };
    report("AMP submit -> task_result", &amp_run);
    report("MIG unary INVOKE        ", &mig_run);
    println!(
        "MIG / AMP = {:.2} x tasks/s (goal: at least 0.80); p50 {:.2} x, p99 {:.2} x",
        mig_run.rate / amp_run.rate,
        ms(mig_run.percentile(50)) / ms(amp_run.percentile(50)),
        ms(mig_run.percentile(99)) / ms(amp_run.percentile(99)),
    );
    for line in metric_lines(&broker, "amp_mig_rejected_total") {
        println!("  {line}");
    }
    assert!(
        served >= 2 * (tasks + warmup) as u64,
        "workers saw {served} offers for {} tasks",
        2 * (tasks + warmup)
    );
}
