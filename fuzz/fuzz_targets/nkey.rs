#![no_main]

#[path = "../identity_checks.rs"]
mod identity_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| identity_checks::check_nkey(data));
