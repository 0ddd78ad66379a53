//! `turbospark serve` (OpenAI-compatible HTTP server, continuous batching) and
//! `turbospark loadtest` (concurrent streaming clients against it). The server itself lives in
//! the `ts-server` crate; this file only parses flags and loads the model.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ts_engine::hub;
use ts_server::loadtest::{self, LoadtestOptions};
use ts_server::{ModelBundle, Server, ServerConfig};

use crate::{load, BackendKind, ModelOpts};

#[derive(Args)]
pub struct ServeArgs {
    /// Model: a .gguf file, a Hugging Face folder, or a known name (default: SmolLM2-135M-Instruct).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Compute backend. `auto` uses CUDA when a GPU is present, else the CPU.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Sequences generated at once (cache slots); more requests wait in the queue.
    #[arg(long = "max-seqs", default_value_t = 4)]
    pub max_seqs: usize,
    /// Context length of each sequence, prompt plus completion (default: min(model's, 4096)).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Requests that may wait for a slot when all are busy; beyond that, 503.
    #[arg(long = "max-queue", default_value_t = 64)]
    pub max_queue: usize,
    /// Most prompt tokens per forward pass (chunked prefill keeps decoding going during long
    /// prompts: the running sequences wait at most one chunk's prefill for their next token).
    /// Default: 1024 on a GPU, 512 on the CPU.
    // 512, not 128: on an H200 at 64 clients 7,694 against 7,253 tok/s, a quarter of the steps
    // mixing prompts with decoding (docs/PERF.md, gpu-next109/111); on CUDA 1,024, not 512:
    // 9,013 against 8,918 and 8,836 against 8,764 (gpu-next140/141, TTFT p99 75-82 ms against
    // 89-97).
    #[arg(long = "prefill-chunk")]
    pub prefill_chunk: Option<usize>,
    /// While others decode, hold new prompts back until this many prompt tokens wait (or for
    /// --prefill-wait steps), so that fewer steps mix prompts with decoding. An experiment: at 64
    /// clients on an H200 it gained nothing (docs/PERF.md). 0 (default): prefill every prompt at once.
    #[arg(long = "prefill-hold", default_value_t = 0)]
    pub prefill_hold: usize,
    /// Most steps --prefill-hold keeps a prompt waiting.
    #[arg(long = "prefill-wait", default_value_t = 8)]
    pub prefill_wait: usize,
    /// Largest request body in bytes.
    #[arg(long = "max-body-bytes", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Pad each forward to a multiple of this many rows so that a request's text does not depend
    /// on what runs beside it (4 matches the CPU kernels' row groups; 1 turns padding off). Not
    /// applied to a model whose products are batch-invariant anyway (on the CPU: every matrix of
    /// Q4_0, Q5_0, Q4_1, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16 or BF16, as the default SmolLM2,
    /// Gemma 3's Q4_K_M and DeepSeek-V2 Q8_0).
    #[arg(long = "row-multiple", default_value_t = 4)]
    pub row_multiple: usize,
    /// CPU referee mode: f32 activations in the matmuls (slower).
    #[arg(long)]
    pub exact: bool,
    /// CPU: copy the weights into memory instead of reading them from the model file's memory
    /// map (for a file that may be overwritten in place while the server runs).
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Quantise the f32/f16/bf16 weight matrices to this type as they load (see `run --help`).
    #[arg(long = "quant", value_enum)]
    pub quant: Option<crate::QuantKind>,
    /// Longest a request may take, in seconds from its arrival: a running one is then finished
    /// with finish_reason "length", one still waiting for a slot gets 503. 0: no limit.
    #[arg(long = "request-timeout", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Do not chain decode steps on the GPU. By default, when every running sequence picks
    /// greedily (temperature 0, no log-probabilities) and no request waits, the server enqueues
    /// the next step from the picks still on the GPU before they reach the host, so the host
    /// streams text while the GPU computes (CUDA; the CPU backend does not chain). The text is
    /// the same either way; a sequence that ends at a stop string costs its row one step.
    #[arg(long = "no-chain")]
    pub no_chain: bool,
    /// (Chaining is the default now; the flag is accepted for old scripts.)
    #[arg(long = "chain", hide = true, conflicts_with = "no_chain")]
    pub chain: bool,
    /// Skip the warm-up: on CUDA the server runs a prompt chunk and a few decode steps of every
    /// slot before it answers (one-time costs such as cuBLAS's start and the first graph
    /// recordings, ~0.8 s on an H200, are then not paid by the first requests). The CPU backend
    /// never warms up.
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// Compute every prompt in full. By default a new request takes the free slot whose cache
    /// already holds the longest prefix of its prompt (the last conversation's turns, a shared
    /// system prompt, a retried request) and computes only the rest, as llama.cpp's server does;
    /// `usage.prompt_tokens_details.cached_tokens` says how many tokens that saved. The text is
    /// the same either way where the backend's kernels are batch invariant (the CPU); on CUDA
    /// the cached rows may differ from recomputed ones in the last bits. Without the cache
    /// nothing computed for one request serves another, but a request's `n` choices still
    /// compute their shared prompt once.
    #[arg(long = "no-prompt-cache")]
    pub no_prompt_cache: bool,
    /// After a step that ended a quarter or more of the running requests, wait up to this many
    /// milliseconds for as many new requests before the next step, so that clients that come
    /// straight back (benchmarks, batch jobs) share one step instead of falling a step out of
    /// phase. The wait ends as soon as they are there; one that runs out pauses waiting for a
    /// second. 0 turns it off.
    #[arg(long = "gather-ms", default_value_t = 10.0)]
    pub gather_ms: f64,
    /// Ask every API request for this key (`Authorization: Bearer KEY`, what OpenAI clients send
    /// as their api_key; or `X-Api-Key: KEY`); others get 401. /health and /metrics stay open.
    /// Read from the environment when not given, so it stays out of the process list.
    #[arg(long = "api-key", env = "TURBOSPARK_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Let browser pages from this origin (e.g. http://localhost:3000) call the API and read
    /// the answers (CORS); repeatable, `*` for any origin. Without it no CORS headers are sent,
    /// so other sites' pages in a browser cannot read this server's answers.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
}

