//! libFuzzer entry point; the body is [`ts_fuzz::tokenizer`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ts_fuzz::tokenizer(data));
