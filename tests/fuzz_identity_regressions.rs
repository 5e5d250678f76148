//! Replays the seed inputs (fuzz/seeds/{jwt,nkey}/*) and every input the identity fuzzers
//! found (fuzz/regressions/{jwt,nkey}/*) through the checks the fuzz targets run, so
//! `cargo test` covers them without a fuzzer.

#[path = "../fuzz/identity_checks.rs"]
mod identity_checks;

mod fuzz_replay;

use fuzz_replay::replay;

#[test]
fn jwt_seeds_and_regressions_hold() {
    assert!(replay("jwt", identity_checks::check_jwt) >= 6);
}

#[test]
fn nkey_seeds_and_regressions_hold() {
    assert!(replay("nkey", identity_checks::check_nkey) >= 4);
}
