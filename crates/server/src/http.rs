//! Routes and handlers: parse → tokenise → validate lengths → submit to the engine → answer
//! (one JSON object, or an SSE stream of chunks ending `data: [DONE]`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::stream::{BoxStream, SelectAll};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc::{channel, Receiver};
use ts_engine::{ChatTemplate, Tokenizer};

use crate::api::{self, Common, Meta, Prompt};
use crate::engine::{Engine, Event, Finish, Job, TokenLogprob, Usage, EVENT_BUFFER};
use crate::error::ApiError;
use crate::metrics::Metrics;

/// What every handler shares.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    /// Other names accepted in `model` (compared case-insensitively, like the id).
    pub aliases: Vec<String>,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    pub metrics: Arc<Metrics>,
    /// Request counter for ids.
    pub counter: AtomicU64,
    /// Longest a generation request may take from arrival (`--request-timeout`); `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// The key `/v1/*`, `/tokenize` and `/detokenize` ask for (`--api-key`), as
    /// `Authorization: Bearer KEY` or `X-Api-Key: KEY`; `None`: open. `/health` and `/metrics`
    /// stay open (probes and scrapers).
    pub api_key: Option<String>,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The CORS policy for `origins` (`serve --cors-origin`): none when empty (browsers then keep
/// other sites' pages from reading the answers); `*` allows every origin. Preflights are
/// answered here, before the key check (browsers send them without credentials).
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| axum::http::HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
            .allow_headers(Any)
            .max_age(Duration::from_secs(600)),
    )
}

/// The router over `state`, refusing bodies over `max_body_bytes`, with the CORS policy for
/// `cors_origins` (none when empty).
pub fn router(state: Arc<AppState>, max_body_bytes: usize, cors_origins: &[String]) -> Router {
    let keyed = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_one))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_key));
    let app = Router::new()
        .merge(keyed)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state);
    match cors(cors_origins) {
        Some(c) => app.layer(c),
        None => app,
    }
}

/// Equal without an early exit at the first differing byte, so the time a refusal takes says
/// nothing of how much of the key was right (the length is not secret).
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// With `--api-key`, a request without the key gets OpenAI's 401 before its handler runs.
async fn require_key(State(st): State<Arc<AppState>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let Some(key) = st.api_key.as_deref() else { return next.run(req).await };
    let h = req.headers();
    let given = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    let e = match given {
        Some(g) if same_bytes(g.as_bytes(), key.as_bytes()) => return next.run(req).await,
        Some(_) => ApiError::unauthorized("Incorrect API key provided."),
        None => ApiError::unauthorized(
            "You didn't provide an API key. This server needs one: send it as 'Authorization: Bearer KEY' (the OpenAI clients' api_key).",
        ),
    };
    record(&st, "auth", e.into_response())
}

fn record(st: &AppState, route: &'static str, r: Response) -> Response {
    st.metrics.response(route, r.status().as_u16());
    r
}

async fn not_found(State(st): State<Arc<AppState>>, uri: axum::http::Uri, method: axum::http::Method) -> Response {
    let e = ApiError::not_found(format!(
        "{method} {}: no such route (routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /metrics)",
        uri.path()
    ));
    record(&st, "other", e.into_response())
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    // Out of service (several forward passes in a row failed): 503 with the reason, so that a
    // load balancer or a supervisor takes the server out and restarts it.
    if let Some(why) = m.out_of_service() {
        let body = json!({ "status": "error", "error": why, "model": st.model_id });
        return record(&st, "health", (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response());
    }
    let body = json!({
        "status": "ok",
        "model": st.model_id,
        "slots_total": st.engine.n_slots(),
        "slots_busy": m.active_seqs.load(Relaxed),
        "queue_depth": m.queue_depth.load(Relaxed),
        "ctx_size": st.engine.ctx(),
    });
    record(&st, "health", axum::Json(body).into_response())
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.response("metrics", 200);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.render()).into_response()
}

/// `POST /tokenize` (llama.cpp's server shape): `{"content": TEXT, "add_special": false,
/// "parse_special": true, "with_pieces": false}` → `{"tokens": [ids]}`, or with pieces
/// `{"tokens": [{"id": ID, "piece": TEXT}]}` (a piece that is not whole UTF-8 is given as its
/// bytes). For the ids a `logit_bias` or a token prompt needs.
async fn tokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let st2 = st.clone();
    let r = tokio::task::spawn_blocking(move || tokenize_inner(&st2, body))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("tokenising failed: {e}"))));
    record(&st, "tokenize", r.map_or_else(IntoResponse::into_response, |v| axum::Json(v).into_response()))
}

