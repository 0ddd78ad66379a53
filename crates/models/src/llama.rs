//! # llama family (SmolLM2, Llama 2/3, Mistral-style dense models)
//!
//! ```text
//! x_0      = embed(tokens)                                   [n, H]
//! per layer l:
//!   h      = rmsnorm(x) * attn_norm
//!   q,k,v  = h Wq, h Wk, h Wv                                 [n, nh*d], [n, nkv*d], [n, nkv*d]
//!   q,k    = rope(q), rope(k)           (pairs (2i,2i+1) in GGUF files, (i,i+d/2) in HF folders)
//!   cache[slot, pos] <- k, v
//!   a      = softmax(q k^T / sqrt(d) + causal) v              per head; kv head = h / (nh/nkv)
//!   x      = x + a Wo
//!   h      = rmsnorm(x) * ffn_norm
//!   x      = x + (silu(h Wg) * (h Wu)) Wd
//! logits   = rmsnorm(x) * output_norm  W_out                  (W_out = embedding when tied)
//! ```
//! GGUF's llama converter permutes Wq/Wk so that rope pairs consecutive elements; HF folders keep
//! the original (NeoX-style halves) layout, so the rope mode follows the source.

use std::sync::Arc;

use ts_core::{AttnParams, Backend, BatchMeta, Glu, RopeMode, RopeSpec, Rows, WeightUse};
use ts_formats::TensorSource;

use crate::bind::Binder;
use crate::meta::Meta;
use crate::names::{Naming, HF_LLAMA};
use crate::{Model, ModelError, ModelInfo, Outputs, Result, RuntimeOptions};

/// Geometry and numerics of a llama model, validated at open.
#[derive(Debug, Clone)]
pub struct LlamaConfig {
    /// Hidden width `H`.
    pub n_embd: usize,
    pub n_layers: usize,
    /// Query heads `nh`.
    pub n_heads: usize,
    /// Key/value heads `nkv` (divides `nh`).
    pub n_kv_heads: usize,
    /// Width of one head `d` (`H / nh` unless the file says otherwise).
    pub head_dim: usize,
    /// FFN inner width.
    pub n_ff: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub eps: f32,
    pub rope_theta: f32,
    /// Rotated dims per head (≤ head_dim).
    pub rope_dim: usize,
    /// Linear rope scaling factor (positions divided by it); 1.0 = none.
    pub rope_linear: f32,
    pub rope_mode: RopeMode,
}

