//! `turbospark loadtest`: N concurrent streaming clients against a local server for a bounded
//! time; reports aggregate generated tokens per second, time to first token (p50/p99) and errors.
//!
//! Each client loops: send a streaming request (`stream_options.include_usage` so the token count
//! is the server's), time the first content chunk, read to `[DONE]`. New requests start only
//! before the deadline; requests still running at the deadline get a grace period (at most
//! [`GRACE`]), after which they are abandoned and counted as cut off. Loopback only.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::client;

/// Longest wait for requests still running when the duration is over.
pub const GRACE: Duration = Duration::from_secs(60);

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadtestOptions {
    /// `http://127.0.0.1:PORT` (loopback only).
    pub url: String,
    /// Concurrent clients.
    pub clients: usize,
    /// How long clients keep starting requests.
    pub duration: Duration,
    /// `max_tokens` of every request.
    pub max_tokens: usize,
    /// The prompt (a user message with `chat`, raw text otherwise).
    pub prompt: String,
    /// Use `/v1/chat/completions` (else `/v1/completions`).
    pub chat: bool,
    /// Sampling temperature (each client gets its own seed).
    pub temperature: f32,
    /// With `Some(n)`: raw completions whose prompt is `n` token ids (different per client), for
    /// models without a tokenizer such as `turbospark synth` checkpoints.
    pub prompt_ids: Option<usize>,
    /// Every request's prompt different from the client's earlier ones from its first token on
    /// (the request's number first, or ids shifted by it), so that a server's prompt cache has
    /// nothing to reuse; otherwise each client repeats its prompt.
    pub fresh_prompts: bool,
    /// The server's API key (`serve --api-key`), sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
}

/// The outcome.
#[derive(Debug, Clone, Default)]
pub struct LoadtestReport {
    pub clients: usize,
    /// Requests that ended with `[DONE]`.
    pub completed: usize,
    /// Requests that failed (HTTP status, connection, error event), with up to 5 examples.
    pub errors: usize,
    pub error_samples: Vec<String>,
    /// Requests abandoned at the end of the grace period.
    pub cut_off: usize,
    /// Generated tokens (from the server's usage).
    pub tokens: u64,
    /// Prompt tokens of the completed requests, and of them those the server's prompt cache
    /// did not compute (`usage.prompt_tokens_details.cached_tokens`; 0 from servers that do not
    /// say).
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Wall time from the first request to the last one finishing.
    pub elapsed: Duration,
    /// Time to first token, sorted.
    pub ttfts: Vec<Duration>,
    /// The server's own count of generated tokens (`turbospark_completion_tokens_total` on its
    /// `/metrics`) from [`steady_start`] into the run to the deadline, and those seconds: the
    /// rate while every client keeps a request running, without the first prompts' wave and
    /// the drain after the deadline (when fewer and fewer requests are left). None from servers
    /// without that counter.
    pub steady: Option<(u64, Duration)>,
    /// The server's steps in the same window, where its `/metrics` has their counters
    /// (`turbospark_steps_total`, `_batch_tokens_total`, `_step_seconds_total`,
    /// `_forward_seconds_total`): how many rows a step carried and how long one took, the two
    /// factors of the steady rate.
    pub steady_steps: Option<StepCounts>,
}

/// Differences of the server's step counters over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepCounts {
    /// Forward passes (steps).
    pub steps: f64,
    /// Tokens the steps fed (decode rows and prompt tokens, without padding).
    pub batch_tokens: f64,
    /// Seconds in steps (the forward, sampling and streaming), and in their forward passes.
    pub step_seconds: f64,
    pub forward_seconds: f64,
}

impl StepCounts {
    /// The counters in a Prometheus text page; None if one is missing.
    fn parse(page: &str) -> Option<StepCounts> {
        let get = |name: &str| metric(page, name);
        Some(StepCounts {
            steps: get("turbospark_steps_total")?,
            batch_tokens: get("turbospark_batch_tokens_total")?,
            step_seconds: get("turbospark_step_seconds_total")?,
            forward_seconds: get("turbospark_forward_seconds_total")?,
        })
    }

    fn since(self, before: StepCounts) -> StepCounts {
        StepCounts {
            steps: self.steps - before.steps,
            batch_tokens: self.batch_tokens - before.batch_tokens,
            step_seconds: self.step_seconds - before.step_seconds,
            forward_seconds: self.forward_seconds - before.forward_seconds,
        }
    }

    /// One line: steps, rows a step (prompt rows included) and of them the tokens generated
    /// (`generated` in the same window), milliseconds a step and in its forward pass.
    fn line(&self, generated: u64) -> Option<String> {
        (self.steps >= 1.0).then(|| {
            format!(
                "{:.0} steps, {:.2} rows a step ({:.2} tokens generated), {:.3} ms a step ({:.3} ms in the forward)",
                self.steps,
                self.batch_tokens / self.steps,
                generated as f64 / self.steps,
                1e3 * self.step_seconds / self.steps,
                1e3 * self.forward_seconds / self.steps
            )
        })
    }
}