fn tokenize_inner(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Value, ApiError> {
    let obj = api::parse_body(&body.map_err(body_error)?)?;
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.as_str(),
        None | Some(Value::Null) => return Err(ApiError::invalid("content", "Missing required parameter: 'content'.")),
        Some(_) => return Err(ApiError::invalid("content", "Invalid type for 'content': expected a string.")),
    };
    let flag = |k: &str, default: bool| match obj.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(k, format!("Invalid type for '{k}': expected a boolean."))),
    };
    let (add_special, parse_special, pieces) = (flag("add_special", false)?, flag("parse_special", true)?, flag("with_pieces", false)?);
    let tok = &st.tokenizer;
    let ids = tok
        .encode_with(content, add_special, parse_special)
        .map_err(|e| ApiError::invalid("content", format!("The text could not be tokenised: {e}")))?;
    let tokens: Vec<Value> = if pieces {
        ids.iter()
            .map(|&id| {
                let b = tok.token_bytes(id, true);
                let piece = match std::str::from_utf8(&b) {
                    Ok(s) => json!(s),
                    Err(_) => json!(b.as_ref()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(json!({ "tokens": tokens }))
}

/// `POST /detokenize`: `{"tokens": [ids]}` → `{"content": TEXT}` (special tokens written out).
async fn detokenize(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let r = (|| -> Result<Value, ApiError> {
        let obj = api::parse_body(&body.map_err(body_error)?)?;
        let nv = st.tokenizer.vocab_size();
        let ids = match obj.get("tokens") {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_u64() {
                    Some(t) if (t as usize) < nv => Ok(t as u32),
                    _ => Err(ApiError::invalid(
                        format!("tokens[{i}]"),
                        format!("'tokens[{i}]' is {v}, not a token id of this vocabulary (0..{nv})."),
                    )),
                })
                .collect::<Result<Vec<u32>, _>>()?,
            None | Some(Value::Null) => return Err(ApiError::invalid("tokens", "Missing required parameter: 'tokens'.")),
            Some(_) => return Err(ApiError::invalid("tokens", "Invalid type for 'tokens': expected an array of token ids.")),
        };
        Ok(json!({ "content": st.tokenizer.decode_with(&ids, true) }))
    })();
    record(&st, "tokenize", r.map_or_else(IntoResponse::into_response, |v| axum::Json(v).into_response()))
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.created, "owned_by": "turbospark"})
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let body = json!({"object": "list", "data": [model_object(&st)]});
    record(&st, "models", axum::Json(body).into_response())
}

async fn model_one(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let r = match check_model(&st, Some(&id)) {
        Ok(()) => axum::Json(model_object(&st)).into_response(),
        Err(e) => e.into_response(),
    };
    record(&st, "models", r)
}

/// Accepts the loaded model's id and aliases (any case); a missing `model` means the loaded one.
fn check_model(st: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    let Some(m) = model else { return Ok(()) };
    let ok = m.eq_ignore_ascii_case(&st.model_id) || st.aliases.iter().any(|a| a.eq_ignore_ascii_case(m));
    if ok {
        return Ok(());
    }
    Err(ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("The model '{m}' does not exist on this server; it serves '{}' (GET /v1/models).", st.model_id),
        kind: "invalid_request_error",
        param: Some("model".into()),
        code: Some("model_not_found"),
    })
}

fn body_error(r: BytesRejection) -> ApiError {
    let status = r.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::bad_request(format!("The request body is too large: {}", r.body_text()))
            .with_status(status)
            .with_code("request_too_large")
    } else {
        ApiError::bad_request(format!("Could not read the request body: {}", r.body_text())).with_status(status)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    // Rendering (a child process for model-supplied templates) and tokenising block: off the
    // async workers.
    let st2 = st.clone();
    let r = match tokio::task::spawn_blocking(move || chat_inner(&st2, body)).await {
        Ok(Ok((c, ids))) => generate(&st, Kind::Chat, c, ids, arrived).await,
        Ok(Err(e)) => Err(e),
        Err(e) => Err(ApiError::internal(format!("preparing the prompt failed: {e}"))),
    };
    record(&st, "chat", r.unwrap_or_else(IntoResponse::into_response))
}

