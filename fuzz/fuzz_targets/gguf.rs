//! libFuzzer entry point; the body is [`ts_fuzz::gguf`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ts_fuzz::gguf(data));
