//! # ts-models — model families, each written once against [`ts_core::Backend`]
//!
//! A family file reads top to bottom as config → weights → forward. Config comes from GGUF
//! metadata or an HF `config.json` (seen as `hf.*` keys, see `ts_formats::hf`) and is validated
//! at open; every tensor the forward uses is bound at open with its expected shape, so nothing is
//! discovered missing at token 1.
//!
//! * [`llama`]     — llama family (SmolLM2, Llama 2/3 …): RMSNorm, GQA, rope, SwiGLU.
//! * [`deepseek2`] — DeepSeek-V2 / V2-Lite / V2.5: MLA with a compressed cache, MoE, YaRN.
//! * [`gemma3`]    — Gemma 3 text models: sandwich norms, q/k norms, sliding-window + global layers.
//! * [`synth`]     — random-weight deepseek2 files (GGUF or HF folder) at real shapes.
//!
//! The engine drives a model through the object-safe [`Model`] trait.

pub mod bind;
pub mod deepseek2;
pub mod gemma3;
pub mod llama;
pub mod meta;
pub mod names;
pub mod synth;
pub mod synth_dense;

use std::sync::Arc;

use ts_core::{Backend, BatchMeta, Rows};
use ts_formats::TensorSource;

/// Errors at open (config, tensors) and during a forward.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {what}")]
    Config { path: String, what: String },
    #[error("{path}: tensor '{tensor}': {what}")]
    Tensor { path: String, tensor: String, what: String },
    #[error(transparent)]
    Backend(#[from] ts_core::BackendError),
    #[error("{0}")]
    Run(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// How much runtime state to size at open.
#[derive(Debug, Clone, Copy)]
pub struct RuntimeOptions {
    /// Context length of one sequence (rows per cache slot).
    pub ctx: usize,
    /// Sequences that can be live at once (cache slots).
    pub n_slots: usize,
    /// Most tokens one forward may carry (prefill chunk size / decode batch).
    pub max_batch: usize,
}

impl Default for RuntimeOptions {
    fn default() -> Self {
        RuntimeOptions { ctx: 4096, n_slots: 1, max_batch: 512 }
    }
}

/// What a loaded model is, for `inspect`, the CLI and the server.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// `general.architecture` ("llama", "deepseek2", …).
    pub arch: String,
    /// `general.name` when present.
    pub name: String,
    pub n_vocab: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    pub n_layers: usize,
    pub n_embd: usize,
    /// Parameters (elements of every bound tensor).
    pub n_params: u64,
    /// Bytes of weights as stored on the backend.
    pub weight_bytes: u64,
    /// Bytes of the backend's second layouts of weights, kept for faster kernels (CUDA: the
    /// tiled expert stacks of the batched decode), on top of `weight_bytes`.
    pub weight_copy_bytes: u64,
    /// Bytes of KV cache per token of context (all layers).
    pub cache_bytes_per_token: u64,
    /// Extra human lines for `inspect` (geometry, experts …).
    pub details: Vec<(String, String)>,
    /// Whether a forward gives each token row the same bits whatever else is in the batch, so
    /// that a server needs no padding for determinism (every matrix's type is batch-invariant on
    /// the backend, [`Backend::batch_invariant`]; a family with batch-dependent paths says no).
    pub batch_invariant: bool,
}

/// What one forward hands back for its output rows (`batch.outputs`, in that order).
///
/// A server step of 64 greedy sequences needs 64 token ids, not 64 × 102,400 logits (26 MB
/// through the PCIe bus and a host copy every step): rows whose sampler is a plain arg-max ask
/// for `argmax` only, the others (temperature, penalties, log-probabilities) for their full row.
pub struct Outputs<'a> {
    /// The output rows whose full logits are wanted, ascending (indices into `batch.outputs`);
    /// `None`: all of them.
    pub full_rows: Option<&'a [u32]>,
    /// `[full rows, n_vocab]`: the k-th full row's logits at `k * n_vocab`.
    pub logits: &'a mut [f32],
    /// When set, receives [`ts_core::argmax`] of every output row (`outputs.len()` ids), computed
    /// by the backend where the logits are.
    pub argmax: Option<&'a mut [u32]>,
    /// Enqueue the arg-max of every output row on the backend and read nothing back
    /// ([`ts_core::ops::Backend::argmax_rows_queued`]; the ids come later through
    /// [`Model::argmax_collect`], and a next batch may take them as
    /// [`ts_core::TOKEN_FROM_ARGMAX`] tokens). Needs `full_rows == Some(&[])`, `argmax == None`
    /// and a backend whose `chains_argmax` is true.
    pub queue_argmax: bool,
}

