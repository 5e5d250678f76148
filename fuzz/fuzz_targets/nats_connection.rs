#![no_main]

#[path = "../nats_checks.rs"]
mod nats_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    nats_checks::check_nats_connection(data);
});
