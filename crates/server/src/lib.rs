//! # ts-server — `turbospark serve`: an OpenAI-compatible HTTP server with continuous batching
//!
//! * [`engine`]  — the engine thread: owns the model, batches every live sequence into one
//!   forward per step (decode tokens + chunked prefill), one [`ts_engine::Sampler`] per sequence,
//!   admission over a pool of cache slots with a bounded queue, early exit for clients that left.
//! * [`http`]    — axum routes: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as
//!   SSE or whole), `GET /v1/models`, `GET /health`, `GET /metrics`.
//! * [`api`]     — OpenAI request parsing (a 400 naming the field for each malformed value) and
//!   response / chunk shapes.
//! * [`stop`]    — stop strings over streamed text (a partial stop string never leaves the server).
//! * [`metrics`] — counters, gauges and the time-to-first-token histogram, as Prometheus text.
//! * [`client`]  — a minimal HTTP/1.1 + SSE client (loopback), for [`loadtest`] and the tests.
//! * [`loadtest`] — `turbospark loadtest`: N streaming clients, aggregate tok/s and TTFT.
//!
//! [`Server::start`] binds, starts the engine and serves on a background thread; the CLI calls
//! [`Server::wait`], tests call [`Server::shutdown`].

pub mod api;
pub mod client;
pub mod engine;
pub mod error;
pub mod http;
pub mod loadtest;
pub mod metrics;
pub mod stop;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use ts_engine::{ChatTemplate, Tokenizer};
use ts_models::Model;

pub use engine::{Engine, EngineConfig};
pub use error::ApiError;
pub use metrics::Metrics;

/// `system_fingerprint` in responses.
pub const FINGERPRINT: &str = concat!("turbospark-", env!("CARGO_PKG_VERSION"));

/// A loaded model with what the server needs beside it.
pub struct ModelBundle {
    /// Loaded with [`ServerConfig::runtime_options`] (slots and widest forward).
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// The id clients see in `/v1/models` and send as `model`.
    pub id: String,
    /// Other accepted `model` names.
    pub aliases: Vec<String>,
}

impl ModelBundle {
    /// Tokenizer and chat template from the model's metadata; `id` from `file_name` (without
    /// `.gguf`). Aliases: `general.name`, the known-model names when the file is a known model,
    /// and `default`.
    pub fn from_metadata(model: Box<dyn Model>, md: &BTreeMap<String, ts_formats::Value>, file_name: &str) -> Result<Self> {
        let tokenizer = Tokenizer::from_gguf_metadata(md).context("tokenizer")?;
        let template = ChatTemplate::from_gguf_metadata(md).context("chat template")?;
        let id = file_name.strip_suffix(".gguf").unwrap_or(file_name).to_string();
        let mut aliases = vec!["default".to_string()];
        if let Some(n) = md.get("general.name").and_then(|v| v.as_str()).filter(|n| !n.is_empty()) {
            aliases.push(n.to_string());
        }
        for k in ts_engine::hub::KNOWN {
            if k.file.eq_ignore_ascii_case(file_name) {
                aliases.extend(k.aliases.iter().map(|a| a.to_string()));
            }
        }
        aliases.retain(|a| !a.eq_ignore_ascii_case(&id));
        Ok(ModelBundle { model, tokenizer, template, id, aliases })
    }
}

/// Server limits beyond the model's runtime options.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests that may wait for a slot when all are busy; more get 503.
    pub max_queue: usize,
    /// Most prompt tokens per forward (chunked prefill).
    pub prefill_chunk: usize,
    /// [`EngineConfig::prefill_hold`] and [`EngineConfig::prefill_wait`] (`--prefill-hold`,
    /// `--prefill-wait`): new prompts held back while others decode, up to that many tokens or
    /// steps. 0 tokens: off.
    pub prefill_hold: usize,
    pub prefill_wait: usize,
    /// Largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
    /// Stop on Ctrl-C / SIGINT (the CLI; not tests).
    pub handle_ctrl_c: bool,
    /// Tokio worker threads for HTTP (the engine has its own thread).
    pub http_threads: usize,
    /// Pad every forward to a multiple of this many rows so a request's text does not depend on
    /// its batch-mates (see [`engine`], "Batch invariance"); 4 matches the CPU kernels, 1 is off.
    pub row_multiple: usize,
    /// Longest a generation request may take from its arrival: a running one is then finished
    /// with `finish_reason` "length", one still waiting for a slot is answered 503; its slot is
    /// freed either way. `None`: no limit.
    pub request_timeout: Option<std::time::Duration>,
    /// [`EngineConfig::chain`]: greedy steps chained on the device where the model can
    /// (`serve --chain`; off until measured on a GPU).
    pub chain: bool,
    /// [`EngineConfig::warmup`]: forwards of the server's own shapes before it answers
    /// (`serve --warmup`; on by default for CUDA, where the first steps pay one-time costs).
    pub warmup: bool,
    /// [`EngineConfig::prompt_cache`]: a new request reuses a free slot's cache rows for the
    /// prompt prefix they hold (on; `serve --no-prompt-cache` turns it off).
    pub prompt_cache: bool,
    /// [`EngineConfig::gather`]: the longest wait for returning clients after a step that ended
    /// many sequences (`serve --gather-ms`, 10 by default there; none in the library's default).
    pub gather: std::time::Duration,
    /// The key the API routes ask for (`serve --api-key`, [`http::AppState::api_key`]); `None`:
    /// open.
    pub api_key: Option<ApiKey>,
    /// Origins whose browser pages may read the answers (`serve --cors-origin`; `*`: any);
    /// empty: no CORS headers.
    pub cors_origins: Vec<String>,
}

