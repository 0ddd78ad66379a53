//! OpenAI request parsing (with a 400 naming the field for every malformed value) and the
//! response / stream-chunk shapes of `/v1/chat/completions` and `/v1/completions`.
//!
//! Requests are parsed from a `serde_json::Value` by hand rather than derived, so that a field of
//! the wrong type or out of range is reported as OpenAI does: status 400, `param` naming it.
//! Unknown fields are ignored (clients send vendor extensions); fields whose meaning we cannot
//! honour (`echo`, `best_of > 1`, `suffix`, non-text content, a `json_schema` with keywords
//! outside `ts_engine::json_schema`'s subset, `tools`, `functions`, `audio`) are refused, not
//! ignored.

use serde_json::{json, Map, Value};
use ts_engine::{ChatMessage, SamplerParams};

use crate::engine::{Finish, JsonMode, TokenLogprob, TopLogprob, Usage};
use crate::error::ApiError;

/// Most stop strings per request.
pub const MAX_STOPS: usize = 16;
/// Most `top_logprobs` for chat (OpenAI's limit).
pub const MAX_TOP_LOGPROBS_CHAT: i64 = 20;
/// Most `logprobs` for completions (OpenAI's limit).
pub const MAX_LOGPROBS_COMPLETIONS: i64 = 5;
/// Most choices (`n`) per request: each is a sequence of its own in the engine.
pub const MAX_CHOICES: usize = 16;
/// Most `logit_bias` entries per request (OpenAI documents none; this bounds the per-token work).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The fields both endpoints share.
#[derive(Debug, Clone, PartialEq)]
pub struct Common {
    /// `model` as sent (checked against the loaded model's names by the caller).
    pub model: Option<String>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `max_tokens` (or `max_completion_tokens` for chat).
    pub max_tokens: Option<usize>,
    /// `stop`.
    pub stop: Vec<String>,
    /// Sampling, with OpenAI's defaults (temperature 1, top_p 1, no top-k / min-p).
    pub sampling: SamplerParams,
    /// `Some(n)` when log-probabilities were asked for, with `n` alternatives per token.
    pub top_logprobs: Option<usize>,
    /// Choices to generate (`n`), each a sequence of its own: 1..=[`MAX_CHOICES`].
    pub n: usize,
    /// `response_format` `json_object` (one JSON object, `ts_engine::json`) or `json_schema`
    /// (JSON of that schema, `ts_engine::json_schema`).
    pub json: Option<JsonMode>,
}

/// A completions prompt: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a decimal",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong_type(key: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(key, format!("Invalid type for '{key}': expected {want}, but got {} instead.", type_name(got)))
}

/// `obj[key]`, with `null` read as absent.
fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn number(obj: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    let Some(v) = field(obj, key) else { return Ok(None) };
    let x = v.as_f64().ok_or_else(|| wrong_type(key, "a number", v))?;
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(key, format!("'{key}' is {x}, but it must be between {lo} and {hi}.")));
    }
    Ok(Some(x))
}

fn integer(obj: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
    let Some(v) = field(obj, key) else { return Ok(None) };
    let x = match v {
        Value::Number(n) => n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15).map(|f| f as i64)),
        _ => None,
    };
    let x = match (x, v) {
        (Some(x), _) => x,
        (None, Value::Number(n)) if n.is_u64() => i64::MAX,
        _ => return Err(wrong_type(key, "an integer", v)),
    };
    if x < lo || x > hi {
        return Err(ApiError::invalid(key, format!("'{key}' is {x}, but it must be between {lo} and {hi}.")));
    }
    Ok(Some(x))
}

fn boolean(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    let Some(v) = field(obj, key) else { return Ok(None) };
    v.as_bool().map(Some).ok_or_else(|| wrong_type(key, "a boolean", v))
}

/// The body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError::bad_request("The request body is empty; expected a JSON object.").with_code("invalid_json"));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")).with_code("invalid_json"))?;
    match v {
        Value::Object(m) => Ok(m),
        other => {
            Err(ApiError::bad_request(format!("The request body must be a JSON object, not {}.", type_name(&other)))
                .with_code("invalid_json"))
        }
    }
}

