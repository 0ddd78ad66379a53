//! Server counters and gauges, rendered as Prometheus text at `GET /metrics`.
//!
//! Everything is an atomic (or a short-held mutex for the histogram and the per-status table),
//! shared between the HTTP handlers and the engine thread.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Upper bounds (seconds) of the time-to-first-token histogram buckets.
pub const TTFT_BUCKETS: [f64; 12] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// A cumulative histogram (Prometheus semantics).
#[derive(Debug, Default, Clone)]
pub struct Histogram {
    /// Count of observations `<=` each bound of [`TTFT_BUCKETS`].
    pub buckets: [u64; TTFT_BUCKETS.len()],
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        for (b, &le) in self.buckets.iter_mut().zip(TTFT_BUCKETS.iter()) {
            if v <= le {
                *b += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

/// An `f64` gauge stored in an `AtomicU64`.
#[derive(Debug, Default)]
pub struct F64Gauge(AtomicU64);

impl F64Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// Every metric the server exports.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Generation requests accepted into the queue.
    pub requests_accepted: AtomicU64,
    /// Requests turned away with 503 because the queue was full.
    pub requests_rejected: AtomicU64,
    /// Sequences that ended with `finish_reason` "stop".
    pub finished_stop: AtomicU64,
    /// Sequences that ended with `finish_reason` "length".
    pub finished_length: AtomicU64,
    /// Sequences whose client went away before the end (slot freed early).
    pub cancelled: AtomicU64,
    /// Sequences ended by an engine error.
    pub failed: AtomicU64,
    /// Requests past their deadline (`--request-timeout`): running ones finished "length",
    /// waiting ones answered 503.
    pub timed_out: AtomicU64,
    /// Clients dropped because they stopped reading (their event channel was full); also
    /// counted in `cancelled`.
    pub slow_clients: AtomicU64,
    /// Prompt tokens of admitted sequences.
    pub prompt_tokens: AtomicU64,
    /// Of which found in their slot's cache and not computed again (the prompt cache).
    pub prompt_tokens_cached: AtomicU64,
    /// Of those, copied from another sequence's slot (a prefix it shares with one running).
    pub prompt_tokens_copied: AtomicU64,
    /// Tokens generated (sampled, end-of-generation tokens excluded).
    pub completion_tokens: AtomicU64,
    /// Requests waiting for a cache slot.
    pub queue_depth: AtomicU64,
    /// Sequences holding a slot (the active batch).
    pub active_seqs: AtomicU64,
    /// Cache slots in all (`--max-seqs`).
    pub slots_total: AtomicU64,
    /// Forward passes run.
    pub steps: AtomicU64,
    /// Tokens fed through forwards (prompt chunks + decode tokens).
    pub batch_tokens: AtomicU64,
    /// Tokens in the latest forward.
    pub last_batch_tokens: AtomicU64,
    /// Forwards by how the backend ran them (`Model::step_counts`): replayed from a recording
    /// (CUDA graphs), recorded, op by op. Each batch shape has its own recording.
    pub steps_replayed: AtomicU64,
    pub steps_recorded: AtomicU64,
    pub steps_eager: AtomicU64,
    /// Steps enqueued before the step before them had come back (chained greedy steps).
    pub steps_chained: AtomicU64,
    /// Waits for returning clients before a step (engine doc, "Returning clients"), those that
    /// ran out, and the seconds they took.
    pub gathers: AtomicU64,
    pub gathers_timed_out: AtomicU64,
    pub gather_seconds: F64Gauge,
    /// Forward passes that failed (an error or a panic in the model or its backend).
    pub steps_failed: AtomicU64,
    /// Failed forward passes since the last one that ran (0 while the engine works).
    pub failed_in_a_row: AtomicU64,
    /// Why the engine is out of service: set once [`UNHEALTHY_AFTER`] forward passes in a row
    /// have failed (a device that lost its context fails every one). From then on `/health`
    /// answers 503 with it and new requests are refused; a restart is what mends it.
    pub out_of_service: Mutex<Option<String>>,
    /// Seconds spent in forwards + sampling.
    pub step_seconds: F64Gauge,
    /// Of which in the model's forward passes (including the logits' copy to the host).
    pub forward_seconds: F64Gauge,
    /// Generated tokens per second over the latest window of about a second (0 when idle).
    pub tokens_per_second: F64Gauge,
    /// Time from a request's arrival to its first generated token.
    pub ttft: Mutex<Histogram>,
    /// HTTP responses by (route, status).
    pub responses: Mutex<BTreeMap<(&'static str, u16), u64>>,
}

/// Failed forward passes in a row after which the engine counts as out of service
/// ([`Metrics::out_of_service`]). One failure fails the step's requests and the engine goes on
/// (a transient fault); three in a row, each with fresh requests, is a backend that no longer
/// works.
pub const UNHEALTHY_AFTER: u64 = 3;

impl Metrics {
    /// Why the engine is out of service, if it is ([`Metrics::out_of_service`]).
    pub fn out_of_service(&self) -> Option<String> {
        self.out_of_service.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Counts one HTTP response.
    pub fn response(&self, route: &'static str, status: u16) {
        let mut m = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *m.entry((route, status)).or_insert(0) += 1;
    }

    /// Records a time to first token, in seconds.
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).observe(secs);
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut s = String::with_capacity(4096);
        let counter = |s: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |s: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut s,
            "turbospark_requests_accepted_total",
            "Generation requests accepted into the queue.",
            self.requests_accepted.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_requests_rejected_total",
            "Generation requests refused with 503 (queue full).",
            self.requests_rejected.load(Relaxed),
        );
        let _ = writeln!(
            s,
            "# HELP turbospark_requests_finished_total Sequences ended, by reason.\n# TYPE turbospark_requests_finished_total counter"
        );
        for (reason, v) in
            [("stop", &self.finished_stop), ("length", &self.finished_length), ("cancelled", &self.cancelled), ("error", &self.failed)]
        {
            let _ = writeln!(s, "turbospark_requests_finished_total{{reason=\"{reason}\"}} {}", v.load(Relaxed));
        }
        counter(
            &mut s,
            "turbospark_requests_timed_out_total",
            "Requests past --request-timeout (running: finished \"length\"; waiting: 503).",
            self.timed_out.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_slow_clients_dropped_total",
            "Sequences dropped because their client stopped reading.",
            self.slow_clients.load(Relaxed),
        );
        counter(&mut s, "turbospark_prompt_tokens_total", "Prompt tokens of admitted requests.", self.prompt_tokens.load(Relaxed));
        counter(
            &mut s,
            "turbospark_prompt_tokens_cached_total",
            "Prompt tokens read from a slot's cache (the prompt cache) instead of computed.",
            self.prompt_tokens_cached.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_prompt_tokens_copied_total",
            "Of the cached prompt tokens, those copied from a running sequence's slot (a shared prefix).",
            self.prompt_tokens_copied.load(Relaxed),
        );
        counter(&mut s, "turbospark_completion_tokens_total", "Tokens generated.", self.completion_tokens.load(Relaxed));
        gauge(&mut s, "turbospark_queue_depth", "Requests waiting for a cache slot.", self.queue_depth.load(Relaxed) as f64);
        gauge(
            &mut s,
            "turbospark_active_sequences",
            "Sequences in the running batch (slots in use).",
            self.active_seqs.load(Relaxed) as f64,
        );
        gauge(&mut s, "turbospark_slots_total", "Cache slots (--max-seqs).", self.slots_total.load(Relaxed) as f64);
        gauge(&mut s, "turbospark_batch_tokens", "Tokens in the latest forward pass.", self.last_batch_tokens.load(Relaxed) as f64);
        counter(&mut s, "turbospark_steps_total", "Forward passes run.", self.steps.load(Relaxed));
        counter(&mut s, "turbospark_steps_failed_total", "Forward passes that failed.", self.steps_failed.load(Relaxed));
        gauge(
            &mut s,
            "turbospark_healthy",
            "1 while the engine serves; 0 once several forward passes in a row have failed (see /health).",
            if self.out_of_service().is_some() { 0.0 } else { 1.0 },
        );
        counter(&mut s, "turbospark_batch_tokens_total", "Tokens fed through forward passes.", self.batch_tokens.load(Relaxed));
        counter(
            &mut s,
            "turbospark_steps_replayed_total",
            "Forward passes replayed from a recording of their batch shape (CUDA graphs).",
            self.steps_replayed.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_steps_recorded_total",
            "Forward passes recorded (then run from the recording).",
            self.steps_recorded.load(Relaxed),
        );
        counter(&mut s, "turbospark_steps_eager_total", "Forward passes enqueued op by op.", self.steps_eager.load(Relaxed));
        counter(
            &mut s,
            "turbospark_steps_chained_total",
            "Steps enqueued on the device from the step before's greedy picks, before those came back.",
            self.steps_chained.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_gathers_total",
            "Waits for returning clients after a step that ended many sequences.",
            self.gathers.load(Relaxed),
        );
        counter(
            &mut s,
            "turbospark_gathers_timed_out_total",
            "Of those, the waits that ran out (waiting then pauses for a second).",
            self.gathers_timed_out.load(Relaxed),
        );
        let _ = writeln!(
            s,
            "# HELP turbospark_gather_seconds_total Seconds the engine waited for returning clients.\n# TYPE turbospark_gather_seconds_total counter\nturbospark_gather_seconds_total {}",
            self.gather_seconds.get()
        );
        let _ = writeln!(
            s,
            "# HELP turbospark_step_seconds_total Seconds spent in forward passes and sampling.\n# TYPE turbospark_step_seconds_total counter\nturbospark_step_seconds_total {}",
            self.step_seconds.get()
        );
        let _ = writeln!(
            s,
            "# HELP turbospark_forward_seconds_total Of the step seconds, those in the model's forward passes (logits copied to the host included; the rest is batching and sampling).\n# TYPE turbospark_forward_seconds_total counter\nturbospark_forward_seconds_total {}",
            self.forward_seconds.get()
        );
        gauge(
            &mut s,
            "turbospark_tokens_per_second",
            "Generated tokens per second over the latest window (about 1 s).",
            self.tokens_per_second.get(),
        );
        {
            let h = self.ttft.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let _ = writeln!(s, "# HELP turbospark_time_to_first_token_seconds Time from request arrival to its first token.\n# TYPE turbospark_time_to_first_token_seconds histogram");
            for (le, c) in TTFT_BUCKETS.iter().zip(h.buckets.iter()) {
                let _ = writeln!(s, "turbospark_time_to_first_token_seconds_bucket{{le=\"{le}\"}} {c}");
            }
            let _ = writeln!(s, "turbospark_time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(s, "turbospark_time_to_first_token_seconds_sum {}", h.sum);
            let _ = writeln!(s, "turbospark_time_to_first_token_seconds_count {}", h.count);
        }
        {
            let m = self.responses.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let _ = writeln!(s, "# HELP turbospark_http_responses_total HTTP responses by route and status.\n# TYPE turbospark_http_responses_total counter");
            for ((route, code), v) in m {
                let _ = writeln!(s, "turbospark_http_responses_total{{route=\"{route}\",code=\"{code}\"}} {v}");
            }
        }
        s
    }
}

/// The value of the first sample named `name` (labels included, e.g.
/// `turbospark_requests_finished_total{reason="cancelled"}`) in Prometheus text `text`.
pub fn scrape(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_and_scrapes() {
        let m = Metrics::default();
        m.completion_tokens.store(42, Relaxed);
        m.cancelled.store(3, Relaxed);
        m.step_seconds.set(1.5);
        m.observe_ttft(0.2);
        m.response("chat", 400);
        m.steps_replayed.store(7, Relaxed);
        m.steps_eager.store(2, Relaxed);
        let t = m.render();
        assert_eq!(scrape(&t, "turbospark_steps_replayed_total"), Some(7.0));
        assert_eq!(scrape(&t, "turbospark_steps_recorded_total"), Some(0.0));
        assert_eq!(scrape(&t, "turbospark_steps_eager_total"), Some(2.0));
        assert_eq!(scrape(&t, "turbospark_completion_tokens_total"), Some(42.0));
        assert_eq!(scrape(&t, "turbospark_requests_finished_total{reason=\"cancelled\"}"), Some(3.0));
        assert_eq!(scrape(&t, "turbospark_step_seconds_total"), Some(1.5));
        assert_eq!(scrape(&t, "turbospark_time_to_first_token_seconds_bucket{le=\"0.25\"}"), Some(1.0));
        assert_eq!(scrape(&t, "turbospark_time_to_first_token_seconds_bucket{le=\"0.1\"}"), Some(0.0));
        assert_eq!(scrape(&t, "turbospark_http_responses_total{route=\"chat\",code=\"400\"}"), Some(1.0));
        assert_eq!(t.matches("# TYPE turbospark_step_seconds_total").count(), 1);
    }
}
