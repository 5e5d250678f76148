#![no_main]

#[path = "../broker_checks.rs"]
mod broker_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    broker_checks::check_broker(data);
});