fn chat_inner(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<(Common, Vec<u32>), ApiError> {
    let body = body.map_err(body_error)?;
    let obj = api::parse_body(&body)?;
    let c = api::parse_common(&obj, true)?;
    check_model(st, c.model.as_deref())?;
    check_bias(st, &c)?;
    let msgs = api::parse_messages(&obj)?;
    let tok = &st.tokenizer;
    let bos = tok.bos().and_then(|b| tok.token_str(b)).unwrap_or("");
    let eos = tok.eos().and_then(|b| tok.token_str(b)).unwrap_or("");
    let text = st
        .template
        .render(&msgs, true, bos, eos)
        .map_err(|e| ApiError::invalid("messages", format!("The chat template could not render these messages: {e}")))?;
    // The template may already start with BOS; do not add a second one.
    let has_bos = !bos.is_empty() && text.starts_with(bos);
    let ids = tok
        .encode_with(&text, tok.add_bos() && !has_bos, true)
        .map_err(|e| ApiError::internal(format!("tokenising the prompt failed: {e}")))?;
    Ok((c, ids))
}

async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrived = Instant::now();
    // (tokenising a long prompt blocks: off the async workers, as for chat)
    let st2 = st.clone();
    let r = match tokio::task::spawn_blocking(move || completions_inner(&st2, body)).await {
        Ok(Ok((c, ids))) => generate(&st, Kind::Completion, c, ids, arrived).await,
        Ok(Err(e)) => Err(e),
        Err(e) => Err(ApiError::internal(format!("preparing the prompt failed: {e}"))),
    };
    record(&st, "completions", r.unwrap_or_else(IntoResponse::into_response))
}