/// Loads the model once, then serves until Ctrl-C.
pub fn serve(a: ServeArgs) -> Result<()> {
    if a.max_seqs == 0 {
        bail!("--max-seqs must be at least 1");
    }
    if !(a.request_timeout >= 0.0) {
        bail!("--request-timeout must be a number of seconds, 0 for no limit");
    }
    if a.gather_ms.is_nan() || a.gather_ms < 0.0 {
        bail!("--gather-ms must be a number of milliseconds, 0 for none");
    }
    if a.prefill_chunk == Some(0) {
        bail!("--prefill-chunk must be at least 1");
    }
    if let Some(bad) =
        a.cors_origin.iter().find(|o| *o != "*" && (!(o.starts_with("http://") || o.starts_with("https://")) || o.ends_with('/')))
    {
        bail!("--cors-origin {bad:?}: give an origin as a browser sends it (scheme://host[:port], no path), or *");
    }
    let api_key = a.api_key.clone().filter(|k| !k.is_empty());
    if a.api_key.as_deref() == Some("") {
        bail!("--api-key (or TURBOSPARK_API_KEY) is empty; give a key, or leave it out for an open server");
    }
    if api_key.is_none() && !a.host.is_loopback() {
        eprintln!("turbospark: warning: listening on {} without --api-key: anyone who can reach this port can use the model", a.host);
    }
    // The forward is sized for the GPU's default chunk unless the CPU is asked for; a CPU chosen
    // by `auto` gets its own default after the load (the forward is then wider than it needs).
    let (gpu_chunk, cpu_chunk) = (1024, 512);
    let provisional = if a.backend == BackendKind::Cpu { cpu_chunk } else { gpu_chunk };
    let mut cfg = ServerConfig {
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk.unwrap_or(provisional),
        prefill_hold: a.prefill_hold,
        prefill_wait: a.prefill_wait,
        max_body_bytes: a.max_body_bytes,
        handle_ctrl_c: true,
        row_multiple: a.row_multiple.max(1),
        request_timeout: (a.request_timeout > 0.0).then(|| std::time::Duration::from_secs_f64(a.request_timeout.min(1e9))),
        chain: !a.no_chain,
        prompt_cache: !a.no_prompt_cache,
        gather: std::time::Duration::from_secs_f64(a.gather_ms.clamp(0.0, 1000.0) / 1e3),
        api_key: api_key.map(ts_server::ApiKey),
        cors_origins: a.cors_origin.clone(),
        ..ServerConfig::default()
    };
    // Slots (plus the pad slot) and the widest forward a step makes; the context comes from
    // --ctx-size or the model.
    let ro = cfg.runtime_options(a.max_seqs, a.ctx_size.unwrap_or(0));
    let o = ModelOpts {
        model: a.model.clone(),
        backend: a.backend,
        threads: a.threads,
        ctx_size: a.ctx_size,
        exact: a.exact,
        batch_size: Some(ro.max_batch),
        no_mmap: a.no_mmap,
        quant: a.quant,
        // Q4_K/Q5_K/Q6_K products of 1-3 rows on the tiled kernel: a model of them needs no
        // padded forwards to keep texts independent of the batch (--row-multiple).
        invariant: true,
    };
    let l = load::load(&o, Some(&hub::SMOLLM2), ro.n_slots)?;
    let file = l.path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_else(|| "model".into());
    let ctx = l.model.options().ctx;
    let bundle = ModelBundle::from_metadata(l.model, l.src.metadata(), &file).with_context(|| format!("{}", l.path.display()))?;
    cfg.warmup = !a.no_warmup && l.backend_name.starts_with("cuda");
    if a.prefill_chunk.is_none() && !l.backend_name.starts_with("cuda") {
        cfg.prefill_chunk = cpu_chunk;
    }
    let t = std::time::Instant::now();
    let (warmup, keyed) = (cfg.warmup, cfg.api_key.is_some());
    let server = Server::start(bundle, cfg, SocketAddr::new(a.host, a.port))?;
    if warmup {
        eprintln!("turbospark: warmed up in {:.2}s (--no-warmup skips it)", t.elapsed().as_secs_f64());
    }
    eprintln!(
        "turbospark: serving {} at {} ({} sequences of {} tokens, backend {}{}); POST /v1/chat/completions, /v1/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics",
        server.model_id(),
        server.url(),
        a.max_seqs,
        ctx,
        l.backend_name,
        if keyed { ", API key required" } else { "" }
    );
    // `l.src` (the mapped file) stays alive until the server stops.
    let r = server.wait();
    drop(l.src);
    r
}

