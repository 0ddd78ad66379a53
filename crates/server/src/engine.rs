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
//!
//! ## Greedy rows come back as ids
//! A row whose sampler is a plain arg-max ([`Sampler::is_plain_greedy`]) and that wants no
//! log-probabilities asks the model for its arg-max only ([`Outputs::argmax`], computed where the
//! logits are); only the other rows' logits are copied back. At 64 greedy sequences of a
//! 102,400-token vocabulary that is 256 bytes per step instead of 26 MB. The pick is the same
//! (`ts_core::argmax` is the sampler's greedy rule).
//!
//! ## Chained steps
//! On a model that chains greedy steps on its device ([`Model::chains_argmax`]: the CUDA
//! families), a step whose every output row is a plain greedy pick leaves its picks there
//! ([`Outputs::queued`]), and when no job waits and every running sequence goes on greedily
//! (below `max_tokens`, inside the context) the next step is enqueued at once, its tokens the
//! picks on the device ([`ts_core::TOKEN_FROM_ARGMAX`]). Only then does the engine wait for this
//! step's picks and stream their text, while the device already runs the next step: the host's
//! turn (sampling, stop strings, streaming, building and uploading the next batch) no longer
//! leaves the GPU idle. A sequence that ends anyway (end of generation, a stop string, its
//! client gone) had one row computed for nothing; its pick is dropped, and its rows are matched
//! by sequence, not slot, since the slot may already serve another. A job that arrives waits
//! at most for the step in flight. The text is the same as without chaining (test
//! `chained_steps_give_the_same_text`). `serve` chains by default (`--no-chain` turns it off;
//! [`EngineConfig::chain`] is off in the library's default config): on the H200 the server's
//! 64 clients got 9,542 tok/s against 9,466-9,480 without (gpu-next148).
//!
//! ## Returning clients
//! Clients that send their next request as soon as one ends (benchmarks, batch jobs, agents)
//! come back together when their sequences end together, over a millisecond or two. A step
//! started on the first arrival would carry only it, and the rest would join a step later and
//! stay a step out of phase with it from then on: at 64 such clients (H100, `loadtest
//! --max-tokens 128`) the server's steps carried 63.0 rows of 64. So after a step that ended at
//! least a quarter of the running sequences, the engine waits up to
//! [`EngineConfig::gather`] (`serve --gather-ms`, 10 ms by default) for as many new requests as
//! it ended (at most the free slots) before it builds the next step; it goes on as soon as they
//! are there. A wait that runs out turns waiting off for [`GATHER_BACKOFF`]: clients that do not
//! come straight back (people) cost at most one wait a second. Never while a step is enqueued
//! ahead: that one's rows are fixed. Measured (H100, 64 clients, gpu-next173): 64.00 rows a
//! step against 63.01, 7,769 tok/s against 7,684 (+1.1%), TTFT p50 10 ms against 24; 37 waits
//! in 20 s, 1.75 ms each on average. (A CPU server of SmolLM2 at 64 clients of 16 tokens on
//! this 2-core machine: 63.2 generated tokens a step against ~57, its clients slower to come
//! back: 3 and 5 ms waits often ran out, 10 ms once in 37.)
//!
//! ## JSON mode
//! A [`Job::json`] sequence (`response_format` `json_object` or `json_schema`) samples from its
//! logits row with every token that would break the syntax (or the schema) at `-inf`
//! (`ts_engine::json`: a recogniser of one JSON object over the tokens' bytes, or
//! `ts_engine::json_schema`'s of a schema's documents, walked over the vocabulary in byte
//! order each step: ~30 µs for SmolLM2's 49k tokens, ~0.1 ms inside a string, ~0.2-0.8 ms for
//! Gemma 3's 262k, on this CPU), and ends with "stop" as soon as the object closes. Its rows
//! always come back whole (never as a device arg-max) and never chain. The vocabulary is sorted
//! for it once, when the engine starts; a model whose tokens cannot write JSON (no tokenizer)
//! refuses JSON mode ([`Engine::json_ready`]).
//!
//! ## Hostile and slow clients
//! The engine thread never blocks on a client. Each job's event channel is bounded
//! ([`EVENT_BUFFER`] events) and written with `try_send`: a client that stops reading (a stalled
//! stream) is dropped when its channel is full, like one that hung up, and its slot is free at
//! once. A job may carry a deadline ([`Job::deadline`], the server's `--request-timeout`): a
//! sequence still running then ends with `finish_reason` "length" (the text so far is kept), and
//! a request still waiting for a slot is answered 503 ([`Event::Unavailable`]).
//!
//! ## Batch invariance
//! A request's text must not depend on what else runs beside it. That holds only if every row of
//! a batched forward is computed with the same arithmetic as it would be alone. The CPU matmul
//! kernels take activation rows in groups of four, and a group of one or two sums its blocks in
//! a different order (two interleaved accumulators) than a group of four: rows agree only to
//! rounding, and greedy decoding can then diverge. So with [`EngineConfig::row_multiple`] = 4
//! the engine pads every forward with dummy tokens (token 0 at positions 0, 1, … of a reserved
//! pad slot, the model's last one) until both its token count and its logits-row count are
//! multiples of 4: every group is full, alone or among fifteen others. The padding is at most
//! `2 * (row_multiple - 1)` rows; decoding reads each weight once per group, so it costs little.
//! A model that reports [`ts_models::ModelInfo::batch_invariant`] (on AVX2, every matrix of
//! Q4_0, Q5_0, Q4_1, Q5_1 or Q8_0: their products of 1-3 rows have the 4-row arithmetic; with
//! `CpuBackend::invariant`, which `turbospark serve` sets, Q4_K, Q5_K and Q6_K as well; F32, F16
//! and BF16 always) is not padded: single-stream decoding then computes one row, not four.
//!
//! ## Prompt cache
//! A slot's cache rows outlive its sequence: when a sequence ends, the engine notes which
//! tokens its slot's rows `0..n_past` hold (the prompt, then the generated tokens fed back).
//! A new job takes the free slot whose rows share the longest prefix with its prompt and starts
//! there: `n_past` begins at that prefix (at most all but the prompt's last token, whose logits
//! the step must compute), and only the rest of the prompt is fed. Multi-turn chats (each
//! request repeats the conversation so far), a shared system prompt and retried requests then
//! skip most of their prefill; `usage.prompt_tokens_details.cached_tokens` counts what was
//! skipped. Reused rows are read only below the sequence's own position, and every row from
//! there on is written by this sequence before it is read (a step enqueued ahead for the slot's
//! last sequence writes only its row `n_past`, which the new sequence overwrites, in stream
//! order). The rows are the ones a fresh prefill would compute wherever a row's arithmetic does
//! not depend on its batch (the CPU's invariant kernels, see above), so the text is the same
//! with the cache or without; on CUDA the rows of generated tokens came from decode kernels and
//! may differ in the last bits. A failed forward forgets every slot's rows. Off with
//! [`EngineConfig::prompt_cache`] = false (`serve --no-prompt-cache`).
//!
//! ## Shared prefixes
//! The rows a prompt needs may also be in a running sequence's slot: a request's other choices
//! (`n` > 1), or clients that send the same long system prompt together. A new job whose
//! prompt shares at least [`MIN_SHARED`] more tokens with a running sequence's computed rows
//! than with any free slot takes a free slot and has those rows copied into it
//! ([`Model::copy_prefix`], in order with the steps; `turbospark_prompt_tokens_copied_total`).
//! A job whose prompt shares [`MIN_SHARED`] tokens or more with a sequence still computing its
//! own prompt, more than any slot holds now, waits (later jobs go ahead of it) until that
//! prompt is done, then copies it: `n` choices compute their prompt once. Without the prompt
//! cache, only a request's own choices share ([`Job::group`]): nothing computed for one
//! request serves another. A model that cannot copy ([`Model::copy_prefix`] fails) turns
//! copying off. (CPU, SmolLM2: 4 choices over a 563-token prompt in 2.21 s against 8.60 s
//! computing it four times.) On CUDA the choices' texts also agree that way: computed four
//! times, in prompt chunks that split the copies at other places, their rows differ in the
//! last bits, and greedy texts can part (H200, a random-weight V2-Lite: after 9-15 tokens).

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::mpsc::Sender;
use ts_core::{BatchMeta, TokenMeta, TOKEN_FROM_ARGMAX};
use ts_engine::json::{Grammar, JsonState, JsonVocab};
use ts_engine::json_schema::{Schema, SchemaState};
use ts_engine::{Sampler, SamplerParams, StreamDecoder, Tokenizer};
use ts_models::{Model, Outputs};

use crate::error::ApiError;
use crate::metrics::{Metrics, UNHEALTHY_AFTER};
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
    Done { finish: Finish, usage: Usage },
    /// The engine failed; the sequence is over.
    Failed(String),
    /// The request was not run (it waited past its deadline for a slot): a 503 with this reason.
    Unavailable(String),
}

/// A finished request's token counts (OpenAI's `usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens (all of them, cached or not).
    pub prompt: usize,
    /// Of which read from the slot's cache instead of computed (module doc, "Prompt cache").
    pub cached: usize,
    /// Tokens generated.
    pub completion: usize,
}

/// Capacity of a job's event channel. A client that falls this many events behind (a stream
/// nobody reads) is dropped, so it cannot make the engine wait or buffer without bound.
pub const EVENT_BUFFER: usize = 1024;

/// Sends `ev` without blocking. `Err(true)`: the receiver is gone; `Err(false)`: it is full
/// (the client stopped reading).
fn try_send(tx: &Sender<Event>, ev: Event) -> Result<(), bool> {
    match tx.try_send(ev) {
        Ok(()) => Ok(()),
        Err(TrySendError::Closed(_)) => Err(true),
        Err(TrySendError::Full(_)) => Err(false),
    }
}

/// What JSON mode constrains the text to.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonMode {
    /// One JSON object (`response_format` `json_object`).
    Object,
    /// A document of this schema (`response_format` `json_schema`).
    Schema(Arc<Schema>),
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
    /// JSON mode: every token keeps the text one JSON object (or a document of the schema),
    /// and the sequence ends when it is complete (module doc, "JSON mode"). Needs
    /// [`Engine::json_ready`].
    pub json: Option<JsonMode>,
    /// Where events go (a bounded channel, see [`EVENT_BUFFER`]). When its receiver is dropped,
    /// or it is full, the sequence stops.
    pub events: Sender<Event>,
    /// When the request arrived (for time to first token).
    pub arrived: Instant,
    /// When the request must be over: a running sequence then finishes with
    /// [`Finish::Length`], a waiting one gets [`Event::Unavailable`]. `None`: no limit.
    pub deadline: Option<Instant>,
    /// The request this job is one choice of: [`Engine::submit_all`] gives the jobs it queues
    /// together (a request's `n` choices) one non-zero id of their own, and they share their
    /// computed prompt even without the prompt cache (module doc, "Shared prefixes"). Give 0.
    pub group: u64,
}

/// Engine sizing beyond what the model's [`ts_models::RuntimeOptions`] says.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Requests that may wait for a slot; beyond that, 503.
    pub max_queue: usize,
    /// Most prompt tokens per step (chunked prefill).
    pub prefill_chunk: usize,
    /// While some sequences are decoding, hold new prompts back until at least this many prompt
    /// tokens wait (0: prefill each prompt at the first step after it arrives), or until the
    /// oldest has waited [`EngineConfig::prefill_wait`] steps: fewer, fuller prompt steps, more
    /// steps of decode rows alone (which a GPU replays from one recording). A throughput knob
    /// for many clients; it delays first tokens by up to `prefill_wait` steps.
    pub prefill_hold: usize,
    /// Most steps a prompt is held back by [`EngineConfig::prefill_hold`].
    pub prefill_wait: usize,
    /// Pad every forward to a multiple of this many token rows and logits rows (see the module
    /// doc, "Batch invariance"). `1` disables padding; otherwise the model's last cache slot is
    /// reserved for the padding and `n_slots - 1` sequences are served.
    pub row_multiple: usize,
    /// Chain greedy steps on the device (module doc, "Chained steps") where the model can
    /// ([`Model::chains_argmax`]).
    pub chain: bool,
    /// Run [`warm_up`]'s forwards before the engine takes its first request.
    pub warmup: bool,
    /// Reuse a free slot's cache rows for the prompt prefix they already hold (module doc,
    /// "Prompt cache").
    pub prompt_cache: bool,
    /// Longest wait for returning clients after a step that ended many sequences (module doc,
    /// "Returning clients"); zero: none.
    pub gather: Duration,
}