impl<'a> Outputs<'a> {
    /// Every output row's full logits, nothing else (what [`Model::forward`] asks for).
    pub fn all(logits: &'a mut [f32]) -> Self {
        Outputs { full_rows: None, logits, argmax: None, queue_argmax: false }
    }

    /// Only the arg-max of every output row, enqueued on the backend ([`Outputs::queue_argmax`]).
    pub fn queued() -> Self {
        Outputs { full_rows: Some(&[]), logits: &mut [], argmax: None, queue_argmax: true }
    }

    /// Hands over output rows `[first, first + rows.n)`, whose logits sit in `rows` of `buf`:
    /// their arg-max when asked, and the full rows among them. Families call it once per chunk
    /// of output rows they compute.
    pub(crate) fn deliver<B: Backend>(&mut self, be: &B, buf: &B::Buf, rows: Rows, first: usize) -> Result<()> {
        let (m, nv) = (rows.n, rows.width);
        if self.queue_argmax {
            // One queued arg-max a step: its ids are the step's, row for row.
            if first != 0 {
                return Err(ModelError::Run("a queued arg-max needs all output rows in one chunk".into()));
            }
            return Ok(be.argmax_rows_queued(buf, rows)?);
        }
        if let Some(ids) = self.argmax.as_deref_mut() {
            be.argmax_rows(buf, rows, &mut ids[first..first + m])?;
        }
        match self.full_rows {
            None => be.read(buf, rows, &mut self.logits[first * nv..(first + m) * nv])?,
            Some(full) => {
                let lo = full.partition_point(|&r| (r as usize) < first);
                let hi = full.partition_point(|&r| (r as usize) < first + m);
                for (k, &r) in full.iter().enumerate().take(hi).skip(lo) {
                    be.read(buf, rows.rows(r as usize - first, 1), &mut self.logits[k * nv..(k + 1) * nv])?;
                }
            }
        }
        Ok(())
    }

    /// Checks the buffers against `n_out` output rows of `n_vocab` logits.
    pub(crate) fn check(&self, n_out: usize, n_vocab: usize) -> Result<()> {
        if self.queue_argmax && (self.argmax.is_some() || self.full_rows.is_none_or(|f| !f.is_empty()) || n_out == 0) {
            return Err(ModelError::Run("a queued arg-max is all a step may ask for, of at least one output row".into()));
        }
        let n_full = self.full_rows.map_or(n_out, |f| f.len());
        if let Some(f) = self.full_rows {
            if f.windows(2).any(|w| w[0] >= w[1]) || f.last().is_some_and(|&r| r as usize >= n_out) {
                return Err(ModelError::Run(format!("full logits rows must ascend below the {n_out} outputs")));
            }
        }
        if self.logits.len() != n_full * n_vocab {
            return Err(ModelError::Run(format!(
                "logits buffer holds {} values, {n_full} rows of {n_vocab} need {}",
                self.logits.len(),
                n_full * n_vocab
            )));
        }
        if let Some(a) = self.argmax.as_deref() {
            if a.len() != n_out {
                return Err(ModelError::Run(format!("arg-max buffer holds {} ids for {n_out} output rows", a.len())));
            }
        }
        Ok(())
    }
}

/// Checks a [`Model::copy_prefix`] request against the options: both slots exist and differ,
/// `n` fits a slot. Returns the two slots' first cache rows.
pub(crate) fn prefix_rows(o: &RuntimeOptions, src: u32, dst: u32, n: usize) -> Result<(usize, usize)> {
    if src == dst || src as usize >= o.n_slots || dst as usize >= o.n_slots || n > o.ctx {
        return Err(ModelError::Run(format!("copy of {n} rows from slot {src} to slot {dst}: {} slots of {} rows", o.n_slots, o.ctx)));
    }
    Ok((src as usize * o.ctx, dst as usize * o.ctx))
}