fn completions_inner(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<(Common, Vec<u32>), ApiError> {
    let body = body.map_err(body_error)?;
    let obj = api::parse_body(&body)?;
    let c = api::parse_common(&obj, false)?;
    check_model(st, c.model.as_deref())?;
    check_bias(st, &c)?;
    let tok = &st.tokenizer;
    let ids = match api::parse_prompt(&obj)? {
        Prompt::Text(t) => {
            let bos = tok.bos().and_then(|b| tok.token_str(b)).unwrap_or("");
            let has_bos = !bos.is_empty() && t.starts_with(bos);
            tok.encode_with(&t, tok.add_bos() && !has_bos, true)
                .map_err(|e| ApiError::internal(format!("tokenising the prompt failed: {e}")))?
        }
        Prompt::Tokens(ids) => {
            let nv = tok.vocab_size();
            if let Some((i, t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= nv) {
                return Err(ApiError::invalid(format!("prompt[{i}]"), format!("Token id {t} is outside the vocabulary (0..{nv}).")));
            }
            ids
        }
    };
    Ok((c, ids))
}

/// Every `logit_bias` id inside the vocabulary (the parser cannot know its size).
fn check_bias(st: &AppState, c: &Common) -> Result<(), ApiError> {
    let nv = st.tokenizer.vocab_size();
    match c.sampling.logit_bias.iter().find(|e| e.0 as usize >= nv) {
        Some(&(id, _)) => {
            Err(ApiError::invalid("logit_bias", format!("Invalid key in 'logit_bias': token id {id} is outside the vocabulary (0..{nv}).")))
        }
        None => Ok(()),
    }
}

/// Length checks, submission, then the answer (streamed or whole).
async fn generate(st: &Arc<AppState>, kind: Kind, c: Common, prompt: Vec<u32>, arrived: Instant) -> Result<Response, ApiError> {
    let ctx = st.engine.ctx();
    let pparam = if kind == Kind::Chat { "messages" } else { "prompt" };
    if prompt.is_empty() {
        return Err(ApiError::invalid(pparam, "The prompt is empty (no tokens)."));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(
            pparam,
            format!(
                "The prompt is {} tokens, but this server's context holds {ctx} tokens (prompt and completion together); shorten the prompt.",
                prompt.len()
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let max_tokens = match c.max_tokens {
        Some(m) if m > ctx => {
            return Err(ApiError::invalid("max_tokens", format!("'max_tokens' is {m}, but this server's context holds {ctx} tokens."))
                .with_code("context_length_exceeded"))
        }
        Some(m) if prompt.len() + m > ctx => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "The prompt ({} tokens) plus 'max_tokens' ({m}) is {} tokens, beyond this server's context of {ctx}; lower max_tokens to at most {}.",
                    prompt.len(),
                    prompt.len() + m,
                    ctx - prompt.len()
                ),
            )
            .with_code("context_length_exceeded"))
        }
        Some(m) => m,
        None => ctx - prompt.len(),
    };
    if c.json.is_some() && !st.engine.json_ready() {
        return Err(ApiError::invalid(
            "response_format",
            "JSON mode needs a vocabulary that can write JSON, and this model's tokens cannot (it has no tokenizer).",
        ));
    }
    if c.n > st.engine.capacity() {
        return Err(ApiError::invalid(
            "n",
            format!("'n' is {}, but this server runs and queues at most {} sequences at once.", c.n, st.engine.capacity()),
        ));
    }
    let n_prompt = prompt.len();
    // One sequence a choice; choice i of a seeded request samples with seed + i (so choice 0
    // is the text the same request with n = 1 gives).
    let mut rxs = Vec::with_capacity(c.n);
    let jobs = (0..c.n.max(1))
        .map(|i| {
            let (tx, rx) = channel(EVENT_BUFFER);
            rxs.push(rx);
            let mut sampling = c.sampling.clone();
            sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
            Job {
                prompt: prompt.clone(),
                sampling,
                max_tokens,
                stop: c.stop.clone(),
                top_logprobs: c.top_logprobs,
                json: c.json.clone(),
                events: tx,
                arrived,
                deadline: st.request_timeout.and_then(|t| arrived.checked_add(t)),
                group: 0,
            }
        })
        .collect();
    st.engine.submit_all(jobs)?;
    let rx = merge(rxs);
    let n = st.counter.fetch_add(1, Relaxed);
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let now = unix_now();
    let meta = Meta { id: format!("{prefix}-{now:x}{n:06x}"), created: now, model: st.model_id.clone() };
    if c.stream {
        Ok(stream_response(kind, meta, c, rx))
    } else {
        whole_response(kind, meta, c, rx, n_prompt).await
    }
}

/// The events of a request's choices as one stream of `(choice, event)`. Dropping it drops
/// every choice's receiver, which stops their sequences.
type Merged = SelectAll<BoxStream<'static, (usize, Event)>>;

fn merge(rxs: Vec<Receiver<Event>>) -> Merged {
    futures_util::stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) }).map(move |e| (i, e)).boxed()
    }))
}

/// A request's usage from its choices' (OpenAI's count for `n` > 1): the prompt once, the
/// completions summed; cached tokens are those every choice read from the cache.
fn add_usage(acc: &mut Option<Usage>, u: Usage) {
    *acc = Some(match *acc {
        None => u,
        Some(a) => Usage { prompt: a.prompt, cached: a.cached.min(u.cached), completion: a.completion + u.completion },
    });
}

