//! Broker load: WebSocket participants messaging each other through the `amp-broker`
//! binary (`send`, `message`, `ack`), next to a baseline measured in the same run against
//! the same nats-server: the project's own JetStream client publishing (with PubAck) and
//! pull-consuming the same number of messages of the same size, with the same concurrency.
//! Then the broker's resident memory, idle and with many idle authenticated sessions.
//!
//! `cargo bench --bench broker_load` runs the full load (release binary). Without
//! `--bench`, as `cargo test --all-targets` runs it, it is a smoke run of the same code
//! with tiny sizes. Sizes of the full run come from the environment:
//! `BROKER_LOAD_PAIRS` (16), `BROKER_LOAD_MESSAGES` per pair (2000),
//! `BROKER_LOAD_BODY_BYTES` (256), `BROKER_LOAD_WINDOW` sends in flight per sender (16),
//! `BROKER_LOAD_ROUNDS` (2) and `BROKER_LOAD_IDLE_SESSIONS` (1000,10000: the idle session
//! counts the memory phase measures, in rising order). `BROKER_LOAD_REGISTRY_TTL_S` sets
//! the broker's `limits.registry_ttl_s` (default 15).
//!
//! `BENCH_CPUS=split` gives nats-server the first CPU to itself and puts the broker
//! and this harness (both paths' clients) on the others, so the ratio answers whether
//! the broker holds JetStream back when JetStream has a core of its own; by default all
//! three processes share every CPU, and the broker path's extra CPU (broker and its
//! clients) is taken from nats-server.
//!
//! Profiling: `AMP_BROKER_WRAPPER="valgrind --tool=callgrind --instr-atstart=no"` starts
//! the broker under callgrind; the bench then instruments it for the broker-path runs only
//! (`callgrind_control -i on`, then `-d` and `-i off`), so the profile holds the messages
//! and nothing of start-up or the memory phase.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::VecDeque;
use std::sync::{Barrier, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use amp_broker::jetstream::{
    AckKind, AckPolicy, ConsumerAction, ConsumerConfig, Context, DeliverPolicy, Delivery,
    DiscardPolicy, Inbound, PublishOptions, PullRequest, Request, RetentionPolicy, StorageType,
    StreamConfig, classify,
};
use amp_broker::nats::{Client as NatsClient, Options, Sid};
use common::NatsServer;
use common::amp::{Broker, Client, metric, open_config, token_hash};
use common::load_client::LoadSession;
use serde_json::{Value, json};

/// The spec's default `inbox_window`: the broker's pull batch and max_ack_pending per
/// inbox, used as the same for the baseline consumers.
const INBOX_WINDOW: u64 = 64;
const WAIT: Duration = Duration::from_secs(30);
const IDLE_TOKEN: &str = "idle-token";

struct Sizes {
    pairs: usize,
    messages: usize,
    body_bytes: usize,
    window: usize,
    rounds: usize,
    idle_sessions: Vec<usize>,
    /// How long idle sessions are held while their CPU cost is taken.
    idle_sample: Duration,
}

impl Sizes {
    fn full() -> Sizes {
        let env = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&v| v > 0)
                .unwrap_or(default)
        };
        Sizes {
            pairs: env("BROKER_LOAD_PAIRS", 16),
            messages: env("BROKER_LOAD_MESSAGES", 2000),
            body_bytes: env("BROKER_LOAD_BODY_BYTES", 256),
            window: env("BROKER_LOAD_WINDOW", 16),
            rounds: env("BROKER_LOAD_ROUNDS", 2),
            idle_sessions: std::env::var("BROKER_LOAD_IDLE_SESSIONS")
                .ok()
                .map(|v| {
                    let mut counts: Vec<usize> =
                        v.split(',').filter_map(|n| n.trim().parse().ok()).collect();
                    counts.sort_unstable();
                    counts
                })
                .filter(|counts| !counts.is_empty())
                .unwrap_or_else(|| vec![1000, 10_000]),
            idle_sample: Duration::from_secs(10),
        }
    }

    fn smoke() -> Sizes {
        Sizes {
            pairs: 2,
            messages: 20,
            body_bytes: 64,
            window: 4,
            rounds: 1,
            idle_sessions: vec![10],
            idle_sample: Duration::from_millis(500),
        }
    }
}

