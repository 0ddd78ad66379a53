//! # gemma3 family (Gemma 3 text models: 270M, 1B, and the text stack of 4B/12B/27B)
//!
//! ```text
//! x_0      = embed(tokens) * sqrt(H)                 (scaled in f32 after the lookup, as llama.cpp)
//! per layer l:
//!   h      = rmsnorm(x) * attn_norm
//!   q,k,v  = h Wq, h Wk, h Wv                        [n, nh*d], [n, nkv*d], [n, nkv*dv]
//!   q,k    = rmsnorm_per_head(q) * q_norm, rmsnorm_per_head(k) * k_norm      (weights [d])
//!   q,k    = rope_neox(q), rope_neox(k)              local layers: base 10000, no scaling
//!                                                    global layers: rope.freq_base, linear scaling
//!   cache[slot, pos] <- k, v
//!   a      = softmax(scale * q k^T + mask) v         local layers: sliding window (pos > p - W)
//!                                                    global layers: causal only
//!   x      = x + rmsnorm(a Wo) * attn_post_norm      (sandwich norm)
//!   h      = rmsnorm(x) * ffn_norm
//!   x      = x + rmsnorm((gelu_tanh(h Wg) * (h Wu)) Wd) * ffn_post_norm
//! logits   = rmsnorm(x) * output_norm  W_out          (W_out = embedding when tied)
//! logits   = cap * tanh(logits / cap)                 only when final_logit_softcapping is set
//! ```
//!
//! ## Norm weights
//! Gemma's RMSNorm multiplies by `(1 + w)`. llama.cpp's converter stores `w + 1` in the GGUF
//! (`gemma3.270m`: `blk.0.attn_norm.weight` values sit around 1, not 0), so GGUF weights are used
//! as stored; HF checkpoints store `w` and get `1 +` added at open (in f32). transformers' GGUF
//! loader subtracts the 1 again and computes `x * (1 + w)`, so both see the same effective weights.
//!
//! ## Layer pattern
//! As llama.cpp's gemma3 (`set_swa_pattern(6)`) and transformers (`sliding_window_pattern = 6`):
//! layer `il` is global when `(il + 1) % 6 == 0`, local (sliding window) otherwise. A GGUF
//! `gemma3.attention.sliding_window_pattern` (an integer period, or one bool per layer, true =
//! sliding) and an HF `layer_types` list override it.
//!
//! ## Attention scale
//! transformers uses `query_pre_attn_scalar ** -0.5`. GGUF has no key for it: llama.cpp uses
//! `1/sqrt(key_length)` except for the 27B (62 layers), where it is `1/sqrt(n_embd / n_head)`;
//! the same rule is applied here, and a `gemma3.attention.scale` key (a direct multiplier) wins.

use std::sync::Arc;

use ts_core::{AttnParams, Backend, BatchMeta, Glu, RopeMode, RopeSpec, Rows, WeightUse};
use ts_formats::{GgmlType, TensorData, TensorSource, Value};

use crate::bind::Binder;
use crate::llama::check_batch;
use crate::meta::Meta;
use crate::names::{Naming, HF_GEMMA3};
use crate::{Model, ModelError, ModelInfo, Outputs, Result, RuntimeOptions};

/// Layers between global layers, counting the global one (llama.cpp / transformers default).
const DEFAULT_SWA_PERIOD: usize = 6;
/// Local layers' rope base (llama.cpp hard-codes it for gemma3; HF `rope_local_base_freq`).
const DEFAULT_LOCAL_ROPE_BASE: f64 = 10_000.0;
/// Output rows projected to the vocabulary per matmul (bounds the logits scratch: the vocabulary
/// is 262144 wide, so `max_batch` rows would cost 1 MiB per row).
const OUT_CHUNK: usize = 16;

/// Geometry and numerics of a Gemma 3 text model, validated at open.
#[derive(Debug, Clone)]
pub struct Gemma3Config {
    /// Hidden width `H`.
    pub n_embd: usize,
    pub n_layers: usize,
    /// Query heads `nh`.
    pub n_heads: usize,
    /// Key/value heads `nkv` (divides `nh`).
    pub n_kv_heads: usize,
    /// Width of one q/k head `d` (`attention.key_length`; 256 in every Gemma 3).
    pub head_dim: usize,
    /// Width of one v head (`attention.value_length`, defaults to `head_dim`).
    pub v_dim: usize,
    /// FFN inner width.
    pub n_ff: usize,
    pub n_vocab: usize,
    /// Context length the model was trained for (tokens).
    pub n_ctx_train: usize,
    /// RMSNorm epsilon (all norms, including the per-head q/k norms).
    pub eps: f32,
    /// `is_global[l]`: layer `l` attends causally over the whole context; otherwise it uses the
    /// sliding window.
    pub is_global: Vec<bool>,
    /// Sliding window `W` in tokens: a local layer's token at position `p` sees positions `> p - W`.
    pub window: u32,
    /// Rope base of the global layers (`rope.freq_base`).
    pub rope_base_global: f32,
    /// Linear rope scaling of the global layers (positions divided by it); 1.0 = none.
    pub rope_linear_global: f32,
    /// Rope base of the local layers (10000 unless `rope.freq_base_swa` says otherwise).
    pub rope_base_local: f32,
    /// Multiplies q·k before the softmax.
    pub attn_scale: f32,
    /// Attention score soft-capping (Gemma 2 style); `None` in every Gemma 3 released.
    pub attn_softcap: Option<f32>,
    /// Final logit soft-capping `cap * tanh(logits / cap)`; `None` when absent (Gemma 3 270M).
    pub final_softcap: Option<f32>,
    /// Embedding multiplier, `sqrt(H)` rounded to f32.
    pub embed_scale: f32,
    /// Added to every norm weight at open: 0 for GGUF (the converter stored `w + 1`), 1 for HF.
    pub norm_offset: f32,
}