impl EngineConfig {
    /// Cache slots the model needs to serve `max_seqs` sequences (one more for the pad slot).
    pub fn model_slots(&self, max_seqs: usize) -> usize {
        max_seqs + usize::from(self.row_multiple > 1)
    }

    /// Most padding rows one forward may get.
    pub fn max_padding(&self) -> usize {
        2 * self.row_multiple.max(1).saturating_sub(1)
    }

    /// The widest forward a step makes for `max_seqs` sequences: one decode token each, a prompt
    /// chunk, and the padding.
    pub fn max_batch(&self, max_seqs: usize) -> usize {
        max_seqs + self.prefill_chunk.max(1) + self.max_padding()
    }
}

/// Forwards of the server's own shapes before its first request, so that what a backend does
/// once (on CUDA: the prompt path's cuBLAS handle and its workspace, scratch grown to the widest
/// step, the first recordings of a step's graph) is not paid by the first clients. In a traced
/// server at 64 clients (H200, gpu-next112) the first prompt step took 113 ms and the engine
/// then stood ~0.7 s after its first decode step, 0.8 s of a 30 s load test.
///
/// One mixed step, the widest the engine makes: a prompt chunk in the first slot and one token
/// in each other slot, every sequence's last row an output (full logits); then three decode
/// steps of one token a slot, outputs as arg-max ids. The cache rows written are a new
/// sequence's to overwrite (each starts its slot at position 0). With padding
/// ([`EngineConfig::row_multiple`] > 1, a model that is not batch-invariant) the counts are
/// multiples of it, as the engine's are: decode rows for the largest multiple of slots, the
/// prompt shortened to fit.
pub fn warm_up(model: &mut dyn Model, cfg: &EngineConfig, n_seqs: usize) -> ts_models::Result<()> {
    let o = model.options();
    let nv = model.info().n_vocab;
    let rm = if model.info().batch_invariant { 1 } else { cfg.row_multiple.max(1) };
    let d = n_seqs / rm * rm;
    if d == 0 || o.ctx < 8 {
        return Ok(());
    }
    // Prompt tokens p with p + d - 1 a multiple of rm, below the context less the decode steps.
    let most = cfg.prefill_chunk.min(o.max_batch + 1 - d).min(o.ctx - 4);
    let Some(p) = (1..=most).rev().find(|p| (p + d - 1).is_multiple_of(rm)) else { return Ok(()) };
    let id = |i: usize| ((1 + 7 * i) % nv) as u32;
    let mut batch = BatchMeta { tokens: Vec::with_capacity(p + d), outputs: Vec::with_capacity(d), slot_len: o.ctx as u32 };
    batch.tokens.extend((0..p).map(|i| TokenMeta { token: id(i), pos: i as u32, slot: 0 }));
    batch.tokens.extend((1..d).map(|s| TokenMeta { token: id(s), pos: 0, slot: s as u32 }));
    batch.outputs.push(p as u32 - 1);
    batch.outputs.extend((p..p + d - 1).map(|r| r as u32));
    let mut logits = vec![0.0f32; d * nv];
    model.forward_outputs(&batch, Outputs::all(&mut logits))?;
    let mut ids = vec![0u32; d];
    for step in 0..3u32 {
        batch.tokens.clear();
        batch.outputs.clear();
        batch.tokens.extend((0..d).map(|s| TokenMeta { token: id(s), pos: (if s == 0 { p as u32 } else { 1 }) + step, slot: s as u32 }));
        batch.outputs.extend(0..d as u32);
        let out = Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut ids), queue_argmax: false };
        model.forward_outputs(&batch, out)?;
    }
    Ok(())
}

enum Msg {
    Job(Box<Job>),
    Shutdown,
}

/// Output rows from which sampling runs on the rayon pool (one sequence per task).
const PARALLEL_SAMPLING_ROWS: usize = 8;

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
    json_ready: bool,
    /// The last [`Job::group`] given.
    groups: AtomicU64,
}

impl Engine {
    /// Starts the engine thread over `model`. The model's options give the context per slot,
    /// the number of slots and the widest forward, which must fit a decode token for every slot
    /// plus at least one prompt token.
    /// With padding on ([`EngineConfig::row_multiple`] > 1) the last slot is the pad slot.
    pub fn start(model: Box<dyn Model>, tok: Arc<Tokenizer>, cfg: EngineConfig, metrics: Arc<Metrics>) -> anyhow::Result<Arc<Engine>> {
        let o = model.options();
        let pad = cfg.row_multiple > 1;
        let n_seqs = o.n_slots.saturating_sub(usize::from(pad));
        if n_seqs == 0 || o.ctx < 2 + cfg.max_padding() {
            anyhow::bail!(
                "the model was loaded with {} slots of {} tokens; the server needs at least {} slots (one is the pad slot when padding) of {} tokens",
                o.n_slots,
                o.ctx,
                1 + usize::from(pad),
                2 + cfg.max_padding()
            );
        }
        if o.max_batch < n_seqs + 1 + cfg.max_padding() {
            anyhow::bail!(
                "the model's widest forward ({} tokens) must hold one decode token per sequence ({n_seqs}), a prompt token and {} padding rows",
                o.max_batch,
                cfg.max_padding()
            );
        }
        let mut model = model;
        if cfg.warmup {
            warm_up(model.as_mut(), &cfg, n_seqs).map_err(|e| anyhow::anyhow!("warm-up forward: {e}"))?;
        }
        // (the vocabulary sorted for JSON mode's masks: ~10 ms for 49k tokens, ~65 for 262k)
        let json = JsonVocab::for_tokenizer(&tok);
        let json_ready = json.usable();
        let json = Arc::new(json);
        let (tx, rx) = mpsc::channel();
        let occupancy = Arc::new(AtomicU64::new(0));
        metrics.slots_total.store(n_seqs as u64, Relaxed);
        let (m2, occ2) = (metrics.clone(), occupancy.clone());
        let thread = std::thread::Builder::new().name("ts-engine".into()).spawn(move || {
            let mut st = Stepper::new(model.as_mut(), &tok, cfg, m2, occ2);
            st.json_vocab = json_ready.then_some(json);
            st.run(rx);
        })?;
        Ok(Arc::new(Engine {
            tx: Mutex::new(tx),
            metrics,
            occupancy,
            ctx: o.ctx,
            n_slots: n_seqs,
            max_queue: cfg.max_queue,
            json_ready,
            thread: Mutex::new(Some(thread)),
            groups: AtomicU64::new(0),
        }))
    }

    /// Context length of one sequence.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Sequences generated at once (cache slots, less the pad slot).
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// Whether JSON mode can run: the vocabulary has the bytes JSON needs ([`Job::json`]).
    pub fn json_ready(&self) -> bool {
        self.json_ready
    }

    /// Most jobs admitted at once (slots + queue): a request of more choices can never run.
    pub fn capacity(&self) -> usize {
        self.n_slots + self.max_queue
    }

    /// Jobs submitted and not finished (waiting + active).
    pub fn occupancy(&self) -> u64 {
        self.occupancy.load(Relaxed)
    }

    /// Queues `job`, or refuses it with 503 when every slot is busy and the queue is full.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.submit_all(vec![job])
    }

    /// Queues several jobs (a request's choices) together: all are admitted, or none (a 503
    /// when the slots and queue cannot take them all). Two or more get one [`Job::group`].
    pub fn submit_all(&self, mut jobs: Vec<Job>) -> Result<(), ApiError> {
        let k = jobs.len() as u64;
        if k > 1 {
            let g = self.groups.fetch_add(1, Relaxed) + 1;
            jobs.iter_mut().for_each(|j| j.group = g);
        }
        if let Some(why) = self.metrics.out_of_service() {
            self.metrics.requests_rejected.fetch_add(k, Relaxed);
            return Err(ApiError::unavailable(format!("the engine is out of service: {why}; the server needs a restart"), "engine_failed"));
        }
        let cap = (self.n_slots + self.max_queue) as u64;
        let admitted = self.occupancy.fetch_update(Relaxed, Relaxed, |o| (o + k <= cap).then_some(o + k)).is_ok();
        if !admitted {
            self.metrics.requests_rejected.fetch_add(k, Relaxed);
            let what = if k == 1 { String::new() } else { format!(" for {k} more sequences") };
            return Err(ApiError::unavailable(
                format!(
                    "server busy: all {} slots are generating and {} requests are already waiting (the queue limit){what}; retry later",
                    self.n_slots, self.max_queue
                ),
                "queue_full",
            ));
        }
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let mut left = k;
        for job in jobs {
            if tx.send(Msg::Job(Box::new(job))).is_err() {
                // (jobs sent before are dropped with the engine; their occupancy with them)
                self.occupancy.fetch_sub(left, Relaxed);
                return Err(ApiError::unavailable("the engine has stopped (the server is shutting down)", "engine_stopped"));
            }
            left -= 1;
            self.metrics.requests_accepted.fetch_add(1, Relaxed);
        }
        drop(tx);
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
    /// Unique for the engine's life (a slot serves many sequences).
    id: u64,
    job: Job,
    slot: u32,
    /// Tokens in the cache.
    n_past: usize,
    /// Of which the prompt prefix found in the slot's cache at admission (module doc, "Prompt
    /// cache"): `n_past` starts there.
    cached: usize,
    /// Whether the slot's rows `0..n_past` may serve a later prompt when this sequence ends
    /// (false after a failed forward).
    keep_rows: bool,
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
    /// JSON mode ([`Job::json`]): where the text is in the grammar, and scratch for the masked
    /// logits row (`n_vocab`, allocated at admission) and the mask's walk.
    json: Option<JsonSeq>,
    first_token_seen: bool,
    /// Set when the sequence is over (its slot is returned at the end of the step).
    done: bool,
    /// Index of this sequence's output row in the current step (`usize::MAX`: none), of its full
    /// logits among the rows copied back (`usize::MAX`: only its arg-max came back), and the
    /// token picked (phase 1 of sampling, see [`Stepper::step`]).
    out_row: usize,
    full_row: usize,
    picked: u32,
}

/// A JSON-mode sequence's grammar state and scratch (see [`Seq::json`]).
struct JsonSeq {
    grammar: JsonGrammar,
    row: Vec<f32>,
}

/// The grammar of a [`JsonMode`], with its state and the mask's walk scratch.
enum JsonGrammar {
    Object(JsonState, Vec<JsonState>),
    Schema(Arc<Schema>, SchemaState, Vec<SchemaState>),
}

impl JsonSeq {
    fn new(mode: &JsonMode, n_vocab: usize) -> JsonSeq {
        let grammar = match mode {
            JsonMode::Object => JsonGrammar::Object(JsonState::new(), Vec::with_capacity(64)),
            JsonMode::Schema(s) => JsonGrammar::Schema(s.clone(), s.start(), Vec::with_capacity(64)),
        };
        JsonSeq { grammar, row: vec![0.0; n_vocab] }
    }

    /// `raw` masked into `row` (see [`JsonVocab::mask`]).
    fn mask(&mut self, v: &JsonVocab, raw: &[f32]) -> &[f32] {
        match &mut self.grammar {
            JsonGrammar::Object(st, walk) => v.mask(&(), st, raw, &mut self.row, walk),
            JsonGrammar::Schema(sc, st, walk) => v.mask(&**sc, st, raw, &mut self.row, walk),
        }
        &self.row
    }

    /// Feeds a picked token's bytes: false if the grammar refuses them.
    fn feed(&mut self, bytes: &[u8]) -> bool {
        match &mut self.grammar {
            JsonGrammar::Object(st, _) => st.feed(bytes),
            JsonGrammar::Schema(sc, st, _) => Grammar::feed(st, sc, bytes),
        }
    }

