//! Soak: the real SmolLM2 served on loopback under ~40 s (`TS_SOAK_SECS`) of concurrent random
//! traffic: valid chat and completion requests (streamed or whole), invalid ones (bad JSON,
//! wrong types, over-long prompts, oversized bodies, unknown routes) and clients that hang up at
//! random points. Afterwards:
//! * every valid request that was not hung up got a complete answer (200 with a
//!   `finish_reason`; streams end with a finish chunk and `[DONE]`), every invalid one a 4xx;
//! * the KV pool is idle again (`/metrics`: no active sequences, nothing queued, and the
//!   engine's occupancy is 0);
//! * the process RSS (`/proc/self/status`, the server runs in-process) is back near its level
//!   after warm-up.
//!
//! Runs in CI as part of `cargo test --release` (about a minute on two cores); every loop and
//! wait is bounded.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use ts_server::{client, ServerConfig};

const CTX: usize = 256;
const MAX_BODY: usize = 64 << 10;

/// Resident set size of this process in KiB.
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A tiny deterministic generator (xorshift64*), one per client.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Tally {
    valid_ok: AtomicU64,
    invalid_ok: AtomicU64,
    hung_up: AtomicU64,
    busy: AtomicU64,
}

const PROMPTS: [&str; 4] = ["Hello", "Write one word about the sea.", "List three colours:", "Once upon a time"];

/// One valid request body.
fn valid(rng: &mut Rng, stream: bool) -> (&'static str, Value) {
    let max_tokens = 1 + rng.below(12);
    let prompt = PROMPTS[rng.below(PROMPTS.len() as u64) as usize];
    let temperature = if rng.below(2) == 0 { 0.0 } else { 0.8 };
    let (path, mut body) = if rng.below(2) == 0 {
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": temperature, "stream": stream, "seed": rng.below(100)}),
        )
    } else {
        (
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": stream, "stop": ["\n\n"]}),
        )
    };
    // (now and then several choices, JSON mode, a logit bias)
    match rng.below(8) {
        0 => body["n"] = json!(1 + rng.below(3)),
        1 => body["response_format"] = json!({"type": "json_object"}),
        2 => body["logit_bias"] = json!({(rng.below(1000)).to_string(): -100, "13": 2.5}),
        _ => {}
    }
    (path, body)
}

/// One invalid request: (path, raw body, expected status).
fn invalid(rng: &mut Rng) -> (&'static str, Vec<u8>, u16) {
    match rng.below(7) {
        0 => ("/v1/chat/completions", b"{\"messages\": [".to_vec(), 400),
        1 => ("/v1/chat/completions", json!({"messages": "hi"}).to_string().into_bytes(), 400),
        2 => ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}).to_string().into_bytes(), 400),
        3 => ("/v1/completions", json!({"prompt": "word ".repeat(CTX * 2)}).to_string().into_bytes(), 400),
        4 => ("/v1/completions", json!({"prompt": "x", "max_tokens": CTX * 4}).to_string().into_bytes(), 400),
        5 => ("/v1/completions", vec![b' '; MAX_BODY + 1], 413),
        _ => ("/v1/nothing-here", b"{}".to_vec(), 404),
    }
}

/// Checks a whole (non-streamed) success.
fn check_whole(v: &Value) {
    let f = v["choices"][0]["finish_reason"].as_str().unwrap_or("");
    assert!(f == "stop" || f == "length", "no finish_reason: {v}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some(), "no usage: {v}");
}

/// Checks a complete stream: a finish chunk, then `[DONE]` last.
fn check_stream(events: &[String]) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream did not end with [DONE]: {events:?}");
    let finished = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .any(|v| v["choices"][0]["finish_reason"].as_str().is_some_and(|f| f == "stop" || f == "length"));
    assert!(finished, "stream without a finish_reason: {events:?}");
}

