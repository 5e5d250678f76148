#![no_main]

#[path = "../ws_checks.rs"]
mod ws_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ws_checks::check_ws_stream(data);
    ws_checks::check_ws_never_read(data);
});
