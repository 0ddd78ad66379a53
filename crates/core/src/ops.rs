//! The [`Backend`] trait: every op a model forward needs, with its exact semantics.
//!
//! The CPU backend's implementation of each op is the reference; a GPU op is correct when it
//! matches it on fresh random inputs (tests in `ts-cuda`). Shapes below use `Rows` notation:
//! `x: [n, w]` means `n` rows of `w` values.

use crate::{BackendError, BatchMeta, Result, Rows, TensorData};

/// How rotary embedding pairs elements within the rotated part of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Consecutive pairs `(2i, 2i+1)` (ggml "normal": llama GGUF, deepseek2).
    Normal,
    /// Halves `(i, i + d/2)` (ggml "neox": gemma3, HF llama layout).
    Neox,
}

/// Rotary embedding, precomputed at open: pair `i` at position `p` rotates by angle
/// `p * freqs[i]`, and both outputs are multiplied by `mscale`.
/// Steps by how they ran ([`Backend::step_counts`]), counts since the backend was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepCounts {
    /// Replayed from a recording: one launch.
    pub replayed: u64,
    /// Recorded this time (and run from the recording).
    pub recorded: u64,
    /// Enqueued op by op: first sight of a key, too many tokens or recordings, or a recording
    /// that could not be kept.
    pub eager: u64,
}

#[derive(Debug, Clone)]
pub struct RopeSpec {
    pub mode: RopeMode,
    /// Rotated dimensions per head (even); `freqs.len() == dim / 2`.
    pub dim: usize,
    /// Per-pair angular frequency in radians per position (YaRN already folded in).
    pub freqs: Vec<f32>,
    /// Magnitude applied to cos and sin (1.0 except for YaRN with mscale != mscale_all_dim).
    pub mscale: f32,
}

/// Multi-head attention over a (K, V) cache with grouped-query heads.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Width of one q/k head.
    pub head_dim: usize,
    /// Width of one v head.
    pub v_dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Sliding window: token at position `p` sees positions `> p - window` only. `None` = global.
    pub window: Option<u32>,
    /// Score soft-capping `cap * tanh(s / cap)` (applied after `scale`). `None` = off.
    pub softcap: Option<f32>,
}

/// Absorbed multi-head latent attention (DeepSeek-V2 MLA) over the compressed cache.
#[derive(Debug, Clone, Copy)]
pub struct MlaParams {
    pub n_heads: usize,
    /// Latent width (`kv_lora_rank`); cache rows are `[c (kv_lora) ; k_pe (rope_dim)]`.
    pub kv_lora: usize,
    pub rope_dim: usize,
    /// Multiplies the score `q_abs·c + q_pe·k_pe` before the softmax.
    pub scale: f32,
}

/// Gated linear unit activation for FFNs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glu {
    /// `silu(g) * u` (llama, deepseek2).
    SwiGlu,
    /// `gelu_tanh(g) * u` (gemma).
    GeGluTanh,
}

/// Expert scoring function of a MoE router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Mixture-of-experts routing and expert FFN parameters.
#[derive(Debug, Clone, Copy)]
pub struct MoeParams {
    pub n_experts: usize,
    /// Experts used per token (top-k).
    pub k: usize,
    pub gating: Gating,
    /// Renormalise the k selected weights to sum to 1.
    pub norm_topk: bool,
    /// Multiplies the (possibly renormalised) weights (`routed_scaling_factor`).
    pub scale: f32,
    /// Group-limited greedy (DeepSeek-V2 236B): experts in `n_group` groups, only the
    /// `topk_group` groups with the highest max score are eligible. `n_group == 1` = plain top-k.
    pub n_group: usize,
    pub topk_group: usize,
    pub glu: Glu,
}

