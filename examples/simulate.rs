//! The deterministic simulator from the command line: many seeds (a soak) or one seed
//! (a replay).
//!
//!     cargo run --release --example simulate -- --seeds 1000
//!     cargo run --release --example simulate -- --seed 0x1234 --steps 400
//!
//! Options: `--seeds N` (seeds `--first` .. `--first + N`, default first 1), `--seed S`
//! (one seed, decimal or 0x hex), `--steps K` (steps before the drain, default 300),
//! `--brokers B`, `--clients C`, `--no-faults`, `--generation G` (the world of an older simulator, to replay a seed found in it), `--fault-rate R` (faults per 1000 steps, default 15), `--verbose` (one line per seed), `--trace` (every frame
//! and fault to stderr).
//! Prints steps/s and every failure with the command that replays it; exits 1 on any.

use std::process::ExitCode;
use std::time::Instant;

use amp_broker::testing::sim::{SimConfig, run};

fn number(s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("not a number: {s} ({e})"))
}

fn main() -> ExitCode {
    match main_inner() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("simulate: {e}");
            ExitCode::from(2)
        }
    }
}

fn main_inner() -> Result<bool, String> {
    let mut args = std::env::args().skip(1);
    let (mut seeds, mut first, mut one) = (100u64, 1u64, None);
    let mut steps = 300u64;
    let (mut brokers, mut clients, mut faults, mut verbose) = (None, None, true, false);
    let mut generation = amp_broker::testing::sim::GENERATION;
    let mut trace = false;
    let mut fault_rate = None;
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--seeds" => seeds = number(&value()?)?,
            "--first" => first = number(&value()?)?,
            "--seed" => one = Some(number(&value()?)?),
            "--steps" => steps = number(&value()?)?,
            "--brokers" => brokers = Some(number(&value()?)? as usize),
            "--clients" => clients = Some(number(&value()?)? as usize),
            "--no-faults" => faults = false,
            "--generation" => generation = number(&value()?)? as u32,
            "--verbose" => verbose = true,
            "--trace" => trace = true,
            "--fault-rate" => fault_rate = Some(number(&value()?)?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let list: Vec<u64> = match one {
        Some(s) => vec![s],
        None => (first..first + seeds).collect(),
    };
    let started = Instant::now();
    let (mut total_steps, mut failures, mut virtual_ms) = (0u64, 0u64, 0u64);
    for seed in &list {
        let mut cfg = SimConfig::new(*seed).steps(steps).faults(faults);
        cfg.generation = generation;
        cfg.trace = trace;
        if let Some(r) = fault_rate {
            cfg.fault_per_mille = r;
        }
        if let Some(b) = brokers {
            cfg = cfg.brokers(b);
        }
        if let Some(c) = clients {
            cfg = cfg.clients(c);
        }
        let t = Instant::now();
        match run(cfg) {
            Ok(r) => {
                total_steps += r.steps;
                virtual_ms += r.virtual_ms;
                if verbose || one.is_some() {
                    println!(
                        "seed {seed:#x}: ok, {} steps, {} brokers, {} clients, {:.1} s virtual, {:.0} ms, trace {:016x}; {:?}; {:?}",
                        r.steps,
                        r.brokers,
                        r.clients,
                        r.virtual_ms as f64 / 1000.0,
                        t.elapsed().as_secs_f64() * 1000.0,
                        r.trace,
                        r.stats,
                        r.counts
                    );
                }
            }
            Err(f) => {
                failures += 1;
                total_steps += f.step;
                println!("{f}");
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{} seeds, {failures} failed, {total_steps} steps in {secs:.2} s: {:.0} steps/s, {:.1} seeds/s, {:.0} virtual s simulated",
        list.len(),
        total_steps as f64 / secs,
        list.len() as f64 / secs,
        virtual_ms as f64 / 1000.0
    );
    Ok(failures == 0)
}
