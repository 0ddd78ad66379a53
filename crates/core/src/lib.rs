//! # ts-core — the contract between models and backends
//!
//! A model family (crate `ts-models`) writes its forward pass once against [`Backend`]; the CPU
//! backend (`ts-cpu`, the reference) and the CUDA backend (`ts-cuda`) implement it. A model never
//! names a concrete backend; a backend never names a model. What a family needs that the trait
//! lacks becomes a new op here, with a CPU reference first.
//!
//! ## Buffers and views
//! Activations live in backend-owned f32 buffers ([`Backend::Buf`], cheap handles). Ops address
//! them through [`Rows`]: `n` rows of `width` f32 values, row `r` starting at `off + r * stride`.
//! Splitting q into per-head nope/rope parts, or the kv_a output into latent and rope halves, is
//! a different `Rows` over the same buffer, never a copy.
//!
//! Outputs may alias inputs only where an op's doc says "in place allowed".
//!
//! ## Batches
//! Every forward runs on a [`BatchMeta`]: a list of tokens, each with its position and the
//! cache slot of its sequence. Batch size 1 is just a batch; prefill of a prompt is a batch of
//! its tokens; a server step mixes sequences. The backend uploads it once per forward
//! ([`Backend::upload_batch`]) so ops can read positions and cache rows on the device.

pub mod ops;

pub use ops::*;
pub use ts_formats::{GgmlType, TensorData};

/// The greedy pick over one row of logits: the index of the largest value under `f32::total_cmp`
/// (so `+0.0 > -0.0`), NaN counting as −∞, ties going to the lowest index; 0 for an empty row.
/// This is the one definition of "arg-max" every sampler and backend agrees with
/// ([`Backend::argmax_rows`], the engine's greedy sampler).
pub fn argmax(row: &[f32]) -> u32 {
    let key = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let Some(&first) = row.first() else { return 0 };
    let (mut best, mut bv) = (0usize, key(first));
    for (i, &l) in row.iter().enumerate().skip(1) {
        let l = key(l);
        if l.total_cmp(&bv) == std::cmp::Ordering::Greater {
            best = i;
            bv = l;
        }
    }
    best as u32
}

/// Errors a backend can raise. One line each, naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("tensor '{name}': {what}")]
    Weight { name: String, what: String },
    #[error("out of {device} memory: {what}")]
    OutOfMemory { device: String, what: String },
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Device(String),
}

pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// `n` rows of `width` f32 values in a buffer; row `r` starts at element `off + r * stride`.
/// Invariant: `stride >= width` (or `n <= 1`), and the last row ends inside the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub off: usize,
    pub n: usize,
    pub width: usize,
    pub stride: usize,
}

impl Rows {
    /// `n` packed rows of `width` starting at element 0.
    pub const fn packed(n: usize, width: usize) -> Self {
        Rows { off: 0, n, width, stride: width }
    }
    /// Columns `[c0, c0 + w)` of every row.
    pub const fn cols(self, c0: usize, w: usize) -> Self {
        Rows { off: self.off + c0, n: self.n, width: w, stride: self.stride }
    }
    /// Rows `[r0, r0 + n)`.
    pub const fn rows(self, r0: usize, n: usize) -> Self {
        Rows { off: self.off + r0 * self.stride, n, width: self.width, stride: self.stride }
    }
    /// Re-split each row into `k` sub-rows of `width / k` (e.g. a row of all heads -> one row per head).
    /// Requires `width % k == 0` and packed rows (`stride == width`).
    pub fn split(self, k: usize) -> Self {
        debug_assert!(self.width.is_multiple_of(k) && (self.stride == self.width || self.n <= 1));
        let w = self.width / k;
        Rows { off: self.off, n: self.n * k, width: w, stride: w }
    }
    /// Elements spanned (index one past the last element).
    pub fn end(&self) -> usize {
        if self.n == 0 {
            self.off
        } else {
            self.off + (self.n - 1) * self.stride + self.width
        }
    }
}

/// A [`TokenMeta::token`] of `TOKEN_FROM_ARGMAX + r` stands for the arg-max of output row `r`
/// of the last [`Backend::argmax_rows_queued`] enqueued before the batch's upload: the id stays
/// on the device, so a greedy step can be enqueued before the previous one's id reaches the
/// host (backends whose [`Backend::chains_argmax`] is true; `Session::greedy_chain`).
pub const TOKEN_FROM_ARGMAX: u32 = 0xFFFF_0000;

/// One token of a batch. Host-side description; see [`Backend::upload_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenMeta {
    /// Vocabulary id, or [`TOKEN_FROM_ARGMAX`]` + r` (a previous step's pick, on the device).
    pub token: u32,
    /// Position in its sequence (0-based); its cache row is `slot * slot_len + pos`.
    pub pos: u32,
    /// Cache slot of its sequence (the KV pool is `n_slots` contiguous slots of `slot_len` rows).
    pub slot: u32,
}

/// What one forward computes. Tokens of one sequence appear in position order, and a token
/// attends to positions `0..=pos` of its slot (the cache must already hold the earlier ones, or
/// they come earlier in this batch).
#[derive(Debug, Clone, Default)]
pub struct BatchMeta {
    pub tokens: Vec<TokenMeta>,
    /// Indices into `tokens` whose logits are wanted (e.g. the last token of each sequence).
    pub outputs: Vec<u32>,
    /// Rows per cache slot (the context length of one sequence).
    pub slot_len: u32,
}

impl BatchMeta {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// A single sequence in slot 0: `tokens` at positions `start..`, logits for the last only
    /// (or for every token when `all_logits`).
    pub fn sequence(tokens: &[u32], start: u32, slot_len: u32, all_logits: bool) -> Self {
        let toks: Vec<TokenMeta> =
            tokens.iter().enumerate().map(|(i, &t)| TokenMeta { token: t, pos: start + i as u32, slot: 0 }).collect();
        let outputs = if all_logits { (0..toks.len() as u32).collect() } else { vec![toks.len() as u32 - 1] };
        BatchMeta { tokens: toks, outputs, slot_len }
    }
}