impl MoeParams {
    /// Plain routing: softmax gating, the top `k` of `n_experts` without renormalisation or
    /// scaling, one group, SwiGLU experts (DeepSeek-V2-Lite's). Other settings by struct update.
    pub fn top_k(n_experts: usize, k: usize) -> Self {
        MoeParams { n_experts, k, gating: Gating::Softmax, norm_topk: false, scale: 1.0, n_group: 1, topk_group: 1, glu: Glu::SwiGlu }
    }
}

/// How a weight will be used, so a backend may choose its storage layout at upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightUse {
    /// `y = W x` (matrix rows are `shape[1]`, each of `shape[0]` values; 3-D = a stack of them).
    Matmul,
    /// A `Matmul` weight of a MoE FFN: an expert stack, or a shared expert FFN that the MoE
    /// runs with its experts. Used exactly as `Matmul`; a backend may keep a second layout of
    /// these for its prompt-size grouped products (the CUDA backend's f16 copies).
    Expert,
    /// Rows gathered by token id. (A `Matmul` weight must serve `embed` too, so a tied
    /// embedding is uploaded once, as `Matmul`, and used for both.)
    Embedding,
    /// A vector applied element-wise (norm weights).
    Vector,
}

/// The expert matrices of one MoE layer: 3-D weights `[in, out, n_experts]` (GGML order).
pub struct Experts<'a, W> {
    /// `[H, ff, E]`
    pub gate: &'a W,
    /// `[H, ff, E]`
    pub up: &'a W,
    /// `[ff, H, E]`
    pub down: &'a W,
}

/// The MoE FFN's routing that follows an attention's output norm
/// ([`Backend::mla_attention_out`]'s `next`): the router, where its logits go, and the routing's
/// parameters (those of the [`Backend::moe_shared`] call that follows).
pub struct MoeNext<'a, W, B> {
    /// The router: f32 `[H, E]`.
    pub router: &'a W,
    /// The logits' buffer and rows there (`[n, E]`).
    pub logits: (&'a B, Rows),
    pub params: &'a MoeParams,
}

/// A device weight: its dtype and GGML-order shape as uploaded.
pub trait WeightInfo {
    fn dtype(&self) -> crate::GgmlType;
    fn shape(&self) -> &[usize];
    /// Bytes it occupies on the device.
    fn bytes(&self) -> usize;
    /// Bytes of second layouts of the same values that the backend keeps for faster kernels
    /// (CUDA's tiled expert stacks), not counted in [`WeightInfo::bytes`]; default none.
    fn copy_bytes(&self) -> usize {
        0
    }
}

/// The ops a forward needs. All ops are enqueued in order; [`Backend::read`] waits for them.
pub trait Backend: Send + Sync {
    /// An f32 activation buffer (a cheap handle; clones share storage).
    type Buf: Clone + Send + Sync;
    /// A KV cache buffer: `rows` of `width` values in the backend's cache precision.
    type Cache: Send + Sync;
    /// A weight in the backend's storage layout.
    type Weight: WeightInfo + Send + Sync;
    /// A batch description resident on the device.
    type Batch: Send + Sync;
    /// A precomputed rope table.
    type Rope: Send + Sync;