#[derive(Args)]
pub struct LoadtestArgs {
    /// Server URL (loopback only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Concurrent streaming clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Seconds during which clients start new requests.
    #[arg(long, default_value_t = 20.0)]
    pub duration: f64,
    /// max_tokens of each request.
    #[arg(long = "max-tokens", default_value_t = 64)]
    pub max_tokens: usize,
    /// Prompt of each request.
    #[arg(long, default_value = "Write a short story about a robot who learns to paint.")]
    pub prompt: String,
    /// Send raw completions (/v1/completions) instead of chat.
    #[arg(long)]
    pub raw: bool,
    /// Sampling temperature (each client has its own seed).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Send raw completions whose prompt is N token ids instead of text (for models without a
    /// tokenizer, e.g. `turbospark synth` checkpoints); implies --raw.
    #[arg(long = "prompt-ids", value_name = "N")]
    pub prompt_ids: Option<usize>,
    /// A new prompt for every request (its number first, or token ids shifted by it) instead of
    /// each client repeating its own: the server's prompt cache then finds nothing to reuse, so
    /// every prompt is computed in full (the `prompts:` line says how many tokens came from the
    /// cache either way).
    #[arg(long = "fresh-prompts")]
    pub fresh_prompts: bool,
    /// The server's API key (`serve --api-key`).
    #[arg(long = "api-key", env = "TURBOSPARK_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// Runs the load test and prints its report.
pub fn loadtest(a: LoadtestArgs) -> Result<()> {
    if !(a.duration.is_finite() && a.duration > 0.0 && a.duration <= 3600.0) {
        bail!("--duration must be between 0 and 3600 seconds");
    }
    let o = LoadtestOptions {
        url: a.url.clone(),
        clients: a.clients,
        duration: Duration::from_secs_f64(a.duration),
        max_tokens: a.max_tokens.max(1),
        prompt: a.prompt.clone(),
        chat: !a.raw && a.prompt_ids.is_none(),
        temperature: a.temperature,
        prompt_ids: a.prompt_ids.map(|n| n.max(1)),
        fresh_prompts: a.fresh_prompts,
        api_key: a.api_key.clone(),
    };
    eprintln!(
        "turbospark: loadtest {} with {} streaming clients for {:.1} s (max_tokens {}, {})",
        a.url,
        a.clients,
        a.duration,
        o.max_tokens,
        if o.chat { "chat" } else { "completions" }
    );
    let r = loadtest::run(&o)?;
    println!("{}", r.summary());
    if r.completed == 0 {
        bail!("no request completed");
    }
    Ok(())
}