/// Nanoseconds on one monotonic clock shared by every thread of this process.
fn clock() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A JSON body of exactly `bytes` bytes (at least its fixed part) carrying send time `t`.
fn body(t: u64, bytes: usize) -> String {
    let head = format!(r#"{{"t":{t:>20},"pad":""#);
    let pad = bytes.saturating_sub(head.len() + 2);
    format!("{head}{}\"}}", "x".repeat(pad))
}

fn sent_at(body: &Value) -> u64 {
    body["t"].as_u64().expect("body carries its send time")
}

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| {
        f.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
    });
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks / per_second
}

/// VmRSS of a process in KiB.
fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:").expect("VmRSS of the broker")
}

/// A `kB` field of /proc/<pid>/status.
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// The RSS once it has stopped moving for a second (at most 15 s of waiting).
fn settled_rss_kib(pid: u32) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = rss_kib(pid);
    loop {
        thread::sleep(Duration::from_secs(1));
        let now = rss_kib(pid);
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

/// Waits (at most 60 s) until a process uses less than 4% of a CPU over half a second
/// (one or two clock ticks).
fn settle_cpu(pid: &str) {
    settle_cpu_over(pid, Duration::from_millis(500));
}

/// Waits (at most 60 s) until a process uses less than 4% of a CPU over `window`.
fn settle_cpu_over(pid: &str, window: Duration) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = cpu_seconds(pid);
    while Instant::now() < deadline {
        thread::sleep(window);
        let now = cpu_seconds(pid);
        if now - last < 0.04 * window.as_secs_f64() + 1e-9 {
            return;
        }
        last = now;
    }
}

/// Waits (at most 5 minutes) until the broker's `amp_inbox_consumers_waiting` is 0.
fn wait_inbox_consumers(broker: &Broker) -> Duration {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(300) {
        if metric(broker, "amp_inbox_consumers_waiting") == Some(0.0) {
            break;
        }
        thread::sleep(Duration::from_millis(100));
    }
    start.elapsed()
}

fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Lets this process (and the broker it starts) hold one socket per idle session.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// What one path measured in one round.
struct Run {
    path: &'static str,
    messages: usize,
    elapsed: Duration,
    latencies: Vec<u64>,
    /// CPU seconds of this process, the broker and the nats-server during the run.
    cpu: [f64; 3],
}

impl Run {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.elapsed.as_secs_f64()
    }

    fn percentile_ms(&self, p: f64) -> f64 {
        let i = ((self.latencies.len() as f64 * p) as usize).min(self.latencies.len() - 1);
        self.latencies[i] as f64 / 1e6
    }
}

