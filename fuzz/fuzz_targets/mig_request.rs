#![no_main]

#[path = "../broker_checks.rs"]
mod broker_checks;
#[path = "../mig_checks.rs"]
mod mig_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mig_checks::check_mig(data);
});