/// Parses the fields shared by chat and completions. `chat` selects the chat flavour of
/// `logprobs` (boolean + `top_logprobs`) and accepts `max_completion_tokens`.
pub fn parse_common(obj: &Map<String, Value>, chat: bool) -> Result<Common, ApiError> {
    let model = match field(obj, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("model", "a string", v)),
    };
    let stream = boolean(obj, "stream")?.unwrap_or(false);
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")
            .map_err(|mut e| {
                e.param = Some("stream_options.include_usage".into());
                e
            })?
            .unwrap_or(false),
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    let mut max_tokens = integer(obj, "max_tokens", 1, u32::MAX as i64)?;
    if chat {
        if let Some(m) = integer(obj, "max_completion_tokens", 1, u32::MAX as i64)? {
            max_tokens = Some(m);
        }
    }
    let stop = match field(obj, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOPS {
                return Err(ApiError::invalid("stop", format!("'stop' has {} entries; at most {MAX_STOPS} are allowed.", a.len())));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| v.as_str().map(str::to_string).ok_or_else(|| wrong_type(&format!("stop[{i}]"), "a string", v)))
                .collect::<Result<Vec<_>, _>>()?
        }
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    let n = integer(obj, "n", 1, i64::MAX)?.unwrap_or(1);
    if n as usize > MAX_CHOICES {
        return Err(ApiError::invalid("n", format!("'n' is {n}; this server generates at most {MAX_CHOICES} choices per request.")));
    }
    let mut sampling = SamplerParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: usize::MAX,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: None,
        logit_bias: Vec::new(),
    };
    if let Some(t) = number(obj, "temperature", 0.0, 2.0)? {
        sampling.temperature = t as f32;
    }
    if let Some(p) = number(obj, "top_p", 0.0, 1.0)? {
        sampling.top_p = p as f32;
    }
    if let Some(k) = integer(obj, "top_k", 0, 1 << 24)? {
        sampling.top_k = k as usize;
    }
    if let Some(p) = number(obj, "min_p", 0.0, 1.0)? {
        sampling.min_p = p as f32;
    }
    if let Some(p) = number(obj, "presence_penalty", -2.0, 2.0)? {
        sampling.presence_penalty = p as f32;
    }
    if let Some(p) = number(obj, "frequency_penalty", -2.0, 2.0)? {
        sampling.frequency_penalty = p as f32;
    }
    sampling.logit_bias = logit_bias(obj)?;
    let json = refuse_unsupported(obj)?;
    if let Some(v) = field(obj, "seed") {
        let seed = match v {
            Value::Number(n) => n.as_u64().or_else(|| n.as_i64().map(|i| i as u64)),
            _ => None,
        };
        sampling.seed = Some(seed.ok_or_else(|| wrong_type("seed", "an integer", v))?);
    }
    let top_logprobs = if chat {
        let want = boolean(obj, "logprobs")?.unwrap_or(false);
        let top = integer(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)?;
        if top.is_some() && !want {
            return Err(ApiError::invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true."));
        }
        want.then(|| top.unwrap_or(0) as usize)
    } else {
        integer(obj, "logprobs", 0, MAX_LOGPROBS_COMPLETIONS)?.map(|n| n as usize)
    };
    Ok(Common {
        model,
        stream,
        include_usage,
        max_tokens: max_tokens.map(|m| m as usize),
        stop,
        sampling,
        top_logprobs,
        n: n as usize,
        json,
    })
}

/// `logit_bias`: an object from token ids (decimal strings) to biases in [-100, 100], added to
/// those tokens' logits before sampling. -100 bans the token (read as -inf), as OpenAI
/// documents it ("should result in a ban"); the ids are checked against the vocabulary by the
/// caller, which knows it. Sorted by id.
fn logit_bias(obj: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match field(obj, "logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(wrong_type("logit_bias", "an object", v)),
    };
    if m.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("'logit_bias' has {} entries; at most {MAX_LOGIT_BIAS} are allowed.", m.len()),
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let id = k.trim().parse::<u32>().map_err(|_| {
            ApiError::invalid("logit_bias", format!("Invalid key in 'logit_bias': '{k}' is not a token id (a non-negative integer)."))
        })?;
        let p = format!("logit_bias.{k}");
        let b = v.as_f64().ok_or_else(|| wrong_type(&p, "a number", v))?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::invalid(p, format!("'logit_bias' for token {id} is {b}, but it must be between -100 and 100.")));
        }
        out.push((id, if b <= -100.0 { f32::NEG_INFINITY } else { b as f32 }));
    }
    out.sort_by_key(|e| e.0);
    Ok(out)
}

