//! Replays the seed inputs (fuzz/seeds/{ws_stream,http_request,amp_frame}/*) and every
//! input those fuzzers found (fuzz/regressions/<target>/*) through the checks the fuzz
//! targets run, so `cargo test` covers them without a fuzzer.

#[path = "../fuzz/ws_checks.rs"]
mod ws_checks;

mod fuzz_replay;

use fuzz_replay::replay;
use std::path::Path;

#[test]
fn ws_stream_seeds_and_regressions_hold_whole_or_split() {
    assert!(replay("ws_stream", ws_checks::check_ws_stream) >= 8);
}

#[test]
fn http_request_seeds_and_regressions_hold() {
    assert!(replay("http_request", ws_checks::check_http_request) >= 9);
}

#[test]
fn amp_frame_seeds_and_regressions_hold() {
    assert!(replay("amp_frame", ws_checks::check_amp_frame) >= 7);
}

/// The seeds with every byte after the header flipped in turn: the cheap stand-in for a
/// fuzzing run in CI.
#[test]
fn ws_stream_and_http_seeds_with_each_byte_flipped_hold() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    for (target, check) in [
        ("ws_stream", ws_checks::check_ws_stream as fn(&[u8])),
        ("http_request", ws_checks::check_http_request),
    ] {
        for entry in std::fs::read_dir(root.join(target)).expect("seed directory") {
            let data = std::fs::read(entry.expect("entry").path()).expect("seed");
            for i in 2..data.len().min(400) {
                let mut mutated = data.clone();
                mutated[i] ^= 0xA5;
                check(&mutated);
            }
        }
    }
}
