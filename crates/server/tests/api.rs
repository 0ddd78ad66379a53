//! The OpenAI surface against the real default model (SmolLM2, CPU): chat and completions,
//! whole and streamed, stop strings, logprobs, seeds, every error class, models/health/metrics.
//! One server is shared by the tests of this file (they only talk HTTP to it).

mod common;

use std::sync::OnceLock;

use common::*;
use serde_json::{json, Value};
use ts_server::{Server, ServerConfig};

const CTX: usize = 512;
const MAX_BODY: usize = 64 << 10;

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| start(4, CTX, ServerConfig { max_queue: 64, prefill_chunk: 64, max_body_bytes: MAX_BODY, ..ServerConfig::default() }))
}

fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream must end with [DONE]: {events:?}");
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("bad chunk {e}: {err}"))).collect()
}

fn check_usage(u: &Value) -> (u64, u64) {
    let p = u["prompt_tokens"].as_u64().expect("prompt_tokens");
    let c = u["completion_tokens"].as_u64().expect("completion_tokens");
    assert_eq!(u["total_tokens"].as_u64(), Some(p + c));
    assert!(p > 0);
    let cached = u["prompt_tokens_details"]["cached_tokens"].as_u64().expect("prompt_tokens_details.cached_tokens");
    assert!(cached < p, "at least the prompt's last token is computed: {u}");
    (p, c)
}

#[test]
fn chat_whole_and_streamed_agree() {
    let s = server();
    let addr = s.addr();
    rt().block_on(async {
        let req = json!({
            "model": s.model_id(),
            "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0
        });
        let (st, v) = post(addr, "/v1/chat/completions", &req).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["object"], "chat.completion");
        assert!(v["id"].as_str().is_some_and(|i| i.starts_with("chatcmpl-")));
        assert_eq!(v["model"], s.model_id());
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["index"], 0);
        // (The answer itself is the model's business: its first token is a near tie between
        // "The" and "L'…", which kernel rounding can flip. The protocol is what is checked.)
        let text = text_of(&v);
        assert!(!text.trim().is_empty(), "{v}");
        let fin = v["choices"][0]["finish_reason"].as_str().expect("finish_reason").to_string();
        assert!(fin == "stop" || fin == "length");
        let (_, n) = check_usage(&v["usage"]);
        assert!((1..=24).contains(&n));
        if fin == "length" {
            assert_eq!(n, 24);
        }

        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        sreq["stream_options"] = json!({"include_usage": true});
        let (st, ev) = stream(addr, "/v1/chat/completions", &sreq).await;
        assert_eq!(st, 200);
        let cs = chunks(&ev);
        assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
        let id = cs[0]["id"].clone();
        let mut streamed = String::new();
        let mut finish = None;
        for c in &cs {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert_eq!(c["id"], id);
            if let Some(ch) = c["choices"].as_array().and_then(|a| a.first()) {
                if let Some(t) = ch["delta"]["content"].as_str() {
                    streamed.push_str(t);
                }
                if let Some(f) = ch["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            }
        }
        assert_eq!(streamed, text, "streamed and whole texts differ");
        assert_eq!(finish.as_deref(), Some(fin.as_str()));
        let last = cs.last().expect("usage chunk");
        assert_eq!(last["choices"].as_array().map(Vec::len), Some(0));
        // (The same counts; the second request may find its prompt in the slot's cache, which
        // `prompt_tokens_details.cached_tokens` reports.)
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(last["usage"][k], v["usage"][k], "{k}");
        }
    });
}