/// Refuses the fields that ask for behaviour this server does not have (tool calls, audio),
/// rather than answering as though they had been honoured. Their neutral values pass:
/// `response_format` of type `text`, empty `tools` / `functions`. Returns the JSON mode that
/// `response_format` asks for, if any.
fn refuse_unsupported(obj: &Map<String, Value>) -> Result<Option<JsonMode>, ApiError> {
    let mut json = None;
    match field(obj, "response_format") {
        None => {}
        Some(Value::Object(o)) => match o.get("type") {
            Some(Value::String(t)) if t == "text" => {}
            Some(Value::String(t)) if t == "json_object" => json = Some(JsonMode::Object),
            Some(Value::String(t)) if t == "json_schema" => {
                let p = "response_format.json_schema";
                let js = match o.get("json_schema") {
                    Some(Value::Object(js)) => js,
                    None | Some(Value::Null) => return Err(ApiError::invalid(p, format!("Missing required parameter: '{p}'."))),
                    Some(v) => return Err(wrong_type(p, "an object", v)),
                };
                let schema = match js.get("schema") {
                    Some(v @ Value::Object(_)) => v,
                    None | Some(Value::Null) => {
                        return Err(ApiError::invalid(format!("{p}.schema"), format!("Missing required parameter: '{p}.schema'.")))
                    }
                    Some(v) => return Err(wrong_type(&format!("{p}.schema"), "an object", v)),
                };
                let compiled = ts_engine::json_schema::Schema::compile(schema)
                    .map_err(|e| ApiError::invalid(format!("{p}.schema"), format!("This schema cannot be enforced: {e}.")))?;
                json = Some(JsonMode::Schema(std::sync::Arc::new(compiled)));
            }
            Some(Value::String(t)) => {
                return Err(ApiError::invalid(
                    "response_format",
                    format!("'response_format' of type '{t}' is not supported (text, json_object and json_schema are)."),
                ))
            }
            Some(v) => return Err(wrong_type("response_format.type", "a string", v)),
            None => return Err(ApiError::invalid("response_format.type", "Missing required parameter: 'response_format.type'.")),
        },
        Some(v) => return Err(wrong_type("response_format", "an object", v)),
    }
    for key in ["tools", "functions"] {
        match field(obj, key) {
            None => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid(
                    key,
                    format!("'{key}' is not supported: this server does not produce tool or function calls."),
                ))
            }
            Some(v) => return Err(wrong_type(key, "an array", v)),
        }
    }
    if field(obj, "audio").is_some() {
        return Err(ApiError::invalid("audio", "'audio' is not supported: this server produces text only."));
    }
    Ok(json)
}

/// `messages` as chat messages. Content may be a string, an array of `{"type": "text"}` parts
/// (joined), or null for an assistant turn. `developer` is read as `system`.
pub fn parse_messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let msgs = match obj.get("messages") {
        None | Some(Value::Null) => return Err(ApiError::invalid("messages", "Missing required parameter: 'messages'.")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong_type("messages", "an array", v)),
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid("messages", "'messages' is empty; it must hold at least one message."));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(m) = m else { return Err(wrong_type(&p, "an object", m)) };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r.as_str(),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!("{p}.role"), format!("Missing required parameter: '{p}.role'.")))
            }
            Some(v) => return Err(wrong_type(&format!("{p}.role"), "a string", v)),
        };
        let role = if role == "developer" { "system" } else { role };
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            None | Some(Value::Null) if role == "assistant" => String::new(),
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!("{p}.content"), format!("Missing required parameter: '{p}.content'.")))
            }
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for (j, part) in parts.iter().enumerate() {
                    let pp = format!("{p}.content[{j}]");
                    let Value::Object(part) = part else { return Err(wrong_type(&pp, "an object", part)) };
                    match (part.get("type").and_then(Value::as_str), part.get("text")) {
                        (Some("text"), Some(Value::String(t))) => s.push_str(t),
                        (Some("text"), Some(v)) => return Err(wrong_type(&format!("{pp}.text"), "a string", v)),
                        (Some("text"), None) => {
                            return Err(ApiError::invalid(format!("{pp}.text"), format!("Missing required parameter: '{pp}.text'.")))
                        }
                        (Some(other), _) => {
                            return Err(ApiError::invalid(
                                format!("{pp}.type"),
                                format!("Content part type '{other}' is not supported; this model reads text only."),
                            ))
                        }
                        (None, _) => {
                            return Err(ApiError::invalid(format!("{pp}.type"), format!("Missing required parameter: '{pp}.type'.")))
                        }
                    }
                }
                s
            }
            Some(v) => return Err(wrong_type(&format!("{p}.content"), "a string or an array of content parts", v)),
        };
        out.push(ChatMessage::new(role, content));
    }
    Ok(out)
}

