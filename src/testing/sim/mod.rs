//! A deterministic simulator of the whole broker: 1-3 broker cores, 2-50 AMP clients and
//! the in-process NATS/JetStream model on one virtual clock, everything decided by one
//! seed. Faults (NATS drops, lost and late replies, broker crashes, server restarts,
//! wall clock steps, vanishing and slow clients) are injected as the run goes; the
//! [invariants] are checked after every step and at the end.
//!
//! ```no_run
//! use amp_broker::testing::sim::{SimConfig, run};
//! let outcome = run(SimConfig::new(0x1234).steps(400));
//! assert!(outcome.is_ok(), "{}", outcome.unwrap_err());
//! ```
//!
//! A run is a pure function of its [`SimConfig`]: the same seed gives the same trace
//! ([`Report::trace`]), so a failure replays exactly with the command it prints.

mod clients;
mod faults;
pub mod invariants;
mod rng;
mod world;

use std::fmt;
use std::time::Duration;

pub use rng::SimRng;
pub use world::{Stats, World};

/// The newest generation of the simulated world (see [`SimConfig::generation`]).
pub const GENERATION: u32 = 3;

/// What one run does.
#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    pub seed: u64,
    /// Steps with faults and random client actions, before the drain.
    pub steps: u64,
    /// Broker cores (1-3 when `None`, chosen by the seed).
    pub brokers: Option<usize>,
    /// Clients (2-12 when `None`, chosen by the seed).
    pub clients: Option<usize>,
    pub faults: bool,
    /// Chance of a fault per step, per mille.
    pub fault_per_mille: u64,
    /// Prints every frame, close and fault to stderr (for investigating a seed).
    pub trace: bool,
    /// What the simulated world includes, by the simulator's generation: 1 as first
    /// built; 2 adds task budgets for p0 and p1 and clients whose reconnect overlaps an
    /// old session the transport has not closed yet; 3 adds `watch`, with an outbound
    /// bound small enough that its snapshot comes in bursts. A seed found in one
    /// generation replays exactly only in it.
    pub generation: u32,
}

impl SimConfig {
    pub fn new(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            steps: 300,
            brokers: None,
            clients: None,
            faults: true,
            fault_per_mille: 15,
            trace: false,
            generation: GENERATION,
        }
    }

    pub fn steps(mut self, steps: u64) -> SimConfig {
        self.steps = steps;
        self
    }

    pub fn brokers(mut self, n: usize) -> SimConfig {
        self.brokers = Some(n.clamp(1, 3));
        self
    }

    pub fn clients(mut self, n: usize) -> SimConfig {
        self.clients = Some(n.clamp(2, 50));
        self
    }

    pub fn faults(mut self, on: bool) -> SimConfig {
        self.faults = on;
        self
    }

    /// The command that replays this run exactly.
    pub fn replay_command(&self) -> String {
        let mut cmd = format!(
            "cargo run --release --example simulate -- --seed {:#x} --steps {}",
            self.seed, self.steps
        );
        if let Some(b) = self.brokers {
            cmd.push_str(&format!(" --brokers {b}"));
        }
        if let Some(c) = self.clients {
            cmd.push_str(&format!(" --clients {c}"));
        }
        if self.generation != GENERATION {
            cmd.push_str(&format!(" --generation {}", self.generation));
        }
        if !self.faults {
            cmd.push_str(" --no-faults");
        } else if self.fault_per_mille != 15 {
            cmd.push_str(&format!(" --fault-rate {}", self.fault_per_mille));
        }
        cmd
    }
}

/// What a run did.
#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    /// Steps taken, drain included.
    pub steps: u64,
    pub brokers: usize,
    pub clients: usize,
    pub virtual_ms: u64,
    /// A hash of every frame and fault: equal for equal configurations.
    pub trace: u64,
    pub stats: Stats,
    pub counts: invariants::Counts,
}

/// A run that broke an invariant.
#[derive(Debug, Clone)]
pub struct Failure {
    pub config: SimConfig,
    pub step: u64,
    pub virtual_ms: u64,
    pub violations: Vec<String>,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation seed {:#x} failed at step {} ({} ms virtual):",
            self.config.seed, self.step, self.virtual_ms
        )?;
        for v in &self.violations {
            writeln!(f, "  - {v}")?;
        }
        write!(f, "replay: {}", self.config.replay_command())
    }
}

/// The drain after the faulty part: long enough for requests to time out (4 s), inbox
/// acks to time out (5 s), leases to run out (3 s) and every task to spend its attempts
/// (3 x (1 s offer + 3 s lease)), with room for reconnects.
const DRAIN: Duration = Duration::from_secs(30);
/// Quiet time after every client left, before the brokers' footprint is checked.
const QUIET: Duration = Duration::from_secs(10);

/// Runs one simulation.
pub fn run(cfg: SimConfig) -> Result<Report, Failure> {
    let mut w = World::new(cfg);
    let fail = |w: &World| Failure {
        config: cfg,
        step: w.step,
        virtual_ms: w.elapsed_ms(),
        violations: w.checker.violations.clone(),
    };
    for _ in 0..cfg.steps {
        w.step(Duration::from_secs(2));
        if !w.checker.violations.is_empty() {
            return Err(fail(&w));
        }
    }
    // Drain: no more faults; everyone online, acking and finishing work.
    w.heal();
    w.draining = true;
    for c in &mut w.clients {
        c.slow = false;
    }
    let until = w.now + DRAIN;
    while w.now < until {
        w.step(Duration::from_millis(500));
        if !w.checker.violations.is_empty() {
            return Err(fail(&w));
        }
    }
    w.checker.check_inbox();
    let submitted: Vec<(String, String)> = w
        .clients
        .iter()
        .flat_map(|c| c.submitted.iter().map(|t| (c.name.clone(), t.clone())))
        .collect();
    let store = w.server.stream_messages("KV_AMP_TASK_STATE");
    let inbox = w.server.stream_messages("AMP_INBOX_dev");
    let budgets: Vec<(String, u64)> = world::BUDGETED
        .iter()
        .filter(|_| cfg.generation >= 2)
        .map(|name| (format!("{}/{name}", world::NS), world::TASK_BUDGET))
        .collect();
    w.checker.check_tasks(&store, &inbox, &submitted, &budgets);
    if !w.checker.violations.is_empty() {
        return Err(fail(&w));
    }
    // Everyone leaves; after a quiet minute nothing of theirs is held.
    w.leaving = true;
    for c in &mut w.clients {
        c.next_at = w.now;
    }
    let until = w.now + QUIET;
    while w.now < until {
        w.step(Duration::from_secs(2));
    }
    for (i, n) in w.nodes.iter().enumerate() {
        let f = n.broker.footprint();
        if f.sessions != 0
            || f.present_participants != 0
            || f.held_submits != 0
            || f.topic_requests != 0
            || f.presence_snapshots != 0
            || f.registry_sections != 0
            || f.offer_watches != 0
        {
            w.checker.violation(format!(
                "broker {i} still holds state after everyone left: {f:?}"
            ));
        }
    }
    if !w.checker.violations.is_empty() {
        return Err(fail(&w));
    }
    Ok(Report {
        seed: cfg.seed,
        steps: w.step,
        brokers: w.nodes.len(),
        clients: w.clients.len(),
        virtual_ms: w.elapsed_ms(),
        trace: w.trace,
        stats: w.stats,
        counts: w.checker.counts,
    })
}