impl LlamaConfig {
    fn read(src: &dyn TensorSource) -> Result<(Self, Naming)> {
        let is_hf = src.metadata().keys().any(|k| k.starts_with("hf."));
        if is_hf {
            let m = Meta::new(src, "hf.");
            let n_embd = m.usize("hidden_size")?;
            let n_heads = m.usize("num_attention_heads")?;
            let head_dim = m.opt_usize("head_dim")?.unwrap_or(n_embd / n_heads.max(1));
            let cfg = LlamaConfig {
                n_embd,
                n_layers: m.usize("num_hidden_layers")?,
                n_heads,
                n_kv_heads: m.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
                head_dim,
                n_ff: m.usize("intermediate_size")?,
                n_vocab: m.usize("vocab_size")?,
                n_ctx_train: m.opt_usize("max_position_embeddings")?.unwrap_or(2048),
                eps: m.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
                rope_theta: m.opt_f64("rope_theta")?.unwrap_or(10000.0) as f32,
                rope_dim: head_dim,
                rope_linear: match m.opt_str("rope_scaling.type")?.or(m.opt_str("rope_scaling.rope_type")?) {
                    None | Some("default") => 1.0,
                    Some("linear") => m.f64("rope_scaling.factor")? as f32,
                    Some(other) => return Err(m.err(format!("rope_scaling type '{other}' is not supported for llama"))),
                },
                rope_mode: RopeMode::Neox,
            };
            cfg.validate(&m)?;
            return Ok((cfg, Naming::Hf));
        }
        let m = Meta::new(src, "llama.");
        let n_embd = m.usize("embedding_length")?;
        let n_heads = m.usize("attention.head_count")?;
        let head_dim = m.opt_usize("attention.key_length")?.unwrap_or(n_embd / n_heads.max(1));
        let tok = src.tensor("token_embd.weight");
        let n_vocab = match m.opt_usize("vocab_size")? {
            Some(v) => v,
            None => tok.map(|t| t.ne()[1]).ok_or_else(|| m.err("no llama.vocab_size and no token_embd.weight"))?,
        };
        let cfg = LlamaConfig {
            n_embd,
            n_layers: m.usize("block_count")?,
            n_heads,
            n_kv_heads: m.opt_usize("attention.head_count_kv")?.unwrap_or(n_heads),
            head_dim,
            n_ff: m.usize("feed_forward_length")?,
            n_vocab,
            n_ctx_train: m.opt_usize("context_length")?.unwrap_or(2048),
            eps: m.opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5) as f32,
            rope_theta: m.opt_f64("rope.freq_base")?.unwrap_or(10000.0) as f32,
            rope_dim: m.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
            rope_linear: match m.opt_str("rope.scaling.type")? {
                None | Some("none") => 1.0,
                Some("linear") => m.f64("rope.scaling.factor")? as f32,
                Some(other) => return Err(m.err(format!("llama.rope.scaling.type '{other}' is not supported"))),
            },
            rope_mode: RopeMode::Normal,
        };
        cfg.validate(&m)?;
        Ok((cfg, Naming::Gguf))
    }

    fn validate(&self, m: &Meta) -> Result<()> {
        let pos = [
            ("hidden size", self.n_embd),
            ("layers", self.n_layers),
            ("heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("ffn width", self.n_ff),
            ("vocab", self.n_vocab),
        ];
        for (what, v) in pos {
            if v == 0 || v > 1 << 24 {
                return Err(m.err(format!("{what} = {v} is out of range")));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(m.err(format!("{} heads are not a multiple of {} kv heads", self.n_heads, self.n_kv_heads)));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(m.err(format!("rope dimension {} must be even and at most the head dim {}", self.rope_dim, self.head_dim)));
        }
        if !(self.eps > 0.0 && self.eps < 1.0) || !(self.rope_theta > 0.0) || !(self.rope_linear > 0.0) {
            return Err(m.err("rms eps, rope base or rope scale out of range"));
        }
        Ok(())
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Weight,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    wo: B::Weight,
    ffn_norm: B::Weight,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
    /// `[n_slots * ctx, nkv*d]`
    k_cache: B::Cache,
    v_cache: B::Cache,
}

/// Activation scratch, sized at open for `max_batch` tokens.
struct Scratch<B: Backend> {
    /// Residual stream `[max_batch, H]`.
    x: B::Buf,
    /// Normed input `[max_batch, H]`; also the gathered output rows.
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    /// Attention output `[max_batch, nh*d]`.
    att: B::Buf,
    /// FFN gate/up `[max_batch, n_ff]`.
    g: B::Buf,
    u: B::Buf,
    /// `[max_batch, n_vocab]`
    logits: B::Buf,
}

pub struct Llama<B: Backend> {
    be: Arc<B>,
    cfg: LlamaConfig,
    info: ModelInfo,
    opts: RuntimeOptions,
    tok_embd: B::Weight,
    output_norm: B::Weight,
    /// `None` when tied to `tok_embd`.
    output: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    rope: B::Rope,
    batch: B::Batch,
    s: Scratch<B>,
}

impl<B: Backend> Llama<B> {
    pub fn open(src: &dyn TensorSource, be: Arc<B>, opts: RuntimeOptions) -> Result<Self> {
        let (cfg, naming) = LlamaConfig::read(src)?;
        let b = Binder::new(src, be.as_ref());
        let (h, d, nh, nkv, ff, v) = (cfg.n_embd, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_ff, cfg.n_vocab);
        // Tied embeddings (no output tensor): one upload serves both the lookup and the logits.
        let tied = !b.has(naming.global("out"));
        let tok_embd = b.get(naming.global("embd"), &[h, v], if tied { WeightUse::Matmul } else { WeightUse::Embedding })?;
        let output_norm = b.get(naming.global("norm"), &[h], WeightUse::Vector)?;
        let output = if tied { None } else { Some(b.get(naming.global("out"), &[h, v], WeightUse::Matmul)?) };
        let rows = opts.n_slots * opts.ctx;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |r: &str| naming.layer(l, r, HF_LLAMA);
            layers.push(Layer {
                attn_norm: b.get(&n("attn_norm"), &[h], WeightUse::Vector)?,
                wq: b.get(&n("attn_q"), &[h, nh * d], WeightUse::Matmul)?,
                wk: b.get(&n("attn_k"), &[h, nkv * d], WeightUse::Matmul)?,
                wv: b.get(&n("attn_v"), &[h, nkv * d], WeightUse::Matmul)?,
                wo: b.get(&n("attn_output"), &[nh * d, h], WeightUse::Matmul)?,
                ffn_norm: b.get(&n("ffn_norm"), &[h], WeightUse::Vector)?,
                w_gate: b.get(&n("ffn_gate"), &[h, ff], WeightUse::Matmul)?,
                w_up: b.get(&n("ffn_up"), &[h, ff], WeightUse::Matmul)?,
                w_down: b.get(&n("ffn_down"), &[ff, h], WeightUse::Matmul)?,
                k_cache: be.alloc_cache(rows, nkv * d)?,
                v_cache: be.alloc_cache(rows, nkv * d)?,
            });
        }
        let unused: Vec<String> = b.unused().into_iter().filter(|n| !n.contains("rope_freqs") && !n.contains("rotary_emb")).collect();
        if !unused.is_empty() {
            return Err(ModelError::Tensor {
                path: src.path().to_string(),
                tensor: unused[0].clone(),
                what: format!("not used by the llama forward ({} unused tensors): the file is not a plain llama model", unused.len()),
            });
        }
        let half = cfg.rope_dim / 2;
        let freqs = (0..half).map(|i| cfg.rope_theta.powf(-2.0 * i as f32 / cfg.rope_dim as f32) / cfg.rope_linear).collect();
        let rope = be.upload_rope(&RopeSpec { mode: cfg.rope_mode, dim: cfg.rope_dim, freqs, mscale: 1.0 })?;
        let mb = opts.max_batch;
        let s = Scratch {
            x: be.alloc(mb * h)?,
            h: be.alloc(mb * h)?,
            q: be.alloc(mb * nh * d)?,
            k: be.alloc(mb * nkv * d)?,
            v: be.alloc(mb * nkv * d)?,
            att: be.alloc(mb * nh * d)?,
            g: be.alloc(mb * ff)?,
            u: be.alloc(mb * ff)?,
            logits: be.alloc(mb * v)?,
        };
        let info = ModelInfo {
            arch: "llama".into(),
            name: src.metadata().get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string(),
            n_vocab: v,
            n_ctx_train: cfg.n_ctx_train,
            n_layers: cfg.n_layers,
            n_embd: h,
            n_params: *b.n_params.borrow(),
            weight_bytes: *b.bytes.borrow(),
            weight_copy_bytes: *b.copy_bytes.borrow(),
            cache_bytes_per_token: (cfg.n_layers * 2 * nkv * d * 4) as u64,
            batch_invariant: b.batch_invariant.get(),
            details: vec![
                ("heads".into(), format!("{nh} query, {nkv} kv, head dim {d}")),
                ("ffn".into(), format!("SwiGLU, width {ff}")),
                ("rope".into(), format!("{:?} pairs, base {}, {} dims", cfg.rope_mode, cfg.rope_theta, cfg.rope_dim)),
            ],
        };
        let batch = be.alloc_batch(mb)?;
        Ok(Llama { be, cfg, info, opts, tok_embd, output_norm, output, layers, rope, batch, s })
    }
}

impl<B: Backend> Model for Llama<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }
    fn options(&self) -> RuntimeOptions {
        self.opts
    }
    fn chains_argmax(&self) -> bool {
        self.be.chains_argmax()
    }
    fn argmax_collect(&mut self, out: &mut [u32]) -> Result<()> {
        Ok(self.be.argmax_collect(out)?)
    }
    fn step_counts(&self) -> ts_core::StepCounts {
        self.be.step_counts()
    }
    fn copy_prefix(&mut self, src: u32, dst: u32, n: usize) -> Result<()> {
        let (s0, d0) = crate::prefix_rows(&self.opts, src, dst, n)?;
        let w = self.cfg.n_kv_heads * self.cfg.head_dim;
        for l in &self.layers {
            self.be.cache_copy(&l.k_cache, w, s0, d0, n)?;
            self.be.cache_copy(&l.v_cache, w, s0, d0, n)?;
        }
        Ok(())
    }

    fn forward_outputs(&mut self, batch: &BatchMeta, mut out: Outputs<'_>) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        check_batch(batch, &self.opts, c.n_vocab, &out, self.be.chains_argmax())?;
        let be = self.be.as_ref();
        let s = &self.s;
        let (h, d, nh, nkv, ff) = (c.n_embd, c.head_dim, c.n_heads, c.n_kv_heads, c.n_ff);
        be.upload_batch(batch, &mut self.batch)?;
        let bt = &self.batch;
        let rx = Rows::packed(n, h);
        be.embed(&self.tok_embd, bt, 1.0, &s.x, rx);
        let attn =
            AttnParams { n_heads: nh, n_kv_heads: nkv, head_dim: d, v_dim: d, scale: 1.0 / (d as f32).sqrt(), window: None, softcap: None };
        for l in &self.layers {
            be.rms_norm(&s.x, rx, Some(&l.attn_norm), c.eps, &s.h, rx);
            let (rq, rk) = (Rows::packed(n, nh * d), Rows::packed(n, nkv * d));
            be.matmul_many(&s.h, rx, &[(&l.wq, &s.q, rq), (&l.wk, &s.k, rk), (&l.wv, &s.v, rk)]);
            be.rope(&s.q, rq.split(nh), nh, bt, &self.rope);
            be.rope(&s.k, rk.split(nkv), nkv, bt, &self.rope);
            be.cache_write(&l.k_cache, &s.k, rk, bt);
            be.cache_write(&l.v_cache, &s.v, rk, bt);
            be.attention(&s.q, rq, &l.k_cache, &l.v_cache, bt, &attn, &s.att, rq);
            be.matmul(&s.att, rq, &l.wo, &s.h, rx);
            be.add(&s.x, rx, &s.h, rx, &s.x, rx);
            be.rms_norm(&s.x, rx, Some(&l.ffn_norm), c.eps, &s.h, rx);
            let rf = Rows::packed(n, ff);
            be.matmul_many(&s.h, rx, &[(&l.w_gate, &s.g, rf), (&l.w_up, &s.u, rf)]);
            be.glu(Glu::SwiGlu, &s.g, rf, &s.u, rf, &s.g, rf);
            be.matmul(&s.g, rf, &l.w_down, &s.h, rx);
            be.add(&s.x, rx, &s.h, rx, &s.x, rx);
        }
        output_logits(
            be,
            &s.x,
            h,
            batch,
            bt,
            &s.h,
            &self.output_norm,
            c.eps,
            self.output.as_ref().unwrap_or(&self.tok_embd),
            &s.logits,
            c.n_vocab,
            &mut out,
        )
    }
}