/// The completions `prompt`: a string, a one-element array of strings, an array of token ids,
/// or a one-element array of such arrays. Several prompts in one request are refused.
pub fn parse_prompt(obj: &Map<String, Value>) -> Result<Prompt, ApiError> {
    for (key, what) in [("echo", "'echo' is not supported"), ("suffix", "'suffix' is not supported")] {
        match field(obj, key) {
            None | Some(Value::Bool(false)) => {}
            Some(Value::String(s)) if key == "suffix" && s.is_empty() => {}
            Some(_) => return Err(ApiError::invalid(key, format!("{what} by this server."))),
        }
    }
    if let Some(b) = integer(obj, "best_of", 1, i64::MAX)? {
        if b != 1 {
            return Err(ApiError::invalid("best_of", "'best_of' must be 1 on this server."));
        }
    }
    let tokens = |a: &[Value], p: &str| -> Result<Vec<u32>, ApiError> {
        a.iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or_else(|| wrong_type(&format!("{p}[{i}]"), "a token id", v))
            })
            .collect()
    };
    match obj.get("prompt") {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "Missing required parameter: 'prompt'.")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) if a.is_empty() => Err(ApiError::invalid("prompt", "'prompt' is an empty array.")),
        Some(Value::Array(a)) => match &a[0] {
            Value::String(_) | Value::Array(_) if a.len() > 1 => {
                Err(ApiError::invalid("prompt", format!("'prompt' holds {} prompts; send one prompt per request.", a.len())))
            }
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            Value::Array(inner) => Ok(Prompt::Tokens(tokens(inner, "prompt[0]")?)),
            _ => Ok(Prompt::Tokens(tokens(a, "prompt")?)),
        },
        Some(v) => Err(wrong_type("prompt", "a string, an array of strings or an array of token ids", v)),
    }
}

/// Identity of a response: the same in every chunk of a stream.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// `usage`, with OpenAI's `prompt_tokens_details.cached_tokens` (the prompt tokens the
/// server's prompt cache did not compute again).
pub fn usage(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    })
}

fn finite(x: f32) -> f64 {
    if x.is_finite() {
        x as f64
    } else {
        -9999.0
    }
}

fn top_json(t: &TopLogprob) -> Value {
    json!({"token": t.token, "logprob": finite(t.logprob), "bytes": t.bytes})
}

/// Chat `logprobs` object for `lps` (`{"content": [...]}`).
pub fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut v = top_json(&l.chosen);
            v["top_logprobs"] = Value::Array(l.top.iter().map(top_json).collect());
            v
        })
        .collect();
    json!({"content": content})
}

/// Legacy completions `logprobs` object; `offset` is the text offset (in characters) of the
/// first token, advanced past the tokens given.
pub fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut tokens = Vec::with_capacity(lps.len());
    let mut token_logprobs = Vec::with_capacity(lps.len());
    let mut top = Vec::with_capacity(lps.len());
    let mut offsets = Vec::with_capacity(lps.len());
    for l in lps {
        tokens.push(Value::String(l.chosen.token.clone()));
        token_logprobs.push(json!(finite(l.chosen.logprob)));
        let mut m = Map::new();
        for t in &l.top {
            m.entry(t.token.clone()).or_insert(json!(finite(t.logprob)));
        }
        top.push(Value::Object(m));
        offsets.push(json!(*offset));
        *offset += l.chosen.token.chars().count();
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// One finished choice of a whole (not streamed) response.
#[derive(Debug, Clone, Copy)]
pub struct Choice<'a> {
    pub text: &'a str,
    pub finish: Finish,
    /// The tokens' log-probabilities, when they were asked for.
    pub logprobs: Option<&'a [TokenLogprob]>,
}

/// A complete `chat.completion`, its choices indexed in order.
pub fn chat_response(m: &Meta, choices: &[Choice<'_>], u: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": c.logprobs.map(chat_logprobs),
                "finish_reason": c.finish.as_str(),
            })
        })
        .collect();
    json!({
        "id": m.id,
        "object": "chat.completion",
        "created": m.created,
        "model": m.model,
        "system_fingerprint": crate::FINGERPRINT,
        "choices": choices,
        "usage": usage(u),
    })
}

