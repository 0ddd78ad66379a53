//! A server whose backend stops working (a GPU that lost its context fails every forward) says
//! so: each failed step fails its requests with 500 and the server goes on, but after
//! `UNHEALTHY_AFTER` failed steps in a row `/health` answers 503 with the reason, `/metrics`
//! has `turbospark_healthy 0`, and new requests are refused with 503 and code `engine_failed`
//! instead of failing one by one. SmolLM2 on the CPU, wrapped in a model that fails on demand.

mod common;

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

use common::*;
use serde_json::{json, Value};
use ts_core::BatchMeta;
use ts_models::{Model, ModelError, ModelInfo, Outputs, RuntimeOptions};
use ts_server::ServerConfig;

/// The real model, or an error from every forward while `fail` is set.
struct Failing {
    inner: Box<dyn Model>,
    fail: Arc<AtomicBool>,
}

impl Model for Failing {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn options(&self) -> RuntimeOptions {
        self.inner.options()
    }
    fn copy_prefix(&mut self, src: u32, dst: u32, n: usize) -> ts_models::Result<()> {
        self.inner.copy_prefix(src, dst, n)
    }
    fn forward_outputs(&mut self, batch: &BatchMeta, out: Outputs<'_>) -> ts_models::Result<()> {
        if self.fail.load(Relaxed) {
            return Err(ModelError::Run("CUDA_ERROR_LAUNCH_FAILED (injected)".into()));
        }
        self.inner.forward_outputs(batch, out)
    }
}

#[test]
fn a_backend_that_keeps_failing_takes_the_server_out_of_service() {
    let fail = Arc::new(AtomicBool::new(false));
    let f2 = fail.clone();
    let s = start_wrapped(2, 256, ServerConfig { prefill_chunk: 64, ..ServerConfig::default() }, move |inner| {
        Box::new(Failing { inner, fail: f2 })
    });
    let addr = s.addr();
    let req = json!({"model": s.model_id(), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    rt().block_on(async {
        let (st, v) = post(addr, "/v1/completions", &req).await;
        assert_eq!(st, 200, "{v}");
        fail.store(true, Relaxed);
        for k in 0..ts_server::metrics::UNHEALTHY_AFTER {
            let (st, v) = post(addr, "/v1/completions", &req).await;
            assert_eq!(st, 500, "request {k} in a failed step: {v}");
            let msg = v["error"]["message"].as_str().unwrap_or_default();
            assert!(msg.contains("CUDA_ERROR_LAUNCH_FAILED"), "the backend's error reaches the client: {v}");
        }
        let (st, t) = get(addr, "/health").await;
        assert_eq!(st, 503, "{t}");
        let h: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(h["status"], "error");
        let why = h["error"].as_str().unwrap_or_default();
        assert!(why.contains("forward passes in a row failed") && why.contains("CUDA_ERROR_LAUNCH_FAILED"), "{why}");
        let (st, v) = post(addr, "/v1/completions", &req).await;
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "engine_failed", "{v}");
        assert!(metric(addr, "turbospark_healthy").await == 0.0);
        assert!(metric(addr, "turbospark_steps_failed_total").await >= 3.0);
    });
    s.shutdown().expect("shutdown");
}
