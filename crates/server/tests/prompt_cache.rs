//! The prompt cache end to end on the CPU (engine.rs, "Prompt cache"): a conversation's next
//! turn, a repeated request and an unrelated one, each answered with the same text as by a
//! server that computes every prompt in full, with `usage.prompt_tokens_details.cached_tokens`
//! saying what was reused. SmolLM2 (llama: K/V rows) through the chat endpoint, and a random
//! tiny DeepSeek-V2 (MLA: one latent row a token) through token-id prompts.

mod common;

use common::*;
use serde_json::{json, Value};
use ts_server::{Server, ServerConfig};

/// Sends each request in turn (greedy); each answer's text and cached prompt tokens. A request
/// `{"next_turn": true, ...}` is a chat whose messages are the last chat's, its answer, then
/// the given message.
async fn conversation(s: &Server, requests: &[Value]) -> Answers {
    let addr = s.addr();
    let mut out = Vec::new();
    let mut last_msgs: Vec<Value> = Vec::new();
    for r in requests {
        let mut r = r.clone();
        let chat = r.get("messages").is_some();
        if r.get("next_turn").and_then(Value::as_bool) == Some(true) {
            let o = r.as_object_mut().expect("object");
            o.remove("next_turn");
            let mut msgs = last_msgs.clone();
            msgs.push(json!({"role": "assistant", "content": out.last().map(|(t, _): &(String, u64)| t.clone()).unwrap_or_default()}));
            msgs.extend(o["messages"].as_array().expect("messages").iter().cloned());
            o.insert("messages".into(), Value::Array(msgs));
        }
        if chat {
            last_msgs = r["messages"].as_array().expect("messages").clone();
        }
        r["model"] = json!(s.model_id());
        r["temperature"] = json!(0);
        let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
        let (st, v) = post(addr, path, &r).await;
        assert_eq!(st, 200, "{v}");
        let text = if chat { v["choices"][0]["message"]["content"].as_str() } else { v["choices"][0]["text"].as_str() };
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage.prompt_tokens_details.cached_tokens");
        assert!(cached < v["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens"), "{v}");
        out.push((text.expect("text").to_string(), cached));
    }
    out
}

/// Each answer's text and cached prompt tokens.
type Answers = Vec<(String, u64)>;

/// The requests on a server with the prompt cache, then on one without.
fn both(start: impl Fn(bool) -> Server, requests: &[Value]) -> (Answers, Answers) {
    let run = |cache: bool| {
        let s = start(cache);
        let r = rt().block_on(conversation(&s, requests));
        s.shutdown().expect("shutdown");
        r
    };
    (run(true), run(false))
}

#[test]
fn chat_turns_reuse_the_conversation_so_far() {
    let cfg = |cache: bool| ServerConfig { prefill_chunk: 32, prompt_cache: cache, ..ServerConfig::default() };
    let requests = [
        json!({"messages": [{"role": "user", "content": "Name three colours of the rainbow."}], "max_tokens": 12}),
        json!({"next_turn": true, "messages": [{"role": "user", "content": "And two more?"}], "max_tokens": 12}),
        json!({"messages": [{"role": "user", "content": "Name three colours of the rainbow."}], "max_tokens": 12}),
        json!({"prompt": "Once upon a time", "max_tokens": 8}),
    ];
    let (with, without) = both(|c| start(2, 512, cfg(c)), &requests);
    for (k, (a, b)) in with.iter().zip(&without).enumerate() {
        assert_eq!(a.0, b.0, "request {k}: the same text with the prompt cache as without");
        assert_eq!(b.1, 0, "request {k}: nothing cached without the cache");
    }
    assert_eq!(with[0].1, 0);
    assert!(with[1].1 > 20, "the next turn reuses the first turn's prompt and answer: {}", with[1].1);
    assert!(with[2].1 > 10, "a repeated request reuses its prompt: {}", with[2].1);
}

#[test]
fn mla_rows_are_reused_too() {
    let path = std::env::temp_dir().join(format!("ts-prompt-cache-{}.gguf", std::process::id()));
    ts_models::synth::synth(ts_models::synth::Preset::Tiny, ts_formats::GgmlType::Q8_0, 7, &path, ts_models::synth::SynthFormat::Gguf)
        .expect("synth");
    let cfg = |cache: bool| ServerConfig { prefill_chunk: 16, prompt_cache: cache, row_multiple: 1, ..ServerConfig::default() };
    let p: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 200).collect();
    let mut p2 = p.clone();
    p2.extend([9, 8, 7]);
    let requests = [
        json!({"prompt": p, "max_tokens": 6}),
        json!({"prompt": p, "max_tokens": 6}),
        json!({"prompt": p2, "max_tokens": 6}),
        json!({"prompt": [1, 2, 3, 4], "max_tokens": 6}),
    ];
    let (with, without) = both(|c| start_file(&path, 2, 256, cfg(c)), &requests);
    let _ = std::fs::remove_file(&path);
    for (k, (a, b)) in with.iter().zip(&without).enumerate() {
        assert_eq!(a.0, b.0, "request {k}: the same text with the prompt cache as without");
    }
    let cached: Vec<u64> = with.iter().map(|r| r.1).collect();
    assert_eq!(cached, [0, 39, 40, 0], "what each request found in its slot");
}
