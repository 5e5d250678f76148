//! Replays the NATS connection fuzz inputs (fuzz/seeds/nats_connection/* and every input
//! the fuzzer found, fuzz/regressions/nats_connection/*) through the check the
//! `nats_connection` fuzz target runs: the sans-IO client connection from a server's first
//! byte (INFO, TLS, credentials, server pool, reconnects, lame duck) on a virtual clock.

#[path = "../fuzz/nats_checks.rs"]
mod nats_checks;

mod fuzz_replay;

use std::path::Path;

fn seed(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds/nats_connection")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn nats_connection_seeds_and_regressions_hold() {
    assert!(fuzz_replay::replay("nats_connection", nats_checks::check_nats_connection) >= 7);
}

/// The seeds with every byte flipped in turn: the cheap stand-in for a fuzzing run in CI.
#[test]
fn nats_connection_seeds_with_each_byte_flipped_hold() {
    let runs = fuzz_replay::flipped_seeds("nats_connection", nats_checks::check_nats_connection);
    assert!(runs > 500, "{runs} flipped programs");
}

/// The harness reaches what it is for: a handshake, servers learned from an INFO, a
/// reconnect, a move off a server in lame duck mode, TLS.
#[test]
fn the_seeds_reach_handshakes_reconnects_and_discovered_servers() {
    let r = nats_checks::run(&seed("handshake-publish-request"));
    assert!(r.connected, "{r:?}");
    let r = nats_checks::run(&seed("reconnect-pool-lame-duck"));
    assert!(
        r.connected && r.reconnects >= 2 && r.discovered >= 1,
        "{r:?}"
    );
    for tls in ["tls-after-info", "tls-handshake-first"] {
        let r = nats_checks::run(&seed(tls));
        assert!(r.connected, "{tls}: {r:?}");
    }
}
