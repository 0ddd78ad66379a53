//! libFuzzer entry point; the body is [`ts_fuzz::server_request`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ts_fuzz::server_request(data));
