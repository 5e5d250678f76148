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
fn ws_stream_inputs_as_programs_of_a_never_reading_peer_keep_output_within_its_bound() {
    assert!(replay("ws_stream", ws_checks::check_ws_never_read) >= 8);
}

/// A few programs built by hand: ping floods, huge texts, fragments, replies and time.
#[test]
fn hand_written_never_reading_programs_keep_output_within_its_bound() {
    let ping_flood: Vec<u8> = (0..4000).flat_map(|_| [0u8, 125]).collect();
    let mut mixed = vec![0u8, 10, 2, 200, 0, 125, 3, 255, 6, 255, 5, 100, 4, 1, 7, 50];
    mixed.extend((0..500).flat_map(|i| [(i % 8) as u8, (i * 31 % 256) as u8]));
    let replies: Vec<u8> = (0..300).flat_map(|_| [6u8, 255, 0, 125]).collect();
    for (a, b) in [(0u8, 0u8), (255, 255), (7, 31), (200, 3)] {
        for body in [&ping_flood, &mixed, &replies] {
            for seed in [0u8, 1, 77] {
                let mut data = vec![a, b, seed];
                data.extend_from_slice(body);
                ws_checks::check_ws_never_read(&data);
            }
        }
    }
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
