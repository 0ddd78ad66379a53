//! `serve --api-key`: the API routes answer 401 (OpenAI's error object) without the key, the
//! probes stay open; `/tokenize` and `/detokenize` (llama.cpp's shapes) round-trip text.

mod common;

use common::*;
use serde_json::{json, Value};
use ts_server::{client, ApiKey, ServerConfig};

const KEY: &str = "sk-local-0123456789";

async fn post_auth(addr: std::net::SocketAddr, path: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, Value) {
    let r = client::post_json_with(addr, path, body, headers).await.expect("request");
    let st = r.status;
    (st, r.json().await.expect("JSON body"))
}

#[test]
fn the_key_guards_the_api_and_tokenize_round_trips() {
    let s = start(2, 256, ServerConfig { api_key: Some(ApiKey(KEY.into())), ..ServerConfig::default() });
    let addr = s.addr();
    assert!(!format!("{:?}", ServerConfig { api_key: Some(ApiKey(KEY.into())), ..ServerConfig::default() }).contains(KEY));
    rt().block_on(async {
        let req = json!({"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0});
        let bearer = format!("Bearer {KEY}");
        for (headers, want) in [
            (vec![], 401),
            (vec![("Authorization", "Bearer wrong")], 401),
            (vec![("Authorization", KEY)], 401),
            (vec![("Authorization", bearer.as_str())], 200),
            (vec![("X-Api-Key", KEY)], 200),
        ] {
            let (st, v) = post_auth(addr, "/v1/completions", &req, &headers).await;
            assert_eq!(st, want, "{headers:?}: {v}");
            if want == 401 {
                assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
                assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("API key")), "{v}");
            }
        }
        let (st, _) = get(addr, "/v1/models").await;
        assert_eq!(st, 401);
        // The probes stay open.
        assert_eq!(get(addr, "/health").await.0, 200);
        assert_eq!(get(addr, "/metrics").await.0, 200);
        assert!(metric(addr, "turbospark_http_responses_total{route=\"auth\",code=\"401\"}").await >= 4.0);

        // /tokenize and /detokenize, keyed too.
        let auth = [("Authorization", bearer.as_str())];
        assert_eq!(post_auth(addr, "/tokenize", &json!({"content": "x"}), &[]).await.0, 401);
        let text = "Hello world, héllo!";
        let (st, v) = post_auth(addr, "/tokenize", &json!({"content": text}), &auth).await;
        assert_eq!(st, 200, "{v}");
        let ids = v["tokens"].as_array().expect("tokens").clone();
        assert!(!ids.is_empty() && ids.iter().all(Value::is_u64), "{v}");
        let (st, v) = post_auth(addr, "/detokenize", &json!({"tokens": ids}), &auth).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["content"], text);
        let (_, v) = post_auth(addr, "/tokenize", &json!({"content": "Hello", "with_pieces": true}), &auth).await;
        assert_eq!(v["tokens"][0]["piece"], "Hello", "{v}");
        assert!(v["tokens"][0]["id"].is_u64(), "{v}");
        for (path, body, param) in [
            ("/tokenize", json!({}), "content"),
            ("/tokenize", json!({"content": 3}), "content"),
            ("/tokenize", json!({"content": "a", "add_special": "yes"}), "add_special"),
            ("/detokenize", json!({"tokens": [1, 99999999]}), "tokens[1]"),
            ("/detokenize", json!({"tokens": "1"}), "tokens"),
        ] {
            let (st, v) = post_auth(addr, path, &body, &auth).await;
            assert_eq!(st, 400, "{path} {body}: {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
        }
    });
    s.shutdown().expect("shutdown");
}

/// `serve --cors-origin`: preflights from the named origin are answered (before the key check),
/// its pages may read the answers; other origins, and every origin on a server without the
/// flag, get no CORS headers.
#[test]
fn cors_only_for_the_named_origins() {
    let ui = "http://localhost:3000";
    let s = start(1, 256, ServerConfig { api_key: Some(ApiKey(KEY.into())), cors_origins: vec![ui.into()], ..ServerConfig::default() });
    let open = start(1, 256, ServerConfig::default());
    rt().block_on(async {
        let preflight = |origin: &'static str| {
            [
                ("Origin", origin),
                ("Access-Control-Request-Method", "POST"),
                ("Access-Control-Request-Headers", "authorization,content-type"),
            ]
        };
        let acao = |r: &client::Response| r.header("access-control-allow-origin").map(str::to_string);
        let r = client::request_with(s.addr(), "OPTIONS", "/v1/chat/completions", None, &preflight(ui)).await.expect("preflight");
        assert!(r.status < 300, "preflight answered: {}", r.status);
        assert_eq!(acao(&r).as_deref(), Some(ui));
        let r = client::request_with(s.addr(), "OPTIONS", "/v1/chat/completions", None, &preflight("http://evil.example"))
            .await
            .expect("preflight");
        assert_eq!(acao(&r), None, "another origin");
        let bearer = format!("Bearer {KEY}");
        let body = json!({"prompt": "Hi", "max_tokens": 1});
        let r =
            client::post_json_with(s.addr(), "/v1/completions", &body, &[("Origin", ui), ("Authorization", &bearer)]).await.expect("post");
        assert_eq!((r.status, acao(&r).as_deref()), (200, Some(ui)));
        let r = client::post_json_with(open.addr(), "/v1/completions", &body, &[("Origin", ui)]).await.expect("post");
        assert_eq!((r.status, acao(&r)), (200, None), "no CORS without --cors-origin");
    });
    s.shutdown().expect("shutdown");
    open.shutdown().expect("shutdown");
}
