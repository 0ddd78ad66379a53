//! The engine thread: owns the model and runs continuous batching.
//!
//! Requests ([`Job`]s) arrive over a channel. Each step the engine
//! 1. takes new jobs and gives waiting ones a free cache slot (first come, first served);
//! 2. drops sequences whose client went away (their slot is free again at once);
//! 3. builds ONE [`BatchMeta`]: one decode token per sequence that is generating, then prompt
//!    chunks of sequences still in prefill, at most `prefill_chunk` prompt tokens per step in all,
//!    so a long prompt never stalls the others' decoding for more than one chunk;
//! 4. runs one forward, samples every sequence whose logits came out (each has its own
//!    [`Sampler`], so a seeded or greedy request gives the same text alone or in a crowd), and
//!    streams the text back over the job's own channel.
//!
//! The batch, output and logits buffers are allocated once and reused by every step.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;
use ts_core::{BatchMeta, TokenMeta};
use ts_engine::{Sampler, SamplerParams, StreamDecoder, Tokenizer};
use ts_models::Model;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::stop::StopMatcher;

/// Why a sequence ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-generation token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// `"stop"` or `"length"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// One of the most likely tokens at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    /// The token's text (lossy UTF-8 of its bytes).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Natural-log probability (log-softmax of the raw logits).
    pub logprob: f32,
}

/// Log-probability of a generated token and the alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The chosen token.
    pub chosen: TopLogprob,
    /// The `top_logprobs` most likely tokens, best first.
    pub top: Vec<TopLogprob>,
}

/// What the engine sends back to a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Text that became final (never part of a stop string), with the log-probabilities of the
    /// tokens that produced it when they were asked for.
    Delta { text: String, logprobs: Vec<TokenLogprob> },
    /// The sequence ended.
    Done { finish: Finish, prompt_tokens: usize, completion_tokens: usize },
    /// The engine failed; the sequence is over.
    Failed(String),
}

/// A generation request, ready for the engine: prompt tokens and how to sample.
#[derive(Debug)]
pub struct Job {
    /// Prompt token ids (non-empty, shorter than the context).
    pub prompt: Vec<u32>,
    /// Sampling parameters (each job gets its own [`Sampler`]).
    pub sampling: SamplerParams,
    /// Most tokens to generate; `prompt.len() + max_tokens <= ctx`.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// `Some(n)`: report the chosen token's log-probability and the `n` most likely ones.
    pub top_logprobs: Option<usize>,
    /// Where events go. When its receiver is dropped, the sequence stops.
    pub events: UnboundedSender<Event>,
    /// When the request arrived (for time to first token).
    pub arrived: Instant,
}

/// Engine sizing beyond what the model's [`ts_models::RuntimeOptions`] says.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Requests that may wait for a slot; beyond that, 503.
    pub max_queue: usize,
    /// Most prompt tokens per step (chunked prefill).
    pub prefill_chunk: usize,
}

enum Msg {
    Job(Box<Job>),
    Shutdown,
}

