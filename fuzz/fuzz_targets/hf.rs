//! libFuzzer entry point; the body is [`ts_fuzz::hf`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ts_fuzz::hf(data));