    fn done(&self) -> bool {
        match &self.grammar {
            JsonGrammar::Object(st, _) => st.done(),
            JsonGrammar::Schema(_, st, _) => st.done(),
        }
    }
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
    /// [`EngineConfig::prefill_hold`], [`EngineConfig::prefill_wait`], and the steps the waiting
    /// prompts have been held so far.
    prefill_hold: usize,
    prefill_wait: usize,
    held: usize,
    /// Pad forwards to multiples of this (1: no padding).
    row_multiple: usize,
    /// The slot padding tokens write (the model's last), when padding.
    pad_slot: u32,
    batch: BatchMeta,
    /// For output row k: the index in `active` of the sequence it belongs to.
    owners: Vec<usize>,
    /// The output rows whose full logits this step copies back (ascending), and their logits
    /// (`[full_rows.len(), n_vocab]`).
    full_rows: Vec<u32>,
    logits: Vec<f32>,
    /// The arg-max of every output row (`max_out` ids).
    argmax: Vec<u32>,
    free: Vec<u32>,
    /// [`EngineConfig::prompt_cache`], and for each slot the tokens whose cache rows it holds
    /// from its last sequence (positions `0..len`), while the slot is free.
    prompt_cache: bool,
    slot_tokens: Vec<Vec<u32>>,
    waiting: VecDeque<Job>,
    active: Vec<Seq<'t>>,
    metrics: Arc<Metrics>,
    occupancy: Arc<AtomicU64>,
    /// Tokens-per-second window.
    win_start: Instant,
    win_tokens: u64,
    /// Reused text buffer for released text.
    scratch: String,
    /// [`EngineConfig::chain`], where the model chains steps.
    chain: bool,
    /// A step is enqueued ahead ([`Stepper::forward_chained_next`]): its rows are the
    /// sequences `ahead_ids` names, in `ahead_batch` (both reused step after step).
    ahead: bool,
    ahead_ids: Vec<u64>,
    ahead_batch: BatchMeta,
    /// The next sequence's id.
    next_id: u64,
    /// [`EngineConfig::gather`], and the sequences the last retirement ended when it ended at
    /// least a quarter of those running (0: no wait due; module doc, "Returning clients").
    gather: Duration,
    returning: usize,
    /// No wait for returning clients before this (a wait ran out).
    gather_off_until: Option<Instant>,
    /// Prefixes are copied from running sequences' slots (module doc, "Shared prefixes"):
    /// until the model fails a copy (from any running sequence with the prompt cache, else
    /// from the job's own request's: [`Stepper::may_share`]).
    copy_prefixes: bool,
    /// The vocabulary for JSON mode's masks (None: the model's tokens cannot write JSON).
    json_vocab: Option<Arc<JsonVocab>>,
}

/// How long waiting for returning clients stays off after a wait that ran out.
pub const GATHER_BACKOFF: Duration = Duration::from_secs(1);

/// The fewest prompt tokens a copy from a running sequence must add to what a free slot holds
/// (module doc, "Shared prefixes"); a job waits for a prompt being computed only if it shares
/// as many.
pub const MIN_SHARED: usize = 16;

/// How many of `prompt`'s first tokens the rows of `s`'s slot hold computed (its prompt, then
/// its generated tokens fed back, up to `n_past`).
fn rows_shared(s: &Seq<'_>, prompt: &[u32]) -> usize {
    let p = s.n_past.min(s.job.prompt.len());
    let held = s.job.prompt[..p].iter().chain(&s.generated[..(s.n_past - p).min(s.generated.len())]);
    held.zip(prompt).take_while(|(a, b)| a == b).count()
}

impl<'m, 't> Stepper<'m, 't> {
    fn new(model: &'m mut dyn Model, tok: &'t Tokenizer, cfg: EngineConfig, metrics: Arc<Metrics>, occupancy: Arc<AtomicU64>) -> Self {
        let o = model.options();
        let n_vocab = model.info().n_vocab;
        let configured = cfg.row_multiple.max(1);
        let n_seqs = o.n_slots - usize::from(configured > 1);
        // A model whose every row gets the same bits in any batch needs no padding (module doc,
        // "Batch invariance"); its pad slot then stays unused.
        let row_multiple = if model.info().batch_invariant { 1 } else { configured };
        let max_out = n_seqs + row_multiple - 1;
        let model_chains = model.chains_argmax();
        Stepper {
            n_vocab,
            max_batch: o.max_batch,
            prefill_chunk: cfg.prefill_chunk.max(1),
            prefill_hold: cfg.prefill_hold,
            prefill_wait: cfg.prefill_wait,
            held: 0,
            row_multiple,
            pad_slot: n_seqs as u32,
            batch: BatchMeta { tokens: Vec::with_capacity(o.max_batch), outputs: Vec::with_capacity(max_out), slot_len: o.ctx as u32 },
            owners: Vec::with_capacity(n_seqs),
            full_rows: Vec::with_capacity(max_out),
            logits: vec![0.0; max_out * n_vocab],
            argmax: vec![0; max_out],
            free: (0..n_seqs as u32).rev().collect(),
            prompt_cache: cfg.prompt_cache,
            slot_tokens: vec![Vec::new(); n_seqs],
            waiting: VecDeque::new(),
            active: Vec::with_capacity(o.n_slots),
            model,
            tok,
            metrics,
            occupancy,
            win_start: Instant::now(),
            win_tokens: 0,
            scratch: String::new(),
            chain: cfg.chain && model_chains,
            ahead: false,
            ahead_ids: Vec::with_capacity(n_seqs),
            ahead_batch: BatchMeta {
                tokens: Vec::with_capacity(n_seqs + 2 * row_multiple),
                outputs: Vec::with_capacity(max_out),
                slot_len: o.ctx as u32,
            },
            next_id: 0,
            gather: cfg.gather,
            returning: 0,
            gather_off_until: None,
            copy_prefixes: true,
            json_vocab: None,
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
            if !self.gather_returning(&rx) {
                return self.fail_all("the server is shutting down");
            }
            self.admit();
            self.drop_cancelled();
            self.expire();
            if self.active.is_empty() {
                continue;
            }
            self.step();
            self.retire();
        }
    }

