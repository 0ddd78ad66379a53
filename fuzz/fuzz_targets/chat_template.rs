//! libFuzzer entry point; the body is [`ts_fuzz::chat_template`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ts_fuzz::chat_template(data));