/// One `chat.completion.chunk`, for choice `index`.
pub fn chat_chunk(m: &Meta, index: usize, delta: Value, finish: Option<Finish>, logprobs: Option<Value>, include_usage: bool) -> Value {
    let mut v = json!({
        "id": m.id,
        "object": "chat.completion.chunk",
        "created": m.created,
        "model": m.model,
        "system_fingerprint": crate::FINGERPRINT,
        "choices": [{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::as_str),
        }],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

/// The last chunk of a stream with `include_usage`: no choices, the usage.
pub fn usage_chunk(m: &Meta, object: &str, u: Usage) -> Value {
    json!({
        "id": m.id,
        "object": object,
        "created": m.created,
        "model": m.model,
        "system_fingerprint": crate::FINGERPRINT,
        "choices": [],
        "usage": usage(u),
    })
}

/// A complete `text_completion`, its choices indexed in order.
pub fn completion_response(m: &Meta, choices: &[Choice<'_>], u: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut off = 0;
            json!({
                "text": c.text,
                "index": i,
                "logprobs": c.logprobs.map(|l| completion_logprobs(l, &mut off)),
                "finish_reason": c.finish.as_str(),
            })
        })
        .collect();
    json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "system_fingerprint": crate::FINGERPRINT,
        "choices": choices,
        "usage": usage(u),
    })
}