/// Runs `pairs` sender/receiver thread pairs, timing from the moment all are connected
/// and warmed up (one message each) to the last delivery; also takes CPU figures.
fn timed_run<S, R>(path: &'static str, s: &Sizes, pids: [&str; 3], sender: S, receiver: R) -> Run
where
    S: Fn(usize, &Barrier) + Sync,
    R: Fn(usize, &Barrier) -> (Vec<u64>, Instant) + Sync,
{
    // What the last run left behind (its sessions ending, its consumers' acks settling)
    // is not this run's cost.
    settle_cpu(pids[1]);
    settle_cpu(pids[2]);
    let barrier = Barrier::new(2 * s.pairs + 1);
    let (start, cpu_before, results) = thread::scope(|scope| {
        let receivers: Vec<_> = (0..s.pairs)
            .map(|i| {
                let (receiver, barrier) = (&receiver, &barrier);
                scope.spawn(move || receiver(i, barrier))
            })
            .collect();
        for i in 0..s.pairs {
            let (sender, barrier) = (&sender, &barrier);
            scope.spawn(move || sender(i, barrier));
        }
        barrier.wait();
        let cpu_before = pids.map(cpu_seconds);
        let start = Instant::now();
        let results: Vec<_> = receivers
            .into_iter()
            .map(|r| r.join().expect("receiver thread"))
            .collect();
        (start, cpu_before, results)
    });
    let cpu_after = pids.map(cpu_seconds);
    let end = results.iter().map(|r| r.1).max().unwrap_or(start);
    let mut latencies: Vec<u64> = results.into_iter().flat_map(|r| r.0).collect();
    latencies.sort_unstable();
    Run {
        path,
        messages: s.pairs * s.messages,
        elapsed: end - start,
        latencies,
        cpu: [0, 1, 2].map(|k| cpu_after[k] - cpu_before[k]),
    }
}

// The broker path: one WebSocket session per thread.

fn login(broker: &Broker, name: &str) -> LoadSession {
    LoadSession::login(broker, "acme", name, &format!("{name}-token"), WAIT)
}

fn broker_sender(broker: &Broker, me: &str, to: &str, s: &Sizes, barrier: &Barrier) {
    let mut session = login(broker, me);
    let send = |session: &mut LoadSession, k: usize, t: u64| {
        let body = body(t, s.body_bytes);
        let frame = format!(r#"{{"op":"send","id":"{k}","to":"{to}","body":{body}}}"#);
        session.queue(frame.as_bytes());
    };
    let expect_ok = |session: &mut LoadSession| {
        let answer = session.next_text().expect("an answer in time");
        assert!(
            answer.starts_with(br#"{"op":"ok""#),
            "send: {}",
            String::from_utf8_lossy(answer)
        );
    };
    send(&mut session, 0, 0);
    expect_ok(&mut session);
    barrier.wait();
    let (mut sent, mut answered) = (0, 0);
    while answered < s.messages {
        while sent < s.messages && sent - answered < s.window {
            sent += 1;
            send(&mut session, sent, clock());
        }
        expect_ok(&mut session);
        answered += 1;
    }
}

fn broker_receiver(broker: &Broker, me: &str, s: &Sizes, barrier: &Barrier) -> (Vec<u64>, Instant) {
    let mut session = login(broker, me);
    // The send time of the next first delivery, acknowledged at once.
    // The members it needs, the body parsed alone as the baseline consumer parses its
    // messages: the two clients do the same JSON work per message.
    #[derive(serde::Deserialize)]
    struct MessageFrame<'a> {
        op: &'a str,
        seq: u64,
        delivery: u64,
        #[serde(borrow)]
        body: &'a serde_json::value::RawValue,
    }
    let take = |session: &mut LoadSession| loop {
        let text = session.next_text().expect("a message in time");
        let frame: MessageFrame = serde_json::from_slice(text).expect("a message frame");
        assert_eq!(frame.op, "message", "{}", String::from_utf8_lossy(text));
        let sent = (frame.delivery == 1).then(|| {
            let body: Value = serde_json::from_str(frame.body.get()).expect("JSON body");
            sent_at(&body)
        });
        let ack = format!(r#"{{"op":"ack","seq":{}}}"#, frame.seq);
        session.queue(ack.as_bytes());
        if let Some(sent) = sent {
            return sent;
        }
    };
    take(&mut session);
    barrier.wait();
    let latencies = (0..s.messages)
        .map(|_| {
            let sent = take(&mut session);
            clock() - sent
        })
        .collect();
    // The last acks go out before the session ends.
    session.flush();
    (latencies, Instant::now())
}

// The baseline: the project's JetStream client straight against the nats-server.

fn jetstream(url: &str) -> Context {
    let client = NatsClient::connect(Options::new(url)).expect("connect to nats-server");
    Context::new(client).with_timeout(WAIT)
}

fn baseline_publisher(url: &str, subject: &str, s: &Sizes, barrier: &Barrier) {
    let mut js = jetstream(url);
    let publish = |js: &mut Context, k: usize, t: u64| {
        let options = PublishOptions {
            msg_id: Some(format!("{subject}-{k}")),
            ..PublishOptions::default()
        };
        js.publish_async(subject, None, body(t, s.body_bytes).as_bytes(), &options)
            .expect("publish")
    };
    let first = publish(&mut js, 0, 0);
    js.wait_pub_ack(first).expect("PubAck");
    barrier.wait();
    let mut in_flight = VecDeque::new();
    for k in 1..=s.messages {
        if in_flight.len() == s.window
            && let Some(id) = in_flight.pop_front()
        {
            js.wait_pub_ack(id).expect("PubAck");
        }
        in_flight.push_back(publish(&mut js, k, clock()));
    }
    for id in in_flight {
        js.wait_pub_ack(id).expect("PubAck");
    }
}

/// A durable pull consumer read the way the broker reads an inbox: one pull of
/// `INBOX_WINDOW` messages outstanding, renewed when used up or ended by a status.
struct PullConsumer {
    js: Context,
    sid: Sid,
    inbox: String,
    pull: Request,
    remaining: u64,
}

impl PullConsumer {
    fn create(url: &str, stream: &str, name: &str, subject: &str) -> PullConsumer {
        let mut js = jetstream(url);
        let config = ConsumerConfig {
            filter_subject: Some(subject.to_string()),
            deliver_policy: Some(DeliverPolicy::All),
            ack_policy: Some(AckPolicy::Explicit),
            ack_wait: Some(Duration::from_secs(30)),
            max_deliver: Some(-1),
            max_ack_pending: Some(INBOX_WINDOW as i64),
            ..ConsumerConfig::durable_pull(name)
        };
        js.create_consumer(stream, &config, ConsumerAction::Create)
            .expect("create consumer");
        let pull = PullRequest {
            batch: INBOX_WINDOW,
            expires: Some(Duration::from_secs(20)),
            idle_heartbeat: Some(Duration::from_secs(5)),
            ..PullRequest::default()
        };
        let pull = js.api().pull_next(stream, name, &pull).expect("pull");
        let inbox = js.client().connection_mut().new_inbox();
        let sid = js.client().subscribe(&inbox, None).expect("subscribe");
        PullConsumer {
            js,
            sid,
            inbox,
            pull,
            remaining: 0,
        }
    }

    /// The send time of the next message, acknowledged at once.
    fn take(&mut self) -> u64 {
        loop {
            if self.remaining == 0 {
                let client = self.js.client();
                client
                    .publish(
                        &self.pull.subject,
                        Some(&self.inbox),
                        None,
                        &self.pull.payload,
                    )
                    .expect("pull");
                self.remaining = INBOX_WINDOW;
            }
            let msg = self
                .js
                .client()
                .next_message(self.sid, WAIT)
                .expect("nats connection")
                .expect("a delivery in time");
            match classify(&Delivery::from(&msg)) {
                Inbound::Message => {
                    self.remaining -= 1;
                    self.js.ack(&msg, &AckKind::Ack).expect("ack");
                    let body: Value = serde_json::from_slice(&msg.payload).expect("JSON body");
                    return sent_at(&body);
                }
                Inbound::IdleHeartbeat { .. } => {}
                _ => self.remaining = 0,
            }
        }
    }
}

fn baseline_consumer(
    url: &str,
    stream: &str,
    name: &str,
    subject: &str,
    s: &Sizes,
    barrier: &Barrier,
) -> (Vec<u64>, Instant) {
    let mut consumer = PullConsumer::create(url, stream, name, subject);
    consumer.take();
    barrier.wait();
    let latencies = (0..s.messages)
        .map(|_| {
            let sent = consumer.take();
            clock() - sent
        })
        .collect();
    (latencies, Instant::now())
}

/// A failed client thread would leave the others waiting at a barrier forever: end the
/// whole run instead, with the servers it started.
fn exit_on_panic(children: [u32; 2]) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        for pid in children {
            // SAFETY: a signal to a child process this run started.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
        }
        std::process::exit(101);
    }));
}