/// Checks every family's forward makes before touching the device.
/// `chain`: the backend takes [`ts_core::TOKEN_FROM_ARGMAX`] tokens (it checks their rows).
pub(crate) fn check_batch(batch: &BatchMeta, o: &RuntimeOptions, n_vocab: usize, out: &Outputs<'_>, chain: bool) -> Result<()> {
    let n = batch.len();
    if n == 0 || n > o.max_batch {
        return Err(ModelError::Run(format!("batch of {n} tokens (1..={} allowed)", o.max_batch)));
    }
    if batch.slot_len as usize != o.ctx {
        return Err(ModelError::Run(format!("batch slot length {} != the cache's {}", batch.slot_len, o.ctx)));
    }
    for t in &batch.tokens {
        if t.token as usize >= n_vocab && !(chain && t.token >= ts_core::TOKEN_FROM_ARGMAX) {
            return Err(ModelError::Run(format!("token id {} is outside the vocabulary ({n_vocab})", t.token)));
        }
        if t.pos as usize >= o.ctx {
            return Err(ModelError::Run(format!("position {} is beyond the context length {}", t.pos, o.ctx)));
        }
        if t.slot as usize >= o.n_slots {
            return Err(ModelError::Run(format!("cache slot {} does not exist ({} slots)", t.slot, o.n_slots)));
        }
    }
    if batch.outputs.iter().any(|&i| i as usize >= n) {
        return Err(ModelError::Run("an output index is outside the batch".into()));
    }
    out.check(batch.outputs.len(), n_vocab)
}

/// Gather the output rows of the residual stream `x` (`bt`: the uploaded batch), norm them,
/// project to the vocabulary and hand them over (`out`). `tmp` must hold `outputs.len() * h` values.
#[allow(clippy::too_many_arguments)]
pub(crate) fn output_logits<B: Backend>(
    be: &B,
    x: &B::Buf,
    h: usize,
    batch: &BatchMeta,
    bt: &B::Batch,
    tmp: &B::Buf,
    norm: &B::Weight,
    eps: f32,
    output: &B::Weight,
    logits_buf: &B::Buf,
    n_vocab: usize,
    out: &mut Outputs<'_>,
) -> Result<()> {
    let no = batch.outputs.len();
    if no == 0 {
        return Ok(());
    }
    let ro = Rows::packed(no, h);
    be.gather_outputs(x, Rows::packed(batch.len(), h), bt, tmp, ro);
    be.rms_norm(tmp, ro, Some(norm), eps, tmp, ro);
    let rl = Rows::packed(no, n_vocab);
    be.matmul(tmp, ro, output, logits_buf, rl);
    out.deliver(be, logits_buf, rl, 0)
}
