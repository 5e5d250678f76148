//! Replays the MIG request fuzz inputs (fuzz/seeds/mig_request/* and every input the fuzzer
//! found, fuzz/regressions/mig_request/*) through the check the `mig_request` fuzz target
//! runs: requests with arbitrary subjects, headers and bodies and arbitrary JetStream
//! answers, no panic, every answer to a caller JSON within `max_payload`.

#[path = "../fuzz/broker_checks.rs"]
mod broker_checks;
#[path = "../fuzz/mig_checks.rs"]
mod mig_checks;

mod fuzz_replay;

#[test]
fn mig_request_seeds_and_regressions_hold() {
    assert!(fuzz_replay::replay("mig_request", mig_checks::check_mig) >= 5);
}

/// The seeds with every byte flipped in turn: the cheap stand-in for a fuzzing run in CI.
#[test]
fn mig_request_seeds_with_each_byte_flipped_hold() {
    let runs = fuzz_replay::flipped_seeds("mig_request", mig_checks::check_mig);
    assert!(runs > 50, "{runs} flipped programs");
}

/// The harness reaches past authentication: Alice's hello, discover and heartbeat are
/// answered with success envelopes.
#[test]
fn canned_requests_are_answered() {
    let seed = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/seeds/mig_request/hello-discover-heartbeat"
    ))
    .expect("seed");
    let answers = mig_checks::run(&seed);
    assert_eq!(answers.len(), 3, "{answers:?}");
    for a in &answers {
        assert!(a.get("error").is_none_or(|e| e.is_null()), "{a}");
    }
}

/// With the JetStream model, Ann's signed PUBLISH is stored and Alice's SUBSCRIBE replays it.
#[test]
fn a_signed_publish_and_a_subscribe_reach_jetstream() {
    let seed = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/seeds/mig_request/model-publish-subscribe-cancel"
    ))
    .expect("seed");
    let answers = mig_checks::run(&seed);
    assert_eq!(answers.len(), 3, "{answers:#?}");
    assert_eq!(answers[0]["accepted"], true, "the publish: {}", answers[0]);
    assert_eq!(
        answers[1]["events"][0]["topic"], "orders.eu",
        "the subscribe replays the publish: {}",
        answers[1]
    );
}