    /// After a step that ended many sequences, waits up to [`EngineConfig::gather`] for as many
    /// new jobs (at most the free slots) before the next step is built (module doc, "Returning
    /// clients"). False: the server is shutting down.
    fn gather_returning(&mut self, rx: &mpsc::Receiver<Msg>) -> bool {
        let expect = std::mem::take(&mut self.returning);
        let start = Instant::now();
        if expect == 0 || self.gather.is_zero() || self.ahead || self.gather_off_until.is_some_and(|t| start < t) {
            return true;
        }
        let want = expect.min(self.free.len());
        let deadline = start + self.gather;
        let mut waited = false;
        while self.waiting.len() < want {
            waited = true;
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Msg::Job(j)) => self.waiting.push_back(*j),
                Ok(Msg::Shutdown) | Err(mpsc::RecvTimeoutError::Disconnected) => return false,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.gather_off_until = Some(Instant::now() + GATHER_BACKOFF);
                    self.metrics.gathers_timed_out.fetch_add(1, Relaxed);
                    break;
                }
            }
        }
        if waited {
            self.metrics.gathers.fetch_add(1, Relaxed);
            self.metrics.gather_seconds.set(self.metrics.gather_seconds.get() + start.elapsed().as_secs_f64());
        }
        true
    }

    /// Gives free slots to waiting jobs (dropping jobs whose client already left).
    fn admit(&mut self) {
        // (jobs waiting for a shared prompt to be computed stay, in order; the rest go ahead)
        let mut i = 0;
        while !self.free.is_empty() && i < self.waiting.len() {
            if self.waiting[i].events.is_closed() {
                self.waiting.remove(i);
                self.metrics.cancelled.fetch_add(1, Relaxed);
                self.occupancy.fetch_sub(1, Relaxed);
                continue;
            }
            if self.awaits_shared(&self.waiting[i].prompt, self.waiting[i].group) {
                i += 1;
                continue;
            }
            let Some(job) = self.waiting.remove(i) else { break };
            let Some((slot, cached)) = self.take_slot(&job.prompt, job.group) else {
                self.waiting.insert(i, job);
                break;
            };
            self.metrics.prompt_tokens.fetch_add(job.prompt.len() as u64, Relaxed);
            self.metrics.prompt_tokens_cached.fetch_add(cached as u64, Relaxed);
            let sampler = Sampler::new(job.sampling.clone());
            let stop = StopMatcher::new(job.stop.clone());
            let json = job.json.as_ref().filter(|_| self.json_vocab.is_some()).map(|m| JsonSeq::new(m, self.n_vocab));
            self.next_id += 1;
            self.active.push(Seq {
                id: self.next_id,
                generated: Vec::with_capacity(job.max_tokens.min(4096)),
                job,
                slot,
                n_past: cached,
                cached,
                keep_rows: true,
                fed: 0,
                next: 0,
                sampler,
                dec: StreamDecoder::new(self.tok),
                stop,
                pending_lp: Vec::new(),
                json,
                first_token_seen: false,
                out_row: usize::MAX,
                full_row: usize::MAX,
                picked: 0,
                done: false,
            });
        }
        self.update_gauges();
    }

    /// Whether running sequence `s`'s rows may be copied for a job of `group`: any sequence's
    /// with the prompt cache, else only those of the job's own request (its other choices).
    fn may_share(&self, s: &Seq<'_>, group: u64) -> bool {
        !s.done && (self.prompt_cache || (group != 0 && s.job.group == group))
    }

    /// Whether a job of `prompt` (of `group`) should wait for a running sequence that is still
    /// computing a prompt sharing at least [`MIN_SHARED`] tokens with it, and more than any slot
    /// holds now (module doc, "Shared prefixes").
    fn awaits_shared(&self, prompt: &[u32], group: u64) -> bool {
        if !self.copy_prefixes {
            return false;
        }
        let limit = prompt.len().saturating_sub(1);
        let common = |t: &[u32]| t.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
        let sources = || self.active.iter().filter(|s| self.may_share(s, group));
        let coming = sources().filter(|s| !s.decoding()).map(|s| common(&s.job.prompt)).max().unwrap_or(0);
        if coming < MIN_SHARED {
            return false;
        }
        let held = sources().map(|s| rows_shared(s, prompt).min(limit));
        let free = self.free.iter().map(|&f| common(&self.slot_tokens[f as usize]));
        coming > held.chain(free).max().unwrap_or(0)
    }

    /// A free slot for `prompt`, and how many of its first tokens the slot's cache rows already
    /// hold (module doc, "Prompt cache"): the free slot whose last sequence shares the longest
    /// prefix with it (the most recently freed of equals), at most all but the prompt's last
    /// token, whose logits the step must compute. Where no slot shares a token: one that holds
    /// nothing (the most recently freed), else the one freed longest ago, so that the rows most
    /// likely to serve again stay. Where a running sequence's rows share [`MIN_SHARED`] tokens
    /// more, they are copied into that slot (module doc, "Shared prefixes"). Without the
    /// prompt cache free slots hold nothing ([`Stepper::retire`]), and only `group`'s running
    /// sequences may be copied.
    fn take_slot(&mut self, prompt: &[u32], group: u64) -> Option<(u32, usize)> {
        let limit = prompt.len().saturating_sub(1);
        let common = |t: &[u32]| t.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let mut best: Option<(usize, usize)> = None; // (index in free, common prefix)
        for (i, &slot) in self.free.iter().enumerate().rev() {
            let c = common(&self.slot_tokens[slot as usize]);
            if best.is_none_or(|(_, b)| c > b) {
                best = Some((i, c));
            }
        }
        let (mut i, c) = best?;
        let c = c.min(limit);
        // A running sequence's rows that share more (the most of them)?
        let src = match self.copy_prefixes {
            true => self
                .active
                .iter()
                .filter(|s| self.may_share(s, group))
                .map(|s| (s.slot, rows_shared(s, prompt).min(limit)))
                .max_by_key(|&(_, m)| m),
            false => None,
        };
        let copy = src.filter(|&(_, m)| m >= c + MIN_SHARED);
        if c == 0 || copy.is_some() {
            i = self.free.iter().rposition(|&s| self.slot_tokens[s as usize].is_empty()).unwrap_or(0);
        }
        // (`remove`, not `swap_remove`: the order of `free` is the order the slots were freed in)
        let slot = self.free.remove(i);
        if let Some((from, m)) = copy {
            match self.model.copy_prefix(from, slot, m) {
                Ok(()) => {
                    self.metrics.prompt_tokens_copied.fetch_add(m as u64, Relaxed);
                    return Some((slot, m));
                }
                Err(e) => {
                    // (the slot's own rows may be half overwritten: they serve nothing now)
                    self.slot_tokens[slot as usize].clear();
                    self.copy_prefixes = false;
                    tracing::warn!("copying cache rows between slots failed ({e}); shared prefixes are computed again from now on");
                    return Some((slot, 0));
                }
            }
        }
        Some((slot, c))
    }

    fn update_gauges(&self) {
        let active = self.active.iter().filter(|s| !s.done).count() as u64;
        self.metrics.active_seqs.store(active, Relaxed);
        self.metrics.queue_depth.store(self.occupancy.load(Relaxed).saturating_sub(active), Relaxed);
    }

    /// Ends what is past its deadline: running sequences finish with [`Finish::Length`],
    /// waiting jobs are answered [`Event::Unavailable`].
    fn expire(&mut self) {
        let now = Instant::now();
        let due = |j: &Job| j.deadline.is_some_and(|d| now >= d);
        if self.waiting.iter().any(due) {
            let metrics = &self.metrics;
            let occupancy = &self.occupancy;
            self.waiting.retain(|j| {
                if !due(j) {
                    return true;
                }
                let waited = now.saturating_duration_since(j.arrived).as_secs_f64();
                let _ = j.events.try_send(Event::Unavailable(format!(
                    "request timed out after {waited:.1} s waiting for a free slot (the server's --request-timeout); retry later"
                )));
                metrics.timed_out.fetch_add(1, Relaxed);
                occupancy.fetch_sub(1, Relaxed);
                false
            });
        }
        let mut any = false;
        for s in self.active.iter_mut() {
            if !s.done && due(&s.job) {
                self.metrics.timed_out.fetch_add(1, Relaxed);
                finish(s, Finish::Length, &self.metrics, &mut self.scratch);
                s.done = true;
                any = true;
            }
        }
        if any {
            self.retire();
        }
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
        let (free, slot_tokens, cache) = (&mut self.free, &mut self.slot_tokens, self.prompt_cache);
        self.active.retain(|s| {
            if s.done {
                free.push(s.slot);
                // The slot's rows 0..n_past: the prompt, then the generated tokens fed back.
                let t = &mut slot_tokens[s.slot as usize];
                t.clear();
                if cache && s.keep_rows {
                    let p = s.n_past.min(s.job.prompt.len());
                    t.extend_from_slice(&s.job.prompt[..p]);
                    t.extend_from_slice(&s.generated[..(s.n_past - p).min(s.generated.len())]);
                }
            }
            !s.done
        });
        let n = (before - self.active.len()) as u64;
        if n > 0 {
            self.occupancy.fetch_sub(n, Relaxed);
            // (a quarter or more of the running sequences ended: their clients may come back
            // together; module doc, "Returning clients")
            if 4 * n as usize >= before {
                self.returning = self.returning.max(n as usize);
            }
        }
        self.update_gauges();
    }

    /// One forward over every active sequence, then sampling (module doc, "Chained steps":
    /// with chaining the forward may already be on the device, enqueued by the step before).
    fn step(&mut self) {
        let t0 = Instant::now();
        if self.ahead {
            self.ahead = false;
            return self.step_ahead(t0);
        }
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
        let pad_room = 2 * (self.row_multiple - 1);
        let mut budget = self.prefill_chunk.min(self.max_batch - self.batch.tokens.len() - pad_room);
        // Prompts held back while others decode (EngineConfig::prefill_hold): only prompts not
        // started yet (a chunked one goes on), fewer tokens than the hold, for at most
        // prefill_wait steps.
        let mut pending = 0;
        let mut started = false;
        for s in self.active.iter().filter(|s| !s.decoding()) {
            pending += s.job.prompt.len() - s.n_past;
            started |= s.n_past > s.cached;
        }
        let decoding = self.batch.tokens.len();
        if self.prefill_hold > 0 && decoding > 0 && pending > 0 && !started && pending < self.prefill_hold && self.held < self.prefill_wait
        {
            self.held += 1;
            budget = 0;
        } else {
            self.held = 0;
        }
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
        let n_real = self.batch.tokens.len();
        self.pad();
        let nv = self.n_vocab;
        let n_rows = self.batch.outputs.len();
        // Which rows need their full logits (module doc, "Greedy rows come back as ids").
        self.full_rows.clear();
        for (k, &i) in self.owners.iter().enumerate() {
            let s = &self.active[i];
            if !(s.sampler.is_plain_greedy(s.generated.len()) && s.job.top_logprobs.is_none() && s.json.is_none()) {
                self.full_rows.push(k as u32);
            }
        }
        let all_full = self.full_rows.len() == n_out;
        let n_full = if all_full { n_rows } else { self.full_rows.len() };
        // Only picks wanted: they stay queued on the device (the padding's too), and the next
        // step may be enqueued from them before they come back.
        let queued = self.chain && n_out > 0 && self.full_rows.is_empty();
        let tf = Instant::now();
        let r = if queued {
            self.forward_chained(n_rows)
        } else {
            let out = Outputs {
                full_rows: (!all_full).then_some(&self.full_rows[..]),
                logits: &mut self.logits[..n_full * nv],
                argmax: (!all_full).then_some(&mut self.argmax[..n_rows]),
                queue_argmax: false,
            };
            let (model, batch) = (&mut *self.model, &self.batch);
            std::panic::catch_unwind(AssertUnwindSafe(|| model.forward_outputs(batch, out)))
        };
        self.after_forward(t0, tf, r, n_out, n_real, all_full);
    }

    /// The step [`Stepper::forward_chained`] enqueued last time, whose rows are the sequences
    /// `ahead_ids` names (those still running), each fed its last pick at the position after
    /// it, then the padding: maybe enqueues the step after it, then collects its picks and
    /// samples.
    fn step_ahead(&mut self, t0: Instant) {
        let n_rows = self.ahead_batch.outputs.len();
        self.owners.clear();
        self.full_rows.clear();
        for s in self.active.iter_mut() {
            s.fed = 0;
        }
        for &id in &self.ahead_ids {
            // (A sequence that ended since, or whose client left, has no row any more; its slot
            // may already serve a new sequence, so rows are matched by id, not by slot.)
            let i = self.active.iter().position(|s| s.id == id && !s.done);
            if let Some(i) = i {
                self.active[i].fed = 1;
            }
            self.owners.push(i.unwrap_or(usize::MAX));
        }
        let n = self.owners.len();
        self.metrics.steps_chained.fetch_add(1, Relaxed);
        let tf = Instant::now();
        let r = self.forward_chained_next(n_rows);
        self.after_forward(t0, tf, r, n, n, false);
    }

    /// Enqueues the step in `self.batch` with its picks queued on the device, then maybe the
    /// step after it, then waits for this step's picks (into `argmax[..n_rows]`).
    fn forward_chained(&mut self, n_rows: usize) -> std::thread::Result<ts_models::Result<()>> {
        let (model, batch) = (&mut *self.model, &self.batch);
        match std::panic::catch_unwind(AssertUnwindSafe(|| model.forward_outputs(batch, Outputs::queued()))) {
            Ok(Ok(())) => self.forward_chained_next(n_rows),
            other => other,
        }
    }

    /// With this step's forward enqueued (picks queued, `n_rows` output rows, `owners` and each
    /// sequence's `fed` set): enqueues the next step from its picks when chaining may (see
    /// [`Stepper::may_chain`]), then waits for this step's picks.
    fn forward_chained_next(&mut self, n_rows: usize) -> std::thread::Result<ts_models::Result<()>> {
        let chain = self.may_chain();
        let model = &mut *self.model;
        let mut next = Ok(Ok(()));
        if chain {
            let b = &mut self.ahead_batch;
            b.tokens.clear();
            b.outputs.clear();
            self.ahead_ids.clear();
            for (k, &i) in self.owners.iter().enumerate() {
                if i == usize::MAX {
                    continue;
                }
                let s = &self.active[i];
                b.outputs.push(b.tokens.len() as u32);
                b.tokens.push(TokenMeta { token: TOKEN_FROM_ARGMAX + k as u32, pos: (s.n_past + s.fed) as u32, slot: s.slot });
                self.ahead_ids.push(s.id);
            }
            pad_batch(b, self.row_multiple, self.pad_slot);
            let b = &self.ahead_batch;
            next = std::panic::catch_unwind(AssertUnwindSafe(|| model.forward_outputs(b, Outputs::queued())));
            self.ahead = matches!(next, Ok(Ok(())));
        }
        let argmax = &mut self.argmax[..n_rows];
        let this = std::panic::catch_unwind(AssertUnwindSafe(|| model.argmax_collect(argmax)));
        match (this, next) {
            (Ok(Ok(())), next) => next,
            (this, _) => this,
        }
    }

    /// Whether the step after this one may be enqueued now, fed this step's picks on the
    /// device: no job waits for a slot and no sequence for its prompt (they would wait a step
    /// longer), and every sequence with a row here goes on with a plain greedy pick (no
    /// log-probabilities, below `max_tokens`, inside the context). A sequence that then ends
    /// anyway (end of generation, a stop string, its client gone) costs its row one wasted
    /// step: the step's pick for it is dropped.
    fn may_chain(&self) -> bool {
        let ctx = self.batch.slot_len as usize;
        let rows = self.owners.iter().filter(|&&i| i != usize::MAX).count();
        self.waiting.is_empty()
            && rows > 0
            && self.active.iter().filter(|s| !s.done).count() == rows
            && self.owners.iter().filter(|&&i| i != usize::MAX).all(|&i| {
                let s = &self.active[i];
                let n = s.generated.len() + 1; // picks after this step's
                s.n_past + s.fed >= s.job.prompt.len()
                    && s.job.top_logprobs.is_none()
                    && s.json.is_none()
                    && s.sampler.is_plain_greedy(n)
                    && n < s.job.max_tokens
                    && s.n_past + s.fed < ctx
            })
    }

    /// After a step's forward (`r`, started at `tf`; the step at `t0`): its rows' sequences
    /// advance, each with an output row (`owners`, `usize::MAX` for a row without one) picks
    /// its token (from `argmax`, or from its logits with `all_full` or a full row), and text
    /// streams back. A failed forward fails every running sequence.
    fn after_forward(
        &mut self,
        t0: Instant,
        tf: Instant,
        r: std::thread::Result<ts_models::Result<()>>,
        n_out: usize,
        n_real: usize,
        all_full: bool,
    ) {
        let nv = self.n_vocab;
        self.metrics.forward_seconds.set(self.metrics.forward_seconds.get() + tf.elapsed().as_secs_f64());
        let err = match r {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("forward failed: {e}")),
            Err(p) => {
                let what = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                Some(format!("forward panicked: {}", what.unwrap_or_else(|| "unknown cause".into())))
            }
        };
        self.metrics.steps.fetch_add(1, Relaxed);
        if err.is_none() {
            self.metrics.failed_in_a_row.store(0, Relaxed);
        }
        let sc = self.model.step_counts();
        self.metrics.steps_replayed.store(sc.replayed, Relaxed);
        self.metrics.steps_recorded.store(sc.recorded, Relaxed);
        self.metrics.steps_eager.store(sc.eager, Relaxed);
        self.metrics.batch_tokens.fetch_add(n_real as u64, Relaxed);
        self.metrics.last_batch_tokens.store(n_real as u64, Relaxed);
        if let Some(e) = err {
            tracing::error!("{e}");
            for s in self.active.iter_mut() {
                s.keep_rows = false;
                if !s.done {
                    let _ = s.job.events.try_send(Event::Failed(e.clone()));
                    s.done = true;
                    self.metrics.failed.fetch_add(1, Relaxed);
                }
            }
            // What the cache holds after a failed forward is not known: no prompt reuses it.
            self.slot_tokens.iter_mut().for_each(Vec::clear);
            self.metrics.steps_failed.fetch_add(1, Relaxed);
            let n = self.metrics.failed_in_a_row.fetch_add(1, Relaxed) + 1;
            let mut now_out = None;
            if n >= UNHEALTHY_AFTER {
                let why = format!("{n} forward passes in a row failed, the last with: {e}");
                let mut oos = self.metrics.out_of_service.lock().unwrap_or_else(|p| p.into_inner());
                if oos.is_none() {
                    tracing::error!(
                        "the engine is out of service ({why}); /health answers 503 and new requests are refused until a restart"
                    );
                    *oos = Some(why.clone());
                    now_out = Some(why);
                }
            }
            // A step enqueued ahead of the failed one is waited for and forgotten; chaining stops.
            if std::mem::take(&mut self.ahead) {
                let n = self.ahead_batch.outputs.len();
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| self.model.argmax_collect(&mut self.argmax[..n])));
            }
            self.chain = false;
            // Out of service from now: the requests still queued would fail step after step.
            if let Some(why) = now_out {
                self.fail_all(&format!("the engine is out of service: {why}"));
            }
            return;
        }
        for s in self.active.iter_mut() {
            s.n_past += s.fed;
        }
        // Sampling, phase 1: every sequence picks its token from its row. The samplers are
        // independent (own parameters, RNG and history), so many rows are sampled in parallel
        // (a greedy pick alone scans the whole vocabulary); the result is the same either way.
        for s in self.active.iter_mut() {
            (s.out_row, s.full_row) = (usize::MAX, usize::MAX);
        }
        for k in 0..n_out {
            let Some(s) = self.active.get_mut(self.owners[k]) else { continue };
            s.out_row = k;
            if all_full {
                s.full_row = k;
            }
        }
        if !all_full {
            for (j, &k) in self.full_rows.iter().enumerate() {
                self.active[self.owners[k as usize]].full_row = j;
            }
        }
        let (logits, argmax, json_vocab) = (&self.logits, &self.argmax, self.json_vocab.as_deref());
        let pick = |s: &mut Seq<'_>| {
            if s.out_row == usize::MAX || s.done {
                return;
            }
            s.picked = match (s.full_row, &mut s.json, json_vocab) {
                (usize::MAX, _, _) => s.sampler.take(argmax[s.out_row]),
                // (JSON mode: the row with every token that breaks the syntax at -inf)
                (j, Some(js), Some(v)) => s.sampler.sample(js.mask(v, &logits[j * nv..(j + 1) * nv]), &s.generated),
                (j, _, _) => s.sampler.sample(&logits[j * nv..(j + 1) * nv], &s.generated),
            };
        };
        if n_out >= PARALLEL_SAMPLING_ROWS && !self.full_rows.is_empty() {
            use rayon::prelude::*;
            self.active.par_iter_mut().for_each(pick);
        } else {
            self.active.iter_mut().for_each(pick);
        }
        // Phase 2, in output order: streaming, stop strings, log-probabilities, metrics.
        let mut produced = 0u64;
        for k in 0..n_out {
            let Some(s) = self.active.get_mut(self.owners[k]) else { continue };
            if s.done {
                continue;
            }
            let row = match s.full_row {
                usize::MAX => &[][..],
                j => &self.logits[j * nv..(j + 1) * nv],
            };
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

    /// Pads the batch so that its token count and its output count are multiples of
    /// `row_multiple` (module doc, "Batch invariance"). Pad tokens sit at positions 0, 1, … of
    /// the pad slot; the first ones are outputs as needed, and their logits are ignored.
    fn pad(&mut self) {
        pad_batch(&mut self.batch, self.row_multiple, self.pad_slot);
    }

    /// Ends every sequence, running or waiting, with `why`.
    fn fail_all(&mut self, why: &str) {
        for s in self.active.iter_mut().filter(|s| !s.done) {
            let _ = s.job.events.try_send(Event::Failed(why.to_string()));
            s.done = true;
            self.metrics.failed.fetch_add(1, Relaxed);
        }
        self.retire();
        for j in self.waiting.drain(..) {
            let _ = j.events.try_send(Event::Failed(why.to_string()));
            self.metrics.failed.fetch_add(1, Relaxed);
            self.occupancy.fetch_sub(1, Relaxed);
        }
        self.update_gauges();
    }
}