fn as_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn main() {
    clock();
    let full = std::env::args().any(|a| a == "--bench");
    let s = if full { Sizes::full() } else { Sizes::smoke() };
    raise_open_files_limit();

    let names = |prefix: &str, n: usize| (0..n).map(|i| format!("{prefix}{i}")).collect();
    let most_idle = s.idle_sessions.last().copied().unwrap_or(0);
    let idle: Vec<String> = names("idle", most_idle);
    let mut load: Vec<String> = Vec::new();
    for round in 0..s.rounds {
        load.extend(names(&format!("s{round}-"), s.pairs));
        load.extend(names(&format!("r{round}-"), s.pairs));
    }
    let mut config = open_config(&as_refs(&load));
    // Idle participants in their own namespace, so their inbox consumers live on a stream
    // the load does not touch. They log in through the namespace's `open` entry (any
    // name, one token), so the figures are the sessions' cost, not a configuration of
    // 10,000 participants.
    config["namespaces"]["idle"] = json!({
        "open": {
            "token_sha256": token_hash(IDLE_TOKEN),
            "permissions": {"send": [">"]},
        },
        // Each idle participant keeps an inbox consumer.
        "inbox": {"max_consumers": most_idle.max(1)},
    });
    // Every session comes from 127.0.0.1.
    let sessions = most_idle + 4 * s.pairs * s.rounds + 16;
    config["limits"]["max_sessions"] = json!(sessions);
    // Idle sessions' registry entries are refreshed every registry_ttl_s / 3.
    if let Some(ttl) = std::env::var("BROKER_LOAD_REGISTRY_TTL_S")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        config["limits"]["registry_ttl_s"] = json!(ttl);
    }
    // The idle sessions read nothing, so they answer no pings: at the default heartbeat
    // (10 s) the broker closes them for silence 30 s after their hello, and a memory
    // phase whose inbox consumers took 20 s to make measured sessions closing. Two
    // minutes covers the whole phase; the pings they would answer are not counted.
    config["limits"]["heartbeat_s"] = json!(120);
    config["limits"]["max_connections_per_ip"] = json!(sessions);
    config["limits"]["connect_burst_per_ip"] = json!(sessions);

    // Children inherit the CPUs of the thread that starts them, and so do this harness's
    // client threads.
    let split = common::split_cpus();
    split.nats_server();
    let nats = NatsServer::start();
    split.the_rest();
    let broker = Broker::start(&nats.url(), &config);
    let broker_pid = broker.pid().expect("broker pid");
    let nats_pid = nats.pid().expect("nats-server pid");
    exit_on_panic([broker_pid, nats_pid]);

    println!(
        "broker_load{}: {} pairs x {} messages, body {} B, {} sends in flight per sender, \
         {} round(s); load average {} at start ({}); amp-broker pid {broker_pid}, \
         nats-server pid {nats_pid}",
        if full {
            ""
        } else {
            " (smoke run; `cargo bench` runs the full one)"
        },
        s.pairs,
        s.messages,
        s.body_bytes,
        s.window,
        s.rounds,
        load_average(),
        split.describe(),
    );

    // Memory first, before the load leaves freed heap behind for sessions to reuse.
    let rss_idle = settled_rss_kib(broker_pid);
    // Heap and stacks versus pages of the mapped executable (shared, reclaimable).
    let split_idle = ["RssAnon:", "RssFile:"].map(|f| status_kib(broker_pid, f).unwrap_or(0));
    let mut sessions: Vec<Client> = Vec::with_capacity(most_idle);
    let mut rss_sessions: Vec<(usize, u64)> = Vec::new();
    for &count in &s.idle_sessions {
        let start = Instant::now();
        sessions.extend(
            idle.get(sessions.len()..count)
                .unwrap_or_default()
                .iter()
                .map(|n| Client::login(&broker, "idle", n, IDLE_TOKEN)),
        );
        let logged_in = start.elapsed();
        // Each session's participant has its inbox consumer and pull before it counts.
        let ready = wait_inbox_consumers(&broker);
        rss_sessions.push((count, settled_rss_kib(broker_pid)));
        // What holding them costs: registry refreshes, pull heartbeats and renewals.
        let pids = [broker_pid, nats_pid].map(|p| p.to_string());
        let before = pids.each_ref().map(|p| cpu_seconds(p));
        thread::sleep(s.idle_sample);
        let busy =
            [0, 1].map(|k| (cpu_seconds(&pids[k]) - before[k]) / s.idle_sample.as_secs_f64());
        println!(
            "{count} idle sessions: logged in after {:.1} s, every inbox consumer after {:.1} s; \
             held for {:.1} s: broker {:.1}% of a CPU, nats-server {:.1}%",
            logged_in.as_secs_f64(),
            (logged_in + ready).as_secs_f64(),
            s.idle_sample.as_secs_f64(),
            busy[0] * 100.0,
            busy[1] * 100.0,
        );
    }
    drop(sessions);
    // Ending thousands of sessions keeps the broker and nats-server busy for a while
    // (their pulls' heartbeats come in waves every 5 s until the pulls expire), and the
    // CPU figures of the first round must not carry it: quiet over a whole wave.
    let wave = Duration::from_secs(6);
    settle_cpu_over(&broker_pid.to_string(), wave);
    settle_cpu_over(&nats_pid.to_string(), wave);

    let mut setup = jetstream(&nats.url());
    let stream = StreamConfig {
        retention: Some(RetentionPolicy::Limits),
        storage: Some(StorageType::File),
        num_replicas: Some(1),
        discard: Some(DiscardPolicy::Old),
        duplicate_window: Some(Duration::from_secs(120)),
        ..StreamConfig::new("BENCH", &["bench.>"])
    };
    setup.create_stream(&stream).expect("baseline stream");

    let (broker_pid, nats_pid) = (broker_pid.to_string(), nats_pid.to_string());
    let pids = ["self", broker_pid.as_str(), nats_pid.as_str()];
    let url = nats.url();
    let mut runs: Vec<(usize, Run)> = Vec::new();
    for round in 0..s.rounds {
        let baseline = || {
            timed_run(
                "jetstream",
                &s,
                pids,
                |i, b| baseline_publisher(&url, &format!("bench.{round}.{i}"), &s, b),
                |i, b| {
                    let subject = format!("bench.{round}.{i}");
                    baseline_consumer(&url, "BENCH", &format!("c{round}-{i}"), &subject, &s, b)
                },
            )
        };
        let through_broker = || {
            common::amp::profile(broker_pid.as_str(), true);
            let run = timed_run(
                "broker",
                &s,
                pids,
                |i, b| {
                    broker_sender(
                        &broker,
                        &format!("s{round}-{i}"),
                        &format!("r{round}-{i}"),
                        &s,
                        b,
                    )
                },
                |i, b| broker_receiver(&broker, &format!("r{round}-{i}"), &s, b),
            );
            common::amp::profile(broker_pid.as_str(), false);
            run
        };
        // Alternate the order so that neither path always runs on a warmer server.
        if round % 2 == 0 {
            runs.push((round, baseline()));
            runs.push((round, through_broker()));
        } else {
            runs.push((round, through_broker()));
            runs.push((round, baseline()));
        }
    }

    println!();
    println!(
        "{:<6} {:<10} {:>10} {:>9} {:>9} {:>9}   {:>22}",
        "round", "path", "msgs/s", "p50 ms", "p99 ms", "p99.9 ms", "CPU us/msg bench/broker/nats"
    );
    for (round, r) in &runs {
        let per_msg = r.cpu.map(|c| c * 1e6 / r.messages as f64);
        println!(
            "{:<6} {:<10} {:>10.0} {:>9.2} {:>9.2} {:>9.2}   {:>8.0} {:>6.0} {:>6.0}",
            round + 1,
            r.path,
            r.rate(),
            r.percentile_ms(0.50),
            r.percentile_ms(0.99),
            r.percentile_ms(0.999),
            per_msg[0],
            per_msg[1],
            per_msg[2],
        );
    }
    let best = |path: &str| {
        runs.iter()
            .filter(|(_, r)| r.path == path)
            .map(|(_, r)| r.rate())
            .fold(0.0, f64::max)
    };
    let ratio = best("broker") / best("jetstream");
    let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
    let per_round: Vec<String> = (0..s.rounds)
        .map(|round| {
            let rate = |path: &str| {
                runs.iter()
                    .find(|(r, run)| *r == round && run.path == path)
                    .map_or(0.0, |(_, run)| run.rate())
            };
            format!("{:.0}%", 100.0 * rate("broker") / rate("jetstream"))
        })
        .collect();
    println!();
    println!(
        "throughput broker/jetstream per round: {}",
        per_round.join(" ")
    );
    println!(
        "throughput broker/jetstream (best of each): {:.0}%   target >= 90%: {}",
        ratio * 100.0,
        verdict(ratio >= 0.9)
    );
    let broker_runs: Vec<&Run> = runs
        .iter()
        .map(|(_, r)| r)
        .filter(|r| r.path == "broker")
        .collect();
    let broker_cpu_us = broker_runs.iter().map(|r| r.cpu[1]).sum::<f64>() * 1e6
        / broker_runs.iter().map(|r| r.messages).sum::<usize>().max(1) as f64;
    println!(
        "broker CPU per message (all broker runs): {broker_cpu_us:.1} us   target <= 8 us: {}",
        verdict(broker_cpu_us <= 8.0)
    );
    println!(
        "broker RSS idle: {:.1} MiB (anonymous {:.1}, file-backed {:.1})   target < 16 MiB: {}",
        rss_idle as f64 / 1024.0,
        split_idle[0] as f64 / 1024.0,
        split_idle[1] as f64 / 1024.0,
        verdict(rss_idle < 16 * 1024)
    );
    for &(count, rss) in &rss_sessions {
        let per_session = rss.saturating_sub(rss_idle) as f64 / count.max(1) as f64;
        let total = if count >= 10_000 {
            format!("   target < 48 MiB: {}", verdict(rss < 48 * 1024))
        } else {
            String::new()
        };
        println!(
            "broker RSS with {count} idle sessions: {:.1} MiB = {:.1} KiB per session   \
             target < 32 KiB: {}{total}",
            rss as f64 / 1024.0,
            per_session,
            verdict(per_session < 32.0)
        );
    }
    println!("load average {} at end", load_average());
}