/// A loaded model with its cache and scratch, ready to run forwards.
pub trait Model: Send {
    fn info(&self) -> &ModelInfo;
    fn options(&self) -> RuntimeOptions;
    /// Run one batch and hand back what `out` asks for its output rows ([`Outputs`]). The cache
    /// rows of every token in the batch are written.
    fn forward_outputs(&mut self, batch: &BatchMeta, out: Outputs<'_>) -> Result<()>;
    /// Run one batch. Writes the logits of `batch.outputs` (in that order) into `logits`,
    /// `[outputs.len(), n_vocab]`. The cache rows of every token in the batch are written.
    fn forward(&mut self, batch: &BatchMeta, logits: &mut [f32]) -> Result<()> {
        self.forward_outputs(batch, Outputs::all(logits))
    }
    /// Whether steps chain on the device ([`ts_core::ops::Backend::chains_argmax`]):
    /// [`Outputs::queued`] and [`ts_core::TOKEN_FROM_ARGMAX`] tokens work. Default false.
    fn chains_argmax(&self) -> bool {
        false
    }
    /// The ids of the oldest queued arg-max ([`Outputs::queued`]), waiting for them.
    fn argmax_collect(&mut self, _out: &mut [u32]) -> Result<()> {
        Err(ModelError::Run("this model's backend does not queue arg-maxes".into()))
    }
    /// Copies the cache rows of positions `0..n` of slot `src` over those of slot `dst`, for
    /// every layer ([`ts_core::ops::Backend::cache_copy`]): a sequence starting in `dst` then
    /// reads the rows another one computed for their shared prompt prefix. In order with the
    /// forwards before and after it. Default: unsupported.
    fn copy_prefix(&mut self, src: u32, dst: u32, n: usize) -> Result<()> {
        let _ = (src, dst, n);
        Err(ModelError::Run("this model cannot copy cache rows between slots".into()))
    }
    /// Its backend's [`ts_core::ops::Backend::step_counts`]: how its forwards ran (replayed,
    /// recorded, op by op). Default: all zero.
    fn step_counts(&self) -> ts_core::StepCounts {
        ts_core::StepCounts::default()
    }
}

/// [`load`], calling `progress(bytes_done, bytes_total)` as tensors are uploaded, and with
/// `requant` = Some(type), quantising the f32/f16/bf16 weight matrices to that type as they load
/// (see [`bind::requant_target`] for which).
pub fn load_with_progress<B: Backend + 'static>(
    src: &dyn TensorSource,
    be: Arc<B>,
    opts: RuntimeOptions,
    requant: Option<ts_formats::GgmlType>,
    progress: Box<dyn FnMut(u64, u64)>,
) -> Result<Box<dyn Model>> {
    bind::PROGRESS.with(|p| *p.borrow_mut() = Some(progress));
    bind::REQUANT.with(|q| q.set(requant));
    let r = load(src, be, opts);
    bind::PROGRESS.with(|p| *p.borrow_mut() = None);
    bind::REQUANT.with(|q| q.set(None));
    r
}

/// Open the family named by the source's `general.architecture` on backend `be`.
///
/// When the backend asks for it ([`ts_core::Backend::warm_up_at_open`]), one forward of the widest
/// batch and one single-token step run here, so every scratch buffer exists before the first real
/// token (they write cache rows of slot 0, which real sequences overwrite).
pub fn load<B: Backend + 'static>(src: &dyn TensorSource, be: Arc<B>, opts: RuntimeOptions) -> Result<Box<dyn Model>> {
    let arch = meta::architecture(src)?;
    let warm = be.warm_up_at_open();
    let mut model: Box<dyn Model> = match arch.as_str() {
        "llama" => Box::new(llama::Llama::open(src, be, opts)?),
        "deepseek2" | "deepseek_v2" => Box::new(deepseek2::DeepSeek2::open(src, be, opts)?),
        "gemma3" | "gemma3_text" => Box::new(gemma3::Gemma3::open(src, be, opts)?),
        other => {
            return Err(ModelError::Config {
                path: src.path().to_string(),
                what: format!("architecture '{other}' is not supported (supported: llama, deepseek2, gemma3)"),
            })
        }
    };
    if warm {
        warm_up(model.as_mut())?;
    }
    Ok(model)
}

/// One forward of `min(max_batch, ctx)` tokens, then one single-token step, in slot 0.
pub fn warm_up(model: &mut dyn Model) -> Result<()> {
    let o = model.options();
    let nv = model.info().n_vocab;
    let n = o.max_batch.min(o.ctx).max(1);
    let mut logits = vec![0f32; nv];
    let wide = BatchMeta::sequence(&vec![0u32; n], 0, o.ctx as u32, false);
    model.forward(&wide, &mut logits)?;
    let one = BatchMeta::sequence(&[0u32], 0, o.ctx as u32, false);
    model.forward(&one, &mut logits)
}
