//! Hostile load: honest sender/receiver pairs doing `send` -> `message` through the
//! `amp-broker` binary, first alone (phase 1), then while attacking connections hammer
//! the same broker (phase 2), in one run against one nats-server. Prints honest
//! throughput and latency of both phases, the broker's peak memory, whether it survived
//! and whether any confirmed honest message was lost, each with its target and MET or
//! MISSED. A benchmark, not a test: it exits 0 whatever the figures.
//!
//! `cargo bench --bench hostile_load` runs the full load (release binary); without
//! `--bench` (as `cargo test --all-targets` runs it) it is a short smoke run of the same
//! code. `-- --secs N` or `HOSTILE_LOAD_SECS` sets the seconds per phase (20). Other
//! sizes: `HOSTILE_LOAD_PAIRS` (16), `HOSTILE_LOAD_RATE` sends/s per sender (100),
//! `HOSTILE_LOAD_WINDOW` (16), `HOSTILE_LOAD_BODY_BYTES` (256), `HOSTILE_LOAD_ATTACKERS`
//! (50, dealt round-robin over the kinds), `HOSTILE_LOAD_KINDS` (a comma-separated subset
//! of `ping,ack,hello,partial,subscribe,churn`; all), `HOSTILE_LOAD_CHURN_PER_S` per churn
//! connection (50), `HOSTILE_LOAD_DRAIN_SECS` (15), `HOSTILE_LOAD_ATTACK_FROM`
//! (127.0.0.2; honest clients use 127.0.0.1), `HOSTILE_LOAD_BROKER_MAX_MIB` (1024, the
//! broker's address-space cap, so a broker that grows without bound fails alone
//! instead of taking the machine).

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "hostile_load/attack.rs"]
mod attack;
#[path = "hostile_load/honest.rs"]
mod honest;
#[path = "hostile_load/raw_ws.rs"]
mod raw_ws;
#[path = "hostile_load/report.rs"]
mod report;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use attack::Kind;
use common::NatsServer;
use common::amp::{Broker, http_get, open_config};
use honest::{Flags, Load, PairShare, clock};
use report::{Phase, Summary};

const NAMESPACE: &str = "acme";
const RAMP: Duration = Duration::from_secs(2);
const PROBE_EVERY: Duration = Duration::from_millis(250);

pub struct Sizes {
    pub secs: u64,
    pub pairs: usize,
    pub rate: u32,
    pub window: usize,
    pub body_bytes: usize,
    pub attackers: usize,
    pub kinds: Vec<Kind>,
    pub churn_per_s: u32,
    pub drain_secs: u64,
    pub attack_from: Ipv4Addr,
    pub broker_max_mib: u64,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

impl Sizes {
    fn full(args: &[String]) -> Sizes {
        let flag_secs = args
            .iter()
            .position(|a| a == "--secs")
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok());
        Sizes {
            secs: flag_secs.unwrap_or(env("HOSTILE_LOAD_SECS", 20u64)).max(1),
            pairs: env("HOSTILE_LOAD_PAIRS", 16usize).max(1),
            rate: env("HOSTILE_LOAD_RATE", 100u32).max(1),
            window: env("HOSTILE_LOAD_WINDOW", 16usize).max(1),
            body_bytes: env("HOSTILE_LOAD_BODY_BYTES", 256usize),
            attackers: env("HOSTILE_LOAD_ATTACKERS", 50usize),
            kinds: kinds_from_env(),
            churn_per_s: env("HOSTILE_LOAD_CHURN_PER_S", 50u32).max(1),
            drain_secs: env("HOSTILE_LOAD_DRAIN_SECS", 15u64),
            attack_from: env("HOSTILE_LOAD_ATTACK_FROM", Ipv4Addr::new(127, 0, 0, 2)),
            broker_max_mib: env("HOSTILE_LOAD_BROKER_MAX_MIB", 1024u64).max(64),
        }
    }

    fn smoke() -> Sizes {
        Sizes {
            secs: 2,
            pairs: 2,
            rate: 20,
            window: 4,
            body_bytes: 64,
            attackers: Kind::ALL.len(),
            kinds: Kind::ALL.to_vec(),
            churn_per_s: 5,
            drain_secs: 10,
            attack_from: Ipv4Addr::new(127, 0, 0, 2),
            broker_max_mib: 1024,
        }
    }
}

/// The kinds named in `HOSTILE_LOAD_KINDS` (unknown names are ignored), else all.
fn kinds_from_env() -> Vec<Kind> {
    let named = std::env::var("HOSTILE_LOAD_KINDS").unwrap_or_default();
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| named.split(',').any(|n| n.trim() == k.short()))
        .collect();
    if kinds.is_empty() {
        Kind::ALL.to_vec()
    } else {
        kinds
    }
}

impl Sizes {
    /// The `index`-th attacker's kind and its number among attackers of that kind.
    fn attacker(&self, index: usize) -> (Kind, usize) {
        let n = self.kinds.len().max(1);
        let kind = self
            .kinds
            .get(index % n)
            .copied()
            .unwrap_or(Kind::PingFlood);
        (kind, index / n)
    }
}