/// One client's loop until `end`.
async fn client_loop(addr: SocketAddr, seed: u64, end: Instant, tally: Arc<Tally>) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for _ in 0..10_000 {
        if Instant::now() >= end {
            break;
        }
        match rng.below(10) {
            // Valid, whole.
            0..=2 => {
                let (path, body) = valid(&mut rng, false);
                let (st, v) = post(addr, path, &body).await;
                if st == 503 {
                    tally.busy.fetch_add(1, Relaxed);
                    continue;
                }
                assert_eq!(st, 200, "{path} {body}: {v}");
                check_whole(&v);
                tally.valid_ok.fetch_add(1, Relaxed);
            }
            // Valid, streamed, read to the end.
            3..=4 => {
                let (path, body) = valid(&mut rng, true);
                let r = tokio::time::timeout(REQ_TIMEOUT, client::post_json(addr, path, &body))
                    .await
                    .expect("headers in time")
                    .expect("request");
                if r.status == 503 {
                    tally.busy.fetch_add(1, Relaxed);
                    continue;
                }
                assert_eq!(r.status, 200, "{path} {body}");
                let mut ev = r.events();
                let mut out = Vec::new();
                for _ in 0..10_000 {
                    match tokio::time::timeout(REQ_TIMEOUT, ev.next()).await.expect("stream event in time").expect("read stream") {
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
                check_stream(&out);
                tally.valid_ok.fetch_add(1, Relaxed);
            }
            // Invalid.
            5..=7 => {
                let (path, body, want) = invalid(&mut rng);
                let r = tokio::time::timeout(REQ_TIMEOUT, client::request(addr, "POST", path, Some(("application/json", &body))))
                    .await
                    .expect("answered in time");
                // An oversized body may be refused before it is all sent (connection reset).
                let Ok(r) = r else {
                    assert_eq!(want, 413, "{path}: request failed");
                    tally.invalid_ok.fetch_add(1, Relaxed);
                    continue;
                };
                assert_eq!(r.status, want, "{path}: {}", String::from_utf8_lossy(&body[..body.len().min(80)]));
                let v = r.json().await.unwrap_or(Value::Null);
                assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{path}: no error message: {v}");
                tally.invalid_ok.fetch_add(1, Relaxed);
            }
            // Hang up: before the headers, or after a few stream events.
            _ => {
                let stream = rng.below(2) == 0;
                let (path, body) = valid(&mut rng, stream);
                let wait = Duration::from_millis(rng.below(300));
                let after = rng.below(4) as usize;
                let fut = async {
                    let r = client::post_json(addr, path, &body).await?;
                    let mut ev = r.events();
                    for _ in 0..after {
                        ev.next().await?;
                    }
                    std::io::Result::Ok(())
                };
                let _ = tokio::time::timeout(wait, fut).await;
                tally.hung_up.fetch_add(1, Relaxed);
            }
        }
    }
}

#[test]
fn soak_random_valid_invalid_and_abandoned_requests() {
    let secs: u64 = std::env::var("TS_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    let cfg = ServerConfig { max_queue: 64, prefill_chunk: 32, max_body_bytes: MAX_BODY, http_threads: 2, ..ServerConfig::default() };
    let s = start(4, CTX, cfg);
    let addr = s.addr();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        // Warm-up, then the idle baseline.
        for prompt in &PROMPTS[..3] {
            let (st, v) = post(addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": 8})).await;
            assert_eq!(st, 200, "{v}");
        }
        let rss0 = rss_kib();
        let tally = Arc::new(Tally::default());
        let end = Instant::now() + Duration::from_secs(secs);
        let clients: Vec<_> = (0..8).map(|i| tokio::spawn(client_loop(addr, i + 1, end, tally.clone()))).collect();
        for c in clients {
            c.await.expect("client task");
        }
        let idle = wait_until(Duration::from_secs(30), || async {
            metric(addr, "turbospark_active_sequences").await == 0.0 && metric(addr, "turbospark_queue_depth").await == 0.0
        })
        .await;
        let m = get(addr, "/metrics").await.1;
        assert!(idle, "the KV pool is not idle again:\n{m}");
        assert_eq!(s.engine().occupancy(), 0);
        let slots = metric(addr, "turbospark_slots_total").await;
        assert_eq!(slots, 4.0);
        // A last request is served normally.
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0})).await;
        assert_eq!(st, 200, "{v}");
        let rss1 = rss_kib();
        let (ok, bad, gone, busy) =
            (tally.valid_ok.load(Relaxed), tally.invalid_ok.load(Relaxed), tally.hung_up.load(Relaxed), tally.busy.load(Relaxed));
        eprintln!(
            "soak: {secs} s, {ok} valid answered, {bad} invalid refused, {gone} hung up, {busy} busy; RSS {} -> {} MiB",
            rss0 / 1024,
            rss1 / 1024
        );
        assert!(ok >= 10 && bad >= 10 && gone >= 5, "too little traffic: {ok} valid, {bad} invalid, {gone} hung up");
        assert_eq!(busy, 0, "8 clients never fill 4 slots + a queue of 64");
        // Back near the warmed-up level (allocator slack allowed, no growth per request).
        assert!(rss1 <= rss0 + 96 * 1024, "RSS grew from {} to {} MiB", rss0 / 1024, rss1 / 1024);
    });
    s.shutdown().expect("shutdown");
}
