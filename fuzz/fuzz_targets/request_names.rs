#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| wasmtron_fuzz::request_names(data));