    /// Short name for messages ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    // ---- memory -------------------------------------------------------------------------
    /// A zeroed f32 buffer of `len` elements.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    /// A zeroed cache of `rows * width` values.
    fn alloc_cache(&self, rows: usize, width: usize) -> Result<Self::Cache>;
    /// A zeroed MLA latent cache (DeepSeek-V2: rows of `kv_lora` + rope values, one per token,
    /// read by all `heads` of its queries). A backend may store it narrower than f32 where its
    /// attention kernels read that (the CUDA backend: f16, the rounding its tensor-core kernels
    /// apply to the keys anyway). Default: [`Backend::alloc_cache`].
    fn alloc_latent_cache(&self, rows: usize, width: usize, kv_lora: usize, heads: usize) -> Result<Self::Cache> {
        let _ = (kv_lora, heads);
        self.alloc_cache(rows, width)
    }
    /// Bytes per value of `cache` (4: f32; a backend's narrower latent cache says so).
    fn cache_value_bytes(&self, cache: &Self::Cache) -> usize {
        let _ = cache;
        4
    }
    fn upload_weight(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<Self::Weight>;
    /// Told before each [`Backend::upload_weight`] of a load: the source bytes of the tensors
    /// still to come after this one. A backend that spends spare memory on second copies of
    /// weights (CUDA's tiled expert stacks) keeps room for them with it; default: ignored.
    fn load_remaining(&self, src_bytes: u64) {
        let _ = src_bytes;
    }
    /// Whether products with weights of type `w` give each activation row the same bits
    /// whatever the other rows of the call (batch invariance: a server then needs no padding
    /// for a request's text not to depend on its neighbours). `false` unless a backend knows.
    fn batch_invariant(&self, w: crate::GgmlType) -> bool {
        let _ = w;
        false
    }
    fn upload_rope(&self, spec: &RopeSpec) -> Result<Self::Rope>;
    /// An empty batch handle with room for `max_tokens` tokens.
    fn alloc_batch(&self, max_tokens: usize) -> Result<Self::Batch>;
    /// Make `meta` the content of `batch` (`meta.len() <= max_tokens`).
    fn upload_batch(&self, meta: &BatchMeta, batch: &mut Self::Batch) -> Result<()>;
    /// Host -> device: `src` into `dst` at element offset `off`.
    fn write(&self, dst: &Self::Buf, off: usize, src: &[f32]) -> Result<()>;
    /// Device -> host: `rows` of `buf` packed into `dst` (`dst.len() == rows.n * rows.width`).
    /// Waits for all enqueued work.
    fn read(&self, buf: &Self::Buf, rows: Rows, dst: &mut [f32]) -> Result<()>;
    /// Device -> host: the greedy pick of each row of `x` ([`crate::argmax`]: NaN counts as −∞,
    /// ties go to the lowest index) into `out` (`out.len() == xr.n`). Waits for all enqueued work.
    /// A backend whose memory is not the host's computes it where the rows are and copies back
    /// `4 * n` bytes instead of `4 * n * width`. The default reads each row and scans it here
    /// (it allocates one row: CPU-side backends override it).
    fn argmax_rows(&self, x: &Self::Buf, xr: Rows, out: &mut [u32]) -> Result<()> {
        assert_eq!(out.len(), xr.n);
        let mut row = vec![0f32; xr.width];
        for (i, o) in out.iter_mut().enumerate() {
            self.read(x, xr.rows(i, 1), &mut row)?;
            *o = crate::argmax(&row);
        }
        Ok(())
    }

    /// Whether this backend chains greedy steps on the device: [`Backend::argmax_rows_queued`]
    /// and [`Backend::argmax_collect`] work, and [`Backend::upload_batch`] takes
    /// [`crate::TOKEN_FROM_ARGMAX`] ids. Default false.
    fn chains_argmax(&self) -> bool {
        false
    }
    /// Enqueue the greedy pick of each row of `x` (as [`Backend::argmax_rows`]) without waiting:
    /// the ids stay on the device for a later batch's [`crate::TOKEN_FROM_ARGMAX`] tokens and
    /// come to the host through [`Backend::argmax_collect`], oldest first. At most two may be
    /// pending (a third is refused). Default: unsupported.
    fn argmax_rows_queued(&self, _x: &Self::Buf, _xr: Rows) -> Result<()> {
        Err(BackendError::Unsupported("queued arg-max".into()))
    }
    /// The ids of the oldest pending [`Backend::argmax_rows_queued`] (`out.len()` its rows),
    /// waiting for them. Default: unsupported.
    fn argmax_collect(&self, _out: &mut [u32]) -> Result<()> {
        Err(BackendError::Unsupported("queued arg-max".into()))
    }

    // ---- ops ----------------------------------------------------------------------------
    /// `out[t] = table[batch.token[t]] * scale` (dequantised). `out: [n_tokens, dim]`.
    fn embed(&self, table: &Self::Weight, batch: &Self::Batch, scale: f32, out: &Self::Buf, o: Rows);
    /// `out[r] = x[r] / rms(x[r]) * w` with `rms = sqrt(mean(x^2) + eps)`; `w: [width]` or none.
    /// In place allowed.
    fn rms_norm(&self, x: &Self::Buf, xr: Rows, w: Option<&Self::Weight>, eps: f32, out: &Self::Buf, o: Rows);
    /// `out[r] = W x[r]` for a 2-D weight `[in, out]`: `x: [n, in]`, `out: [n, out]`.
    fn matmul(&self, x: &Self::Buf, xr: Rows, w: &Self::Weight, out: &Self::Buf, o: Rows);
    /// Several matmuls of one input (q/k/v, gate/up): `out_i[r] = W_i x[r]` for each
    /// `(W_i, out_i, o_i)` of `jobs`, exactly as [`Backend::matmul`] per job (the default). A
    /// backend may run them as one op (one activation quantisation, one parallel region).
    fn matmul_many(&self, x: &Self::Buf, xr: Rows, jobs: &[(&Self::Weight, &Self::Buf, Rows)]) {
        for &(w, out, o) in jobs {
            self.matmul(x, xr, w, out, o);
        }
    }
    /// Per-head matmul with a 3-D weight `[in, out, G]`: row `r` uses matrix `r % G`
    /// (rows are token-major, head-minor).
    fn matmul_grouped(&self, x: &Self::Buf, xr: Rows, w: &Self::Weight, out: &Self::Buf, o: Rows);
    /// `out = a + b`. In place allowed (`out` == `a` or `b`).
    fn add(&self, a: &Self::Buf, ar: Rows, b: &Self::Buf, br: Rows, out: &Self::Buf, o: Rows);
    /// `x *= s`. In place.
    fn scale(&self, x: &Self::Buf, xr: Rows, s: f32);
    /// `out = act(gate) * up`. In place allowed (`out` == `gate`).
    fn glu(&self, kind: Glu, gate: &Self::Buf, gr: Rows, up: &Self::Buf, ur: Rows, out: &Self::Buf, o: Rows);
    /// `x = cap * tanh(x / cap)`. In place.
    fn softcap(&self, x: &Self::Buf, xr: Rows, cap: f32);
    /// `dst = src`.
    fn copy(&self, src: &Self::Buf, sr: Rows, dst: &Self::Buf, dr: Rows);
    /// `out[i] = x[batch.outputs[i]]`: the rows of the uploaded batch's output tokens, gathered in
    /// one op (`xr.n` = the batch's tokens, `o.n` = its outputs, same widths). A device reads the
    /// index list uploaded with the batch, so a recorded step serves every set of output rows of
    /// the same size.
    fn gather_outputs(&self, x: &Self::Buf, xr: Rows, batch: &Self::Batch, out: &Self::Buf, o: Rows);
    /// Rotate the first `rope.dim` values of each row in place. `xr` has one row per head,
    /// `heads_per_token` consecutive rows per batch token, whose position gives the angle.
    fn rope(&self, x: &Self::Buf, xr: Rows, heads_per_token: usize, batch: &Self::Batch, rope: &Self::Rope);
    /// Write row `t` of `src` (`[n_tokens, cache width]`) to cache row `slot * slot_len + pos`.
    fn cache_write(&self, cache: &Self::Cache, src: &Self::Buf, sr: Rows, batch: &Self::Batch);
    /// Copy cache rows `src .. src + n` over rows `dst .. dst + n` (`width` values a row; the two
    /// ranges do not overlap), in order with the ops before and after it: a sequence takes
    /// the rows another one computed for their shared prompt prefix. Default: unsupported.
    fn cache_copy(&self, cache: &Self::Cache, width: usize, src: usize, dst: usize, n: usize) -> Result<()> {
        let _ = (cache, width, src, dst, n);
        Err(BackendError::Unsupported("copying cache rows".into()))
    }
    /// Causal GQA attention: `q: [n_tokens, n_heads*head_dim]`, caches of
    /// `n_kv_heads*head_dim` / `n_kv_heads*v_dim` wide rows, `out: [n_tokens, n_heads*v_dim]`.
    /// Query head `h` uses kv head `h / (n_heads / n_kv_heads)`.
    fn attention(
        &self,
        q: &Self::Buf,
        qr: Rows,
        k: &Self::Cache,
        v: &Self::Cache,
        batch: &Self::Batch,
        p: &AttnParams,
        out: &Self::Buf,
        o: Rows,
    );
    /// Absorbed MLA: `q: [n_tokens*n_heads, kv_lora + rope_dim]` (`[q_abs ; q_pe]` per head),
    /// cache rows `[c ; k_pe]`; `out: [n_tokens*n_heads, kv_lora] = softmax(scale * q·row) · c`.
    fn mla_attention(&self, q: &Self::Buf, qr: Rows, cache: &Self::Cache, batch: &Self::Batch, p: &MlaParams, out: &Self::Buf, o: Rows);
    /// Routed experts: from router `logits: [n, E]` pick `k` experts per row with weights
    /// (per `p`), and write `out[r] = sum_e w_e * down_e(glu(gate_e x, up_e x))`. `x: [n, H]`.
    fn moe(
        &self,
        x: &Self::Buf,
        xr: Rows,
        logits: &Self::Buf,
        lr: Rows,
        experts: Experts<'_, Self::Weight>,
        p: &MoeParams,
        out: &Self::Buf,
        o: Rows,
    );
    /// Wait for all enqueued work.
    fn synchronize(&self) -> Result<()>;

    // ---- fused ops (optional: each default is the sequence of plain ops it replaces) ------------
    /// Residual add then norm: `x += delta`, then `out = rms_norm(x) * w` (exactly
    /// [`Backend::add`] then [`Backend::rms_norm`], the default). `out` may be `delta` (same view).
    fn add_rms_norm(
        &self,
        x: &Self::Buf,
        xr: Rows,
        delta: &Self::Buf,
        dr: Rows,
        w: Option<&Self::Weight>,
        eps: f32,
        out: &Self::Buf,
        o: Rows,
    ) {
        self.add(x, xr, delta, dr, x, xr);
        self.rms_norm(x, xr, w, eps, out, o);
    }
    /// A layer's first norm and the products that read it: [`Backend::add_rms_norm`]`(x, delta,
    /// w, eps, out)`, then [`Backend::matmul_many`]`(out, jobs)` (the default). A backend may
    /// normalise the row inside each product block instead of a launch of its own (CUDA, one
    /// token: the same bits). `out` must not be `delta`.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_matmul_many(
        &self,
        (x, xr): (&Self::Buf, Rows),
        (delta, dr): (&Self::Buf, Rows),
        w: Option<&Self::Weight>,
        eps: f32,
        (out, o): (&Self::Buf, Rows),
        jobs: &[(&Self::Weight, &Self::Buf, Rows)],
    ) {
        self.add_rms_norm(x, xr, delta, dr, w, eps, out, o);
        self.matmul_many(out, o, jobs);
    }
    /// [`Backend::add_rms_norm_matmul_many`] without the add: [`Backend::rms_norm`]`(x, w, eps,
    /// out)`, then [`Backend::matmul_many`]`(out, jobs)` (the default); `x` is not written.
    fn rms_norm_matmul_many(
        &self,
        (x, xr): (&Self::Buf, Rows),
        w: Option<&Self::Weight>,
        eps: f32,
        (out, o): (&Self::Buf, Rows),
        jobs: &[(&Self::Weight, &Self::Buf, Rows)],
    ) {
        self.rms_norm(x, xr, w, eps, out, o);
        self.matmul_many(out, o, jobs);
    }
    /// `dst = rope(src)` with `src` left unchanged (default: [`Backend::copy`] then
    /// [`Backend::rope`] on `dst`). Rows and positions as in `rope`; `dst` must not overlap `src`.
    fn rope_copy(
        &self,
        src: &Self::Buf,
        sr: Rows,
        dst: &Self::Buf,
        dr: Rows,
        heads_per_token: usize,
        batch: &Self::Batch,
        rope: &Self::Rope,
    ) {
        self.copy(src, sr, dst, dr);
        self.rope(dst, dr, heads_per_token, batch, rope);
    }
    /// The MLA cache write: per row of `x: [n_tokens, cache width]`, rms_norm the first
    /// `norm_width` values in place (weight `w`), rope the `rope.dim` values from column
    /// `norm_width` in place (one head per token), then [`Backend::cache_write`] the rows (the
    /// default: those three ops).
    #[allow(clippy::too_many_arguments)]
    fn norm_rope_cache_write(
        &self,
        x: &Self::Buf,
        xr: Rows,
        norm_width: usize,
        w: Option<&Self::Weight>,
        eps: f32,
        batch: &Self::Batch,
        rope: &Self::Rope,
        cache: &Self::Cache,
    ) {
        let nr = xr.cols(0, norm_width);
        self.rms_norm(x, nr, w, eps, x, nr);
        let rope_dim = xr.width - norm_width;
        self.rope(x, xr.cols(norm_width, rope_dim), 1, batch, rope);
        self.cache_write(cache, x, xr, batch);
    }
    /// [`Backend::norm_rope_cache_write`] of the latent rows `x` and [`Backend::rope_copy`] of
    /// the query's rope part (`q` rows `qr` -> `qd` rows `qdr`, `heads` rows per token) in one op
    /// (the default: those two ops). MLA needs both per layer; they read the same positions.
    /// With `absorb` = (W_uk, rows of `q`, rows of `qd`), also the absorbed query's product
    /// [`Backend::matmul_grouped`]`(q, src, W_uk, qd, dst)`, which reads only `q` (the default:
    /// after the other two).
    #[allow(clippy::too_many_arguments)]
    fn mla_rope_cache_write(
        &self,
        x: &Self::Buf,
        xr: Rows,
        norm_width: usize,
        w: Option<&Self::Weight>,
        eps: f32,
        (q, qr, qd, qdr, heads): (&Self::Buf, Rows, &Self::Buf, Rows, usize),
        absorb: Option<(&Self::Weight, Rows, Rows)>,
        batch: &Self::Batch,
        rope: &Self::Rope,
        cache: &Self::Cache,
    ) {
        self.norm_rope_cache_write(x, xr, norm_width, w, eps, batch, rope, cache);
        self.rope_copy(q, qr, qd, qdr, heads, batch, rope);
        if let Some((wk, src, dst)) = absorb {
            self.matmul_grouped(q, src, wk, qd, dst);
        }
    }
    /// An MLA layer's input side with a plain (not low-rank) q in one op: the layer's first norm
    /// and the two products that read it, `jobs` = `[(W_q, q, qo), (W_kv_a, kv, kvo)]`
    /// ([`Backend::add_rms_norm_matmul_many`] with `delta`, [`Backend::rms_norm_matmul_many`]
    /// without), then [`Backend::mla_rope_cache_write`] of `kv` (rows `kvo`, `norm_width` of
    /// them normed by `kv_w`) and of `q` (`q_rope`'s source must be `q`; `absorb`'s rows are
    /// rows of `q`). The default is those ops. `q` and `kv` are the chain's scratch, which a
    /// backend may leave unwritten (the CUDA backend, for a decode batch: one product for both
    /// matrices into scratch of its own, read from there; see [`Backend::join_products`]).
    #[allow(clippy::too_many_arguments)]
    fn norm_qkv_rope_cache(
        &self,
        (x, xr): (&Self::Buf, Rows),
        delta: Option<(&Self::Buf, Rows)>,
        w: Option<&Self::Weight>,
        eps: f32,
        (out, o): (&Self::Buf, Rows),
        jobs: [(&Self::Weight, &Self::Buf, Rows); 2],
        (norm_width, kv_w): (usize, Option<&Self::Weight>),
        q_rope: (&Self::Buf, Rows, &Self::Buf, Rows, usize),
        absorb: Option<(&Self::Weight, Rows, Rows)>,
        batch: &Self::Batch,
        rope: &Self::Rope,
        cache: &Self::Cache,
    ) {
        match delta {
            Some(d) => self.add_rms_norm_matmul_many((x, xr), d, w, eps, (out, o), &jobs),
            None => self.rms_norm_matmul_many((x, xr), w, eps, (out, o), &jobs),
        }
        let (_, kv, kvo) = jobs[1];
        self.mla_rope_cache_write(kv, kvo, norm_width, kv_w, eps, q_rope, absorb, batch, rope, cache);
    }
    /// A hint, at load, that the matrices `weights` (2-D, the same input width) multiply the same
    /// rows (an MLA layer's W_q and W_kv_a): a backend may store them side by side, so that one
    /// product serves all of them (the CUDA backend: their f16 copies in one allocation, for
    /// [`Backend::norm_qkv_rope_cache`]). Changes no result. Default: nothing.
    fn join_products(&self, weights: &mut [&mut Self::Weight]) {
        let _ = weights;
    }
    /// A hint that `weights` (up to eight, in the order the layer reads them; an attention's
    /// list names q or q_a, kv_a, W_uk, W_uv, W_o first) are read soon: a
    /// backend may start bringing them closer (the CUDA backend: into L2, from a one-token
    /// attention kernel, which leaves the memory bus mostly idle; a routed expert stack's first
    /// experts from a decode batch's attention merge, `TS_CUDA_XPF`). Changes no result.
    /// Default: nothing.
    fn prefetch_hint(&self, _weights: &[&Self::Weight]) {}
    /// The attention's output side of an MLA layer in one op: [`Backend::mla_attention`] of `q`
    /// into `lat`, the per-head value product `av = lat · W_uv` ([`Backend::matmul_grouped`] over
    /// rows `avr`), the output product `y = av · W_o` ([`Backend::matmul`], `av` read as rows
    /// `avo`: `[n, n_heads * v]`, `y` as rows `xr`), then [`Backend::add_rms_norm`]`(x, y, w, eps,
    /// out)`: the default is those four ops. `lat`, `av` and `y` are the chain's scratch, which a
    /// backend may leave unwritten (the CUDA backend, for one token: the merge of the context
    /// splits and both products in one kernel, whose per-head rows the norm adds). With `next`
    /// (the MoE router, its logits' rows, the routing), also the normed rows' product with the
    /// router into those rows ([`Backend::matmul`]`(out, o, router, ..)`, the default), which a
    /// backend may compute in the norm's launch; and a backend may route those logits there too,
    /// for the [`Backend::moe_shared`] of `out` and them that follows (the CUDA backend, for one
    /// token: CudaBackend's `pre_route`).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_out(
        &self,
        (q, qr): (&Self::Buf, Rows),
        cache: &Self::Cache,
        batch: &Self::Batch,
        p: &MlaParams,
        (w_uv, wo): (&Self::Weight, &Self::Weight),
        (lat, lr, av, avr, avo): (&Self::Buf, Rows, &Self::Buf, Rows, Rows),
        (x, xr, y): (&Self::Buf, Rows, &Self::Buf),
        w: Option<&Self::Weight>,
        eps: f32,
        out: &Self::Buf,
        o: Rows,
        next: Option<MoeNext<'_, Self::Weight, Self::Buf>>,
    ) {
        self.mla_attention(q, qr, cache, batch, p, lat, lr);
        self.matmul_grouped(lat, lr, w_uv, av, avr);
        self.matmul(av, avo, wo, y, xr);
        self.add_rms_norm(x, xr, y, xr, w, eps, out, o);
        if let Some(m) = next {
            self.matmul(out, o, m.router, m.logits.0, m.logits.1);
        }
    }
    /// Routed experts plus a shared FFN in one op: `out[r] = moe(x)[r] + down_s(glu(gate_s x[r],
    /// up_s x[r]))` with 2-D shared weights (`[H, ff_s]`, `[H, ff_s]`, `[ff_s, H]`). Returns false,
    /// having enqueued nothing, when the backend has no such path for these shapes (the default):
    /// the caller then runs [`Backend::moe`] and the shared FFN itself.
    #[allow(clippy::too_many_arguments)]
    fn moe_shared(
        &self,
        _x: &Self::Buf,
        _xr: Rows,
        _logits: &Self::Buf,
        _lr: Rows,
        _experts: Experts<'_, Self::Weight>,
        _shared: Experts<'_, Self::Weight>,
        _p: &MoeParams,
        _out: &Self::Buf,
        _o: Rows,
    ) -> bool {
        false
    }

    /// [`Backend::moe_shared`] with its result added into the residual rows: `res[r] += moe(x)[r]
    /// + shared(x)[r]`, the same bits as `moe_shared` into a buffer and then [`Backend::add`]
    /// (or the add inside the next [`Backend::add_rms_norm_matmul_many`]). Returns false, having
    /// enqueued nothing, when the backend has no such path for these shapes (the default): the
    /// caller then runs `moe_shared` into a buffer and adds it itself.
    #[allow(clippy::too_many_arguments)]
    fn moe_shared_residual(
        &self,
        _x: &Self::Buf,
        _xr: Rows,
        _logits: &Self::Buf,
        _lr: Rows,
        _experts: Experts<'_, Self::Weight>,
        _shared: Experts<'_, Self::Weight>,
        _p: &MoeParams,
        _res: &Self::Buf,
        _rr: Rows,
    ) -> bool {
        false
    }

    // ---- recorded steps (optional) --------------------------------------------------------------
    /// Start a forward step of `n_tokens` tokens whose sequence of ops (shapes, buffers, weights)
    /// is fully determined by `key`, per-step values (token ids, positions, slots) coming only
    /// from the batch uploaded before this call. Returns true when the backend replayed its
    /// recording of that step: the caller then enqueues none of the step's ops and does not call
    /// [`Backend::graph_end`]. Otherwise the caller enqueues the ops, then calls `graph_end`.
    /// The default records nothing (the CPU backend).
    fn graph_begin(&self, _key: u64, _n_tokens: usize) -> bool {
        false
    }
    /// What of a step's launches this backend decides from the batch's metadata beyond its token
    /// count, slot sharing and outputs (which the caller's `key` holds already): the caller mixes
    /// it into the [`Backend::graph_begin`] key, so a recording is replayed only for batches that
    /// would launch the same kernels. The CUDA backend: whether the MLA decode takes its
    /// long-context kernel. Default 0.
    fn graph_class(&self, _batch: &BatchMeta) -> u64 {
        0
    }
    /// End a step begun by a [`Backend::graph_begin`] that returned false. Returns false when the
    /// ops were being recorded but the recording could not be kept, in which case none of them
    /// ran and the caller must enqueue them again (without another `graph_begin`). Default: true.
    fn graph_end(&self) -> bool {
        true
    }

    /// How the steps bracketed by [`Backend::graph_begin`] / [`Backend::graph_end`] ran so far
    /// (a server's mixed batches each have their own key: this says how many found a
    /// recording). Default: all zero (the backend records nothing).
    fn step_counts(&self) -> StepCounts {
        StepCounts::default()
    }

    /// True when the backend sizes its own scratch (dequantised weights, MoE intermediates,
    /// recordings) on first use: the loader then runs one widest forward and one decode step at
    /// open, so all of it is allocated before the first real token. Default false (the CPU backend
    /// sizes everything at construction or per model buffer).
    fn warm_up_at_open(&self) -> bool {
        false
    }
}