/// [`Stepper::pad`] of `batch`: to multiples of `m` rows, pad tokens in `pad_slot`.
fn pad_batch(batch: &mut BatchMeta, m: usize, pad_slot: u32) {
    if m <= 1 {
        return;
    }
    let (n, k) = (batch.tokens.len(), batch.outputs.len());
    let q = (m - k % m) % m;
    let p = q + (m - (n + q) % m) % m;
    for i in 0..p {
        if i < q {
            batch.outputs.push(batch.tokens.len() as u32);
        }
        batch.tokens.push(TokenMeta { token: 0, pos: i as u32, slot: pad_slot });
    }
}

fn token_logprob(tok: &Tokenizer, id: u32, logprob: f32) -> TopLogprob {
    let bytes = tok.token_bytes(id, true).into_owned();
    TopLogprob { token: String::from_utf8_lossy(&bytes).into_owned(), bytes, logprob }
}

/// Takes the token picked for `s` (phase 1 of [`Stepper::step`]), streams its text, and ends the
/// sequence when due. `row` is its logits row when it came back (always, when log-probabilities
/// are asked for), else empty.
/// Returns true when a token was generated (end-of-generation tokens are not counted).
fn sample_one(s: &mut Seq<'_>, row: &[f32], tok: &Tokenizer, metrics: &Metrics, out: &mut String) -> bool {
    if !s.first_token_seen {
        s.first_token_seen = true;
        metrics.observe_ttft(s.job.arrived.elapsed().as_secs_f64());
    }
    let id = s.picked;
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
    // JSON mode: the object closed (or, were the mask ever to let a wrong token through, the
    // text left the grammar) ends the sequence after this token's text.
    let json_over = s.json.as_mut().is_some_and(|js| !js.feed(&tok.token_bytes(id, false)) || js.done());
    let piece = s.dec.push(id);
    out.clear();
    let stopped = s.stop.push(&piece, out);
    if stopped {
        // The tokens that formed the stop string are not reported.
        s.pending_lp.clear();
    }
    if !out.is_empty() && !send_delta(s, out, metrics) {
        return true;
    }
    if stopped || json_over {
        // (`finish` sends what the decoder and the stop matcher still hold)
        finish(s, Finish::Stop, metrics, out);
    } else if s.generated.len() >= s.job.max_tokens {
        finish(s, Finish::Length, metrics, out);
    }
    true
}