/// The default pattern: global when `(il + 1) % period == 0`.
fn periodic(n_layers: usize, period: usize) -> Vec<bool> {
    (0..n_layers).map(|il| (il + 1) % period == 0).collect()
}

fn positive(m: &Meta, key: &str, v: Option<f64>) -> Result<Option<f32>> {
    match v {
        Some(x) if !(x > 0.0 && x.is_finite()) => Err(m.err(format!("{}{key} = {x} must be positive", m.prefix))),
        other => Ok(other.map(|x| x as f32)),
    }
}

impl Gemma3Config {
    fn read(src: &dyn TensorSource) -> Result<(Self, Naming)> {
        if src.metadata().keys().any(|k| k.starts_with("hf.")) {
            return Self::read_hf(src).map(|c| (c, Naming::Hf));
        }
        let m = Meta::new(src, "gemma3.");
        let n_embd = m.usize("embedding_length")?;
        let n_heads = m.usize("attention.head_count")?;
        let n_layers = m.usize("block_count")?;
        let head_dim = m.opt_usize("attention.key_length")?.unwrap_or(n_embd / n_heads.max(1));
        let n_vocab = match m.opt_usize("vocab_size")? {
            Some(v) => v,
            None => {
                src.tensor("token_embd.weight").map(|t| t.ne()[1]).ok_or_else(|| m.err("no gemma3.vocab_size and no token_embd.weight"))?
            }
        };
        let is_global = match m.raw("attention.sliding_window_pattern") {
            None => periodic(n_layers, DEFAULT_SWA_PERIOD),
            Some(v) => {
                let key = "gemma3.attention.sliding_window_pattern";
                if let Some(p) = v.as_u64() {
                    if p == 0 {
                        return Err(m.err(format!("{key} = 0: a period of at least 1 is needed")));
                    }
                    periodic(n_layers, p as usize)
                } else if let Some(a) = v.as_array() {
                    if a.len() != n_layers {
                        return Err(m.err(format!("{key} has {} entries for {n_layers} layers", a.len())));
                    }
                    // One bool per layer, true = sliding window (llama.cpp's swa_layers).
                    a.iter()
                        .map(|x| {
                            x.as_bool().map(|swa| !swa).ok_or_else(|| m.err(format!("{key} entries must be bools, found {}", x.short())))
                        })
                        .collect::<Result<_>>()?
                } else {
                    return Err(m.err(format!("{key} must be an integer period or one bool per layer, found {}", v.short())));
                }
            }
        };
        let rope_linear_global = match m.opt_str("rope.scaling.type")? {
            None | Some("none") => 1.0,
            Some("linear") => positive(&m, "rope.scaling.factor", Some(m.f64("rope.scaling.factor")?))?.unwrap_or(1.0),
            Some(other) => return Err(m.err(format!("gemma3.rope.scaling.type '{other}' is not supported (none, linear)"))),
        };
        let attn_scale = match positive(&m, "attention.scale", m.opt_f64("attention.scale")?)? {
            Some(s) => s,
            // llama.cpp: the 27B uses query_pre_attn_scalar = n_embd / n_head.
            None if n_layers == 62 => 1.0 / ((n_embd / n_heads.max(1)) as f32).sqrt(),
            None => 1.0 / (head_dim as f32).sqrt(),
        };
        let cfg = Gemma3Config {
            n_embd,
            n_layers,
            n_heads,
            n_kv_heads: m.opt_usize("attention.head_count_kv")?.unwrap_or(n_heads),
            head_dim,
            v_dim: m.opt_usize("attention.value_length")?.unwrap_or(head_dim),
            n_ff: m.usize("feed_forward_length")?,
            n_vocab,
            n_ctx_train: m.opt_usize("context_length")?.unwrap_or(32768),
            eps: m.opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6) as f32,
            window: u32::try_from(m.usize("attention.sliding_window")?)
                .map_err(|_| m.err("gemma3.attention.sliding_window is too large"))?,
            is_global,
            rope_base_global: positive(&m, "rope.freq_base", m.opt_f64("rope.freq_base")?)?.unwrap_or(1_000_000.0),
            rope_linear_global,
            rope_base_local: positive(&m, "rope.freq_base_swa", m.opt_f64("rope.freq_base_swa")?)?
                .unwrap_or(DEFAULT_LOCAL_ROPE_BASE as f32),
            attn_scale,
            attn_softcap: positive(&m, "attn_logit_softcapping", m.opt_f64("attn_logit_softcapping")?)?,
            final_softcap: positive(&m, "final_logit_softcapping", m.opt_f64("final_logit_softcapping")?)?,
            embed_scale: (n_embd as f64).sqrt() as f32,
            norm_offset: 0.0,
        };
        if let Some(rd) = m.opt_usize("rope.dimension_count")? {
            if rd != head_dim {
                return Err(
                    m.err(format!("gemma3.rope.dimension_count = {rd}: only full-head rope (= key_length {head_dim}) is supported"))
                );
            }
        }
        cfg.validate(&m)?;
        Ok((cfg, Naming::Gguf))
    }

    /// `Gemma3ForCausalLM` `config.json` (`model_type` "gemma3_text").
    fn read_hf(src: &dyn TensorSource) -> Result<Self> {
        let m = Meta::new(src, "hf.");
        if m.raw("text_config.hidden_size").is_some() {
            return Err(m.err("a multimodal Gemma3ForConditionalGeneration checkpoint (hf.text_config): only the text-only Gemma3ForCausalLM layout is supported"));
        }
        match m.opt_str("hidden_activation")?.or(m.opt_str("hidden_act")?) {
            None | Some("gelu_pytorch_tanh") | Some("gelu_tanh") => {}
            Some(other) => return Err(m.err(format!("hf.hidden_activation '{other}' is not supported (gelu_pytorch_tanh)"))),
        }
        if m.opt_bool("use_bidirectional_attention")? == Some(true) {
            return Err(m.err("hf.use_bidirectional_attention = true (embedding variant) is not supported"));
        }
        let n_embd = m.usize("hidden_size")?;
        let n_heads = m.usize("num_attention_heads")?;
        let n_layers = m.usize("num_hidden_layers")?;
        let head_dim = m.opt_usize("head_dim")?.unwrap_or(256);
        let is_global = match m.raw("layer_types") {
            Some(v) => {
                let a = v.as_array().ok_or_else(|| m.err(format!("hf.layer_types must be a list, found {}", v.short())))?;
                if a.len() != n_layers {
                    return Err(m.err(format!("hf.layer_types has {} entries for {n_layers} layers", a.len())));
                }
                a.iter()
                    .map(|x| match x.as_str() {
                        Some("full_attention") => Ok(true),
                        Some("sliding_attention") => Ok(false),
                        _ => Err(m.err(format!("hf.layer_types entry {} is not supported (full_attention, sliding_attention)", x.short()))),
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                let p = m.opt_usize("sliding_window_pattern")?.unwrap_or(DEFAULT_SWA_PERIOD);
                if p == 0 {
                    return Err(m.err("hf.sliding_window_pattern = 0: a period of at least 1 is needed"));
                }
                periodic(n_layers, p)
            }
        };
        // Rope: the new `rope_parameters.{full,sliding}_attention` layout or the older
        // `rope_theta` / `rope_local_base_freq` / `rope_scaling` keys.
        let rope_type = |prefix: &str| -> Result<Option<&str>> {
            Ok(m.opt_str(&format!("{prefix}rope_type"))?.or(m.opt_str(&format!("{prefix}type"))?))
        };
        let (full, slide) = ("rope_parameters.full_attention.", "rope_parameters.sliding_attention.");
        let rope_base_global = m.opt_f64(&format!("{full}rope_theta"))?.or(m.opt_f64("rope_theta")?).unwrap_or(1_000_000.0);
        let rope_base_local =
            m.opt_f64(&format!("{slide}rope_theta"))?.or(m.opt_f64("rope_local_base_freq")?).unwrap_or(DEFAULT_LOCAL_ROPE_BASE);
        let linear = |prefix: &str| -> Result<f64> {
            match rope_type(prefix)? {
                None | Some("default") => Ok(1.0),
                Some("linear") => m.f64(&format!("{prefix}factor")),
                Some(other) => Err(m.err(format!("hf.{prefix}rope_type '{other}' is not supported (default, linear)"))),
            }
        };
        let rope_linear_global = if m.raw(&format!("{full}rope_type")).is_some() || m.raw(&format!("{full}type")).is_some() {
            linear(full)?
        } else {
            linear("rope_scaling.")?
        };
        if m.raw(&format!("{slide}rope_type")).is_some() && linear(slide)? != 1.0 {
            return Err(m.err("hf.rope_parameters.sliding_attention: scaled rope on the local layers is not supported"));
        }
        let qpas = m.opt_f64("query_pre_attn_scalar")?.unwrap_or(256.0);
        let cfg = Gemma3Config {
            n_embd,
            n_layers,
            n_heads,
            n_kv_heads: m.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
            head_dim,
            v_dim: head_dim,
            n_ff: m.usize("intermediate_size")?,
            n_vocab: m.usize("vocab_size")?,
            n_ctx_train: m.opt_usize("max_position_embeddings")?.unwrap_or(32768),
            eps: m.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            window: u32::try_from(m.opt_usize("sliding_window")?.unwrap_or(4096)).map_err(|_| m.err("hf.sliding_window is too large"))?,
            is_global,
            rope_base_global: positive(&m, "rope_theta", Some(rope_base_global))?.unwrap_or(1.0),
            rope_linear_global: positive(&m, "rope_scaling.factor", Some(rope_linear_global))?.unwrap_or(1.0),
            rope_base_local: positive(&m, "rope_local_base_freq", Some(rope_base_local))?.unwrap_or(1.0),
            attn_scale: 1.0 / positive(&m, "query_pre_attn_scalar", Some(qpas))?.unwrap_or(1.0).sqrt(),
            attn_softcap: positive(&m, "attn_logit_softcapping", m.opt_f64("attn_logit_softcapping")?)?,
            final_softcap: positive(&m, "final_logit_softcapping", m.opt_f64("final_logit_softcapping")?)?,
            embed_scale: (n_embd as f64).sqrt() as f32,
            norm_offset: 1.0,
        };
        cfg.validate(&m)?;
        Ok(cfg)
    }

    fn validate(&self, m: &Meta) -> Result<()> {
        let pos = [
            ("hidden size", self.n_embd),
            ("layers", self.n_layers),
            ("heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("v head dim", self.v_dim),
            ("ffn width", self.n_ff),
            ("vocab", self.n_vocab),
            ("sliding window", self.window as usize),
        ];
        for (what, v) in pos {
            if v == 0 || v > 1 << 24 {
                return Err(m.err(format!("{what} = {v} is out of range")));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(m.err(format!("{} heads are not a multiple of {} kv heads", self.n_heads, self.n_kv_heads)));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(m.err(format!("head dim {} must be even for rope", self.head_dim)));
        }
        if !(self.eps > 0.0 && self.eps < 1.0) {
            return Err(m.err(format!("rms eps {} out of range", self.eps)));
        }
        Ok(())
    }

    fn rope_spec(&self, base: f32, linear: f32) -> RopeSpec {
        let d = self.head_dim;
        let freqs = (0..d / 2).map(|i| ((base as f64).powf(-2.0 * i as f64 / d as f64) / linear as f64) as f32).collect();
        RopeSpec { mode: RopeMode::Neox, dim: d, freqs, mscale: 1.0 }
    }
}

struct Layer<B: Backend> {
    /// Global (causal over the whole context) or local (sliding window).
    global: bool,
    /// `[H]` each (effective `1 + w`).
    attn_norm: B::Weight,
    /// `[H, nh*d]`, `[H, nkv*d]`, `[H, nkv*dv]`
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    /// `[d]`, applied to every head.
    q_norm: B::Weight,
    k_norm: B::Weight,
    /// `[nh*dv, H]`
    wo: B::Weight,
    /// `[H]`
    post_attn_norm: B::Weight,
    ffn_norm: B::Weight,
    /// `[H, ff]`, `[H, ff]`, `[ff, H]`
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
    /// `[H]`
    post_ffn_norm: B::Weight,
    /// `[n_slots * ctx, nkv*d]` and `[n_slots * ctx, nkv*dv]`
    k_cache: B::Cache,
    v_cache: B::Cache,
}

/// Activation scratch, sized at open for `max_batch` tokens.
struct Scratch<B: Backend> {
    /// Residual stream `[max_batch, H]`.
    x: B::Buf,
    /// Normed input / branch output `[max_batch, H]`; also the gathered output rows.
    h: B::Buf,
    /// `[max_batch, nh*d]`, `[max_batch, nkv*d]`, `[max_batch, nkv*dv]`
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    /// Attention output `[max_batch, nh*dv]`.
    att: B::Buf,
    /// FFN gate/up `[max_batch, n_ff]`.
    g: B::Buf,
    u: B::Buf,
    /// `[min(max_batch, OUT_CHUNK), n_vocab]`
    logits: B::Buf,
}

pub struct Gemma3<B: Backend> {
    be: Arc<B>,
    cfg: Gemma3Config,
    info: ModelInfo,
    opts: RuntimeOptions,
    /// `[H, n_vocab]`, looked up by token.
    tok_embd: B::Weight,
    output_norm: B::Weight,
    /// `[H, n_vocab]`; `None` when tied to `tok_embd` (one upload serves both).
    output: Option<B::Weight>,
    layers: Vec<Layer<B>>,
    rope_local: B::Rope,
    rope_global: B::Rope,
    batch: B::Batch,
    s: Scratch<B>,
}

/// Bind a norm weight `[len]`, adding `offset` (HF stores `w`, the forward needs `1 + w`).
fn norm_weight<B: Backend>(b: &Binder<'_, B>, name: &str, len: usize, offset: f32) -> Result<B::Weight> {
    if offset == 0.0 {
        return b.get(name, &[len], WeightUse::Vector);
    }
    let t = b.raw(name, &[len])?;
    let mut v = vec![0f32; len];
    ts_formats::quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| b.err(name, e.to_string()))?;
    let bytes: Vec<u8> = v.iter().flat_map(|x| (x + offset).to_le_bytes()).collect();
    let shape = [len];
    b.upload(&TensorData { name, dtype: GgmlType::F32, shape: &shape, data: &bytes, keep: None }, WeightUse::Vector)
}

impl<B: Backend> Gemma3<B> {
    pub fn open(src: &dyn TensorSource, be: Arc<B>, opts: RuntimeOptions) -> Result<Self> {
        let (cfg, naming) = Gemma3Config::read(src)?;
        let b = Binder::new(src, be.as_ref());
        let (h, d, dv, nh, nkv, ff, v) = (cfg.n_embd, cfg.head_dim, cfg.v_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_ff, cfg.n_vocab);
        let off = cfg.norm_offset;
        // Tied embeddings (no output tensor): one upload serves both the lookup and the logits.
        let tied = !b.has(naming.global("out"));
        let tok_embd = b.get(naming.global("embd"), &[h, v], if tied { WeightUse::Matmul } else { WeightUse::Embedding })?;
        let output_norm = norm_weight(&b, naming.global("norm"), h, off)?;
        let output = if tied { None } else { Some(b.get(naming.global("out"), &[h, v], WeightUse::Matmul)?) };
        let rows = opts.n_slots * opts.ctx;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |r: &str| naming.layer(l, r, HF_GEMMA3);
            layers.push(Layer {
                global: cfg.is_global[l],
                attn_norm: norm_weight(&b, &n("attn_norm"), h, off)?,
                wq: b.get(&n("attn_q"), &[h, nh * d], WeightUse::Matmul)?,
                wk: b.get(&n("attn_k"), &[h, nkv * d], WeightUse::Matmul)?,
                wv: b.get(&n("attn_v"), &[h, nkv * dv], WeightUse::Matmul)?,
                q_norm: norm_weight(&b, &n("attn_q_norm"), d, off)?,
                k_norm: norm_weight(&b, &n("attn_k_norm"), d, off)?,
                wo: b.get(&n("attn_output"), &[nh * dv, h], WeightUse::Matmul)?,
                post_attn_norm: norm_weight(&b, &n("post_attention_norm"), h, off)?,
                ffn_norm: norm_weight(&b, &n("ffn_norm"), h, off)?,
                w_gate: b.get(&n("ffn_gate"), &[h, ff], WeightUse::Matmul)?,
                w_up: b.get(&n("ffn_up"), &[h, ff], WeightUse::Matmul)?,
                w_down: b.get(&n("ffn_down"), &[ff, h], WeightUse::Matmul)?,
                post_ffn_norm: norm_weight(&b, &n("post_ffw_norm"), h, off)?,
                k_cache: be.alloc_cache(rows, nkv * d)?,
                v_cache: be.alloc_cache(rows, nkv * dv)?,
            });
        }
        let unused: Vec<String> = b.unused().into_iter().filter(|n| !n.contains("rope_freqs") && !n.contains("rotary_emb")).collect();
        if !unused.is_empty() {
            return Err(ModelError::Tensor {
                path: src.path().to_string(),
                tensor: unused[0].clone(),
                what: format!(
                    "not used by the gemma3 forward ({} unused tensors): the file is not a plain Gemma 3 text model",
                    unused.len()
                ),
            });
        }
        let rope_local = be.upload_rope(&cfg.rope_spec(cfg.rope_base_local, 1.0))?;
        let rope_global = be.upload_rope(&cfg.rope_spec(cfg.rope_base_global, cfg.rope_linear_global))?;
        let mb = opts.max_batch;
        let s = Scratch {
            x: be.alloc(mb * h)?,
            h: be.alloc(mb * h)?,
            q: be.alloc(mb * nh * d)?,
            k: be.alloc(mb * nkv * d)?,
            v: be.alloc(mb * nkv * dv)?,
            att: be.alloc(mb * nh * dv)?,
            g: be.alloc(mb * ff)?,
            u: be.alloc(mb * ff)?,
            logits: be.alloc(mb.min(OUT_CHUNK) * v)?,
        };
        let n_global = cfg.is_global.iter().filter(|&&g| g).count();
        let globals: Vec<String> = cfg.is_global.iter().enumerate().filter(|(_, &g)| g).map(|(i, _)| i.to_string()).collect();
        let cap = |c: Option<f32>| c.map_or("none".to_string(), |c| c.to_string());
        let info = ModelInfo {
            arch: "gemma3".into(),
            name: src.metadata().get("general.name").and_then(Value::as_str).unwrap_or("").to_string(),
            n_vocab: v,
            n_ctx_train: cfg.n_ctx_train,
            n_layers: cfg.n_layers,
            n_embd: h,
            n_params: *b.n_params.borrow(),
            weight_bytes: *b.bytes.borrow(),
            weight_copy_bytes: *b.copy_bytes.borrow(),
            cache_bytes_per_token: (cfg.n_layers * nkv * (d + dv) * 4) as u64,
            batch_invariant: b.batch_invariant.get(),
            details: vec![
                ("heads".into(), format!("{nh} query, {nkv} kv, head dim {d} (v {dv}), q/k RMSNorm per head, scale {:.6}", cfg.attn_scale)),
                (
                    "attention".into(),
                    format!(
                        "{} local (sliding window {}), {n_global} global (layers {})",
                        cfg.n_layers - n_global,
                        cfg.window,
                        globals.join(",")
                    ),
                ),
                (
                    "rope".into(),
                    format!(
                        "NeoX halves, local base {}, global base {} (linear scale {})",
                        cfg.rope_base_local, cfg.rope_base_global, cfg.rope_linear_global
                    ),
                ),
                ("ffn".into(), format!("GeGLU (gelu tanh), width {ff}")),
                (
                    "norms".into(),
                    format!(
                        "RMSNorm eps {}, sandwich (pre + post attention/FFN), weights {}",
                        cfg.eps,
                        if off == 0.0 { "stored as 1+w (GGUF)" } else { "stored as w, 1 added at open (HF)" }
                    ),
                ),
                (
                    "embedding".into(),
                    format!("scaled by sqrt({h}) = {:.4}, output {}", cfg.embed_scale, if tied { "tied" } else { "separate" }),
                ),
                ("softcap".into(), format!("attention {}, final logits {}", cap(cfg.attn_softcap), cap(cfg.final_softcap))),
            ],
        };
        let batch = be.alloc_batch(mb)?;
        Ok(Gemma3 { be, cfg, info, opts, tok_embd, output_norm, output, layers, rope_local, rope_global, batch, s })
    }

    /// Gather the output rows of `x`, norm them, project to the vocabulary (in chunks of
    /// [`OUT_CHUNK`] rows), soft-cap when configured, and read the logits back.
    fn output_logits(&self, batch: &BatchMeta, out: &mut Outputs<'_>) -> Result<()> {
        let (be, s, c) = (self.be.as_ref(), &self.s, &self.cfg);
        let (h, nv) = (c.n_embd, c.n_vocab);
        let no = batch.outputs.len();
        if no == 0 {
            return Ok(());
        }
        let ro = Rows::packed(no, h);
        be.gather_outputs(&s.x, Rows::packed(batch.len(), h), &self.batch, &s.h, ro);
        be.rms_norm(&s.h, ro, Some(&self.output_norm), c.eps, &s.h, ro);
        let chunk = self.opts.max_batch.min(OUT_CHUNK);
        for i0 in (0..no).step_by(chunk) {
            let m = chunk.min(no - i0);
            let rl = Rows::packed(m, nv);
            be.matmul(&s.h, ro.rows(i0, m), self.output.as_ref().unwrap_or(&self.tok_embd), &s.logits, rl);
            if let Some(cap) = c.final_softcap {
                be.softcap(&s.logits, rl, cap);
            }
            out.deliver(be, &s.logits, rl, i0)?;
        }
        Ok(())
    }
}

impl<B: Backend> Model for Gemma3<B> {
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
        let c = &self.cfg;
        let (kw, vw) = (c.n_kv_heads * c.head_dim, c.n_kv_heads * c.v_dim);
        for l in &self.layers {
            self.be.cache_copy(&l.k_cache, kw, s0, d0, n)?;
            self.be.cache_copy(&l.v_cache, vw, s0, d0, n)?;
        }
        Ok(())
    }

    fn forward_outputs(&mut self, batch: &BatchMeta, mut out: Outputs<'_>) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        check_batch(batch, &self.opts, c.n_vocab, &out, self.be.chains_argmax())?;
        let be = self.be.as_ref();
        let s = &self.s;
        let (h, d, dv, nh, nkv, ff) = (c.n_embd, c.head_dim, c.v_dim, c.n_heads, c.n_kv_heads, c.n_ff);
        be.upload_batch(batch, &mut self.batch)?;
        let bt = &self.batch;
        let rx = Rows::packed(n, h);
        be.embed(&self.tok_embd, bt, c.embed_scale, &s.x, rx);
        let local = AttnParams {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            v_dim: dv,
            scale: c.attn_scale,
            window: Some(c.window),
            softcap: c.attn_softcap,
        };
        let global = AttnParams { window: None, ..local };
        let (rq, rk, rv, ra, rf) =
            (Rows::packed(n, nh * d), Rows::packed(n, nkv * d), Rows::packed(n, nkv * dv), Rows::packed(n, nh * dv), Rows::packed(n, ff));
        for l in &self.layers {
            let (rope, attn) = if l.global { (&self.rope_global, &global) } else { (&self.rope_local, &local) };
            be.rms_norm(&s.x, rx, Some(&l.attn_norm), c.eps, &s.h, rx);
            be.matmul(&s.h, rx, &l.wq, &s.q, rq);
            be.matmul(&s.h, rx, &l.wk, &s.k, rk);
            be.matmul(&s.h, rx, &l.wv, &s.v, rv);
            be.rms_norm(&s.q, rq.split(nh), Some(&l.q_norm), c.eps, &s.q, rq.split(nh));
            be.rms_norm(&s.k, rk.split(nkv), Some(&l.k_norm), c.eps, &s.k, rk.split(nkv));
            be.rope(&s.q, rq.split(nh), nh, bt, rope);
            be.rope(&s.k, rk.split(nkv), nkv, bt, rope);
            be.cache_write(&l.k_cache, &s.k, rk, bt);
            be.cache_write(&l.v_cache, &s.v, rv, bt);
            be.attention(&s.q, rq, &l.k_cache, &l.v_cache, bt, attn, &s.att, ra);
            be.matmul(&s.att, ra, &l.wo, &s.h, rx);
            be.rms_norm(&s.h, rx, Some(&l.post_attn_norm), c.eps, &s.h, rx);
            be.add(&s.x, rx, &s.h, rx, &s.x, rx);
            be.rms_norm(&s.x, rx, Some(&l.ffn_norm), c.eps, &s.h, rx);
            be.matmul(&s.h, rx, &l.w_gate, &s.g, rf);
            be.matmul(&s.h, rx, &l.w_up, &s.u, rf);
            be.glu(Glu::GeGluTanh, &s.g, rf, &s.u, rf, &s.g, rf);
            be.matmul(&s.g, rf, &l.w_down, &s.h, rx);
            be.rms_norm(&s.h, rx, Some(&l.post_ffn_norm), c.eps, &s.h, rx);
            be.add(&s.x, rx, &s.h, rx, &s.x, rx);
        }
        self.output_logits(batch, &mut out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use ts_cpu::CpuBackend;
    use ts_formats::{GgmlType, TensorData, TensorSource, Value};

    use super::*;

    /// An in-memory F32 source.
    struct Mem {
        meta: BTreeMap<String, Value>,
        tensors: Vec<(String, Vec<usize>, Vec<u8>)>,
    }

    impl TensorSource for Mem {
        fn path(&self) -> &str {
            "mem.gguf"
        }
        fn tensor(&self, name: &str) -> Option<TensorData<'_>> {
            self.tensors.iter().find(|t| t.0 == name).map(|t| TensorData {
                name: &t.0,
                dtype: GgmlType::F32,
                shape: &t.1,
                data: &t.2,
                keep: None,
            })
        }
        fn tensor_names(&self) -> Vec<&str> {
            self.tensors.iter().map(|t| t.0.as_str()).collect()
        }
        fn metadata(&self) -> &BTreeMap<String, Value> {
            &self.meta
        }
    }

    const H: usize = 32;
    const NH: usize = 2;
    const NKV: usize = 1;
    const D: usize = 16;
    const FF: usize = 48;
    const V: usize = 40;
    const L: usize = 3;
    const W: usize = 4;

    fn gguf_meta(layers: usize) -> BTreeMap<String, Value> {
        let mut m = BTreeMap::new();
        let u = |x: usize| Value::U32(x as u32);
        m.insert("general.architecture".into(), Value::String("gemma3".into()));
        m.insert("gemma3.embedding_length".into(), u(H));
        m.insert("gemma3.block_count".into(), u(layers));
        m.insert("gemma3.attention.head_count".into(), u(NH));
        m.insert("gemma3.attention.head_count_kv".into(), u(NKV));
        m.insert("gemma3.attention.key_length".into(), u(D));
        m.insert("gemma3.attention.value_length".into(), u(D));
        m.insert("gemma3.feed_forward_length".into(), u(FF));
        m.insert("gemma3.vocab_size".into(), u(V));
        m.insert("gemma3.attention.sliding_window".into(), u(W));
        m.insert("gemma3.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-6));
        m.insert("gemma3.rope.freq_base".into(), Value::F32(1e6));
        m
    }

    /// A random tiny model: `hf` selects the naming and whether norm weights carry the +1.
    fn tiny(hf: bool, softcap: Option<f32>) -> Mem {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |scale: f32| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        };
        let naming = if hf { Naming::Hf } else { Naming::Gguf };
        let mut tensors = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, norm: bool, rnd: &mut dyn FnMut(f32) -> f32| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n).map(|_| if norm { rnd(0.5) + if hf { 0.0 } else { 1.0 } } else { rnd(0.3) }).collect();
            tensors.push((name, shape, vals.iter().flat_map(|v| v.to_le_bytes()).collect()));
        };
        add(naming.global("embd").into(), vec![H, V], false, &mut rnd);
        add(naming.global("norm").into(), vec![H], true, &mut rnd);
        for l in 0..L {
            for (role, shape, norm) in [
                ("attn_norm", vec![H], true),
                ("attn_q", vec![H, NH * D], false),
                ("attn_k", vec![H, NKV * D], false),
                ("attn_v", vec![H, NKV * D], false),
                ("attn_q_norm", vec![D], true),
                ("attn_k_norm", vec![D], true),
                ("attn_output", vec![NH * D, H], false),
                ("post_attention_norm", vec![H], true),
                ("ffn_norm", vec![H], true),
                ("ffn_gate", vec![H, FF], false),
                ("ffn_up", vec![H, FF], false),
                ("ffn_down", vec![FF, H], false),
                ("post_ffw_norm", vec![H], true),
            ] {
                add(naming.layer(l, role, HF_GEMMA3), shape, norm, &mut rnd);
            }
        }
        let meta = if hf {
            let mut m = BTreeMap::new();
            let i = |x: usize| Value::I64(x as i64);
            m.insert("general.architecture".into(), Value::String("gemma3_text".into()));
            for (k, v) in [
                ("hidden_size", H),
                ("num_hidden_layers", L),
                ("num_attention_heads", NH),
                ("num_key_value_heads", NKV),
                ("head_dim", D),
                ("intermediate_size", FF),
                ("vocab_size", V),
                ("sliding_window", W),
                ("query_pre_attn_scalar", D),
            ] {
                m.insert(format!("hf.{k}"), i(v));
            }
            m.insert("hf.sliding_window_pattern".into(), i(3));
            m.insert("hf.rms_norm_eps".into(), Value::F64(1e-6));
            m.insert("hf.rope_theta".into(), Value::F64(1e6));
            m.insert("hf.rope_local_base_freq".into(), Value::F64(1e4));
            m.insert("hf.hidden_activation".into(), Value::String("gelu_pytorch_tanh".into()));
            if let Some(c) = softcap {
                m.insert("hf.final_logit_softcapping".into(), Value::F64(c as f64));
            }
            m
        } else {
            let mut m = gguf_meta(L);
            m.insert("gemma3.attention.sliding_window_pattern".into(), Value::U32(3));
            if let Some(c) = softcap {
                m.insert("gemma3.final_logit_softcapping".into(), Value::F32(c));
            }
            m
        };
        Mem { meta, tensors }
    }

    fn logits(src: &Mem, toks: &[u32], one_by_one: bool) -> Vec<f32> {
        let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu").exact());
        let opts = RuntimeOptions { ctx: 32, n_slots: 1, max_batch: 16 };
        let mut m = crate::load(src, be, opts).expect("open");
        let mut out = vec![0f32; toks.len() * V];
        if one_by_one {
            for (i, &t) in toks.iter().enumerate() {
                m.forward(&BatchMeta::sequence(&[t], i as u32, 32, false), &mut out[i * V..(i + 1) * V]).expect("forward");
            }
        } else {
            m.forward(&BatchMeta::sequence(toks, 0, 32, true), &mut out).expect("forward");
        }
        out
    }

    const TOKS: [u32; 11] = [2, 7, 19, 3, 33, 8, 8, 21, 39, 0, 14];

    #[test]
    fn config_matches_llama_cpp_defaults() {
        let src = Mem { meta: gguf_meta(18), tensors: vec![] };
        let (c, _) = Gemma3Config::read(&src).expect("config");
        let globals: Vec<usize> = (0..18).filter(|&l| c.is_global[l]).collect();
        assert_eq!(globals, [5, 11, 17]);
        assert_eq!((c.rope_base_local, c.rope_base_global, c.rope_linear_global), (10_000.0, 1e6, 1.0));
        assert_eq!(c.attn_scale, 0.25);
        assert_eq!(c.norm_offset, 0.0);
        assert_eq!((c.attn_softcap, c.final_softcap), (None, None));
        assert_eq!(c.embed_scale, (H as f32).sqrt());
    }

    #[test]
    fn unknown_variants_are_errors_naming_the_key() {
        let mut src = Mem { meta: gguf_meta(6), tensors: vec![] };
        src.meta.insert("gemma3.rope.scaling.type".into(), Value::String("yarn".into()));
        let e = Gemma3Config::read(&src).expect_err("must refuse").to_string();
        assert!(e.contains("gemma3.rope.scaling.type") && e.contains("yarn"), "{e}");
        let mut src = Mem { meta: gguf_meta(6), tensors: vec![] };
        src.meta.insert("gemma3.attention.sliding_window_pattern".into(), Value::String("x".into()));
        let e = Gemma3Config::read(&src).expect_err("must refuse").to_string();
        assert!(e.contains("gemma3.attention.sliding_window_pattern"), "{e}");
        let mut src = Mem { meta: gguf_meta(6), tensors: vec![] };
        src.meta.remove("gemma3.attention.sliding_window");
        let e = Gemma3Config::read(&src).expect_err("must refuse").to_string();
        assert!(e.contains("gemma3.attention.sliding_window"), "{e}");
        // Linear scaling applies to the global layers only.
        let mut src = Mem { meta: gguf_meta(6), tensors: vec![] };
        src.meta.insert("gemma3.rope.scaling.type".into(), Value::String("linear".into()));
        src.meta.insert("gemma3.rope.scaling.factor".into(), Value::F32(8.0));
        let (c, _) = Gemma3Config::read(&src).expect("config");
        assert_eq!((c.rope_linear_global, c.rope_base_local), (8.0, 10_000.0));
    }

    #[test]
    fn unused_and_missing_tensors_are_errors() {
        let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu"));
        let opts = RuntimeOptions { ctx: 16, n_slots: 1, max_batch: 4 };
        let mut src = tiny(false, None);
        src.tensors.push(("blk.0.extra.weight".into(), vec![H], vec![0; H * 4]));
        let e = crate::load(&src, be.clone(), opts).err().expect("must refuse").to_string();
        assert!(e.contains("blk.0.extra.weight") && e.contains("not used"), "{e}");
        let mut src = tiny(false, None);
        src.tensors.retain(|t| t.0 != "blk.1.post_ffw_norm.weight");
        let e = crate::load(&src, be, opts).err().expect("must refuse").to_string();
        assert!(e.contains("blk.1.post_ffw_norm.weight") && e.contains("missing"), "{e}");
    }

    /// Prefill of 11 tokens (window 4, layer 2 global) equals decoding them one at a time.
    #[test]
    fn prefill_equals_decode_past_the_window() {
        let src = tiny(false, None);
        let a = logits(&src, &TOKS, false);
        let b = logits(&src, &TOKS, true);
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-5, "prefill vs decode differ by {d}");
    }

    /// The HF naming with norm weights stored without the +1 gives the same logits as the GGUF
    /// naming with it folded in; soft-capping bounds the logits.
    #[test]
    fn hf_naming_and_norm_offset_match_gguf() {
        let a = logits(&tiny(false, None), &TOKS, false);
        let b = logits(&tiny(true, None), &TOKS, false);
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-5, "GGUF vs HF naming differ by {d}");
        let c = logits(&tiny(false, Some(0.5)), &TOKS, false);
        for (x, y) in a.iter().zip(&c) {
            assert!((0.5 * (x / 0.5).tanh() - y).abs() <= 1e-5, "softcap: {x} -> {y}");
        }
        let c_hf = logits(&tiny(true, Some(0.5)), &TOKS, false);
        let d = c.iter().zip(&c_hf).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d <= 1e-5, "soft-capped GGUF vs HF differ by {d}");
    }
}