/// Handle to the engine thread.
pub struct Engine {
    tx: Mutex<mpsc::Sender<Msg>>,
    metrics: Arc<Metrics>,
    /// Jobs submitted and not finished yet (waiting + active).
    occupancy: Arc<AtomicU64>,
    ctx: usize,
    n_slots: usize,
    max_queue: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Starts the engine thread over `model`. The model's options give the context per slot,
    /// the number of slots and the widest forward, which must fit a decode token for every slot
    /// plus at least one prompt token.
    pub fn start(model: Box<dyn Model>, tok: Arc<Tokenizer>, cfg: EngineConfig, metrics: Arc<Metrics>) -> anyhow::Result<Arc<Engine>> {
        let o = model.options();
        if o.n_slots == 0 || o.ctx < 2 {
            anyhow::bail!("the model was loaded with {} slots of {} tokens; the server needs at least 1 slot of 2", o.n_slots, o.ctx);
        }
        if o.max_batch < o.n_slots + 1 {
            anyhow::bail!(
                "the model's widest forward ({} tokens) must hold one decode token per slot ({}) plus a prompt token",
                o.max_batch,
                o.n_slots
            );
        }
        let (tx, rx) = mpsc::channel();
        let occupancy = Arc::new(AtomicU64::new(0));
        metrics.slots_total.store(o.n_slots as u64, Relaxed);
        let (m2, occ2) = (metrics.clone(), occupancy.clone());
        let prefill_chunk = cfg.prefill_chunk.max(1);
        let thread = std::thread::Builder::new().name("ts-engine".into()).spawn(move || {
            let mut model = model;
            let mut st = Stepper::new(model.as_mut(), &tok, prefill_chunk, m2, occ2);
            st.run(rx);
        })?;
        Ok(Arc::new(Engine {
            tx: Mutex::new(tx),
            metrics,
            occupancy,
            ctx: o.ctx,
            n_slots: o.n_slots,
            max_queue: cfg.max_queue,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Context length of one sequence.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Cache slots (sequences generated at once).
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Jobs submitted and not finished (waiting + active).
    pub fn occupancy(&self) -> u64 {
        self.occupancy.load(Relaxed)
    }

    /// Queues `job`, or refuses it with 503 when every slot is busy and the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let cap = (self.n_slots + self.max_queue) as u64;
        let admitted = self.occupancy.fetch_update(Relaxed, Relaxed, |o| (o < cap).then_some(o + 1)).is_ok();
        if !admitted {
            self.metrics.requests_rejected.fetch_add(1, Relaxed);
            return Err(ApiError::unavailable(
                format!(
                    "server busy: all {} slots are generating and {} requests are already waiting (the queue limit); retry later",
                    self.n_slots, self.max_queue
                ),
                "queue_full",
            ));
        }
        let sent = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Job(Box::new(job)));
        if sent.is_err() {
            self.occupancy.fetch_sub(1, Relaxed);
            return Err(ApiError::unavailable("the engine has stopped (the server is shutting down)", "engine_stopped"));
        }
        self.metrics.requests_accepted.fetch_add(1, Relaxed);
        self.metrics.queue_depth.store(self.occupancy().saturating_sub(self.metrics.active_seqs.load(Relaxed)), Relaxed);
        Ok(())
    }

    /// Stops the engine: running and waiting requests get [`Event::Failed`]; waits for the thread.
    pub fn shutdown(&self) {
        let _ = self.tx.lock().unwrap_or_else(|e| e.into_inner()).send(Msg::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A sequence holding a cache slot.
struct Seq<'t> {
    job: Job,
    slot: u32,
    /// Tokens in the cache.
    n_past: usize,
    /// Tokens this step feeds.
    fed: usize,
    /// The last sampled token (fed next step).
    next: u32,
    generated: Vec<u32>,
    sampler: Sampler,
    dec: StreamDecoder<'t>,
    stop: StopMatcher,
    /// Log-probabilities of tokens whose text is still held back.
    pending_lp: Vec<TokenLogprob>,
    first_token_seen: bool,
    /// Set when the sequence is over (its slot is returned at the end of the step).
    done: bool,
}

impl Seq<'_> {
    fn decoding(&self) -> bool {
        self.n_past >= self.job.prompt.len()
    }
}

/// The engine's state; lives on the engine thread.
struct Stepper<'m, 't> {
    model: &'m mut dyn Model,
    tok: &'t Tokenizer,
    n_vocab: usize,
    max_batch: usize,
    prefill_chunk: usize,
    batch: BatchMeta,
    /// For output row k: the index in `active` of the sequence it belongs to.
    owners: Vec<usize>,
    logits: Vec<f32>,
    free: Vec<u32>,
    waiting: VecDeque<Job>,
    active: Vec<Seq<'t>>,
    metrics: Arc<Metrics>,
    occupancy: Arc<AtomicU64>,
    /// Tokens-per-second window.
    win_start: Instant,
    win_tokens: u64,
    /// Reused text buffer for released text.
    scratch: String,
}

impl<'m, 't> Stepper<'m, 't> {
    fn new(model: &'m mut dyn Model, tok: &'t Tokenizer, prefill_chunk: usize, metrics: Arc<Metrics>, occupancy: Arc<AtomicU64>) -> Self {
        let o = model.options();
        let n_vocab = model.info().n_vocab;
        Stepper {
            n_vocab,
            max_batch: o.max_batch,
            prefill_chunk,
            batch: BatchMeta { tokens: Vec::with_capacity(o.max_batch), outputs: Vec::with_capacity(o.n_slots), slot_len: o.ctx as u32 },
            owners: Vec::with_capacity(o.n_slots),
            logits: vec![0.0; o.n_slots * n_vocab],
            free: (0..o.n_slots as u32).rev().collect(),
            waiting: VecDeque::new(),
            active: Vec::with_capacity(o.n_slots),
            model,
            tok,
            metrics,
            occupancy,
            win_start: Instant::now(),
            win_tokens: 0,
            scratch: String::new(),
        }
    }

    /// The loop: until shutdown (or every sender gone).
    fn run(&mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                self.metrics.tokens_per_second.set(0.0);
                self.win_tokens = 0;
                match rx.recv() {
                    Ok(Msg::Job(j)) => self.waiting.push_back(*j),
                    Ok(Msg::Shutdown) | Err(_) => return self.fail_all("the server is shutting down"),
                }
                self.win_start = Instant::now();
            }
            loop {
                match rx.try_recv() {
                    Ok(Msg::Job(j)) => self.waiting.push_back(*j),
                    Ok(Msg::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return self.fail_all("the server is shutting down"),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            self.admit();
            self.drop_cancelled();
            if self.active.is_empty() {
                continue;
            }
            self.step();
            self.retire();
        }
    }

    /// Gives free slots to waiting jobs (dropping jobs whose client already left).
    fn admit(&mut self) {
        while !self.free.is_empty() {
            let Some(job) = self.waiting.pop_front() else { break };
            if job.events.is_closed() {
                self.metrics.cancelled.fetch_add(1, Relaxed);
                self.occupancy.fetch_sub(1, Relaxed);
                continue;
            }
            let Some(slot) = self.free.pop() else { break };
            self.metrics.prompt_tokens.fetch_add(job.prompt.len() as u64, Relaxed);
            let sampler = Sampler::new(job.sampling.clone());
            let stop = StopMatcher::new(job.stop.clone());
            self.active.push(Seq {
                generated: Vec::with_capacity(job.max_tokens.min(4096)),
                job,
                slot,
                n_past: 0,
                fed: 0,
                next: 0,
                sampler,
                dec: StreamDecoder::new(self.tok),
                stop,
                pending_lp: Vec::new(),
                first_token_seen: false,
                done: false,
            });
        }
        self.update_gauges();
    }

    fn update_gauges(&self) {
        let active = self.active.iter().filter(|s| !s.done).count() as u64;
        self.metrics.active_seqs.store(active, Relaxed);
        self.metrics.queue_depth.store(self.occupancy.load(Relaxed).saturating_sub(active), Relaxed);
    }

    /// Stops sequences whose client hung up.
    fn drop_cancelled(&mut self) {
        let mut any = false;
        for s in self.active.iter_mut() {
            if !s.done && s.job.events.is_closed() {
                s.done = true;
                self.metrics.cancelled.fetch_add(1, Relaxed);
                any = true;
            }
        }
        if any {
            self.retire();
        }
    }

    /// Returns the slots of finished sequences.
    fn retire(&mut self) {
        let before = self.active.len();
        let free = &mut self.free;
        self.active.retain(|s| {
            if s.done {
                free.push(s.slot);
            }
            !s.done
        });
        let n = (before - self.active.len()) as u64;
        if n > 0 {
            self.occupancy.fetch_sub(n, Relaxed);
        }
        self.update_gauges();
    }

    /// One forward over every active sequence, then sampling.
    fn step(&mut self) {
        let t0 = Instant::now();
        self.batch.tokens.clear();
        self.batch.outputs.clear();
        self.owners.clear();
        for (i, s) in self.active.iter_mut().enumerate() {
            s.fed = 0;
            if s.decoding() {
                self.batch.outputs.push(self.batch.tokens.len() as u32);
                self.batch.tokens.push(TokenMeta { token: s.next, pos: s.n_past as u32, slot: s.slot });
                self.owners.push(i);
                s.fed = 1;
            }
        }
        let mut budget = self.prefill_chunk.min(self.max_batch - self.batch.tokens.len());
        for (i, s) in self.active.iter_mut().enumerate() {
            if budget == 0 {
                break;
            }
            if s.decoding() {
                continue;
            }
            let rest = &s.job.prompt[s.n_past..];
            let take = rest.len().min(budget);
            for (j, &t) in rest[..take].iter().enumerate() {
                self.batch.tokens.push(TokenMeta { token: t, pos: (s.n_past + j) as u32, slot: s.slot });
            }
            if take == rest.len() {
                self.batch.outputs.push(self.batch.tokens.len() as u32 - 1);
                self.owners.push(i);
            }
            s.fed = take;
            budget -= take;
        }
        let n_out = self.batch.outputs.len();
        let nv = self.n_vocab;
        let (model, batch, logits) = (&mut *self.model, &self.batch, &mut self.logits[..n_out * nv]);
        let r = std::panic::catch_unwind(AssertUnwindSafe(|| model.forward(batch, logits)));
        let err = match r {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("forward failed: {e}")),
            Err(p) => {
                let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                Some(format!("forward panicked: {}", what.unwrap_or_else(|| "unknown cause".into())))
            }
        };
        self.metrics.steps.fetch_add(1, Relaxed);
        self.metrics.batch_tokens.fetch_add(self.batch.tokens.len() as u64, Relaxed);
        self.metrics.last_batch_tokens.store(self.batch.tokens.len() as u64, Relaxed);
        if let Some(e) = err {
            tracing::error!("{e}");
            for s in self.active.iter_mut() {
                if !s.done {
                    let _ = s.job.events.send(Event::Failed(e.clone()));
                    s.done = true;
                    self.metrics.failed.fetch_add(1, Relaxed);
                }
            }
            return;
        }
        for s in self.active.iter_mut() {
            s.n_past += s.fed;
        }
        let mut produced = 0u64;
        for k in 0..n_out {
            let i = self.owners[k];
            let row = &self.logits[k * nv..(k + 1) * nv];
            let s = &mut self.active[i];
            if s.done {
                continue;
            }
            if sample_one(s, row, self.tok, &self.metrics, &mut self.scratch) {
                produced += 1;
            }
        }
        let el = t0.elapsed().as_secs_f64();
        self.metrics.step_seconds.set(self.metrics.step_seconds.get() + el);
        self.win_tokens += produced;
        let w = self.win_start.elapsed().as_secs_f64();
        if w >= 1.0 {
            self.metrics.tokens_per_second.set(self.win_tokens as f64 / w);
            self.win_tokens = 0;
            self.win_start = Instant::now();
        }
    }

    /// Ends every sequence, running or waiting, with `why`.
    fn fail_all(&mut self, why: &str) {
        for s in self.active.iter_mut().filter(|s| !s.done) {
            let _ = s.job.events.send(Event::Failed(why.to_string()));
            s.done = true;
            self.metrics.failed.fetch_add(1, Relaxed);
        }
        self.retire();
        for j in self.waiting.drain(..) {
            let _ = j.events.send(Event::Failed(why.to_string()));
            self.metrics.failed.fetch_add(1, Relaxed);
            self.occupancy.fetch_sub(1, Relaxed);
        }
        self.update_gauges();
    }
}

fn token_logprob(tok: &Tokenizer, id: u32, logprob: f32) -> TopLogprob {
    let bytes = tok.token_bytes(id, true).into_owned();
    TopLogprob { token: String::from_utf8_lossy(&bytes).into_owned(), bytes, logprob }
}

/// Samples the next token of `s` from `row`, streams its text, and ends the sequence when due.
/// Returns true when a token was generated (end-of-generation tokens are not counted).
fn sample_one(s: &mut Seq<'_>, row: &[f32], tok: &Tokenizer, metrics: &Metrics, out: &mut String) -> bool {
    if !s.first_token_seen {
        s.first_token_seen = true;
        metrics.observe_ttft(s.job.arrived.elapsed().as_secs_f64());
    }
    let id = s.sampler.sample(row, &s.generated);
    if tok.is_eog(id) {
        finish(s, Finish::Stop, metrics, out);
        return false;
    }
    if let Some(n) = s.job.top_logprobs {
        let (lp, top) = s.sampler.logprobs_for(row, id, n);
        s.pending_lp.push(TokenLogprob {
            chosen: token_logprob(tok, id, lp),
            top: top.into_iter().map(|(t, l)| token_logprob(tok, t, l)).collect(),
        });
    }
    s.generated.push(id);
    s.next = id;
    metrics.completion_tokens.fetch_add(1, Relaxed);
    let piece = s.dec.push(id);
    out.clear();
    let stopped = s.stop.push(&piece, out);
    if stopped {
        // The tokens that formed the stop string are not reported.
        s.pending_lp.clear();
    }
    if !out.is_empty() && !send_delta(s, out) {
        metrics.cancelled.fetch_add(1, Relaxed);
        return true;
    }
    if stopped {
        finish(s, Finish::Stop, metrics, out);
    } else if s.generated.len() >= s.job.max_tokens {
        finish(s, Finish::Length, metrics, out);
    }
    true
}

/// Sends `text` with the pending log-probabilities; on a closed channel marks the sequence
/// cancelled and returns false.
fn send_delta(s: &mut Seq<'_>, text: &str) -> bool {
    let ev = Event::Delta { text: text.to_string(), logprobs: std::mem::take(&mut s.pending_lp) };
    if s.job.events.send(ev).is_err() {
        s.done = true;
        return false;
    }
    true
}

/// Flushes held text and sends [`Event::Done`].
fn finish(s: &mut Seq<'_>, why: Finish, metrics: &Metrics, out: &mut String) {
    out.clear();
    if !s.stop.stopped() {
        let rest = s.dec.flush();
        if s.stop.push(&rest, out) {
            s.pending_lp.clear();
        }
        s.stop.finish(out);
    }
    let why = if s.stop.stopped() { Finish::Stop } else { why };
    if (!out.is_empty() || !s.pending_lp.is_empty()) && !send_delta(s, out) {
        metrics.cancelled.fetch_add(1, Relaxed);
        return;
    }
    let done = Event::Done { finish: why, prompt_tokens: s.job.prompt.len(), completion_tokens: s.generated.len() };
    if s.job.events.send(done).is_err() {
        metrics.cancelled.fetch_add(1, Relaxed);
    } else {
        match why {
            Finish::Stop => metrics.finished_stop.fetch_add(1, Relaxed),
            Finish::Length => metrics.finished_length.fetch_add(1, Relaxed),
        };
    }
    s.done = true;
}