async fn whole_response(kind: Kind, meta: Meta, c: Common, mut rx: Merged, n_prompt: usize) -> Result<Response, ApiError> {
    let n = c.n.max(1);
    let mut texts = vec![String::new(); n];
    let mut lps: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
    let mut finishes: Vec<Option<Finish>> = vec![None; n];
    let mut total = None;
    while let Some((i, ev)) = rx.next().await {
        match ev {
            Event::Delta { text: t, logprobs } => {
                texts[i].push_str(&t);
                lps[i].extend(logprobs);
            }
            Event::Done { finish, usage } => {
                finishes[i] = Some(finish);
                add_usage(&mut total, usage);
                if finishes.iter().all(Option::is_some) {
                    let choices: Vec<api::Choice<'_>> = (0..n)
                        .map(|j| api::Choice {
                            text: &texts[j],
                            finish: finishes[j].unwrap_or(Finish::Stop),
                            logprobs: c.top_logprobs.map(|_| lps[j].as_slice()),
                        })
                        .collect();
                    let usage = total.unwrap_or(usage);
                    let v = match kind {
                        Kind::Chat => api::chat_response(&meta, &choices, usage),
                        Kind::Completion => api::completion_response(&meta, &choices, usage),
                    };
                    return Ok(axum::Json(v).into_response());
                }
            }
            Event::Failed(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
            Event::Unavailable(e) => return Err(ApiError::unavailable(e, "timeout")),
        }
    }
    Err(ApiError::internal(format!("the engine dropped the request ({n_prompt} prompt tokens) without finishing it")))
}

enum Phase {
    Start,
    Running,
    Over,
}

struct StreamState {
    kind: Kind,
    meta: Meta,
    include_usage: bool,
    logprobs: bool,
    rx: Merged,
    phase: Phase,
    /// Per choice: text offset (characters) for legacy completions logprobs.
    offsets: Vec<usize>,
    /// Choices not yet finished.
    open: usize,
    /// The finished choices' usage so far.
    usage: Option<Usage>,
}

fn sse(buf: &mut String, v: &Value) {
    buf.push_str("data: ");
    buf.push_str(&v.to_string());
    buf.push_str("\n\n");
}

impl StreamState {
    fn delta(&mut self, i: usize, text: &str, lps: &[TokenLogprob], finish: Option<Finish>) -> Value {
        match self.kind {
            Kind::Chat => {
                let lp = self.logprobs.then(|| api::chat_logprobs(lps));
                let delta = if finish.is_some() && text.is_empty() { json!({}) } else { json!({"content": text}) };
                api::chat_chunk(&self.meta, i, delta, finish, lp, self.include_usage)
            }
            Kind::Completion => {
                let lp = self.logprobs.then(|| api::completion_logprobs(lps, &mut self.offsets[i]));
                api::completion_chunk(&self.meta, i, text, finish, lp, self.include_usage)
            }
        }
    }

    /// The next bytes of the stream, or None at its end.
    async fn next(&mut self) -> Option<Bytes> {
        let mut out = String::new();
        match self.phase {
            Phase::Over => return None,
            Phase::Start => {
                self.phase = Phase::Running;
                if self.kind == Kind::Chat {
                    for i in 0..self.offsets.len() {
                        let v = api::chat_chunk(&self.meta, i, json!({"role": "assistant", "content": ""}), None, None, self.include_usage);
                        sse(&mut out, &v);
                    }
                    return Some(Bytes::from(out));
                }
            }
            Phase::Running => {}
        }
        match self.rx.next().await {
            Some((i, Event::Delta { text, logprobs })) => {
                let v = self.delta(i, &text, &logprobs, None);
                sse(&mut out, &v);
            }
            Some((i, Event::Done { finish, usage })) => {
                let v = self.delta(i, "", &[], Some(finish));
                sse(&mut out, &v);
                add_usage(&mut self.usage, usage);
                self.open = self.open.saturating_sub(1);
                if self.open == 0 {
                    if self.include_usage {
                        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                        sse(&mut out, &api::usage_chunk(&self.meta, object, self.usage.unwrap_or(usage)));
                    }
                    out.push_str("data: [DONE]\n\n");
                    self.phase = Phase::Over;
                }
            }
            Some((_, Event::Failed(e))) => {
                sse(&mut out, &ApiError::internal(format!("generation failed: {e}")).body());
                out.push_str("data: [DONE]\n\n");
                self.phase = Phase::Over;
            }
            Some((_, Event::Unavailable(e))) => {
                sse(&mut out, &ApiError::unavailable(e, "timeout").body());
                out.push_str("data: [DONE]\n\n");
                self.phase = Phase::Over;
            }
            None => {
                sse(&mut out, &ApiError::internal("the engine dropped the request without finishing it").body());
                out.push_str("data: [DONE]\n\n");
                self.phase = Phase::Over;
            }
        }
        Some(Bytes::from(out))
    }
}

/// An SSE response; dropping it (client gone) drops `rx`, which stops the sequences.
fn stream_response(kind: Kind, meta: Meta, c: Common, rx: Merged) -> Response {
    let n = c.n.max(1);
    let st = StreamState {
        kind,
        meta,
        include_usage: c.include_usage,
        logprobs: c.top_logprobs.is_some(),
        rx,
        phase: Phase::Start,
        offsets: vec![0; n],
        open: n,
        usage: None,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move { st.next().await.map(|b| (Ok::<Bytes, Infallible>(b), st)) });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .header("x-accel-buffering", "no")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| ApiError::internal(format!("building the stream response failed: {e}")).into_response())
}