/// One streamed `text_completion` chunk, for choice `index`.
pub fn completion_chunk(m: &Meta, index: usize, text: &str, finish: Option<Finish>, logprobs: Option<Value>, include_usage: bool) -> Value {
    let mut v = json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "system_fingerprint": crate::FINGERPRINT,
        "choices": [{
            "text": text,
            "index": index,
            "logprobs": logprobs,
            "finish_reason": finish.map(Finish::as_str),
        }],
    });
    if include_usage {
        v["usage"] = Value::Null;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(s: &str) -> Map<String, Value> {
        parse_body(s.as_bytes()).expect("test JSON")
    }

    #[test]
    fn body_errors() {
        assert_eq!(parse_body(b"{not json").unwrap_err().code, Some("invalid_json"));
        assert!(parse_body(b"[1]").unwrap_err().message.contains("JSON object"));
        assert!(parse_body(b"  ").unwrap_err().message.contains("empty"));
    }

    #[test]
    fn common_types_and_ranges() {
        let e = parse_common(&obj(r#"{"temperature": "hot"}"#), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("expected a number"), "{}", e.message);
        let e = parse_common(&obj(r#"{"max_tokens": 0}"#), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse_common(&obj(r#"{"max_tokens": 1.5}"#), false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse_common(&obj(r#"{"stop": [1]}"#), false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop[0]"));
        let e = parse_common(&obj(r#"{"n": 17}"#), false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = parse_common(&obj(r#"{"n": 0}"#), false).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        assert_eq!(parse_common(&obj(r#"{"n": 3}"#), true).expect("valid").n, 3);
        assert_eq!(parse_common(&obj(r#"{}"#), true).expect("valid").n, 1);
        let e = parse_common(&obj(r#"{"top_logprobs": 2}"#), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = parse_common(&obj(r#"{"stream": "yes"}"#), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream"));
        let c = parse_common(
            &obj(r#"{"model": "m", "stream": true, "stream_options": {"include_usage": true}, "max_completion_tokens": 7,
                 "stop": "x", "temperature": 0, "seed": 5, "logprobs": true, "top_logprobs": 3, "top_k": 4, "min_p": 0.1,
                 "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_p": null}"#),
            true,
        )
        .expect("valid");
        assert_eq!(c.model.as_deref(), Some("m"));
        assert!(c.stream && c.include_usage);
        assert_eq!(c.max_tokens, Some(7));
        assert_eq!(c.stop, vec!["x"]);
        assert_eq!(c.sampling.temperature, 0.0);
        assert_eq!(c.sampling.top_p, 1.0);
        assert_eq!((c.sampling.top_k, c.sampling.seed), (4, Some(5)));
        assert_eq!(c.top_logprobs, Some(3));
        let c = parse_common(&obj(r#"{"logprobs": 2}"#), false).expect("valid");
        assert_eq!(c.top_logprobs, Some(2));
    }

    #[test]
    fn logit_bias_is_parsed_and_checked() {
        let c = parse_common(&obj(r#"{"logit_bias": {"50": -100, "7": 2.5, " 9": 0}}"#), true).expect("valid");
        assert_eq!(c.sampling.logit_bias, vec![(7, 2.5), (9, 0.0), (50, f32::NEG_INFINITY)]);
        assert!(parse_common(&obj(r#"{"logit_bias": null}"#), true).expect("valid").sampling.logit_bias.is_empty());
        for (body, param, what) in [
            (r#"{"logit_bias": [1]}"#, "logit_bias", "expected an object"),
            (r#"{"logit_bias": {"x": 1}}"#, "logit_bias", "'x' is not a token id"),
            (r#"{"logit_bias": {"-3": 1}}"#, "logit_bias", "'-3' is not a token id"),
            (r#"{"logit_bias": {"3": "1"}}"#, "logit_bias.3", "expected a number"),
            (r#"{"logit_bias": {"3": 101}}"#, "logit_bias.3", "between -100 and 100"),
        ] {
            let e = parse_common(&obj(body), false).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(what), "{body}: {}", e.message);
        }
        let many: Map<String, Value> = (0..=MAX_LOGIT_BIAS).map(|i| (i.to_string(), json!(1))).collect();
        let mut o = Map::new();
        o.insert("logit_bias".into(), Value::Object(many));
        assert!(parse_common(&o, true).unwrap_err().message.contains("at most"));
    }

    #[test]
    fn unsupported_features_are_refused_not_ignored() {
        for body in [
            r#"{"response_format": {"type": "text"}}"#,
            r#"{"response_format": {"type": "json_object"}}"#,
            r#"{"tools": [], "tool_choice": "none"}"#,
            r#"{"functions": null, "user": "u", "metadata": {}}"#,
        ] {
            parse_common(&obj(body), true).unwrap_or_else(|e| panic!("{body}: {}", e.message));
        }
        for (body, param) in [
            (r#"{"response_format": {"type": "json_schema", "json_schema": {}}}"#, "response_format.json_schema.schema"),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": "string", "format": "date"}}}}}}"#,
                "response_format.json_schema.schema",
            ),
            (r#"{"response_format": {"type": "xml"}}"#, "response_format"),
            (r#"{"response_format": {}}"#, "response_format.type"),
            (r#"{"response_format": "json"}"#, "response_format"),
            (r#"{"tools": [{"type": "function", "function": {"name": "f"}}]}"#, "tools"),
            (r#"{"functions": [{"name": "f"}]}"#, "functions"),
            (r#"{"audio": {"voice": "alloy"}}"#, "audio"),
        ] {
            let e = parse_common(&obj(body), true).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn messages() {
        assert_eq!(parse_messages(&obj(r#"{"messages": []}"#)).unwrap_err().param.as_deref(), Some("messages"));
        assert_eq!(parse_messages(&obj(r#"{}"#)).unwrap_err().param.as_deref(), Some("messages"));
        assert_eq!(parse_messages(&obj(r#"{"messages": "hi"}"#)).unwrap_err().param.as_deref(), Some("messages"));
        let e = parse_messages(&obj(r#"{"messages": [{"role": "user", "content": 3}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = parse_messages(&obj(r#"{"messages": [{"content": "x"}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_messages(&obj(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
        let m = parse_messages(&obj(r#"{"messages": [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]}"#))
        .expect("valid");
        assert_eq!(m, vec![ChatMessage::new("system", "be brief"), ChatMessage::new("user", "ab"), ChatMessage::new("assistant", "")]);
    }

    #[test]
    fn prompts() {
        assert_eq!(parse_prompt(&obj(r#"{"prompt": "hi"}"#)).expect("ok"), Prompt::Text("hi".into()));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": ["hi"]}"#)).expect("ok"), Prompt::Text("hi".into()));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": [1, 2]}"#)).expect("ok"), Prompt::Tokens(vec![1, 2]));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": [[1, 2]]}"#)).expect("ok"), Prompt::Tokens(vec![1, 2]));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": ["a", "b"]}"#)).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": [1, "b"]}"#)).unwrap_err().param.as_deref(), Some("prompt[1]"));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": 5}"#)).unwrap_err().param.as_deref(), Some("prompt"));
        assert_eq!(parse_prompt(&obj(r#"{"prompt": "x", "echo": true}"#)).unwrap_err().param.as_deref(), Some("echo"));
        assert_eq!(parse_prompt(&obj(r#"{}"#)).unwrap_err().param.as_deref(), Some("prompt"));
    }
}
