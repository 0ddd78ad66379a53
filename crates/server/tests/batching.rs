//! Continuous batching against the real default model (SmolLM2, CPU): the same texts alone and
//! among 15 others, admission control (503 when the queue is full), and a client that hangs up
//! freeing its slot.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};
use ts_server::ServerConfig;

/// 16 requests: greedy chat and completions, plus seeded sampling.
fn requests() -> Vec<(&'static str, Value)> {
    let topics = [
        "the sea",
        "a lost key",
        "winter",
        "the moon",
        "a robot",
        "coffee",
        "a library",
        "trains",
        "rain",
        "a cat",
        "mountains",
        "music",
        "a garden",
        "bread",
        "the desert",
        "fireflies",
    ];
    topics
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let max_tokens = 10 + (i % 4) * 2;
            match i % 4 {
                0 => ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": format!("Write one sentence about {t}.")}], "max_tokens": max_tokens, "temperature": 0})),
                1 => ("/v1/completions", json!({"prompt": format!("A short poem about {t}:\n"), "max_tokens": max_tokens, "temperature": 0})),
                2 => ("/v1/completions", json!({"prompt": format!("Facts about {t}. First,"), "max_tokens": max_tokens, "temperature": 0.8, "seed": 100 + i})),
                _ => ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": format!("Tell me about {t}.")}], "max_tokens": max_tokens, "temperature": 0.7, "top_k": 40, "seed": i, "stream": true})),
            }
        })
        .collect()
}

async fn run_one(addr: std::net::SocketAddr, path: &str, body: &Value) -> String {
    if body["stream"] == json!(true) {
        let (st, ev) = stream(addr, path, body).await;
        assert_eq!(st, 200);
        let mut text = String::new();
        for e in ev.iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).expect("chunk");
            text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
        text
    } else {
        let (st, v) = post(addr, path, body).await;
        assert_eq!(st, 200, "{v}");
        text_of(&v)
    }
}

/// The 16 requests one after another, then all at once, on a server chaining its greedy steps
/// or not (`ServerConfig::chain`); returns the texts alone and the chained steps' count.
fn sixteen(chain: bool) -> (Vec<String>, f64) {
    let s = start(16, 256, ServerConfig { prefill_chunk: 32, chain, ..ServerConfig::default() });
    let addr = s.addr();
    let reqs = requests();
    let r = rt().block_on(async {
        let mut alone = Vec::new();
        for (path, body) in &reqs {
            alone.push(run_one(addr, path, body).await);
        }
        let steps_alone = metric(addr, "turbospark_steps_total").await;
        let mut tasks = Vec::new();
        for (path, body) in reqs.clone() {
            tasks.push(tokio::spawn(async move { run_one(addr, path, &body).await }));
        }
        let mut together = Vec::new();
        for t in tasks {
            together.push(t.await.expect("task"));
        }
        let steps_together = metric(addr, "turbospark_steps_total").await - steps_alone;
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert!(!a.is_empty(), "request {i} generated nothing");
            assert_eq!(a, b, "request {i} ({}) differs alone vs among 15 others (chain {chain})", reqs[i].1);
        }
        // They really ran together: far fewer forwards than one sequence at a time.
        assert!(steps_together * 3.0 < steps_alone, "{steps_together} steps together vs {steps_alone} alone");
        (alone, metric(addr, "turbospark_steps_chained_total").await)
    });
    s.shutdown().expect("shutdown");
    r
}

#[test]
fn sixteen_concurrent_requests_give_the_texts_they_give_alone() {
    let (plain, none) = sixteen(false);
    assert_eq!(none, 0.0);
    // Chained greedy steps (the CPU backend chains too, computing at once): the same texts.
    let (chained, steps) = sixteen(true);
    assert!(steps > 0.0, "no chained step");
    assert_eq!(plain, chained, "chained steps changed a text");
}

#[test]
fn full_queue_gets_503_and_a_client_that_hangs_up_frees_its_slot() {
    let s = start(1, 256, ServerConfig { max_queue: 1, prefill_chunk: 32, ..ServerConfig::default() });
    let addr = s.addr();
    rt().block_on(async {
        let long = json!({"prompt": "Count slowly:", "max_tokens": 200, "temperature": 0, "stream": true});
        // A holds the only slot, B waits in the queue (its headers come back once it is queued).
        let a = ts_server::client::post_json(addr, "/v1/completions", &long).await.expect("A");
        assert_eq!(a.status, 200);
        let b = ts_server::client::post_json(addr, "/v1/completions", &long).await.expect("B");
        assert_eq!(b.status, 200);
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": "C", "max_tokens": 2})).await;
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "queue_full");
        assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("queue")), "{v}");
        assert_eq!(metric(addr, "turbospark_requests_rejected_total").await, 1.0);

        // A reads two events and hangs up; B then gets the slot; B hangs up too.
        let mut ea = a.events();
        for _ in 0..2 {
            ea.next().await.expect("A stream").expect("A event");
        }
        drop(ea);
        let mut eb = b.events();
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(60), eb.next())
                .await
                .expect("B starts once A left")
                .expect("B stream")
                .expect("B event");
        }
        drop(eb);
        let freed = wait_until(Duration::from_secs(30), || async {
            metric(addr, "turbospark_requests_finished_total{reason=\"cancelled\"}").await == 2.0
                && metric(addr, "turbospark_active_sequences").await == 0.0
                && metric(addr, "turbospark_queue_depth").await == 0.0
        })
        .await;
        assert!(freed, "the slots were not freed:\n{}", get(addr, "/metrics").await.1);
        assert_eq!(s.engine().occupancy(), 0);
        // Neither ran to its 200 tokens.
        assert!(metric(addr, "turbospark_completion_tokens_total").await < 300.0);
        // The slot serves the next request.
        let (st, v) = post(addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 3);
    });
    s.shutdown().expect("shutdown");
}
