//! Replays the whole-broker fuzz inputs (fuzz/seeds/broker/* and every input the fuzzer
//! found, fuzz/regressions/broker/*) through the check the `broker` fuzz target runs:
//! the core with WebSocket sessions and its NATS connection fed arbitrary bytes on a
//! virtual clock, no panic, bounded queues.

#[path = "../fuzz/broker_checks.rs"]
mod broker_checks;

mod fuzz_replay;

#[test]
fn broker_seeds_and_regressions_hold() {
    assert!(fuzz_replay::replay("broker", broker_checks::check_broker) >= 5);
}

/// The seeds with every byte flipped in turn: the cheap stand-in for a fuzzing run in CI.
#[test]
fn broker_seeds_with_each_byte_flipped_hold() {
    let runs = fuzz_replay::flipped_seeds("broker", broker_checks::check_broker);
    assert!(runs > 100, "{runs} flipped programs");
}

/// The harness reaches what it is for: logged-in sessions, stored sends and deliveries.
#[test]
fn a_canned_program_logs_in_and_has_a_send_stored() {
    let seed = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/seeds/broker/login-send-ack"
    ))
    .expect("seed");
    let sent = broker_checks::run(&seed);
    for want in ["0:challenge", "1:challenge", "0:ok", "1:ok"] {
        assert!(sent.iter().any(|s| s == want), "no {want} in {sent:?}");
    }
    assert!(
        sent.iter().filter(|s| *s == "0:ok").count() >= 2,
        "hello and the stored send answered ok: {sent:?}"
    );
}

/// Op 9 hands the NATS connection to the JetStream model: a send is stored and pulled to
/// its receiver, a publish reaches a topic subscriber, a submitted task is offered.
#[test]
fn a_program_with_the_jetstream_model_reaches_deliveries_events_and_offers() {
    let seed = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fuzz/seeds/broker/jetstream-model-deliveries"
    ))
    .expect("seed");
    let sent = broker_checks::run(&seed);
    for want in ["1:message", "1:event", "0:offer"] {
        assert!(sent.iter().any(|s| s == want), "no {want} in {sent:?}");
    }
}
