#![no_main]

#[path = "../ws_checks.rs"]
mod ws_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| ws_checks::check_amp_frame(data));
