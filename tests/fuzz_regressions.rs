//! Replays every input the fuzzers found (fuzz/regressions/<target>/*) and the seed inputs
//! (fuzz/seeds/<target>/*) through the same checks the fuzz targets run, so CI covers them
//! without a fuzzer. A target without findings has no regressions directory.

#[path = "../fuzz/checks.rs"]
mod checks;

mod fuzz_replay;

use fuzz_replay::replay;

#[test]
fn parser_seeds_and_regressions_hold() {
    assert!(replay("parser", checks::check_parser) >= 2);
}

#[test]
fn headers_seeds_and_regressions_hold() {
    assert!(replay("headers", checks::check_headers) >= 2);
}

#[test]
fn subject_seeds_and_regressions_hold() {
    assert!(replay("subject", checks::check_subject) >= 1);
}

#[test]
fn jetstream_reply_seeds_and_regressions_hold() {
    assert!(replay("jetstream_reply", checks::check_jetstream_reply) >= 6);
}

#[test]
fn roundtrip_seeds_and_regressions_hold() {
    assert!(replay("roundtrip", checks::check_roundtrip) >= 1);
}