/// A secret that `Debug` does not print (configurations get logged).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// [`ServerConfig::request_timeout`]'s default (`--request-timeout 600`).
pub const DEFAULT_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_queue: 64,
            prefill_chunk: 512,
            prefill_hold: 0,
            prefill_wait: 8,
            max_body_bytes: 4 << 20,
            handle_ctrl_c: false,
            http_threads: 2,
            row_multiple: 4,
            request_timeout: Some(DEFAULT_REQUEST_TIMEOUT),
            chain: false,
            warmup: false,
            prompt_cache: true,
            gather: std::time::Duration::ZERO,
            api_key: None,
            cors_origins: Vec::new(),
        }
    }
}

impl ServerConfig {
    /// The engine's part of the configuration.
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            max_queue: self.max_queue,
            prefill_chunk: self.prefill_chunk,
            prefill_hold: self.prefill_hold,
            prefill_wait: self.prefill_wait,
            row_multiple: self.row_multiple,
            chain: self.chain,
            warmup: self.warmup,
            prompt_cache: self.prompt_cache,
            gather: self.gather,
        }
    }

    /// How to load the model to serve `max_seqs` sequences of `ctx` tokens: the slots (plus the
    /// pad slot) and the widest forward a step makes.
    pub fn runtime_options(&self, max_seqs: usize, ctx: usize) -> ts_models::RuntimeOptions {
        let e = self.engine();
        ts_models::RuntimeOptions { ctx, n_slots: e.model_slots(max_seqs), max_batch: e.max_batch(max_seqs) }
    }
}

/// A running server.
pub struct Server {
    addr: SocketAddr,
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    model_id: String,
    stop_tx: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Server {
    /// Binds `addr` (port 0 picks a free one), starts the engine over `bundle.model` and serves
    /// on a background thread. Returns once the socket listens.
    pub fn start(bundle: ModelBundle, cfg: ServerConfig, addr: SocketAddr) -> Result<Server> {
        let listener = std::net::TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let metrics = Arc::new(Metrics::default());
        let tokenizer = Arc::new(bundle.tokenizer);
        let engine = Engine::start(bundle.model, tokenizer.clone(), cfg.engine(), metrics.clone())?;
        let state = Arc::new(http::AppState {
            engine: engine.clone(),
            tokenizer,
            template: bundle.template,
            model_id: bundle.id.clone(),
            aliases: bundle.aliases,
            created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            metrics: metrics.clone(),
            counter: AtomicU64::new(0),
            request_timeout: cfg.request_timeout,
            api_key: cfg.api_key.as_ref().map(|k| k.0.clone()),
        });
        let app = http::router(state, cfg.max_body_bytes, &cfg.cors_origins);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.http_threads.max(1))
            .thread_name("ts-http")
            .enable_all()
            .build()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let ctrl_c = cfg.handle_ctrl_c;
        let thread = std::thread::Builder::new().name("ts-serve".into()).spawn(move || -> Result<()> {
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let stop = async move {
                    if ctrl_c {
                        tokio::select! {
                            _ = stop_rx => {}
                            _ = tokio::signal::ctrl_c() => { eprintln!("turbospark: stopping (Ctrl-C)"); }
                        }
                    } else {
                        let _ = stop_rx.await;
                    }
                };
                axum::serve(listener, app).with_graceful_shutdown(stop).await?;
                Ok(())
            })
        })?;
        Ok(Server { addr, engine, metrics, model_id: bundle.id, stop_tx: Some(stop_tx), thread: Some(thread) })
    }

    /// The address served (with the real port).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The model id served.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The live metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The engine (slots, occupancy).
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Blocks until the server stops (Ctrl-C with [`ServerConfig::handle_ctrl_c`]).
    pub fn wait(mut self) -> Result<()> {
        let r = self.join();
        self.engine.shutdown();
        r
    }

    /// Stops the engine (running requests end with an error) and the HTTP server.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop()
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?,
            None => Ok(()),
        }
    }

    fn stop(&mut self) -> Result<()> {
        self.engine.shutdown();
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        self.join()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
