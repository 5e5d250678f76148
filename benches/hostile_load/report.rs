//! Figures of a hostile-load run and the table that prints them with their targets.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::attack::{Kind, Stats};
use super::honest::{ReceiverResult, SenderResult};

/// Honest p99 under attack may be at most this many times the unattacked p99 ...
const P99_FACTOR: f64 = 3.0;
/// ... and never above this.
const P99_CEILING_MS: f64 = 250.0;
const PEAK_RSS_MIB: f64 = 64.0;

pub fn status_field<'a>(status: &'a str, field: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .map(str::trim)
}

/// A `kB` field of /proc/<pid>/status.
pub fn status_kib(status: &str, field: &str) -> Option<u64> {
    status_field(status, field)?
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// CPU seconds (user + system) of a process so far; `pid` may be "self".
pub fn cpu_seconds(pid: &str) -> f64 {
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

pub fn load_average() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

pub struct AttackRow {
    kind: Kind,
    connections: usize,
    sessions: u64,
    ended_by_broker: u64,
    refused: u64,
    bytes_sent: u64,
    first_refusal: Option<String>,
    first_close: Option<String>,
}

impl AttackRow {
    pub fn new(kind: Kind, connections: usize, stats: &Stats) -> AttackRow {
        AttackRow {
            kind,
            connections,
            sessions: stats.sessions.load(Ordering::Relaxed),
            ended_by_broker: stats.ended_by_broker.load(Ordering::Relaxed),
            refused: stats.refused.load(Ordering::Relaxed),
            bytes_sent: stats.bytes_sent.load(Ordering::Relaxed),
            first_refusal: stats.first_refusal.lock().ok().and_then(|f| f.clone()),
            first_close: stats.first_close.lock().ok().and_then(|f| f.clone()),
        }
    }
}

/// One phase's honest figures.
#[derive(Default)]
pub struct Phase {
    pub start_ns: u64,
    pub end_ns: u64,
    pub elapsed: Duration,
    /// CPU seconds of the bench, the broker and the nats-server during the phase.
    pub cpu: [f64; 3],
    sent: u64,
    confirmed: u64,
    confirmed_in_phase: u64,
    refused: u64,
    unconfirmed: u64,
    reconnects: u64,
    not_warmed_up: u64,
    /// Latencies (ns) of first deliveries, sorted at print time.
    latencies: Vec<u64>,
    delivered_in_phase: u64,
    lost: u64,
    confirmed_sets: Vec<Vec<u64>>,
    seen_sets: Vec<std::collections::HashSet<u64>>,
    pub probe_waits: Vec<u64>,
    pub peak_rss_kib: u64,
    pub hwm_kib: Option<u64>,
    pub attack: Vec<AttackRow>,
}

impl Phase {
    // Senders and receivers are added in pair order, so pair i is index i of both.
    pub fn add_sender(&mut self, r: SenderResult) {
        self.sent += r.sent;
        self.confirmed += r.confirmed.len() as u64;
        self.confirmed_in_phase += r.confirmed_in_phase;
        self.refused += r.refused;
        self.unconfirmed += r.unconfirmed;
        self.reconnects += r.reconnects;
        self.not_warmed_up += u64::from(!r.warmed_up);
        self.confirmed_sets.push(r.confirmed);
    }

    pub fn add_receiver(&mut self, r: ReceiverResult) {
        self.reconnects += r.reconnects;
        self.not_warmed_up += u64::from(!r.warmed_up);
        for (arrival, latency) in &r.deliveries {
            self.latencies.push(*latency);
            if *arrival <= self.end_ns {
                self.delivered_in_phase += 1;
            }
        }
        self.seen_sets.push(r.seen);
    }

    fn settle(&mut self) {
        self.latencies.sort_unstable();
        self.probe_waits.sort_unstable();
        self.lost = self
            .confirmed_sets
            .iter()
            .zip(&self.seen_sets)
            .map(|(confirmed, seen)| confirmed.iter().filter(|k| !seen.contains(k)).count() as u64)
            .sum();
        // A receiver that never reported lost everything of its pair.
        self.lost += self
            .confirmed_sets
            .iter()
            .skip(self.seen_sets.len())
            .map(|c| c.len() as u64)
            .sum::<u64>();
    }

    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `p` quantile in ms, or None without samples.
    fn quantile_ms(sorted: &[u64], p: f64) -> Option<f64> {
        let last = sorted.len().checked_sub(1)?;
        let i = ((sorted.len() as f64 * p) as usize).min(last);
        Some(sorted[i] as f64 / 1e6)
    }

    fn p99_ms(&self) -> Option<f64> {
        Phase::quantile_ms(&self.latencies, 0.99)
    }
}

pub struct Summary {
    pub phases: [Phase; 2],
    pub alive: bool,
    pub died_at_ns: u64,
    pub final_hwm_kib: Option<u64>,
    pub load_at_start: String,
    pub load_at_end: String,
    pub own_hwm_kib: Option<u64>,
    pub broker_max_mib: u64,
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or("-".to_string(), |v| format!("{v:.2}"))
}

fn verdict(ok: bool) -> &'static str {
    if ok { "MET" } else { "MISSED" }
}

impl Summary {
    pub fn print(mut self) {
        for p in &mut self.phases {
            p.settle();
        }
        let [q, a] = &self.phases;
        println!();
        println!(
            "{:<44} {:>14} {:>14}",
            "honest pairs", "1: no attack", "2: attack"
        );
        let row = |label: &str, f: &dyn Fn(&Phase) -> String| {
            println!("{label:<44} {:>14} {:>14}", f(q), f(a));
        };
        row("phase seconds", &|p| {
            format!("{:.1}", p.elapsed.as_secs_f64())
        });
        row("sends/s", &|p| format!("{:.0}", p.rate(p.sent)));
        row("confirmed (ok) msgs/s, in phase", &|p| {
            format!("{:.0}", p.rate(p.confirmed_in_phase))
        });
        row("delivered msgs/s, in phase", &|p| {
            format!("{:.0}", p.rate(p.delivered_in_phase))
        });
        for (label, quantile) in [
            ("latency p50 ms (send -> message)", 0.5),
            ("latency p99 ms", 0.99),
            ("latency p99.9 ms", 0.999),
            ("latency max ms", 1.0),
        ] {
            row(label, &|p| {
                fmt_ms(Phase::quantile_ms(&p.latencies, quantile))
            });
        }
        row("newcomer waits for challenge p50 ms", &|p| {
            fmt_ms(Phase::quantile_ms(&p.probe_waits, 0.5))
        });
        row("newcomer waits for challenge max ms", &|p| {
            fmt_ms(Phase::quantile_ms(&p.probe_waits, 1.0))
        });
        row("confirmed, never delivered (lost)", &|p| p.lost.to_string());
        row("sent, never confirmed by drain end", &|p| {
            p.unconfirmed.to_string()
        });
        row("sends refused with an error", &|p| p.refused.to_string());
        row("honest sessions replaced", &|p| p.reconnects.to_string());
        row("honest sessions without warm-up", &|p| {
            p.not_warmed_up.to_string()
        });
        row("CPU s bench / broker / nats, in phase", &|p| {
            format!("{:.0}/{:.0}/{:.0}", p.cpu[0], p.cpu[1], p.cpu[2])
        });
        row("broker VmRSS peak sampled MiB", &|p| {
            format!("{:.1}", mib(p.peak_rss_kib))
        });
        row("broker VmHWM at phase end MiB", &|p| {
            p.hwm_kib.map_or("-".into(), |k| format!("{:.1}", mib(k)))
        });

        println!();
        println!(
            "{:<30} {:>5} {:>10} {:>10} {:>10} {:>10}",
            "attack (phase 2)", "conns", "sessions", "ended", "refused", "MiB sent"
        );
        for r in a.attack.iter().filter(|r| r.connections > 0) {
            println!(
                "{:<30} {:>5} {:>10} {:>10} {:>10} {:>10.1}",
                r.kind.label(),
                r.connections,
                r.sessions,
                r.ended_by_broker,
                r.refused,
                r.bytes_sent as f64 / (1u64 << 20) as f64,
            );
        }
        println!(
            "(sessions: got as far as the attack; ended: by the broker; refused: connect, \
             upgrade or login failed)"
        );
        for r in &a.attack {
            for (what, text) in [("refused", &r.first_refusal), ("closed", &r.first_close)] {
                if let Some(text) = text {
                    println!("  {} first {what}: {text}", r.kind.short());
                }
            }
        }

        println!();
        let (qp99, ap99) = (q.p99_ms(), a.p99_ms());
        let bound = qp99.map(|v| v * P99_FACTOR);
        println!(
            "honest p99 under attack {} ms <= {P99_FACTOR}x unattacked p99 ({} ms): {}",
            fmt_ms(ap99),
            fmt_ms(bound),
            verdict(matches!((ap99, bound), (Some(x), Some(b)) if x <= b))
        );
        println!(
            "honest p99 under attack {} ms <= {P99_CEILING_MS} ms: {}",
            fmt_ms(ap99),
            verdict(ap99.is_some_and(|x| x <= P99_CEILING_MS))
        );
        let peak = self
            .final_hwm_kib
            .unwrap_or(0)
            .max(a.peak_rss_kib)
            .max(q.peak_rss_kib);
        println!(
            "broker peak RSS (VmHWM, else sampled VmRSS) {:.1} MiB <= {PEAK_RSS_MIB} MiB: {}",
            mib(peak),
            verdict(self.alive && mib(peak) <= PEAK_RSS_MIB)
        );
        let death = if self.alive {
            String::new()
        } else if self.died_at_ns > 0 {
            let when = |ns: u64| ns as f64 / 1e9;
            format!(
                " (process gone {:.1} s into phase 2; address space capped at {} MiB)",
                when(self.died_at_ns.saturating_sub(a.start_ns)),
                self.broker_max_mib
            )
        } else {
            " (/healthz did not answer 200)".to_string()
        };
        println!(
            "broker alive at the end (process and /healthz){death}: {}",
            verdict(self.alive)
        );
        let lost = q.lost + a.lost;
        println!(
            "no confirmed honest message lost ({lost} lost): {}",
            verdict(lost == 0)
        );
        println!(
            "load average {} at start, {} at end; bench VmHWM {:.1} MiB",
            self.load_at_start,
            self.load_at_end,
            mib(self.own_hwm_kib.unwrap_or(0))
        );
    }
}