/// When the steady window starts: a tenth of the duration in (at least 1 s, at most 10 s), so
/// that the clients' first prompts are behind it.
pub fn steady_start(duration: Duration) -> Duration {
    (duration / 10).clamp(Duration::from_secs(1), Duration::from_secs(10)).min(duration / 2)
}

/// The value of the sample `name` (no labels) in a Prometheus text page, if present.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' '))).and_then(|v| v.trim().parse::<f64>().ok())
}

/// `turbospark_completion_tokens_total` in a Prometheus text page, if present.
fn completion_tokens(page: &str) -> Option<u64> {
    metric(page, "turbospark_completion_tokens_total").map(|v| v as u64)
}

impl LoadtestReport {
    /// Aggregate generated tokens per second.
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second in the steady window (see [`LoadtestReport::steady`]).
    pub fn steady_tokens_per_second(&self) -> Option<f64> {
        self.steady.map(|(t, d)| t as f64 / d.as_secs_f64().max(1e-9))
    }

    /// The `q`-quantile (0..=1) of time to first token (nearest rank).
    pub fn ttft_quantile(&self, q: f64) -> Option<Duration> {
        if self.ttfts.is_empty() {
            return None;
        }
        let rank = ((q * self.ttfts.len() as f64).ceil() as usize).clamp(1, self.ttfts.len());
        Some(self.ttfts[rank - 1])
    }

    /// Human summary, several lines.
    pub fn summary(&self) -> String {
        let q = |x: Option<Duration>| x.map_or("n/a".to_string(), |d| format!("{:.3} s", d.as_secs_f64()));
        let mut s = format!(
            "clients: {}\nrequests: {} completed, {} errors, {} cut off at the deadline\ntokens: {} generated in {:.2} s = {:.1} tok/s aggregate\nTTFT: p50 {}, p99 {}\nprompts: {} tokens, {} of them from the server's prompt cache",
            self.clients,
            self.completed,
            self.errors,
            self.cut_off,
            self.tokens,
            self.elapsed.as_secs_f64(),
            self.tokens_per_second(),
            q(self.ttft_quantile(0.5)),
            q(self.ttft_quantile(0.99)),
            self.prompt_tokens,
            self.cached_tokens,
        );
        if let (Some(r), Some((t, d))) = (self.steady_tokens_per_second(), self.steady) {
            s.push_str(&format!(
                "\nsteady: {t} tokens in {:.2} s = {r:.1} tok/s (the server's count, from the first prompts' end to the deadline: every client running)",
                d.as_secs_f64()
            ));
            if let Some(l) = self.steady_steps.as_ref().and_then(|c| c.line(t)) {
                s.push_str(&format!("\nsteady steps: {l}"));
            }
        }
        for e in &self.error_samples {
            s.push_str(&format!("\nerror: {e}"));
        }
        s
    }
}

enum Outcome {
    /// `prompt`: (prompt tokens, of which cached), from the usage chunk.
    Done {
        ttft: Option<Duration>,
        tokens: u64,
        prompt: (u64, u64),
    },
    Failed(String),
}

async fn one_request(addr: SocketAddr, path: &str, body: &Value, auth: Option<&str>) -> Outcome {
    let t0 = Instant::now();
    let headers: Vec<(&str, &str)> = auth.map(|a| ("Authorization", a)).into_iter().collect();
    let resp = match client::post_json_with(addr, path, body, &headers).await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(format!("connect/send: {e}")),
    };
    if resp.status != 200 {
        let st = resp.status;
        let text = resp.text().await.unwrap_or_default();
        return Outcome::Failed(format!("HTTP {st}: {}", text.chars().take(300).collect::<String>()));
    }
    let mut ev = resp.events();
    let mut ttft = None;
    let mut tokens = 0u64;
    let mut deltas = 0u64;
    let mut prompt = (0u64, 0u64);
    loop {
        let data = match ev.next().await {
            Ok(Some(d)) => d,
            Ok(None) => return Outcome::Failed("stream ended without [DONE]".into()),
            Err(e) => return Outcome::Failed(format!("reading the stream: {e}")),
        };
        if data == "[DONE]" {
            let tokens = if tokens > 0 { tokens } else { deltas };
            return Outcome::Done { ttft, tokens, prompt };
        }
        let v: Value = match serde_json::from_str(&data) {
            Ok(v) => v,
            Err(e) => return Outcome::Failed(format!("bad chunk ({e}): {data}")),
        };
        if let Some(err) = v.get("error") {
            return Outcome::Failed(format!("error event: {err}"));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let n = |x: Option<&Value>| x.and_then(Value::as_u64);
            if let Some(c) = n(u.get("completion_tokens")) {
                tokens = c;
            }
            prompt = (
                n(u.get("prompt_tokens")).unwrap_or(0),
                n(u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens"))).unwrap_or(0),
            );
        }
        let c0 = v.get("choices").and_then(|c| c.get(0));
        let text = c0.and_then(|c| c.get("text").or_else(|| c.get("delta").and_then(|d| d.get("content")))).and_then(Value::as_str);
        if text.is_some_and(|t| !t.is_empty()) {
            deltas += 1;
            if ttft.is_none() {
                ttft = Some(t0.elapsed());
            }
        }
    }
}