#[test]
fn completions_whole_and_streamed_agree() {
    let addr = server().addr();
    rt().block_on(async {
        let req = json!({"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
        let (st, v) = post(addr, "/v1/completions", &req).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["object"], "text_completion");
        assert!(v["id"].as_str().is_some_and(|i| i.starts_with("cmpl-")));
        let text = text_of(&v);
        assert!(text.contains("Paris"), "{text}");
        let fin = v["choices"][0]["finish_reason"].as_str().expect("finish").to_string();
        let (p, n) = check_usage(&v["usage"]);
        assert!(p >= 5);
        if fin == "length" {
            assert_eq!(n, 12);
        }
        // Without stream_options there is no usage chunk, and no "usage" key in chunks.
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        let (st, ev) = stream(addr, "/v1/completions", &sreq).await;
        assert_eq!(st, 200);
        let cs = chunks(&ev);
        let mut streamed = String::new();
        for c in &cs {
            assert_eq!(c["object"], "text_completion");
            assert!(c.get("usage").is_none());
            streamed.push_str(c["choices"][0]["text"].as_str().expect("text"));
        }
        assert_eq!(streamed, text);
        assert_eq!(cs.last().expect("last")["choices"][0]["finish_reason"].as_str(), Some(fin.as_str()));
        // Token-id prompts are accepted too.
        let (st, v) =
            post(addr, "/v1/completions", &json!({"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], 5);
    });
}

#[test]
fn stop_strings_cut_before_and_never_stream() {
    let addr = server().addr();
    rt().block_on(async {
        let base = json!({"prompt": "Once upon a time, in a small village,", "max_tokens": 40, "temperature": 0});
        let (st, v) = post(addr, "/v1/completions", &base).await;
        assert_eq!(st, 200, "{v}");
        let full = text_of(&v);
        // A stop string from the middle of the greedy text: the answer must be what precedes it.
        let chars: Vec<char> = full.chars().collect();
        assert!(chars.len() > 20, "{full:?}");
        let mid = chars.len() / 2;
        let stop: String = chars[mid..mid + 4].iter().collect();
        let want: String = full[..full.find(&stop).expect("stop occurs")].to_string();
        for body in [
            {
                let mut b = base.clone();
                b["stop"] = json!(stop);
                b
            },
            {
                let mut b = base.clone();
                b["stop"] = json!(["never-appears-ZZZ", stop]);
                b
            },
        ] {
            let (st, v) = post(addr, "/v1/completions", &body).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(text_of(&v), want, "stop {stop:?}");
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            let mut sb = body.clone();
            sb["stream"] = json!(true);
            let (_, ev) = stream(addr, "/v1/completions", &sb).await;
            let cs = chunks(&ev);
            let pieces: Vec<String> = cs.iter().map(|c| c["choices"][0]["text"].as_str().unwrap_or("").to_string()).collect();
            assert_eq!(pieces.concat(), want);
            // No streamed piece may even begin the stop string past the released text.
            assert!(!pieces.concat().contains(&stop));
            assert_eq!(cs.last().expect("last")["choices"][0]["finish_reason"], "stop");
        }
        // Chat: a stop word taken from the greedy answer.
        let mut chat = json!({
            "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Describe Paris in two sentences."}],
            "max_tokens": 32,
            "temperature": 0
        });
        let (st, v) = post(addr, "/v1/chat/completions", &chat).await;
        assert_eq!(st, 200, "{v}");
        let full = text_of(&v);
        let words: Vec<&str> = full.split_whitespace().collect();
        assert!(words.len() >= 4, "{full:?}");
        let stop = words[words.len() / 2];
        let want = &full[..full.find(stop).expect("stop occurs")];
        chat["stop"] = json!([stop]);
        let (st, v) = post(addr, "/v1/chat/completions", &chat).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(text_of(&v), want, "stop {stop:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    });
}

#[test]
fn logprobs_seed_and_penalties() {
    let addr = server().addr();
    rt().block_on(async {
        let req = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 3});
        let (st, v) = post(addr, "/v1/chat/completions", &req).await;
        assert_eq!(st, 200, "{v}");
        let content = v["choices"][0]["logprobs"]["content"].as_array().expect("logprobs.content");
        assert!(!content.is_empty());
        for e in content {
            let lp = e["logprob"].as_f64().expect("logprob");
            assert!(lp <= 0.0);
            let top = e["top_logprobs"].as_array().expect("top_logprobs");
            assert_eq!(top.len(), 3);
            // Greedy: the chosen token is the most likely one.
            assert_eq!(top[0]["token"], e["token"]);
            assert!(e["bytes"].is_array());
        }
        let joined: String = content.iter().map(|e| e["token"].as_str().unwrap_or("")).collect();
        assert!(text_of(&v).starts_with(joined.trim_end()) || joined.starts_with(&text_of(&v)), "{joined:?} vs {:?}", text_of(&v));

        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": "One, two,", "max_tokens": 4, "temperature": 0, "logprobs": 2})).await;
        assert_eq!(st, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let toks = lp["tokens"].as_array().expect("tokens");
        assert_eq!(lp["token_logprobs"].as_array().map(Vec::len), Some(toks.len()));
        assert_eq!(lp["top_logprobs"].as_array().map(Vec::len), Some(toks.len()));
        assert_eq!(lp["text_offset"][0], 0);

        // A fixed seed reproduces a sampled text.
        let seeded = json!({"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "min_p": 0.02, "seed": 1234});
        let (_, a) = post(addr, "/v1/completions", &seeded).await;
        let (_, b) = post(addr, "/v1/completions", &seeded).await;
        assert_eq!(text_of(&a), text_of(&b));

        let pen = json!({"prompt": "hello hello hello hello", "max_tokens": 12, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 1.0});
        let (st, v) = post(addr, "/v1/completions", &pen).await;
        assert_eq!(st, 200, "{v}");
    });
}

#[test]
fn several_choices_a_request() {
    let addr = server().addr();
    rt().block_on(async {
        // Greedy: n copies of the one text; the prompt counted once, the completions summed.
        let one = json!({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0});
        let (st, a) = post(addr, "/v1/completions", &one).await;
        assert_eq!(st, 200, "{a}");
        let mut three = one.clone();
        three["n"] = json!(3);
        let (st, v) = post(addr, "/v1/completions", &three).await;
        assert_eq!(st, 200, "{v}");
        let choices = v["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 3);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{v}");
            assert_eq!(c["text"], a["choices"][0]["text"], "{v}");
        }
        let (p1, c1) = check_usage(&a["usage"]);
        let (p3, c3) = check_usage(&v["usage"]);
        assert_eq!((p3, c3), (p1, 3 * c1));
        // Seeded: choice i samples with seed + i, so choice 0 is the n = 1 text and the others differ.
        let seeded = json!({"prompt": "My favourite animal is", "max_tokens": 16, "temperature": 1.0, "seed": 1234});
        let mut seeded3 = seeded.clone();
        seeded3["n"] = json!(3);
        let (_, s1) = post(addr, "/v1/completions", &seeded).await;
        let (_, s3) = post(addr, "/v1/completions", &seeded3).await;
        let texts: Vec<&str> = s3["choices"].as_array().expect("choices").iter().map(|c| c["text"].as_str().unwrap_or("")).collect();
        assert_eq!(texts[0], text_of(&s1));
        assert!(texts[1] != texts[0] || texts[2] != texts[0], "{texts:?}");
        let (_, again) = post(addr, "/v1/completions", &seeded3).await;
        assert_eq!(again["choices"], s3["choices"], "a seeded request repeats");
        // Streamed chat: each choice's role chunk, deltas and finish under its index; the
        // joined deltas are the whole response's texts; one usage chunk at the end.
        let chat =
            json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0.9, "seed": 5, "n": 2});
        let (st, whole) = post(addr, "/v1/chat/completions", &chat).await;
        assert_eq!(st, 200, "{whole}");
        let mut streamed = chat.clone();
        streamed["stream"] = json!(true);
        streamed["stream_options"] = json!({"include_usage": true});
        let (st, events) = stream(addr, "/v1/chat/completions", &streamed).await;
        assert_eq!(st, 200);
        let (mut text, mut roles, mut finishes, mut usage) = (vec![String::new(); 2], [0; 2], [0; 2], None);
        for c in chunks(&events) {
            if !c["usage"].is_null() {
                assert!(usage.is_none(), "one usage chunk");
                usage = Some(c["usage"].clone());
            }
            for ch in c["choices"].as_array().expect("choices") {
                let i = ch["index"].as_u64().expect("index") as usize;
                if ch["delta"]["role"] == "assistant" {
                    roles[i] += 1;
                }
                if let Some(t) = ch["delta"]["content"].as_str() {
                    text[i].push_str(t);
                }
                if ch["finish_reason"].is_string() {
                    finishes[i] += 1;
                }
            }
        }
        assert_eq!((roles, finishes), ([1, 1], [1, 1]));
        for (i, t) in text.iter().enumerate() {
            assert_eq!(t.as_str(), whole["choices"][i]["message"]["content"].as_str().unwrap_or(""), "choice {i}");
        }
        assert_eq!(usage.as_ref().map(check_usage), Some(check_usage(&whole["usage"])));
    });
}

/// A request's `n` choices compute their shared prompt once: the others copy its rows
/// (engine.rs, "Shared prefixes"), and their greedy texts are the text of one choice alone.
#[test]
fn choices_copy_their_prompt() {
    let addr = server().addr();
    rt().block_on(async {
        let prompt = "Once upon a time, in a small village at the edge of a vast and quiet forest, there lived an old clockmaker who";
        let one = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
        let (st, a) = post(addr, "/v1/completions", &one).await;
        assert_eq!(st, 200, "{a}");
        let (p, _) = check_usage(&a["usage"]);
        assert!(p > 20, "a prompt long enough to share: {p} tokens");
        let before = metric(addr, "turbospark_prompt_tokens_cached_total").await;
        let mut four = one.clone();
        four["n"] = json!(4);
        four["prompt"] = json!(format!("{prompt} made"));
        let (st, v) = post(addr, "/v1/completions", &four).await;
        assert_eq!(st, 200, "{v}");
        let texts: Vec<&str> = v["choices"].as_array().expect("choices").iter().map(|c| c["text"].as_str().unwrap_or("")).collect();
        assert!(texts.iter().all(|t| *t == texts[0]), "{texts:?}");
        let mut alone = one.clone();
        alone["prompt"] = four["prompt"].clone();
        alone["seed"] = json!(1);
        let (_, b) = post(addr, "/v1/completions", &alone).await;
        assert_eq!(texts[0], text_of(&b));
        // (each choice after the first reads the prompt from a running choice's rows, or from a
        // free slot's when the slots were busy with other tests until the first had ended)
        let saved = metric(addr, "turbospark_prompt_tokens_cached_total").await - before;
        assert!(saved >= 3.0 * p as f64, "three choices skip the prompt: {saved} tokens not computed");
    });
}

/// JSON mode (`response_format` `json_object`): the text is one JSON object, ended as soon as
/// the object closes (`finish_reason` "stop"), the same streamed as whole; a text cut by
/// `max_tokens` is a prefix of one.
#[test]
fn json_mode_gives_one_object() {
    let addr = server().addr();
    rt().block_on(async {
        let ask = "Give me a JSON object describing a cat with its name and age.";
        for (temperature, seed) in [(0.0, 0), (0.9, 7), (1.2, 8)] {
            let req = json!({"messages": [{"role": "user", "content": ask}], "max_tokens": 200, "temperature": temperature, "seed": seed,
                             "response_format": {"type": "json_object"}});
            let (st, v) = post(addr, "/v1/chat/completions", &req).await;
            assert_eq!(st, 200, "{v}");
            let text = text_of(&v);
            let mut g = ts_engine::json::JsonState::new();
            assert!(g.feed(text.as_bytes()), "a JSON prefix: {text:?}");
            if v["choices"][0]["finish_reason"] == "stop" {
                let parsed: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
                assert!(parsed.is_object(), "{text}");
                assert!(g.done());
            } else {
                assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
            }
            let mut streamed = req.clone();
            streamed["stream"] = json!(true);
            let (st, events) = stream(addr, "/v1/chat/completions", &streamed).await;
            assert_eq!(st, 200);
            let joined: String = chunks(&events).iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
            assert_eq!(joined, text, "temperature {temperature}");
        }
        // A schema: the keys in order, the types, the enum, the array bound.
        let schema = json!({"type": "object", "properties": {
            "age": {"type": "integer"}, "colour": {"enum": ["black", "white", "ginger"]}, "indoor": {"type": "boolean"},
            "name": {"type": "string"}, "toys": {"type": "array", "items": {"type": "string"}, "maxItems": 2}
        }, "required": ["age", "colour", "indoor", "name", "toys"], "additionalProperties": false});
        let compiled = ts_engine::json_schema::Schema::compile(&schema).expect("schema");
        let mut stops = 0;
        for (temperature, seed) in [(0.0, 0), (0.7, 1), (0.7, 2), (1.0, 3)] {
            let req = json!({"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 120, "temperature": temperature, "seed": seed,
                             "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "strict": true, "schema": schema}}});
            let (st, v) = post(addr, "/v1/chat/completions", &req).await;
            assert_eq!(st, 200, "{v}");
            let text = text_of(&v);
            let mut g = compiled.start();
            assert!(ts_engine::json::Grammar::feed(&mut g, &compiled, text.as_bytes()), "of the schema so far: {text:?}");
            if v["choices"][0]["finish_reason"] == "stop" {
                stops += 1;
                let o: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
                let keys: Vec<&str> = o.as_object().expect("object").keys().map(String::as_str).collect();
                assert_eq!(keys, ["age", "colour", "indoor", "name", "toys"], "{text}");
                assert!(o["age"].is_i64() && o["indoor"].is_boolean() && o["name"].is_string(), "{text}");
                assert!(["black", "white", "ginger"].contains(&o["colour"].as_str().unwrap_or("")), "{text}");
                assert!(o["toys"].as_array().is_some_and(|t| t.len() <= 2 && t.iter().all(Value::is_string)), "{text}");
            }
        }
        eprintln!("json_schema: {stops} of 4 complete within 120 tokens");
        // Completions too, even from a prompt that is not about JSON; a short budget cuts it.
        let req =
            json!({"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "response_format": {"type": "json_object"}});
        let (st, v) = post(addr, "/v1/completions", &req).await;
        assert_eq!(st, 200, "{v}");
        assert!(ts_engine::json::JsonState::new().feed(text_of(&v).as_bytes()), "{v}");
    });
}

/// The id of `text` as one token of the default model.
fn one_token(text: &str) -> u32 {
    let path = ts_engine::hub::ensure(&ts_engine::hub::SMOLLM2, &mut |m| eprintln!("hub: {m}")).expect("the default model");
    let src = ts_formats::open_model(&path).expect("open the model");
    let tok = ts_engine::tokenizer::Tokenizer::from_gguf_metadata(src.metadata()).expect("tokenizer");
    let ids = tok.encode(text, false).expect("encode");
    assert_eq!(ids.len(), 1, "{text:?} is one token: {ids:?}");
    ids[0]
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let addr = server().addr();
    let paris = one_token(" Paris");
    rt().block_on(async {
        let base = json!({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0});
        let (st, v) = post(addr, "/v1/completions", &base).await;
        assert_eq!(st, 200, "{v}");
        assert!(text_of(&v).starts_with(" Paris"), "greedy picks Paris first: {v}");
        // -100 bans it, on the whole and on the streamed path; the text changes.
        let mut banned = base.clone();
        banned["logit_bias"] = json!({paris.to_string(): -100});
        let (st, v) = post(addr, "/v1/completions", &banned).await;
        assert_eq!(st, 200, "{v}");
        let text = text_of(&v);
        assert!(!text.contains("Paris"), "banned: {text:?}");
        banned["stream"] = json!(true);
        let (st, events) = stream(addr, "/v1/completions", &banned).await;
        assert_eq!(st, 200);
        let streamed: String = chunks(&events).iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
        assert_eq!(streamed, text);
        // +100 forces it, in chat too, every step.
        let forced = json!({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3, "temperature": 0.8, "seed": 3,
                            "logit_bias": {paris.to_string(): 100}});
        let (st, v) = post(addr, "/v1/chat/completions", &forced).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(text_of(&v), " Paris Paris Paris");
        // An id outside the vocabulary is refused by name.
        let mut bad = base.clone();
        bad["logit_bias"] = json!({"999999": 1});
        let (st, v) = post(addr, "/v1/completions", &bad).await;
        assert_error(st, &v, 400, Some("logit_bias"), None, "outside the vocabulary");
    });
}

fn assert_error(st: u16, v: &Value, want_status: u16, param: Option<&str>, code: Option<&str>, says: &str) {
    assert_eq!(st, want_status, "{v}");
    let e = &v["error"];
    let msg = e["message"].as_str().unwrap_or_else(|| panic!("no error.message in {v}"));
    assert!(msg.to_lowercase().contains(&says.to_lowercase()), "message {msg:?} should mention {says:?}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.as_object().is_some_and(|o| o.contains_key("param") && o.contains_key("code")), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    if let Some(c) = code {
        assert_eq!(e["code"], c, "{v}");
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = server();
    let addr = s.addr();
    rt().block_on(async {
        let chat = "/v1/chat/completions";
        let user = json!([{"role": "user", "content": "hi"}]);
        let (st, v) = post_raw(addr, chat, b"{\"messages\": [").await;
        assert_error(st, &v, 400, None, Some("invalid_json"), "not valid JSON");
        let (st, v) = post_raw(addr, chat, b"[1, 2]").await;
        assert_error(st, &v, 400, None, Some("invalid_json"), "JSON object");
        let (st, v) = post(addr, chat, &json!({"messages": user, "temperature": "warm"})).await;
        assert_error(st, &v, 400, Some("temperature"), None, "temperature");
        let (st, v) = post(addr, chat, &json!({"messages": user, "max_tokens": "ten"})).await;
        assert_error(st, &v, 400, Some("max_tokens"), None, "max_tokens");
        let (st, v) = post(addr, chat, &json!({"messages": "hi"})).await;
        assert_error(st, &v, 400, Some("messages"), None, "messages");
        let (st, v) = post(addr, chat, &json!({"messages": [{"role": "user", "content": 5}]})).await;
        assert_error(st, &v, 400, Some("messages[0].content"), None, "content");
        let (st, v) = post(addr, chat, &json!({"messages": user, "stop": 3})).await;
        assert_error(st, &v, 400, Some("stop"), None, "stop");
        let (st, v) = post(addr, chat, &json!({"messages": user, "model": "gpt-4o"})).await;
        assert_error(st, &v, 404, Some("model"), Some("model_not_found"), "gpt-4o");
        let (st, v) = post(addr, chat, &json!({"messages": []})).await;
        assert_error(st, &v, 400, Some("messages"), None, "empty");
        let (st, v) = post(addr, chat, &json!({"model": s.model_id()})).await;
        assert_error(st, &v, 400, Some("messages"), None, "messages");
        let (st, v) = post(addr, chat, &json!({"messages": user, "max_tokens": CTX + 1})).await;
        assert_error(st, &v, 400, Some("max_tokens"), Some("context_length_exceeded"), "context");
        let (st, v) = post(addr, chat, &json!({"messages": user, "max_tokens": CTX - 5})).await;
        assert_error(st, &v, 400, Some("max_tokens"), Some("context_length_exceeded"), "plus 'max_tokens'");
        let long = "hello ".repeat(CTX + 50);
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": long})).await;
        assert_error(st, &v, 400, Some("prompt"), Some("context_length_exceeded"), "prompt is");
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": [999_999]})).await;
        assert_error(st, &v, 400, Some("prompt[0]"), None, "vocabulary");
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": "x", "n": 17})).await;
        assert_error(st, &v, 400, Some("n"), None, "at most 16 choices");
        let (st, v) = post(addr, chat, &json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {}}})).await;
        assert_error(st, &v, 400, Some("response_format.json_schema.schema"), None, "missing");
        let schema = json!({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}});
        let (st, v) =
            post(addr, chat, &json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}))
                .await;
        assert_error(st, &v, 400, Some("response_format.json_schema.schema"), None, "'format' is not supported");
        let (st, v) = post(addr, chat, &json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}]})).await;
        assert_error(st, &v, 400, Some("tools"), None, "tool");
        let big = json!({"prompt": "a".repeat(MAX_BODY + 1000)});
        let (st, v) = post(addr, "/v1/completions", &big).await;
        assert_error(st, &v, 413, None, Some("request_too_large"), "too large");
        let (st, text) = get(addr, "/v1/nothing-here").await;
        assert_eq!(st, 404);
        let v: Value = serde_json::from_str(&text).expect("JSON error");
        assert_error(st, &v, 404, None, None, "no such route");

        // Still serving, and the aliases of the model are accepted.
        for name in [s.model_id().to_string(), "smollm2".into(), "SmolLM2-135M-Instruct".into(), "default".into()] {
            let (st, v) = post(addr, chat, &json!({"model": name, "messages": user, "max_tokens": 2, "temperature": 0})).await;
            assert_eq!(st, 200, "model {name}: {v}");
        }
        assert!(metric(addr, "turbospark_http_responses_total{route=\"chat\",code=\"400\"}").await >= 9.0);
    });
}

#[test]
fn models_health_metrics() {
    let s = server();
    let addr = s.addr();
    rt().block_on(async {
        let (st, t) = get(addr, "/v1/models").await;
        assert_eq!(st, 200);
        let v: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(v["object"], "list");
        assert_eq!(v["data"][0]["id"], s.model_id());
        assert_eq!(v["data"][0]["object"], "model");
        let (st, t) = get(addr, &format!("/v1/models/{}", s.model_id())).await;
        assert_eq!(st, 200, "{t}");
        let (st, t) = get(addr, "/health").await;
        assert_eq!(st, 200);
        let v: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(v["status"], "ok");
        assert_eq!(v["slots_total"], 4);
        let (st, t) = get(addr, "/metrics").await;
        assert_eq!(st, 200);
        for name in [
            "turbospark_requests_accepted_total",
            "turbospark_prompt_tokens_total",
            "turbospark_completion_tokens_total",
            "turbospark_queue_depth",
            "turbospark_active_sequences",
            "turbospark_batch_tokens",
            "turbospark_time_to_first_token_seconds_count",
            "turbospark_tokens_per_second",
        ] {
            assert!(ts_server::metrics::scrape(&t, name).is_some(), "{name} missing");
        }
    });
}