/// Watches the broker process: its VmRSS every 50 ms (peak per phase) and whether it
/// is still alive.
#[derive(Default)]
struct Watch {
    phase: AtomicUsize,
    peak_rss_kib: [AtomicU64; 3],
    died_at_ns: AtomicU64,
    stop: AtomicBool,
}

impl Watch {
    fn run(&self, pid: u32) {
        while !self.stop.load(Ordering::Relaxed) {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok();
            let alive = status.as_deref().is_some_and(|s| {
                report::status_field(s, "State:").is_some_and(|v| !v.starts_with('Z'))
            });
            if !alive {
                let _ = self.died_at_ns.compare_exchange(
                    0,
                    clock().max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
                return;
            }
            if let Some(rss) = status
                .as_deref()
                .and_then(|s| report::status_kib(s, "VmRSS:"))
            {
                let phase = self.phase.load(Ordering::Relaxed).min(2);
                self.peak_rss_kib[phase].fetch_max(rss, Ordering::Relaxed);
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn alive(&self) -> bool {
        self.died_at_ns.load(Ordering::Relaxed) == 0
    }
}

fn broker_hwm_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    report::status_kib(&status, "VmHWM:")
}

/// Caps the broker's address space, so that unbounded growth ends the broker (reported
/// as a crash) rather than pushing a shared machine into swap or the OOM killer.
fn cap_address_space(pid: u32, mib: u64) {
    let bytes = mib.saturating_mul(1 << 20);
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: prlimit on a child process this run started, with a live struct.
    let ret = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_AS,
            &limit,
            std::ptr::null_mut(),
        )
    };
    if ret != 0 {
        println!("warning: could not cap the broker's address space");
    }
}

/// A failed thread would leave the others waiting at a barrier: end the run instead,
/// with the servers it started.
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

fn run_phase(
    number: usize,
    attacked: bool,
    s: &Sizes,
    load: &Load,
    target: attack::Target,
    watch: &Watch,
    pids: [u32; 2],
) -> Phase {
    let pids = ["self".to_string(), pids[0].to_string(), pids[1].to_string()];
    let cpu = || pids.clone().map(|p| report::cpu_seconds(&p));
    let flags = Flags::default();
    flags.sending.store(true, Ordering::Relaxed);
    flags.receiving.store(true, Ordering::Relaxed);
    let shares: Vec<PairShare> = (0..s.pairs).map(|_| PairShare::default()).collect();
    let gates = [Barrier::new(2 * s.pairs + 1), Barrier::new(2 * s.pairs + 1)];
    let stop_attack = AtomicBool::new(false);
    let attack_stats: Vec<attack::Stats> =
        Kind::ALL.iter().map(|_| attack::Stats::default()).collect();
    let probe_waits = Mutex::new(Vec::new());
    let mut phase = Phase::default();

    thread::scope(|scope| {
        let senders: Vec<_> = (0..s.pairs)
            .map(|i| {
                let (flags, share, gates) = (&flags, &shares[i], [&gates[0], &gates[1]]);
                scope.spawn(move || honest::sender(load, number, i, gates, flags, share))
            })
            .collect();
        let receivers: Vec<_> = (0..s.pairs)
            .map(|i| {
                let (flags, share, gates) = (&flags, &shares[i], [&gates[0], &gates[1]]);
                scope.spawn(move || honest::receiver(load, number, i, gates, flags, share))
            })
            .collect();
        gates[0].wait();
        let attackers: Vec<_> = if attacked {
            let started: Vec<_> = (0..s.attackers)
                .map(|j| {
                    let (kind, index) = s.attacker(j);
                    let stats =
                        &attack_stats[Kind::ALL.iter().position(|k| *k == kind).unwrap_or(0)];
                    let stop = &stop_attack;
                    thread::Builder::new()
                        .stack_size(256 * 1024)
                        .spawn_scoped(scope, move || attack::run(kind, index, target, stop, stats))
                        .expect("spawn an attacker thread")
                })
                .collect();
            thread::sleep(RAMP);
            started
        } else {
            Vec::new()
        };
        let probe = scope.spawn(|| honest::probe(load, PROBE_EVERY, &flags, &probe_waits));
        gates[1].wait();
        let started = Instant::now();
        phase.start_ns = clock();
        let cpu_before = cpu();
        thread::sleep(Duration::from_secs(s.secs));
        flags.sending.store(false, Ordering::Relaxed);
        phase.end_ns = clock();
        let cpu_after = cpu();
        phase.cpu = [0, 1, 2].map(|k| cpu_after[k] - cpu_before[k]);
        phase.elapsed = started.elapsed();
        phase.peak_rss_kib = watch.peak_rss_kib[number].load(Ordering::Relaxed);
        // The drain runs without the attack: a message counts as lost only if it never
        // arrives once the broker is left alone.
        stop_attack.store(true, Ordering::Relaxed);
        for a in attackers {
            let _ = a.join();
        }
        let _ = probe.join();
        let drain_deadline = Instant::now() + Duration::from_secs(s.drain_secs);
        while flags.complete.load(Ordering::Relaxed) < s.pairs && Instant::now() < drain_deadline {
            thread::sleep(Duration::from_millis(20));
        }
        flags.receiving.store(false, Ordering::Relaxed);
        for h in senders {
            if let Ok(r) = h.join() {
                phase.add_sender(r);
            }
        }
        for h in receivers {
            if let Ok(r) = h.join() {
                phase.add_receiver(r);
            }
        }
    });
    phase.probe_waits = probe_waits.into_inner().unwrap_or_default();
    phase.attack = Kind::ALL
        .iter()
        .zip(&attack_stats)
        .map(|(kind, st)| {
            let count = (0..s.attackers)
                .filter(|&j| s.attacker(j).0 == *kind)
                .count();
            report::AttackRow::new(*kind, count, st)
        })
        .collect();
    phase
}

fn main() {
    clock();
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    let s = if full {
        Sizes::full(&args)
    } else {
        Sizes::smoke()
    };

    let mut names: Vec<String> = Vec::new();
    for phase in 1..=2 {
        for i in 0..s.pairs {
            names.push(honest::sender_name(phase, i));
            names.push(honest::receiver_name(phase, i));
        }
    }
    names.extend((0..s.attackers).filter_map(|j| {
        let (kind, index) = s.attacker(j);
        kind.participant(index)
    }));
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let config = open_config(&refs);

    let nats = NatsServer::start();
    let broker = Broker::start(&nats.url(), &config);
    let broker_pid = broker.pid().expect("broker pid");
    let nats_pid = nats.pid().expect("nats-server pid");
    exit_on_panic([broker_pid, nats_pid]);
    cap_address_space(broker_pid, s.broker_max_mib);

    let load = Load {
        broker: broker.addr,
        namespace: NAMESPACE,
        rate: s.rate,
        window: s.window,
        body_bytes: s.body_bytes,
    };
    let target = attack::Target {
        broker: broker.addr,
        source: s.attack_from,
        namespace: NAMESPACE,
        churn_per_s: s.churn_per_s,
    };
    let load_at_start = report::load_average();
    println!(
        "hostile_load{}: {} pairs x {} sends/s, {} in flight per sender, body {} B, {} s per \
         phase; {} attacking connections ({}) from {}; load average {} at start ({} CPUs); \
         amp-broker pid {broker_pid}, nats-server pid {nats_pid}",
        if full {
            ""
        } else {
            " (smoke run; `cargo bench --bench hostile_load` runs the full one)"
        },
        s.pairs,
        s.rate,
        s.window,
        s.body_bytes,
        s.secs,
        s.attackers,
        s.kinds
            .iter()
            .map(|k| k.short())
            .collect::<Vec<_>>()
            .join(","),
        s.attack_from,
        load_at_start,
        thread::available_parallelism().map_or(0, |n| n.get()),
    );

    let pids = [broker_pid, nats_pid];
    let watch = Watch::default();
    let summary = thread::scope(|scope| {
        scope.spawn(|| watch.run(broker_pid));
        watch.phase.store(1, Ordering::Relaxed);
        let mut quiet = run_phase(1, false, &s, &load, target, &watch, pids);
        quiet.hwm_kib = broker_hwm_kib(broker_pid);
        println!(
            "phase 1 (no attack) done; load average {}",
            report::load_average()
        );
        watch.phase.store(2, Ordering::Relaxed);
        let mut attacked = run_phase(2, true, &s, &load, target, &watch, pids);
        attacked.hwm_kib = broker_hwm_kib(broker_pid);
        println!(
            "phase 2 (attack) done; load average {}",
            report::load_average()
        );
        // Alive means the process is there and still answers /healthz.
        let healthy = watch.alive()
            && common::wait_until(Duration::from_secs(10), || {
                http_get(broker.addr, "/healthz").is_some_and(|(status, _)| status == 200)
            });
        let summary = Summary {
            phases: [quiet, attacked],
            alive: watch.alive() && healthy,
            died_at_ns: watch.died_at_ns.load(Ordering::Relaxed),
            final_hwm_kib: broker_hwm_kib(broker_pid),
            load_at_start,
            load_at_end: report::load_average(),
            own_hwm_kib: std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|st| report::status_kib(&st, "VmHWM:")),
            broker_max_mib: s.broker_max_mib,
        };
        watch.stop.store(true, Ordering::Relaxed);
        summary
    });
    let alive = summary.alive;
    summary.print();
    if !alive {
        println!("broker log (last lines):");
        let log = broker.log();
        let lines: Vec<&str> = log.lines().collect();
        for line in &lines[lines.len().saturating_sub(20)..] {
            println!("  {line}");
        }
    }
}