/// Runs the load test (builds its own Tokio runtime).
pub fn run(o: &LoadtestOptions) -> Result<LoadtestReport> {
    if o.clients == 0 {
        bail!("--clients must be at least 1");
    }
    if o.clients > 4096 {
        bail!("--clients {} is too many (at most 4096)", o.clients);
    }
    let addr = client::loopback_addr(&o.url)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        // Reachability first: a clear error instead of N connection failures.
        let h = client::request(addr, "GET", "/health", None).await.with_context(|| format!("{}: server not reachable", o.url))?;
        if h.status != 200 {
            bail!("{}: /health answered {}", o.url, h.status);
        }
        // The key next (one clear error, not a 401 a request).
        let auth = o.api_key.as_ref().map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = auth.as_deref().map(|a| ("Authorization", a)).into_iter().collect();
        let m = client::request_with(addr, "GET", "/v1/models", None, &headers)
            .await
            .with_context(|| format!("{}: server not reachable", o.url))?;
        if m.status == 401 {
            let why = if o.api_key.is_some() { "refused the API key given" } else { "wants an API key (--api-key or TURBOSPARK_API_KEY)" };
            bail!("{}: the server {why}", o.url);
        }
        let (path, base) = if o.chat && o.prompt_ids.is_none() {
            ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": o.prompt}]}))
        } else {
            ("/v1/completions", json!({"prompt": o.prompt}))
        };
        let start = Instant::now();
        let deadline = start + o.duration;
        let hard = deadline + GRACE.min(o.duration.max(Duration::from_secs(10)));
        let mut tasks = Vec::with_capacity(o.clients);
        for c in 0..o.clients {
            let mut body = base.clone();
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
            body["max_tokens"] = json!(o.max_tokens);
            body["temperature"] = json!(o.temperature);
            body["seed"] = json!(c);
            let (prompt_ids, fresh, clients) = (o.prompt_ids, o.fresh_prompts, o.clients);
            let text = o.prompt.clone();
            let auth = auth.clone();
            tasks.push(tokio::spawn(async move {
                let mut res = Vec::new();
                let mut r = 0usize;
                while Instant::now() < deadline {
                    // This request's prompt: the client's own (token ids 1.. shifted per client, so
                    // that clients do not share one), and with `fresh` another one each request.
                    let k = if fresh { r * clients + c } else { c };
                    if let Some(len) = prompt_ids {
                        let mut ids: Vec<u32> = (0..len).map(|i| 1 + ((i * 7 + k * 13) % 1000) as u32).collect();
                        if fresh {
                            // (the request's number in the first two ids: no two requests alike)
                            ids[0] = 1 + (k % 1000) as u32;
                            if len > 1 {
                                ids[1] = 1 + (k / 1000 % 1000) as u32;
                            }
                        }
                        body["prompt"] = json!(ids);
                    } else if fresh {
                        let t = format!("Request {k}. {text}");
                        match body.get_mut("messages") {
                            Some(m) => m[0]["content"] = json!(t),
                            None => body["prompt"] = json!(t),
                        }
                    }
                    r += 1;
                    let left = hard.saturating_duration_since(Instant::now());
                    match tokio::time::timeout(left, one_request(addr, path, &body, auth.as_deref())).await {
                        Ok(out) => res.push(Some(out)),
                        Err(_) => {
                            res.push(None);
                            break;
                        }
                    }
                }
                res
            }));
        }
        // The steady window, read from the server's counter (none if it has no such counter).
        let (w0, w1) = (start + steady_start(o.duration), deadline);
        let steady = tokio::spawn(async move {
            let count = || async {
                let r = client::request(addr, "GET", "/metrics", None).await.ok().filter(|r| r.status == 200)?;
                let page = r.text().await.ok()?;
                Some((completion_tokens(&page)?, StepCounts::parse(&page)))
            };
            tokio::time::sleep_until(w0.into()).await;
            let ((c0, s0), t0) = (count().await?, Instant::now());
            tokio::time::sleep_until(w1.into()).await;
            let ((c1, s1), t1) = (count().await?, Instant::now());
            let steps = s1.zip(s0).map(|(a, b)| a.since(b));
            Some(((c1.saturating_sub(c0), t1 - t0), steps))
        });
        let mut rep = LoadtestReport { clients: o.clients, ..Default::default() };
        for t in tasks {
            let outs = t.await.context("a client task panicked")?;
            for out in outs {
                match out {
                    None => rep.cut_off += 1,
                    Some(Outcome::Done { ttft, tokens, prompt }) => {
                        rep.completed += 1;
                        rep.tokens += tokens;
                        rep.prompt_tokens += prompt.0;
                        rep.cached_tokens += prompt.1;
                        rep.ttfts.extend(ttft);
                    }
                    Some(Outcome::Failed(e)) => {
                        rep.errors += 1;
                        if rep.error_samples.len() < 5 {
                            rep.error_samples.push(e);
                        }
                    }
                }
            }
        }
        rep.elapsed = start.elapsed();
        (rep.steady, rep.steady_steps) = match steady.await.ok().flatten() {
            Some((tokens, steps)) => (Some(tokens), steps),
            None => (None, None),
        };
        rep.ttfts.sort();
        Ok(rep)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let r = LoadtestReport { ttfts: (1..=100).map(Duration::from_millis).collect(), ..Default::default() };
        assert_eq!(r.ttft_quantile(0.5), Some(Duration::from_millis(50)));
        assert_eq!(r.ttft_quantile(0.99), Some(Duration::from_millis(99)));
        assert_eq!(LoadtestReport::default().ttft_quantile(0.5), None);
    }

    #[test]
    fn steady_window_and_counter() {
        assert_eq!(steady_start(Duration::from_secs(30)), Duration::from_secs(3));
        assert_eq!(steady_start(Duration::from_secs(300)), Duration::from_secs(10));
        assert_eq!(steady_start(Duration::from_secs(5)), Duration::from_secs(1));
        assert_eq!(steady_start(Duration::from_secs(1)), Duration::from_millis(500));
        let page = "# HELP turbospark_completion_tokens_total Tokens generated.\n# TYPE turbospark_completion_tokens_total counter\nturbospark_completion_tokens_total 12345\nturbospark_steps_total 7\n";
        assert_eq!(completion_tokens(page), Some(12345));
        assert_eq!(completion_tokens("turbospark_steps_total 7\n"), None);
        let r = LoadtestReport { steady: Some((5000, Duration::from_millis(500))), ..Default::default() };
        assert_eq!(r.steady_tokens_per_second(), Some(10_000.0));
        assert!(r.summary().contains("steady: 5000 tokens in 0.50 s = 10000.0 tok/s"), "{}", r.summary());
        assert!(!LoadtestReport::default().summary().contains("steady"));
    }

    #[test]
    fn steady_steps_from_the_counters() {
        let page = |steps: u64, toks: u64, ss: f64, fs: f64| {
            format!(
                "turbospark_steps_total {steps}\nturbospark_steps_chained_total 3\nturbospark_batch_tokens_total {toks}\nturbospark_step_seconds_total {ss}\nturbospark_forward_seconds_total {fs}\n"
            )
        };
        let a = StepCounts::parse(&page(100, 6400, 0.8, 0.75)).unwrap();
        let b = StepCounts::parse(&page(1100, 69_770, 9.11, 8.96)).unwrap();
        assert_eq!(a.steps, 100.0);
        // (`turbospark_steps_total` is not read from `turbospark_steps_chained_total`'s line)
        assert_eq!(StepCounts::parse("turbospark_steps_chained_total 3\nturbospark_batch_tokens_total 1\nturbospark_step_seconds_total 1\nturbospark_forward_seconds_total 1\n"), None);
        let d = b.since(a);
        assert_eq!(
            d.line(62_980).unwrap(),
            "1000 steps, 63.37 rows a step (62.98 tokens generated), 8.310 ms a step (8.210 ms in the forward)"
        );
        let r = LoadtestReport { steady: Some((5000, Duration::from_millis(500))), steady_steps: Some(d), ..Default::default() };
        assert!(r.summary().contains("\nsteady steps: 1000 steps, 63.37 rows a step (5.00 tokens generated)"), "{}", r.summary());
        assert_eq!(StepCounts::default().line(0), None);
    }

    #[test]
    fn refuses_non_loopback() {
        let o = LoadtestOptions {
            url: "http://192.0.2.1:8080".into(),
            clients: 1,
            duration: Duration::from_secs(1),
            max_tokens: 1,
            prompt: "x".into(),
            prompt_ids: None,
            fresh_prompts: false,
            api_key: None,
            chat: false,
            temperature: 0.0,
        };
        let e = run(&o).expect_err("must refuse");
        assert!(e.to_string().contains("loopback"), "{e}");
    }
}