/// Sends `text` with the pending log-probabilities; on a closed or full channel (see
/// [`EVENT_BUFFER`]) counts the sequence cancelled, marks it done and returns false.
fn send_delta(s: &mut Seq<'_>, text: &str, metrics: &Metrics) -> bool {
    let ev = Event::Delta { text: text.to_string(), logprobs: std::mem::take(&mut s.pending_lp) };
    match try_send(&s.job.events, ev) {
        Ok(()) => true,
        Err(closed) => {
            if !closed {
                metrics.slow_clients.fetch_add(1, Relaxed);
            }
            metrics.cancelled.fetch_add(1, Relaxed);
            s.done = true;
            false
        }
    }
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
    if (!out.is_empty() || !s.pending_lp.is_empty()) && !send_delta(s, out, metrics) {
        return;
    }
    let usage = Usage { prompt: s.job.prompt.len(), cached: s.cached, completion: s.generated.len() };
    let done = Event::Done { finish: why, usage };
    if let Err(closed) = try_send(&s.job.events, done) {
        if !closed {
            metrics.slow_clients.fetch_add(1, Relaxed);
        }
        metrics.cancelled.fetch_add(1, Relaxed);
    } else {
        match why {
            Finish::Stop => metrics.finished_stop.fetch_add(1, Relaxed),
            Finish::Length => metrics.finished_length.fetch_add(1, Relaxed),
        };
    }
    s.done = true;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;
    use tokio::sync::mpsc::{channel, Receiver};
    use ts_models::{ModelInfo, RuntimeOptions};

    /// One forward as the mock saw it: (slot, pos, token) of every token but the padding, and the
    /// output rows.
    type Seen = Arc<Mutex<Vec<(Vec<(u32, u32, u32)>, usize)>>>;

    /// A "model" whose next token is `token + 1` (with `history`: a hash of everything its slot
    /// holds up to the token, so that a wrong prefix reused from the cache shows in the text),
    /// checking the batch invariants the real cache relies on: each slot's positions continue
    /// from what it holds, or go back over it (a new sequence, from 0 or past a cached prefix),
    /// never past it.
    struct Counting {
        info: ModelInfo,
        opts: RuntimeOptions,
        /// The tokens each slot's rows hold, by position.
        slots: Vec<Vec<u32>>,
        history: bool,
        seen: Seen,
        /// Forward sizes must be multiples of this; tokens of the pad slot are not recorded.
        row_multiple: usize,
        pad_slot: Option<u32>,
        /// Chains steps as the CUDA models do: queued picks (at most two pending), the latest
        /// of which `TOKEN_FROM_ARGMAX + r` tokens read.
        chains: bool,
        queue: VecDeque<Vec<u32>>,
        last: Vec<u32>,
        /// While set, every forward fails (as a backend that lost its device would).
        fail: Arc<AtomicBool>,
    }

    impl Model for Counting {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn options(&self) -> RuntimeOptions {
            self.opts
        }
        fn chains_argmax(&self) -> bool {
            self.chains
        }
        fn copy_prefix(&mut self, src: u32, dst: u32, n: usize) -> ts_models::Result<()> {
            let rows = &self.slots[src as usize];
            assert!(src != dst && n <= rows.len(), "copy of {n} rows from slot {src}, which holds {}", rows.len());
            self.slots[dst as usize] = rows[..n].to_vec();
            Ok(())
        }
        fn argmax_collect(&mut self, out: &mut [u32]) -> ts_models::Result<()> {
            let ids = self.queue.pop_front().expect("a queued arg-max to collect");
            assert_eq!(ids.len(), out.len(), "collected rows");
            out.copy_from_slice(&ids);
            Ok(())
        }
        fn forward_outputs(&mut self, batch: &BatchMeta, out: Outputs<'_>) -> ts_models::Result<()> {
            if self.fail.load(Relaxed) {
                return Err(ts_models::ModelError::Run("injected device failure".into()));
            }
            let nv = self.info.n_vocab;
            assert!(batch.len() <= self.opts.max_batch && !batch.is_empty());
            let n_full = out.full_rows.map_or(batch.outputs.len(), |f| f.len());
            assert_eq!(out.logits.len(), n_full * nv);
            // The picks of the latest queued step stand in for TOKEN_FROM_ARGMAX tokens.
            let mut batch = batch.clone();
            for t in batch.tokens.iter_mut().filter(|t| t.token >= TOKEN_FROM_ARGMAX) {
                assert!(self.chains, "a chained token without chaining");
                t.token = self.last[(t.token - TOKEN_FROM_ARGMAX) as usize];
            }
            let batch = &batch;
            // Each output row's next token, from the slot's rows as they are after its token.
            let mut nexts = Vec::with_capacity(batch.outputs.len());
            let mut o = batch.outputs.iter().peekable();
            for (i, t) in batch.tokens.iter().enumerate() {
                let f = &mut self.slots[t.slot as usize];
                assert!(t.pos as usize <= f.len(), "slot {} pos {} but the slot holds {} rows", t.slot, t.pos, f.len());
                f.truncate(t.pos as usize);
                f.push(t.token);
                if o.peek() == Some(&&(i as u32)) {
                    o.next();
                    let n = if self.history {
                        f.iter().enumerate().fold(7usize, |h, (j, &x)| (h * 31 + (x as usize + 1) * (j + 1)) % 999_983)
                    } else {
                        t.token as usize + 1
                    };
                    nexts.push(n % nv);
                }
            }
            assert_eq!(nexts.len(), batch.outputs.len(), "output rows in token order");
            out.logits.fill(0.0);
            let next = |k: usize| nexts[k];
            match out.full_rows {
                None => (0..batch.outputs.len()).for_each(|k| out.logits[k * nv + next(k)] = 1.0),
                Some(f) => f.iter().enumerate().for_each(|(j, &k)| out.logits[j * nv + next(k as usize)] = 1.0),
            }
            if let Some(ids) = out.argmax {
                ids.iter_mut().enumerate().for_each(|(k, id)| *id = next(k) as u32);
            }
            if out.queue_argmax {
                assert!(self.chains && self.queue.len() < 2, "a third pending pick");
                self.last = (0..batch.outputs.len()).map(|k| next(k) as u32).collect();
                self.queue.push_back(self.last.clone());
            }
            assert_eq!(batch.len() % self.row_multiple, 0, "forward of {} tokens", batch.len());
            assert_eq!(batch.outputs.len() % self.row_multiple, 0, "forward with {} outputs", batch.outputs.len());
            self.seen.lock().unwrap_or_else(|e| e.into_inner()).push((
                batch.tokens.iter().filter(|t| Some(t.slot) != self.pad_slot).map(|t| (t.slot, t.pos, t.token)).collect(),
                batch.outputs.len(),
            ));
            std::thread::sleep(Duration::from_millis(2));
            Ok(())
        }
    }

    /// An engine of `n_seqs` sequences, unpadded, chaining steps with `chain` (the mock then
    /// chains too).
    fn engine_chain(n_seqs: usize, chunk: usize, max_queue: usize, chain: bool) -> (Arc<Engine>, Seen, Arc<Metrics>) {
        engine_cfg(
            n_seqs,
            EngineConfig {
                max_queue,
                prefill_chunk: chunk,
                prefill_hold: 0,
                prefill_wait: 0,
                row_multiple: 1,
                chain,
                warmup: false,
                prompt_cache: true,
                gather: Duration::ZERO,
            },
        )
    }

    fn engine_padded(n_seqs: usize, chunk: usize, max_queue: usize, row_multiple: usize) -> (Arc<Engine>, Seen, Arc<Metrics>) {
        engine_cfg(
            n_seqs,
            EngineConfig {
                max_queue,
                prefill_chunk: chunk,
                prefill_hold: 0,
                prefill_wait: 0,
                row_multiple,
                chain: false,
                warmup: false,
                prompt_cache: true,
                gather: Duration::ZERO,
            },
        )
    }

    fn engine_cfg(n_seqs: usize, cfg: EngineConfig) -> (Arc<Engine>, Seen, Arc<Metrics>) {
        engine_cfg_failing(n_seqs, cfg, Arc::default())
    }

    /// [`engine_cfg`] whose model fails every forward while `fail` is set.
    fn engine_cfg_failing(n_seqs: usize, cfg: EngineConfig, fail: Arc<AtomicBool>) -> (Arc<Engine>, Seen, Arc<Metrics>) {
        engine_mock(n_seqs, cfg, fail, false)
    }

    /// The engine over a [`Counting`] model: failing while `fail` is set, its tokens from the
    /// slot's whole history with `history`.
    fn engine_mock(n_seqs: usize, cfg: EngineConfig, fail: Arc<AtomicBool>, history: bool) -> (Arc<Engine>, Seen, Arc<Metrics>) {
        let nv = 1000;
        let seen: Seen = Arc::default();
        let row_multiple = cfg.row_multiple;
        let n_slots = cfg.model_slots(n_seqs);
        let opts = RuntimeOptions { ctx: 512, n_slots, max_batch: cfg.max_batch(n_seqs) };
        let info = ModelInfo {
            arch: "mock".into(),
            name: "counting".into(),
            n_vocab: nv,
            n_ctx_train: 512,
            n_layers: 1,
            n_embd: 1,
            n_params: 0,
            weight_bytes: 0,
            weight_copy_bytes: 0,
            cache_bytes_per_token: 0,
            details: Vec::new(),
            batch_invariant: false,
        };
        let pad_slot = (row_multiple > 1).then_some(n_seqs as u32);
        let model = Counting {
            info,
            opts,
            slots: vec![Vec::new(); n_slots],
            history,
            seen: seen.clone(),
            row_multiple,
            pad_slot,
            chains: cfg.chain,
            queue: VecDeque::new(),
            last: Vec::new(),
            fail,
        };
        let metrics = Arc::new(Metrics::default());
        let e = Engine::start(Box::new(model), Arc::new(Tokenizer::none(nv)), cfg, metrics.clone()).expect("engine starts");
        assert_eq!(e.n_slots(), n_seqs);
        (e, seen, metrics)
    }

    fn job(prompt: Vec<u32>, max_tokens: usize) -> (Job, Receiver<Event>) {
        let (tx, rx) = channel(EVENT_BUFFER);
        let j = Job {
            prompt,
            sampling: SamplerParams::greedy(),
            max_tokens,
            stop: Vec::new(),
            top_logprobs: None,
            json: None,
            events: tx,
            arrived: Instant::now(),
            deadline: None,
            group: 0,
        };
        (j, rx)
    }

    /// Collects a job's text until Done (bounded wait).
    fn collect(rx: &mut Receiver<Event>) -> (String, Option<Finish>, usize) {
        let mut text = String::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            match rx.try_recv() {
                Ok(Event::Delta { text: t, .. }) => text.push_str(&t),
                Ok(Event::Done { finish, usage }) => return (text, Some(finish), usage.completion),
                Ok(Event::Failed(e)) => panic!("failed: {e}"),
                Ok(Event::Unavailable(e)) => panic!("unavailable: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        (text, None, 0)
    }

    /// A job's first event, which must be a text delta (bounded wait).
    fn first_delta(rx: &mut Receiver<Event>) -> String {
        let t0 = Instant::now();
        let first = loop {
            if let Ok(ev) = rx.try_recv() {
                break ev;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "no first token");
            std::thread::sleep(Duration::from_millis(1));
        };
        let Event::Delta { text, .. } = first else { panic!("expected a delta, got {first:?}") };
        text
    }

    fn expect(from: u32, n: u32) -> String {
        (from..from + n).map(|t| format!("<{t}>")).collect()
    }

    #[test]
    fn decode_continues_during_chunked_prefill() {
        for row_multiple in [1, 4] {
            decode_continues_during_chunked_prefill_with(row_multiple);
        }
    }

    fn decode_continues_during_chunked_prefill_with(row_multiple: usize) {
        let (e, seen, m) = engine_padded(2, 16, 4, row_multiple);
        let (a, mut ra) = job(vec![1, 2, 3], 60);
        e.submit(a).expect("queued");
        // Wait for A's first token, then send a 100-token prompt.
        let first = first_delta(&mut ra);
        let steps_before = seen.lock().expect("lock").len();
        let long: Vec<u32> = (100..200).collect();
        let (b, mut rb) = job(long, 5);
        e.submit(b).expect("queued");
        let (rest_a, fa, na) = collect(&mut ra);
        let (text_b, fb, nb) = collect(&mut rb);
        assert_eq!(format!("{first}{rest_a}"), expect(4, 60));
        assert_eq!((fa, na), (Some(Finish::Length), 60));
        assert_eq!(text_b, expect(200, 5));
        assert_eq!((fb, nb), (Some(Finish::Length), 5));
        // B's prompt went through in chunks of at most 16, each forward also carrying A's decode
        // token while A was still running.
        let seen = seen.lock().expect("lock");
        let b_steps: Vec<_> =
            seen[steps_before..].iter().filter(|(toks, _)| toks.iter().any(|t| t.2 >= 100 && t.2 < 200 && t.1 < 100)).collect();
        assert!(b_steps.len() >= 100usize.div_ceil(16), "{} prefill steps", b_steps.len());
        for (toks, _) in &b_steps {
            let prompt_toks = toks.iter().filter(|t| t.2 >= 100 && t.2 < 200 && t.1 < 100).count();
            assert!(prompt_toks <= 16, "{prompt_toks} prompt tokens in one forward");
            let a_slot_tokens = toks.iter().filter(|t| !(t.2 >= 100 && t.2 < 200 && t.1 < 100)).count();
            assert!(a_slot_tokens <= 1);
        }
        let mixed =
            b_steps.iter().filter(|(toks, _)| toks.len() > toks.iter().filter(|t| t.2 >= 100 && t.2 < 200 && t.1 < 100).count()).count();
        assert!(mixed >= 3, "decode tokens rode along in only {mixed} prefill steps");
        assert_eq!(m.completion_tokens.load(Relaxed), 65);
        drop(seen);
        e.shutdown();
    }

    /// `prefill_hold`: while A decodes, B's 2-token prompt waits for C's 7 (9 >= 8 tokens) and
    /// both go through in one forward; D's prompt alone is held at most `prefill_wait` steps,
    /// then prefilled (its text is right, nothing starves); A keeps decoding meanwhile.
    /// The warm-up's forwards run before the first request (a mixed step as wide as the
    /// engine's widest, then three decode steps of every slot; with padding, in multiples of
    /// it), and the requests after them get their texts (the mock checks that every slot's
    /// positions continue or restart at 0).
    #[test]
    fn warm_up_runs_first_and_leaves_the_slots_usable() {
        for (n_seqs, row_multiple, want) in [(3, 1, Some((16 + 2, 3))), (5, 4, Some((16, 4))), (3, 4, None)] {
            let cfg = EngineConfig {
                max_queue: 8,
                prefill_chunk: 16,
                prefill_hold: 0,
                prefill_wait: 0,
                row_multiple,
                chain: false,
                warmup: true,
                prompt_cache: true,
                gather: Duration::ZERO,
            };
            let (e, seen, _m) = engine_cfg(n_seqs, cfg);
            let warm: Vec<(usize, usize)> = seen.lock().unwrap().iter().map(|(t, o)| (t.len(), *o)).collect();
            match want {
                Some((tokens, rows)) => assert_eq!(
                    warm,
                    vec![(tokens, rows), (rows, rows), (rows, rows), (rows, rows)],
                    "{n_seqs} slots, rows of {row_multiple}"
                ),
                None => assert!(warm.is_empty(), "no warm-up below a row multiple of slots: {warm:?}"),
            }
            let (a, mut ra) = job(vec![1, 2, 3], 5);
            let (b, mut rb) = job(vec![40, 41], 4);
            e.submit(a).expect("queued");
            e.submit(b).expect("queued");
            assert_eq!(collect(&mut ra).0, expect(4, 5));
            assert_eq!(collect(&mut rb).0, expect(42, 4));
        }
    }

    /// Returning clients (module doc): four sequences end in one step while a fifth decodes,
    /// and their clients come back 0, 10, 20 and 30 ms later. With a wait (of up to 1 s) the four
    /// new prompts go through in one forward (and the wait is counted); without one each goes in
    /// at the first step after it arrives. The texts are right either way.
    #[test]
    fn returning_clients_share_a_step() {
        for gather in [Duration::from_secs(1), Duration::ZERO] {
            let cfg = EngineConfig {
                max_queue: 8,
                prefill_chunk: 64,
                prefill_hold: 0,
                prefill_wait: 0,
                row_multiple: 1,
                chain: false,
                warmup: false,
                prompt_cache: true,
                gather,
            };
            let (e, seen, m) = engine_cfg(5, cfg);
            let (a, mut ra) = job(vec![1, 2, 3], 150);
            e.submit(a).expect("queued");
            first_delta(&mut ra);
            // (submitted within microseconds of each other, while a step of 2 ms runs: admitted
            // together, so they end together)
            let wave: Vec<_> = (0..4u32).map(|i| job(vec![100 + 10 * i, 101 + 10 * i], 3)).collect();
            let mut rxs = Vec::new();
            for (j, rx) in wave {
                e.submit(j).expect("queued");
                rxs.push(rx);
            }
            let clients: Vec<_> = rxs
                .into_iter()
                .enumerate()
                .map(|(i, mut rx)| {
                    let e = e.clone();
                    std::thread::spawn(move || {
                        let (text, _, n) = collect(&mut rx);
                        assert_eq!((text, n), (expect(102 + 10 * i as u32, 3), 3));
                        std::thread::sleep(Duration::from_millis(10 * i as u64));
                        let (j, mut rx) = job(vec![300 + 10 * i as u32, 301 + 10 * i as u32], 2);
                        e.submit(j).expect("queued");
                        assert_eq!(collect(&mut rx).0, expect(302 + 10 * i as u32, 2));
                    })
                })
                .collect();
            for c in clients {
                c.join().expect("client");
            }
            assert_eq!(collect(&mut ra).0.len(), expect(5, 149).len());
            let seen = seen.lock().expect("lock");
            let step_of = |tok: u32| seen.iter().position(|(toks, _)| toks.iter().any(|t| t.2 == tok && t.1 == 0)).expect("prompt seen");
            let first_wave: Vec<usize> = (0..4).map(|i| step_of(100 + 10 * i)).collect();
            assert!(first_wave.iter().all(|&s| s == first_wave[0]), "the first wave went in at steps {first_wave:?}");
            let second: Vec<usize> = (0..4).map(|i| step_of(300 + 10 * i)).collect();
            if gather.is_zero() {
                assert!(second.windows(2).all(|w| w[0] < w[1]), "without a wait: steps {second:?}");
                assert_eq!(m.gathers.load(Relaxed), 0);
            } else {
                assert!(second.iter().all(|&s| s == second[0]), "with a wait: steps {second:?}");
                // (the second wave's end waits too, for clients that do not come back: that one
                // runs out)
                assert!(m.gathers.load(Relaxed) >= 1, "no wait counted");
            }
            drop(seen);
            e.shutdown();
        }
    }

    #[test]
    fn prefill_hold_batches_prompts() {
        let cfg = EngineConfig {
            max_queue: 8,
            prefill_chunk: 32,
            prefill_hold: 8,
            prefill_wait: 1000,
            row_multiple: 1,
            chain: false,
            warmup: false,
            prompt_cache: true,
            gather: Duration::ZERO,
        };
        let (e, seen, _m) = engine_cfg(4, cfg);
        let (a, mut ra) = job(vec![1, 2, 3], 300);
        e.submit(a).expect("queued");
        let first = first_delta(&mut ra);
        let (b, mut rb) = job(vec![500, 501], 3);
        let (c, mut rc) = job((600..607).collect(), 3);
        e.submit(b).expect("queued");
        e.submit(c).expect("queued");
        assert_eq!(collect(&mut rb).0, expect(502, 3));
        assert_eq!(collect(&mut rc).0, expect(607, 3));
        {
            let seen = seen.lock().expect("lock");
            let step_of = |tok: u32| seen.iter().position(|(toks, _)| toks.iter().any(|t| t.2 == tok && t.1 == 0)).expect("prompt seen");
            assert_eq!(step_of(500), step_of(600), "B's and C's prompts in one forward");
            // A (tokens below 500) decoded in that forward too.
            assert!(seen[step_of(500)].0.iter().any(|t| t.2 < 500));
        }
        e.shutdown();
        // A prompt alone is held at most prefill_wait steps.
        let cfg = EngineConfig { prefill_wait: 3, ..cfg };
        let (e, seen, _m) = engine_cfg(4, cfg);
        let (a, mut ra) = job(vec![1, 2, 3], 300);
        e.submit(a).expect("queued");
        first_delta(&mut ra);
        let before = seen.lock().expect("lock").len();
        let (d, mut rd) = job(vec![700, 701], 3);
        e.submit(d).expect("queued");
        assert_eq!(collect(&mut rd).0, expect(702, 3));
        let seen = seen.lock().expect("lock");
        let d_step = seen.iter().position(|(toks, _)| toks.iter().any(|t| t.2 == 700)).expect("D's prompt seen");
        assert!(d_step >= before + 3, "D's prompt went in at step {d_step}, held fewer than 3 steps after {before}");
        drop(seen);
        e.shutdown();
        assert_eq!(first, expect(4, 1));
    }

    #[test]
    fn dropped_receiver_frees_the_slot_and_queue_is_bounded() {
        for chain in [false, true] {
            dropped_receiver_frees_the_slot_and_queue_is_bounded_with(chain);
        }
    }

    fn dropped_receiver_frees_the_slot_and_queue_is_bounded_with(chain: bool) {
        let (e, _seen, m) = engine_chain(1, 8, 1, chain);
        let (a, mut ra) = job(vec![1], 400);
        e.submit(a).expect("queued");
        let (b, mut rb) = job(vec![7], 3);
        e.submit(b).expect("queued");
        let (c, _rc) = job(vec![9], 3);
        let err = e.submit(c).expect_err("queue full");
        assert_eq!(err.status.as_u16(), 503);
        assert_eq!(err.code, Some("queue_full"));
        // A is running; hang up after its first token.
        let t0 = Instant::now();
        while ra.try_recv().is_err() {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(ra);
        let (text_b, fb, _) = collect(&mut rb);
        assert_eq!(text_b, expect(8, 3));
        assert_eq!(fb, Some(Finish::Length));
        assert_eq!(m.cancelled.load(Relaxed), 1);
        assert!(m.completion_tokens.load(Relaxed) < 100, "A kept generating after its client left");
        let t0 = Instant::now();
        while e.occupancy() != 0 {
            assert!(t0.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(1));
        }
        e.shutdown();
    }

    /// Waits (bounded) until every submitted job is finished.
    fn wait_idle(e: &Engine) {
        let t0 = Instant::now();
        while e.occupancy() != 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "engine not idle: occupancy {}", e.occupancy());
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_client_that_stops_reading_is_dropped_without_stalling_the_batch() {
        for chain in [false, true] {
            a_client_that_stops_reading_is_dropped_without_stalling_the_batch_with(chain);
        }
    }

    fn a_client_that_stops_reading_is_dropped_without_stalling_the_batch_with(chain: bool) {
        let (e, _seen, m) = engine_chain(2, 8, 2, chain);
        // A's client never reads: its channel (8 events here) fills after 8 tokens.
        let (mut a, ra) = job(vec![1], 400);
        let (tx, small) = channel(8);
        a.events = tx;
        drop(ra);
        e.submit(a).expect("queued");
        let (b, mut rb) = job(vec![50], 100);
        e.submit(b).expect("queued");
        let (text_b, fb, nb) = collect(&mut rb);
        assert_eq!((text_b, fb, nb), (expect(51, 100), Some(Finish::Length), 100));
        wait_idle(&e);
        assert_eq!(m.slow_clients.load(Relaxed), 1);
        assert_eq!(m.cancelled.load(Relaxed), 1);
        // A was dropped once full, not run to its 400 tokens.
        assert!(m.completion_tokens.load(Relaxed) < 100 + 20, "{}", m.completion_tokens.load(Relaxed));
        assert_eq!(small.len(), 8);
        // Recovery: the freed slots serve new requests.
        let (c, mut rc) = job(vec![5], 3);
        e.submit(c).expect("queued");
        assert_eq!(collect(&mut rc).0, expect(6, 3));
        e.shutdown();
    }

    #[test]
    fn deadline_ends_running_sequences_with_length_and_waiting_ones_with_503() {
        for chain in [false, true] {
            deadline_ends_running_sequences_with_length_and_waiting_ones_with_503_with(chain);
        }
    }

    fn deadline_ends_running_sequences_with_length_and_waiting_ones_with_503_with(chain: bool) {
        let (e, _seen, m) = engine_chain(1, 8, 2, chain);
        let (mut a, mut ra) = job(vec![1], 500);
        a.deadline = Some(Instant::now() + Duration::from_millis(150));
        e.submit(a).expect("queued");
        // B waits behind A for the only slot and times out first.
        let (mut b, mut rb) = job(vec![1], 5);
        b.deadline = Some(Instant::now() + Duration::from_millis(50));
        e.submit(b).expect("queued");
        let t0 = Instant::now();
        let (text_a, fa, na) = collect(&mut ra);
        assert_eq!(fa, Some(Finish::Length));
        assert!(na > 0 && na < 500, "{na} tokens");
        assert_eq!(text_a, expect(2, na as u32));
        assert!(t0.elapsed() < Duration::from_secs(5));
        match rb.try_recv() {
            Ok(Event::Unavailable(why)) => assert!(why.contains("timed out"), "{why}"),
            other => panic!("B: {other:?}"),
        }
        wait_idle(&e);
        assert_eq!(m.timed_out.load(Relaxed), 2);
        assert_eq!(m.finished_length.load(Relaxed), 1);
        // Recovery.
        let (c, mut rc) = job(vec![5], 3);
        e.submit(c).expect("queued");
        assert_eq!(collect(&mut rc).0, expect(6, 3));
        e.shutdown();
    }

    /// Chained steps (module doc, "Chained steps") give every request the text it gets without
    /// them: greedy ones of all lengths (1 and 2 tokens: ending at or right after the chained
    /// step), one ending on a stop string, a chunked prompt, a seeded sampled one and one with
    /// log-probabilities (steps with them are not chained), and one arriving mid-run (it waits
    /// for no more than the step in flight). The mock checks every slot's positions.
    #[test]
    fn chained_steps_give_the_same_text() {
        let run = |chain: bool, row_multiple: usize| {
            let cfg = EngineConfig {
                max_queue: 16,
                prefill_chunk: 16,
                prefill_hold: 0,
                prefill_wait: 0,
                row_multiple,
                chain,
                warmup: false,
                prompt_cache: true,
                gather: Duration::ZERO,
            };
            let (e, _seen, m) = engine_cfg(4, cfg);
            let mut rxs = Vec::new();
            let mut submit = |prompt: Vec<u32>, max: usize, edit: &dyn Fn(&mut Job)| {
                let (mut j, rx) = job(prompt, max);
                edit(&mut j);
                e.submit(j).expect("queued");
                rxs.push(rx);
            };
            submit(vec![1, 2, 3], 40, &|_| ());
            submit(vec![100], 1, &|_| ());
            submit(vec![200, 201], 2, &|_| ());
            submit(vec![300], 30, &|j| j.stop = vec!["<310>".into()]);
            submit((400..440).collect(), 5, &|_| ());
            submit(vec![500], 6, &|j| {
                j.sampling = SamplerParams { temperature: 0.7, top_k: 0, top_p: 1.0, min_p: 0.0, seed: Some(7), ..SamplerParams::default() }
            });
            submit(vec![600], 4, &|j| j.top_logprobs = Some(2));
            submit(vec![700], 50, &|_| ());
            let mut out: Vec<_> = rxs.iter_mut().map(collect).collect();
            // One more after the others, into a running engine.
            let (j, mut rx) = job(vec![800, 801, 802], 20);
            let (a, mut ra) = job(vec![900], 90);
            e.submit(a).expect("queued");
            std::thread::sleep(Duration::from_millis(20));
            e.submit(j).expect("queued");
            out.push(collect(&mut rx));
            out.push(collect(&mut ra));
            let chained = m.steps_chained.load(Relaxed);
            e.shutdown();
            (out, chained)
        };
        let (plain, none) = run(false, 1);
        assert_eq!(none, 0);
        for row_multiple in [1, 4] {
            let (chained, steps) = run(true, row_multiple);
            assert!(steps > 50, "{steps} chained steps with rows padded to {row_multiple}");
            assert_eq!(plain, chained, "rows padded to {row_multiple}");
        }
        assert_eq!(plain[0], (expect(4, 40), Some(Finish::Length), 40));
        assert_eq!(plain[3].0, expect(301, 9));
        assert_eq!(plain[3].1, Some(Finish::Stop));
        assert_eq!(plain[9], (expect(901, 90), Some(Finish::Length), 90));
    }

    #[test]
    fn stop_string_ends_the_sequence() {
        for chain in [false, true] {
            stop_string_ends_the_sequence_with(chain);
        }
    }

    fn stop_string_ends_the_sequence_with(chain: bool) {
        let (e, _seen, m) = engine_chain(1, 8, 1, chain);
        let (mut a, mut ra) = job(vec![1], 100);
        a.stop = vec!["<6>".into()];
        e.submit(a).expect("queued");
        let (text, f, _) = collect(&mut ra);
        assert_eq!(text, "<2><3><4><5>");
        assert_eq!(f, Some(Finish::Stop));
        assert_eq!(m.finished_stop.load(Relaxed), 1);
        e.shutdown();
    }

    /// A job's text and usage (bounded wait).
    fn collect_usage(rx: &mut Receiver<Event>) -> (String, Usage) {
        let mut text = String::new();
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            match rx.try_recv() {
                Ok(Event::Delta { text: t, .. }) => text.push_str(&t),
                Ok(Event::Done { usage, .. }) => return (text, usage),
                Ok(other) => panic!("{other:?}"),
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        panic!("no end after 20 s: {text}");
    }

    /// The token ids of a text of the id-only tokenizer ("<5><17>").
    fn ids(text: &str) -> Vec<u32> {
        text.split('>').filter(|p| !p.is_empty()).map(|p| p.trim_start_matches('<').parse().expect("an id")).collect()
    }

    fn cache_cfg(prompt_cache: bool) -> EngineConfig {
        EngineConfig {
            max_queue: 8,
            prefill_chunk: 8,
            prefill_hold: 0,
            prefill_wait: 0,
            row_multiple: 1,
            chain: false,
            warmup: false,
            prompt_cache,
            gather: Duration::ZERO,
        }
    }

    /// The prompt cache (module doc, "Prompt cache"): a repeated prompt reuses all but its last
    /// token; the next turn of a conversation (the last prompt, its answer, a new message)
    /// reuses everything its slot holds; an unrelated prompt nothing. The texts are those an
    /// engine without the cache gives, and the mock's tokens hash their slot's whole history,
    /// so a wrong reused prefix would show in them.
    #[test]
    fn the_prompt_cache_reuses_a_slots_rows() {
        let run = |cache: bool| {
            let (e, _, m) = engine_mock(2, cache_cfg(cache), Arc::default(), true);
            let go = |prompt: &[u32], max: usize| {
                let (j, mut rx) = job(prompt.to_vec(), max);
                e.submit(j).unwrap();
                collect_usage(&mut rx)
            };
            let p: Vec<u32> = (10..30).collect(); // 20 tokens, three chunks of 8
            let mut out = Vec::new();
            let (t1, u1) = go(&p, 5);
            out.push((t1.clone(), u1.cached));
            let (t2, u2) = go(&p, 5);
            out.push((t2, u2.cached));
            let mut turn = p.clone();
            turn.extend(ids(&t1));
            turn.extend([3, 4]);
            let (t3, u3) = go(&turn, 4);
            out.push((t3, u3.cached));
            let (t4, u4) = go(&[500, 501, 502], 3);
            out.push((t4, u4.cached));
            e.shutdown();
            (out, m.prompt_tokens_cached.load(Relaxed))
        };
        let (with, cached) = run(true);
        let (without, none) = run(false);
        for (k, ((a, _), (b, _))) in with.iter().zip(&without).enumerate() {
            assert_eq!(a, b, "request {k}: the same text with the cache as without");
        }
        // 19 of the repeated 20; the turn: its slot holds the 20 and the first 4 of the 5
        // generated tokens (the last was never fed); the unrelated prompt: none.
        let got: Vec<usize> = with.iter().map(|(_, c)| *c).collect();
        assert_eq!(got, [0, 19, 24, 0]);
        assert_eq!(cached, 43);
        assert!(without.iter().all(|(_, c)| *c == 0) && none == 0);
    }

    /// Shared prefixes (module doc): jobs submitted together with one prompt (a request's `n`
    /// choices) compute it once, the others wait for it and copy its rows, with the prompt cache
    /// or without; a job whose prompt shares a long prefix with another request's running
    /// sequence copies its rows with the prompt cache only. The texts are those of an engine
    /// without the cache given the jobs one by one (the mock's tokens hash their slot's whole
    /// history, so a wrong copy would show), with and without chained steps.
    #[test]
    fn shared_prefixes_are_computed_once() {
        for chain in [false, true] {
            let run = |cache: bool, together: bool| {
                let cfg = EngineConfig { chain, ..cache_cfg(cache) };
                let (e, seen, m) = engine_mock(4, cfg, Arc::default(), true);
                let p: Vec<u32> = (100..140).collect(); // 40 tokens, five chunks of 8
                let mut rxs = Vec::new();
                let jobs: Vec<Job> = (0..3)
                    .map(|_| {
                        let (j, rx) = job(p.clone(), 6);
                        rxs.push(rx);
                        j
                    })
                    .collect();
                if together {
                    e.submit_all(jobs).unwrap();
                } else {
                    jobs.into_iter().for_each(|j| e.submit(j).unwrap());
                }
                let mut out: Vec<(String, usize)> = rxs.iter_mut().map(collect_usage).map(|(t, u)| (t, u.cached)).collect();
                // A prompt that shares 30 tokens with a running sequence's rows: it copies them
                // (with the prompt cache).
                let (j, mut long) = job((1..60).collect(), 40);
                e.submit(j).unwrap();
                let first = first_delta(&mut long);
                let mut q: Vec<u32> = (1..31).collect();
                q.extend([900, 901, 902]);
                let (j, mut rx) = job(q, 4);
                e.submit(j).unwrap();
                let (t, u) = collect_usage(&mut rx);
                out.push((t, u.cached));
                let (rest, _) = collect_usage(&mut long);
                out.push((first + &rest, 0));
                e.shutdown();
                let prompt_rows = seen
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .flat_map(|(t, _)| t.iter())
                    .filter(|t| t.2 >= 100 && t.2 < 140)
                    .count();
                (out, m.prompt_tokens_copied.load(Relaxed), prompt_rows)
            };
            let (reference, none, rows_all) = run(false, false);
            assert_eq!((none, rows_all), (0, 3 * 40), "chain {chain}: one by one, without the cache, nothing is shared");
            for cache in [true, false] {
                let (got, copied, rows) = run(cache, true);
                for (k, ((a, _), (b, _))) in got.iter().zip(&reference).enumerate() {
                    assert_eq!(a, b, "chain {chain}, cache {cache}, request {k}: the same text with copies as without");
                }
                let cached: Vec<usize> = got.iter().map(|(_, c)| *c).collect();
                let other = if cache { 30 } else { 0 };
                assert_eq!(cached[..4], [0, 39, 39, other], "chain {chain}, cache {cache}: cached tokens");
                assert_eq!(copied, 39 + 39 + other as u64, "chain {chain}, cache {cache}");
                // The 40-token prompt went through the model once (and its last token twice more).
                assert_eq!(rows, 40 + 2, "chain {chain}, cache {cache}: prompt rows fed");
            }
        }
    }

    /// The prompt cache with chained steps (a step enqueued ahead for a sequence that then ends
    /// writes a row of its slot after the slot is free): concurrent conversations, each turn
    /// reusing its slot, give the texts an engine without the cache gives.
    #[test]
    fn the_prompt_cache_with_chained_steps() {
        let run = |cache: bool| {
            let cfg = EngineConfig { chain: true, ..cache_cfg(cache) };
            let (e, _, m) = engine_mock(3, cfg, Arc::default(), true);
            let mut convs: Vec<Vec<u32>> = (0..3u32).map(|c| (0..9 + c).map(|i| 40 * c + i + 1).collect()).collect();
            let mut texts = Vec::new();
            for turn in 0..4 {
                let rxs: Vec<_> = convs
                    .iter()
                    .map(|p| {
                        let (j, rx) = job(p.clone(), 3 + turn);
                        e.submit(j).unwrap();
                        rx
                    })
                    .collect();
                for (c, mut rx) in rxs.into_iter().enumerate() {
                    let (t, _) = collect_usage(&mut rx);
                    convs[c].extend(ids(&t));
                    convs[c].push(7 + turn as u32);
                    texts.push(t);
                }
            }
            e.shutdown();
            (texts, m.prompt_tokens_cached.load(Relaxed), m.steps_chained.load(Relaxed))
        };
        let (with, cached, chained) = run(true);
        let (without, none, _) = run(false);
        assert_eq!(with, without);
        assert!(cached > 0 && none == 0 && chained > 0, "cached {cached}, chained {chained}");
    }

    /// Two conversations take turns on two slots: each turn finds its own conversation's slot,
    /// not the one freed last, and a third prompt takes the slot that holds nothing.
    #[test]
    fn the_prompt_cache_keeps_conversations_apart() {
        let (e, _, _m) = engine_mock(3, cache_cfg(true), Arc::default(), true);
        let go = |prompt: &[u32]| {
            let (j, mut rx) = job(prompt.to_vec(), 2);
            e.submit(j).unwrap();
            collect_usage(&mut rx)
        };
        let (a, b): (Vec<u32>, Vec<u32>) = ((100..110).collect(), (200..212).collect());
        assert_eq!(go(&a).1.cached, 0);
        assert_eq!(go(&b).1.cached, 0);
        assert_eq!(go(&a).1.cached, 9);
        assert_eq!(go(&b).1.cached, 11);
        let c: Vec<u32> = (300..305).collect();
        assert_eq!(go(&c).1.cached, 0);
        assert_eq!(go(&a).1.cached, 9, "the new prompt did not take a's slot");
        assert_eq!(go(&b).1.cached, 11, "nor b's");
        e.shutdown();
    }

    /// A job's last event: Failed's message, or None for a job that ended otherwise (bounded
    /// wait).
    fn failure(rx: &mut Receiver<Event>) -> Option<String> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            match rx.try_recv() {
                Ok(Event::Failed(e)) => return Some(e),
                Ok(Event::Done { .. }) | Ok(Event::Unavailable(_)) => return None,
                Ok(_) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        None
    }

    /// A failed forward fails the requests in it, and the engine goes on: the next request,
    /// on a model that works again, completes; one failure is not "out of service".
    #[test]
    fn a_failed_step_fails_its_requests_and_the_engine_goes_on() {
        let fail = Arc::new(AtomicBool::new(true));
        let (e, _, m) = engine_cfg_failing(2, cache_cfg(true), fail.clone());
        let (j, mut rx) = job(vec![1, 2, 3], 4);
        e.submit(j).unwrap();
        let why = failure(&mut rx).expect("the request fails with its step");
        assert!(why.contains("injected device failure"), "{why}");
        fail.store(false, Relaxed);
        let (j, mut rx) = job(vec![5, 6], 3);
        e.submit(j).unwrap();
        let (_, finish, n) = collect(&mut rx);
        assert_eq!((finish, n), (Some(Finish::Length), 3));
        assert_eq!(m.steps_failed.load(Relaxed), 1);
        assert_eq!(m.failed_in_a_row.load(Relaxed), 0);
        assert!(m.out_of_service().is_none());
        assert!(m.render().contains("turbospark_healthy 1"));
        e.shutdown();
    }

    /// UNHEALTHY_AFTER failed forwards in a row take the engine out of service: the metrics
    /// say so (for /health's 503), and the next request is refused with 503 and the reason
    /// instead of failing in yet another step.
    #[test]
    fn failed_steps_in_a_row_take_the_engine_out_of_service() {
        let fail = Arc::new(AtomicBool::new(true));
        let (e, _, m) = engine_cfg_failing(2, cache_cfg(true), fail);
        for k in 0..UNHEALTHY_AFTER {
            assert!(m.out_of_service().is_none(), "out of service after {k} failures");
            let (j, mut rx) = job(vec![1, 2, 3], 4);
            e.submit(j).unwrap();
            assert!(failure(&mut rx).is_some(), "request {k} fails");
        }
        let why = m.out_of_service().expect("out of service");
        assert!(why.contains("3 forward passes in a row failed") && why.contains("injected device failure"), "{why}");
        assert!(m.render().contains("turbospark_healthy 0"));
        let (j, _rx) = job(vec![1], 2);
        let err = e.submit(j).expect_err("refused");
        assert_eq!(err.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert!(err.message.contains("out of service") && err.message.contains("restart"), "{}", err.message);
        e.shutdown();
    }

    #[test]
    fn shutdown_fails_running_requests() {
        for chain in [false, true] {
            shutdown_fails_running_requests_with(chain);
        }
    }

    fn shutdown_fails_running_requests_with(chain: bool) {
        let (e, _seen, _m) = engine_chain(1, 8, 2, chain);
        let (a, mut ra) = job(vec![1], 500);
        e.submit(a).expect("queued");
        let (b, mut rb) = job(vec![1], 5);
        e.submit(b).expect("queued");
        e.shutdown();
        let drain = |rx: &mut Receiver<Event>| {
            let mut last = None;
            while let Ok(ev) = rx.try_recv() {
                last = Some(ev);
            }
            last
        };
        assert!(matches!(drain(&mut ra), Some(Event::Failed(_)) | Some(Event::Done { .. })));
        assert!(matches!(drain(&mut rb), Some(Event::Failed(_)) | Some(Event::Done { .. })));
        let (c, _rc) = job(vec![1], 1);
        assert_eq!(e.submit(c).expect_err("stopped").code, Some("engine_stopped"));
    }
}
