//! # deepseek2 family (DeepSeek-V2, V2-Lite, V2.5): MLA with a compressed cache, MoE, YaRN
//!
//! ```text
//! x_0      = embed(tokens)                                              [n, H]
//! per layer l:
//!   h      = rmsnorm(x) * attn_norm
//!   q      = h Wq                       or  rmsnorm(h Wq_a) * q_a_norm  Wq_b   [n, nh*(nope+rope)]
//!            per head: q = [q_nope (nope) ; q_pe (rope)]
//!   q_pe   = rope(q_pe)                                  (YaRN, pairs (2i, 2i+1))
//!   kv     = h Wkv_a = [c (kv_lora) ; k_pe (rope)]                     [n, kv_lora+rope]
//!   c      = rmsnorm(c) * kv_a_norm       (the latent half only; k_pe is not normed)
//!   k_pe   = rope(k_pe)                                  (one rope head shared by all heads)
//!   cache[slot, pos] <- [c ; k_pe]                       (one row per token per layer, no V)
//!   q_abs  = q_nope W_UK[h]                              per head: [nope] -> [kv_lora]
//!   s_j    = scale * (q_abs · c_j + q_pe · k_pe_j)       causal, per head
//!   o_lat  = softmax(s) · c                              per head: [kv_lora]
//!   o      = o_lat W_UV[h]                               per head: [kv_lora] -> [v]
//!   x      = x + o Wo                                    [n, nh*v] -> [n, H]
//!   h      = rmsnorm(x) * ffn_norm
//!   dense lead layers (l < n_dense_lead):
//!     x    = x + (silu(h Wg) * (h Wu)) Wd                width ff_dense
//!   MoE layers:
//!     r    = h W_router                                  [n, E] (f32)
//!     w    = top-k of softmax(r) (or sigmoid), optionally renormalised, times routed scale
//!     x    = x + sum_{e in top-k} w_e FFN_e(h) + FFN_shared(h)   (shared width n_shared*ff_exp)
//! logits   = rmsnorm(x) * output_norm  W_out
//! ```
//!
//! ## Why the absorbed form is exact
//! The checkpoint's `kv_b` maps the latent `c` to per-head `k_nope = W_K[h] c` and
//! `v = W_V[h] c`. Then `q_nope · k_nope = (W_K[h]^T q_nope) · c = q_abs · c`, and
//! `sum_j p_j v_j = W_V[h] (sum_j p_j c_j)`. So the cache holds only `[c ; k_pe]` and the two
//! halves of `kv_b` are applied to the query and to the attention output instead of to every
//! cached row. `W_UK[h] = W_K[h]^T` is stored as a 3-D matmul weight `[nope, kv_lora, nh]`
//! (GGML order: matrix `h` has `kv_lora` rows of `nope` values), `W_UV[h] = W_V[h]` as
//! `[kv_lora, v, nh]`. MLA-layout GGUF files store exactly these (`attn_k_b`, `attn_v_b`);
//! from a legacy `attn_kv_b` or an HF `kv_b_proj` they are built on the host at open,
//! **in f32** whatever the file's type (they are small: `nh*(nope+v)*kv_lora` values per layer),
//! so a quantised `kv_b` is dequantised once and not re-quantised.
//!
//! ## YaRN
//! Per rope pair `i` (of `d/2`), `f_extra = theta^(-2i/d)`, `f_inter = f_extra / factor`, and with
//! the ramp `r_i = clamp((i - low) / (high - low), 0, 1)`, where `low = floor(cd(beta_fast))`,
//! `high = ceil(cd(beta_slow))` clamped to `[0, d-1]` and
//! `cd(b) = d * ln(orig_ctx / (2 pi b)) / (2 ln theta)`, the frequency is
//! `f_i = f_inter * r_i + f_extra * (1 - r_i)` (HF `_compute_yarn_parameters` and ggml's
//! `rope_yarn` agree). With `m(s) = 1 + 0.1 * s * ln(factor)` (1 when factor <= 1):
//! * the rotation magnitude (applied to q_pe and k_pe, so q_pe·k_pe gets it squared) is
//!   `attention_factor` when the config gives it, else `m(mscale) / m(mscale_all_dim)` when
//!   both are non-zero, else `m(1)` (transformers' rule; the original DeepSeek remote code differs
//!   only when exactly one of the two is given);
//! * the score scale is `m(mscale_all_dim)^2 / sqrt(nope + rope)` when `mscale_all_dim` is
//!   non-zero, else `1 / sqrt(nope + rope)`. For V2-Lite (`mscale == mscale_all_dim == 0.707`,
//!   factor 40) that is a magnitude of exactly 1 and a scale of `1.26080^2 / sqrt(192)`.
//! * GGUF stores only `yarn_log_multiplier = 0.1 * mscale_all_dim`; llama.cpp then rotates with
//!   magnitude 1 and scales scores by `(1 + yarn_log_multiplier * ln factor)^2 / sqrt(nope+rope)`,
//!   which we follow (it equals the HF rule whenever `mscale == mscale_all_dim`).
//!
//! ## Routing
//! Softmax (or sigmoid) over all experts in f32, top-k (group-limited when `n_group > 1`),
//! renormalised only when `norm_topk_prob` / `expert_weights_norm` is set and `k > 1` (the
//! reference code skips renormalising a single choice), times `routed_scaling_factor`. Shared
//! experts always run and are added. Not implemented, refused at open with the field named:
//! `topk_method = noaux_tc`, score-correction biases (`e_score_correction_bias`,
//! `exp_probs_b`), `moe_layer_freq != 1`.

use std::sync::Arc;

use ts_core::{
    Backend, BatchMeta, Experts, Gating, GgmlType, Glu, MlaParams, MoeNext, MoeParams, RopeMode, RopeSpec, Rows, TensorData, WeightUse,
};
use ts_formats::{quant, TensorSource};

use crate::bind::Binder;
use crate::llama::check_batch;
use crate::meta::Meta;
use crate::{Model, ModelError, ModelInfo, Outputs, Result, RuntimeOptions};

// ================================================================================================
// Config
// ================================================================================================

/// YaRN rope scaling parameters (as read; folded into [`RopeSpec`] by [`DeepSeek2Config::rope_spec`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    /// Context extension factor (`> 1` to have any effect).
    pub factor: f64,
    /// Context length the model was pre-trained with, in positions.
    pub orig_ctx: f64,
    /// Rotations (over the original context) above which a pair is extrapolated (kept). Default 32.
    pub beta_fast: f64,
    /// Rotations below which a pair is interpolated (divided by `factor`). Default 1.
    pub beta_slow: f64,
    /// Whether the ramp ends are rounded outwards to whole pairs (floor/ceil); default true.
    pub truncate: bool,
}

/// Mixture-of-experts geometry and routing of the MoE layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// Routed experts `E` per MoE layer.
    pub n_experts: usize,
    /// Experts used per token (top-k), `1..=E`.
    pub k: usize,
    /// Shared experts (always run), fused into one FFN of width `n_shared * ff_exp`; may be 0.
    pub n_shared: usize,
    /// Inner width of one expert FFN.
    pub ff_exp: usize,
    pub gating: Gating,
    /// Renormalise the k chosen weights to sum 1 (only applied when `k > 1`).
    pub norm_topk: bool,
    /// Multiplies the routed weights (`routed_scaling_factor` / `expert_weights_scale`).
    pub scale: f32,
    /// Expert groups (`E % n_group == 0`); 1 = plain greedy top-k.
    pub n_group: usize,
    /// Groups eligible per token (`1..=n_group`).
    pub topk_group: usize,
}

/// Geometry and numerics of a deepseek2 model, validated at open.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSeek2Config {
    /// Hidden width `H`.
    pub n_embd: usize,
    pub n_layers: usize,
    pub n_vocab: usize,
    /// Context length the model was trained for (positions).
    pub n_ctx_train: usize,
    /// Attention heads `nh` (MLA has no separate kv heads: one latent serves all).
    pub n_heads: usize,
    /// Rank of the low-rank q projection (`q_a -> q_a_norm -> q_b`); `None` = one plain `Wq`.
    pub q_lora: Option<usize>,
    /// Latent width `kv_lora` (the cached `c`).
    pub kv_lora: usize,
    /// Non-rotated part of a q/k head (`qk_nope_head_dim`).
    pub nope: usize,
    /// Rotated part of a q/k head (`qk_rope_head_dim`), even; also the width of the shared k_pe.
    pub rope_dim: usize,
    /// Width of one v head (`v_head_dim`).
    pub v_dim: usize,
    /// Leading layers with a dense FFN (`first_k_dense_replace` / `leading_dense_block_count`);
    /// all layers when the model has no experts.
    pub n_dense_lead: usize,
    /// Inner width of the dense FFN of the lead layers (`intermediate_size` / `feed_forward_length`).
    pub ff_dense: usize,
    /// Expert layout of layers `n_dense_lead..`; `None` when every layer is dense.
    pub moe: Option<MoeConfig>,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Rope base `theta`.
    pub rope_theta: f64,
    /// YaRN scaling; `None` = plain rope.
    pub yarn: Option<Yarn>,
    /// Magnitude of the rope rotation (`RopeSpec::mscale`), see the module doc.
    pub rope_mscale: f32,
    /// Score scale of the attention (multiplies `q·k` before the softmax), see the module doc.
    pub attn_scale: f32,
}

/// Where the tensors come from, and so their names and the kv_b layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// HF folder: `model.layers.L.self_attn.kv_b_proj`, experts one tensor each.
    Hf,
    /// GGUF with `attn_k_b` / `attn_v_b` (llama.cpp converter since April 2025).
    GgufMla,
    /// GGUF with one `attn_kv_b`.
    GgufLegacy,
}

/// Softmax-scale multiplier of YaRN: `1 + 0.1 * m * ln(factor)` (1 when `factor <= 1`).
pub fn yarn_get_mscale(factor: f64, m: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        1.0 + 0.1 * m * factor.ln()
    }
}

impl DeepSeek2Config {
    /// Read and validate the config from GGUF (`deepseek2.*`) or HF (`hf.*`) metadata.
    pub fn read(src: &dyn TensorSource) -> Result<(Self, Layout)> {
        if src.metadata().keys().any(|k| k.starts_with("hf.")) {
            Self::read_hf(src)
        } else {
            Self::read_gguf(src)
        }
    }

    fn read_hf(src: &dyn TensorSource) -> Result<(Self, Layout)> {
        let m = Meta::new(src, "hf.");
        let n_embd = m.usize("hidden_size")?;
        let n_layers = m.usize("num_hidden_layers")?;
        let n_heads = m.usize("num_attention_heads")?;
        if let Some(kvh) = m.opt_usize("num_key_value_heads")? {
            if kvh != n_heads {
                return Err(m.err(format!(
                    "hf.num_key_value_heads = {kvh} differs from num_attention_heads = {n_heads}: not an MLA model this loader knows"
                )));
            }
        }
        let q_lora = m.opt_usize("q_lora_rank")?.filter(|&r| r > 0);
        let n_experts = m.opt_usize("n_routed_experts")?.unwrap_or(0);
        let moe = if n_experts == 0 {
            None
        } else {
            if let Some(f) = m.opt_usize("moe_layer_freq")? {
                if f != 1 {
                    return Err(
                        m.err(format!("hf.moe_layer_freq = {f} is not supported (only 1: every layer after the dense lead is MoE)"))
                    );
                }
            }
            let gating = match m.opt_str("scoring_func")?.unwrap_or("softmax") {
                "softmax" => Gating::Softmax,
                "sigmoid" => Gating::Sigmoid,
                other => return Err(m.err(format!("hf.scoring_func = '{other}' is not supported (softmax, sigmoid)"))),
            };
            let (n_group, topk_group) = match m.opt_str("topk_method")?.unwrap_or("greedy") {
                "greedy" => (1, 1),
                "group_limited_greedy" => (m.opt_usize("n_group")?.unwrap_or(1), m.opt_usize("topk_group")?.unwrap_or(1)),
                other => return Err(m.err(format!("hf.topk_method = '{other}' is not implemented (greedy, group_limited_greedy)"))),
            };
            Some(MoeConfig {
                n_experts,
                k: m.usize("num_experts_per_tok")?,
                n_shared: m.opt_usize("n_shared_experts")?.unwrap_or(0),
                ff_exp: m.usize("moe_intermediate_size")?,
                gating,
                norm_topk: m.opt_bool("norm_topk_prob")?.unwrap_or(false),
                scale: m.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
                n_group,
                topk_group,
            })
        };
        let n_dense_lead = if moe.is_some() { m.opt_usize("first_k_dense_replace")?.unwrap_or(0) } else { n_layers };
        let nope = m.usize("qk_nope_head_dim")?;
        let rope_dim = m.usize("qk_rope_head_dim")?;
        let n_ctx_train = m.opt_usize("max_position_embeddings")?.unwrap_or(4096);

        // Rope: `rope_parameters` (newer transformers, theta inside) or `rope_scaling` + `rope_theta`.
        let has_params = m.map.keys().any(|k| k.starts_with("hf.rope_parameters."));
        let rp = if has_params { "rope_parameters." } else { "rope_scaling." };
        let rope_theta = if has_params {
            m.opt_f64("rope_parameters.rope_theta")?.or(m.opt_f64("rope_theta")?).unwrap_or(10000.0)
        } else {
            m.opt_f64("rope_theta")?.unwrap_or(10000.0)
        };
        let k = |s: &str| format!("{rp}{s}");
        let rtype = match m.opt_str(&k("rope_type"))? {
            Some(t) => Some(t),
            None => m.opt_str(&k("type"))?,
        };
        let qk = (nope + rope_dim) as f64;
        let (yarn, rope_mscale, attn_scale) = match rtype {
            None | Some("default") => (None, 1.0, 1.0 / qk.sqrt()),
            Some("yarn") => {
                let factor = m.f64(&k("factor"))?;
                let y = Yarn {
                    factor,
                    orig_ctx: m.opt_f64(&k("original_max_position_embeddings"))?.unwrap_or(n_ctx_train as f64),
                    beta_fast: m.opt_f64(&k("beta_fast"))?.unwrap_or(32.0),
                    beta_slow: m.opt_f64(&k("beta_slow"))?.unwrap_or(1.0),
                    truncate: m.opt_bool(&k("truncate"))?.unwrap_or(true),
                };
                let ms = m.opt_f64(&k("mscale"))?.unwrap_or(0.0);
                let msad = m.opt_f64(&k("mscale_all_dim"))?.unwrap_or(0.0);
                let rot = match m.opt_f64(&k("attention_factor"))? {
                    Some(a) => a,
                    None if ms != 0.0 && msad != 0.0 => yarn_get_mscale(factor, ms) / yarn_get_mscale(factor, msad),
                    None => yarn_get_mscale(factor, 1.0),
                };
                let scale = if msad != 0.0 { yarn_get_mscale(factor, msad).powi(2) / qk.sqrt() } else { 1.0 / qk.sqrt() };
                (Some(y), rot, scale)
            }
            Some(other) => return Err(m.err(format!("hf.{rp}type = '{other}' is not supported for deepseek2 (default, yarn)"))),
        };
        let cfg = DeepSeek2Config {
            n_embd,
            n_layers,
            n_vocab: m.usize("vocab_size")?,
            n_ctx_train,
            n_heads,
            q_lora,
            kv_lora: m.usize("kv_lora_rank")?,
            nope,
            rope_dim,
            v_dim: m.usize("v_head_dim")?,
            n_dense_lead,
            ff_dense: m.usize("intermediate_size")?,
            moe,
            eps: m.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta,
            yarn,
            rope_mscale: rope_mscale as f32,
            attn_scale: attn_scale as f32,
        };
        cfg.validate(&m)?;
        Ok((cfg, Layout::Hf))
    }

    fn read_gguf(src: &dyn TensorSource) -> Result<(Self, Layout)> {
        let m = Meta::new(src, "deepseek2.");
        let n_embd = m.usize("embedding_length")?;
        let n_layers = m.usize("block_count")?;
        let n_heads = m.usize("attention.head_count")?;
        let kv_lora = m.usize("attention.kv_lora_rank")?;
        let rope_dim = m.usize("rope.dimension_count")?;
        let key_len = m.usize("attention.key_length")?;
        let val_len = m.usize("attention.value_length")?;
        let kv_heads = m.opt_usize("attention.head_count_kv")?;
        // MLA-layout files describe the absorbed cache in key_length/value_length and the per-head
        // geometry in the *_mla keys; legacy files have only the per-head geometry.
        let (layout, qk, v_dim) = match m.opt_usize("attention.key_length_mla")? {
            Some(qk) => {
                let v = m.usize("attention.value_length_mla")?;
                if key_len != kv_lora + rope_dim || val_len != kv_lora {
                    return Err(m.err(format!(
                        "deepseek2.attention.key_length {key_len} / value_length {val_len} should be kv_lora+rope = {} / kv_lora = {kv_lora} in an MLA-layout file",
                        kv_lora + rope_dim
                    )));
                }
                if kv_heads.is_some_and(|h| h != 1) {
                    return Err(
                        m.err(format!("deepseek2.attention.head_count_kv = {} in an MLA-layout file (expected 1)", kv_heads.unwrap_or(0)))
                    );
                }
                (Layout::GgufMla, qk, v)
            }
            None => {
                if kv_heads.is_some_and(|h| h != n_heads) {
                    return Err(m.err(format!(
                        "deepseek2.attention.head_count_kv = {} differs from head_count = {n_heads}",
                        kv_heads.unwrap_or(0)
                    )));
                }
                (Layout::GgufLegacy, key_len, val_len)
            }
        };
        if qk <= rope_dim {
            return Err(m.err(format!("deepseek2 key length {qk} must exceed the rope dimension {rope_dim}")));
        }
        let nope = qk - rope_dim;
        let n_vocab = match m.opt_usize("vocab_size")? {
            Some(v) => v,
            None => src
                .tensor("token_embd.weight")
                .map(|t| t.ne()[1])
                .ok_or_else(|| m.err("no deepseek2.vocab_size and no token_embd.weight"))?,
        };
        let n_experts = m.opt_usize("expert_count")?.unwrap_or(0);
        let moe = if n_experts == 0 {
            None
        } else {
            let gating = match m.opt_usize("expert_gating_func")? {
                None | Some(1) => Gating::Softmax,
                Some(2) => Gating::Sigmoid,
                Some(g) => return Err(m.err(format!("deepseek2.expert_gating_func = {g} is not supported (1 softmax, 2 sigmoid)"))),
            };
            Some(MoeConfig {
                n_experts,
                k: m.usize("expert_used_count")?,
                n_shared: m.opt_usize("expert_shared_count")?.unwrap_or(0),
                ff_exp: m.usize("expert_feed_forward_length")?,
                gating,
                norm_topk: m.opt_bool("expert_weights_norm")?.unwrap_or(false),
                scale: m.opt_f64("expert_weights_scale")?.unwrap_or(1.0) as f32,
                n_group: m.opt_usize("expert_group_count")?.unwrap_or(1).max(1),
                topk_group: m.opt_usize("expert_group_used_count")?.unwrap_or(1).max(1),
            })
        };
        let n_dense_lead = if moe.is_some() { m.opt_usize("leading_dense_block_count")?.unwrap_or(0) } else { n_layers };
        let n_ctx_train = m.opt_usize("context_length")?.unwrap_or(4096);
        let rope_theta = m.opt_f64("rope.freq_base")?.unwrap_or(10000.0);
        let qkf = qk as f64;
        let (yarn, attn_scale) = match m.opt_str("rope.scaling.type")? {
            None | Some("none") => (None, 1.0 / qkf.sqrt()),
            Some("yarn") => {
                let factor = m.f64("rope.scaling.factor")?;
                let y = Yarn {
                    factor,
                    orig_ctx: m.opt_f64("rope.scaling.original_context_length")?.unwrap_or(n_ctx_train as f64),
                    beta_fast: m.opt_f64("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                    beta_slow: m.opt_f64("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                    truncate: true,
                };
                let log_mul = m.opt_f64("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0);
                let ms = if factor <= 1.0 { 1.0 } else { 1.0 + log_mul * factor.ln() };
                (Some(y), ms * ms / qkf.sqrt())
            }
            Some(other) => return Err(m.err(format!("deepseek2.rope.scaling.type = '{other}' is not supported (none, yarn)"))),
        };
        let cfg = DeepSeek2Config {
            n_embd,
            n_layers,
            n_vocab,
            n_ctx_train,
            n_heads,
            q_lora: m.opt_usize("attention.q_lora_rank")?.filter(|&r| r > 0),
            kv_lora,
            nope,
            rope_dim,
            v_dim,
            n_dense_lead,
            ff_dense: m.usize("feed_forward_length")?,
            moe,
            eps: m.opt_f64("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6) as f32,
            rope_theta,
            yarn,
            rope_mscale: 1.0,
            attn_scale: attn_scale as f32,
        };
        cfg.validate(&m)?;
        Ok((cfg, layout))
    }

    fn validate(&self, m: &Meta) -> Result<()> {
        let mut pos = vec![
            ("hidden size", self.n_embd),
            ("layers", self.n_layers),
            ("heads", self.n_heads),
            ("kv_lora_rank", self.kv_lora),
            ("qk_nope_head_dim", self.nope),
            ("qk_rope_head_dim", self.rope_dim),
            ("v_head_dim", self.v_dim),
            ("vocab", self.n_vocab),
        ];
        if let Some(r) = self.q_lora {
            pos.push(("q_lora_rank", r));
        }
        if self.n_dense_lead > 0 {
            pos.push(("dense ffn width", self.ff_dense));
        }
        if let Some(e) = &self.moe {
            pos.push(("expert ffn width", e.ff_exp));
        }
        for (what, v) in pos {
            if v == 0 || v > 1 << 24 {
                return Err(m.err(format!("{what} = {v} is out of range")));
            }
        }
        if !self.rope_dim.is_multiple_of(2) {
            return Err(m.err(format!("rope dimension {} must be even", self.rope_dim)));
        }
        if self.n_dense_lead > self.n_layers {
            return Err(m.err(format!("{} leading dense layers but only {} layers", self.n_dense_lead, self.n_layers)));
        }
        if let Some(e) = &self.moe {
            if e.k == 0 || e.k > e.n_experts {
                return Err(m.err(format!("{} experts per token with {} experts", e.k, e.n_experts)));
            }
            if e.n_experts % e.n_group != 0 || e.topk_group > e.n_group || e.topk_group == 0 {
                return Err(m.err(format!("expert groups: {} experts in {} groups, {} used", e.n_experts, e.n_group, e.topk_group)));
            }
            if e.n_group > 1 && e.k > e.topk_group * (e.n_experts / e.n_group) {
                return Err(m.err(format!(
                    "{} experts per token exceed the {} in the {} eligible groups",
                    e.k,
                    e.topk_group * (e.n_experts / e.n_group),
                    e.topk_group
                )));
            }
            if !(e.scale.is_finite() && e.scale > 0.0) {
                return Err(m.err(format!("routed scaling factor {} out of range", e.scale)));
            }
        }
        if !(self.eps > 0.0 && self.eps < 1.0)
            || !(self.rope_theta > 1.0)
            || !(self.attn_scale.is_finite() && self.attn_scale > 0.0)
            || !(self.rope_mscale.is_finite() && self.rope_mscale > 0.0)
        {
            return Err(m.err("rms eps, rope base, rope magnitude or attention scale out of range"));
        }
        if let Some(y) = &self.yarn {
            if !(y.factor > 0.0 && y.orig_ctx >= 1.0 && y.beta_fast > 0.0 && y.beta_slow > 0.0) {
                return Err(m.err(format!("YaRN parameters out of range: {y:?}")));
            }
        }
        Ok(())
    }

    /// Per-pair rope frequencies (YaRN folded in) and magnitude; see the module doc.
    pub fn rope_spec(&self) -> RopeSpec {
        let d = self.rope_dim as f64;
        let half = self.rope_dim / 2;
        let base = self.rope_theta;
        let freqs = (0..half)
            .map(|i| {
                let extra = base.powf(-2.0 * i as f64 / d);
                let Some(y) = &self.yarn else { return extra as f32 };
                let inter = extra / y.factor;
                let corr = |rot: f64| d * (y.orig_ctx / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
                let (mut lo, mut hi) = (corr(y.beta_fast), corr(y.beta_slow));
                if y.truncate {
                    lo = lo.floor();
                    hi = hi.ceil();
                }
                let (lo, hi) = (lo.max(0.0), hi.min(d - 1.0));
                let ramp = ((i as f64 - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0);
                (inter * ramp + extra * (1.0 - ramp)) as f32
            })
            .collect();
        RopeSpec { mode: RopeMode::Normal, dim: self.rope_dim, freqs, mscale: self.rope_mscale }
    }

    /// Width of one q head (`nope + rope`).
    pub fn qk_dim(&self) -> usize {
        self.nope + self.rope_dim
    }
    /// Width of one MLA cache row (`kv_lora + rope`).
    pub fn cache_width(&self) -> usize {
        self.kv_lora + self.rope_dim
    }
    /// Widest FFN inner dimension any layer uses (dense lead or fused shared experts).
    pub fn ff_max(&self) -> usize {
        let dense = if self.n_dense_lead > 0 { self.ff_dense } else { 0 };
        let shared = self.moe.map_or(0, |e| e.n_shared * e.ff_exp);
        dense.max(shared).max(1)
    }
}

// ================================================================================================
// Tensor names
// ================================================================================================

/// Canonical per-layer role (GGUF short name) → HF name, for the roles both formats have.
/// Expert stacks (`ffn_*_exps`) and the MLA halves (`attn_k_b`, `attn_v_b`) are GGUF-only.
pub fn hf_layer_name(role: &str) -> Option<&'static str> {
    Some(match role {
        "attn_norm" => "input_layernorm.weight",
        "attn_q" => "self_attn.q_proj.weight",
        "attn_q_a" => "self_attn.q_a_proj.weight",
        "attn_q_a_norm" => "self_attn.q_a_layernorm.weight",
        "attn_q_b" => "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm.weight",
        "attn_kv_b" => "self_attn.kv_b_proj.weight",
        "attn_output" => "self_attn.o_proj.weight",
        "ffn_norm" => "post_attention_layernorm.weight",
        "ffn_gate" => "mlp.gate_proj.weight",
        "ffn_up" => "mlp.up_proj.weight",
        "ffn_down" => "mlp.down_proj.weight",
        "ffn_gate_inp" => "mlp.gate.weight",
        "ffn_gate_shexp" => "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp" => "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp" => "mlp.shared_experts.down_proj.weight",
        "exp_probs_b" => "mlp.gate.e_score_correction_bias",
        _ => return None,
    })
}

/// The file name of per-layer tensor `role` of layer `l`.
fn layer_name(layout: Layout, l: usize, role: &str) -> String {
    match layout {
        Layout::Hf => format!("model.layers.{l}.{}", hf_layer_name(role).unwrap_or(role)),
        _ if role == "exp_probs_b" => format!("blk.{l}.exp_probs_b.bias"),
        _ => format!("blk.{l}.{role}.weight"),
    }
}

fn global_name(layout: Layout, what: &str) -> &'static str {
    match (layout, what) {
        (Layout::Hf, "embd") => "model.embed_tokens.weight",
        (Layout::Hf, "norm") => "model.norm.weight",
        (Layout::Hf, _) => "lm_head.weight",
        (_, "embd") => "token_embd.weight",
        (_, "norm") => "output_norm.weight",
        _ => "output.weight",
    }
}

// ================================================================================================
// Weights
// ================================================================================================

/// The query projection.
enum QProj<B: Backend> {
    /// `Wq: [H, nh*(nope+rope)]`
    Plain { wq: B::Weight },
    /// `Wq_a: [H, q_lora]`, `q_a_norm: [q_lora]`, `Wq_b: [q_lora, nh*(nope+rope)]`
    LowRank { wq_a: B::Weight, q_a_norm: B::Weight, wq_b: B::Weight },
}

/// A SwiGLU FFN: gate/up `[H, ff]`, down `[ff, H]`.
struct DenseFfn<B: Backend> {
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
    /// Inner width `ff`.
    ff: usize,
}

enum Ffn<B: Backend> {
    Dense(DenseFfn<B>),
    Moe {
        /// Router `[H, E]`, always F32.
        router: B::Weight,
        /// `[H, ff_exp, E]`
        gate_exps: B::Weight,
        /// `[H, ff_exp, E]`
        up_exps: B::Weight,
        /// `[ff_exp, H, E]`
        down_exps: B::Weight,
        /// Fused shared experts (width `n_shared * ff_exp`); `None` when `n_shared == 0`.
        shared: Option<DenseFfn<B>>,
    },
}

struct Layer<B: Backend> {
    /// `[H]`
    attn_norm: B::Weight,
    q: QProj<B>,
    /// `[H, kv_lora + rope]`
    wkv_a: B::Weight,
    /// `[kv_lora]`
    kv_a_norm: B::Weight,
    /// `W_UK`: `[nope, kv_lora, nh]` (matrix h maps q_nope of head h to its kv_lora-wide query).
    w_uk: B::Weight,
    /// `W_UV`: `[kv_lora, v, nh]` (matrix h maps head h's latent output to its v values).
    w_uv: B::Weight,
    /// `[nh*v, H]`
    wo: B::Weight,
    /// `[H]`
    ffn_norm: B::Weight,
    ffn: Ffn<B>,
    /// MLA cache `[n_slots * ctx, kv_lora + rope]`: rows `[c ; k_pe]`.
    cache: B::Cache,
}

/// Activation scratch, sized at open for `max_batch` tokens (`mb`).
struct Scratch<B: Backend> {
    /// Residual stream `[mb, H]`.
    x: B::Buf,
    /// Normed input `[mb, H]`; also the gathered output rows.
    h: B::Buf,
    /// Second `[mb, H]` buffer: attention and FFN outputs (dense, routed, shared) before the
    /// residual add (fused with the next norm, see `Backend::add_rms_norm`).
    y: B::Buf,
    /// Low-rank q intermediate `[mb, q_lora]` (1 element when q is plain).
    qa: B::Buf,
    /// Queries `[mb, nh*(nope+rope)]` (per head `[q_nope ; q_pe]`).
    q: B::Buf,
    /// kv_a output `[mb, kv_lora + rope]` = the cache rows of this batch.
    kv: B::Buf,
    /// Absorbed queries `[mb*nh, kv_lora + rope]` (per head `[q_abs ; q_pe]`).
    qm: B::Buf,
    /// Latent attention output `[mb*nh, kv_lora]`.
    lat: B::Buf,
    /// Attention output `[mb, nh*v]`.
    av: B::Buf,
    /// FFN gate/up `[mb, ff_max]`.
    g: B::Buf,
    u: B::Buf,
    /// Router logits `[mb, E]` (1 element without experts).
    rl: B::Buf,
    /// `[mb, n_vocab]`
    logits: B::Buf,
}

/// A loaded deepseek2 model with its MLA cache and scratch.
pub struct DeepSeek2<B: Backend> {
    be: Arc<B>,
    /// Validated geometry (read once at open).
    cfg: DeepSeek2Config,
    /// What `inspect` shows.
    info: ModelInfo,
    /// Cache slots, context per slot and `max_batch` the scratch and caches were sized for.
    opts: RuntimeOptions,
    /// `[H, V]`
    tok_embd: B::Weight,
    /// `[H]`
    output_norm: B::Weight,
    /// `[H, V]` (the embedding when tied)
    output: B::Weight,
    /// `n_layers` layers, dense lead first.
    layers: Vec<Layer<B>>,
    /// YaRN table for q_pe and k_pe (`rope_dim` dims, normal pairs).
    rope: B::Rope,
    /// Device batch, room for `max_batch` tokens.
    batch: B::Batch,
    s: Scratch<B>,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Dequantise a whole tensor to f32 on the host.
fn to_f32<B: Backend>(b: &Binder<'_, B>, t: &TensorData<'_>) -> Result<Vec<f32>> {
    let mut v = vec![0f32; t.numel()];
    quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| b.err(t.name, format!("cannot dequantise: {e}")))?;
    Ok(v)
}

/// Upload a host-built f32 tensor named `name` with GGML shape `shape`.
fn upload_f32<B: Backend>(b: &Binder<'_, B>, name: &str, shape: &[usize], v: &[f32], usage: WeightUse) -> Result<B::Weight> {
    let bytes = f32_bytes(v);
    b.upload(&TensorData { name, dtype: GgmlType::F32, shape, data: &bytes, keep: None }, usage)
}

impl<B: Backend> DeepSeek2<B> {
    pub fn open(src: &dyn TensorSource, be: Arc<B>, opts: RuntimeOptions) -> Result<Self> {
        let (cfg, layout) = DeepSeek2Config::read(src)?;
        Self::open_with(src, be, opts, cfg, layout)
    }

    /// Bind the weights of `src` for an already-read `cfg`.
    pub fn open_with(src: &dyn TensorSource, be: Arc<B>, opts: RuntimeOptions, cfg: DeepSeek2Config, layout: Layout) -> Result<Self> {
        let b = Binder::new(src, be.as_ref());
        let (h, nh, kl, rd, nope, vd, nv) = (cfg.n_embd, cfg.n_heads, cfg.kv_lora, cfg.rope_dim, cfg.nope, cfg.v_dim, cfg.n_vocab);
        let qk = cfg.qk_dim();
        let tok_embd = b.get(global_name(layout, "embd"), &[h, nv], WeightUse::Embedding)?;
        let output_norm = b.get(global_name(layout, "norm"), &[h], WeightUse::Vector)?;
        let output = if b.has(global_name(layout, "out")) {
            b.get(global_name(layout, "out"), &[h, nv], WeightUse::Matmul)?
        } else {
            b.get(global_name(layout, "embd"), &[h, nv], WeightUse::Matmul)?
        };
        let rows = opts.n_slots.checked_mul(opts.ctx).ok_or_else(|| ModelError::Run("cache rows overflow".into()))?;
        let mut layers = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let n = |r: &str| layer_name(layout, l, r);
            let vec = |r: &str, len: usize| b.get(&n(r), &[len], WeightUse::Vector);
            let mat = |r: &str, i: usize, o: usize| b.get(&n(r), &[i, o], WeightUse::Matmul);
            if b.has(&n("exp_probs_b")) {
                return Err(b.err(&n("exp_probs_b"), "expert score-correction bias (DeepSeek-V3 noaux_tc routing) is not implemented"));
            }
            let mut q = match cfg.q_lora {
                None => QProj::Plain { wq: mat("attn_q", h, nh * qk)? },
                Some(r) => {
                    QProj::LowRank { wq_a: mat("attn_q_a", h, r)?, q_a_norm: vec("attn_q_a_norm", r)?, wq_b: mat("attn_q_b", r, nh * qk)? }
                }
            };
            let (w_uk, w_uv) = match layout {
                Layout::GgufMla => {
                    (b.get(&n("attn_k_b"), &[nope, kl, nh], WeightUse::Matmul)?, b.get(&n("attn_v_b"), &[kl, vd, nh], WeightUse::Matmul)?)
                }
                Layout::GgufLegacy | Layout::Hf => {
                    // kv_b: [kv_lora, nh*(nope+v)] (GGML): row h*(nope+v) + i is K row i of head h
                    // (i < nope), then its v V rows; each row holds kv_lora values.
                    let name = n("attn_kv_b");
                    let t = b.raw(&name, &[kl, nh * (nope + vd)])?;
                    let kvb = to_f32(&b, &t)?;
                    let mut uk = vec![0f32; nope * kl * nh]; // [nope, kv_lora, nh]: uk[(hh*kl + c)*nope + i]
                    let mut uv = vec![0f32; kl * vd * nh]; // [kv_lora, v, nh]: uv[(hh*vd + j)*kl + c]
                    for hh in 0..nh {
                        let head = &kvb[hh * (nope + vd) * kl..(hh + 1) * (nope + vd) * kl];
                        for i in 0..nope {
                            for c in 0..kl {
                                uk[(hh * kl + c) * nope + i] = head[i * kl + c];
                            }
                        }
                        uv[hh * vd * kl..(hh + 1) * vd * kl].copy_from_slice(&head[nope * kl..]);
                    }
                    (
                        upload_f32(&b, &format!("{name}:W_UK"), &[nope, kl, nh], &uk, WeightUse::Matmul)?,
                        upload_f32(&b, &format!("{name}:W_UV"), &[kl, vd, nh], &uv, WeightUse::Matmul)?,
                    )
                }
            };
            // (A MoE's shared FFN is bound as `Expert`: it rides in the experts' launches.)
            let ffn_of = |ff: usize, g: &str, u: &str, d: &str, usage: WeightUse| -> Result<DenseFfn<B>> {
                let m = |r: &str, i: usize, o: usize| b.get(&n(r), &[i, o], usage);
                Ok(DenseFfn { gate: m(g, h, ff)?, up: m(u, h, ff)?, down: m(d, ff, h)?, ff })
            };
            let dense = |ff: usize, g: &str, u: &str, d: &str| ffn_of(ff, g, u, d, WeightUse::Matmul);
            let ffn = match cfg.moe {
                Some(e) if l >= cfg.n_dense_lead => {
                    let (ne, fe) = (e.n_experts, e.ff_exp);
                    // The router runs in f32 (as the reference does), whatever the file stores.
                    let rt = b.raw(&n("ffn_gate_inp"), &[h, ne])?;
                    let router = if rt.dtype == GgmlType::F32 {
                        b.upload(&rt, WeightUse::Matmul)?
                    } else {
                        upload_f32(&b, rt.name, &[h, ne], &to_f32(&b, &rt)?, WeightUse::Matmul)?
                    };
                    let (gate_exps, up_exps, down_exps) = match layout {
                        Layout::Hf => (
                            stack_experts(&b, l, "gate_proj", [h, fe], ne)?,
                            stack_experts(&b, l, "up_proj", [h, fe], ne)?,
                            stack_experts(&b, l, "down_proj", [fe, h], ne)?,
                        ),
                        _ => (
                            b.get(&n("ffn_gate_exps"), &[h, fe, ne], WeightUse::Expert)?,
                            b.get(&n("ffn_up_exps"), &[h, fe, ne], WeightUse::Expert)?,
                            b.get(&n("ffn_down_exps"), &[fe, h, ne], WeightUse::Expert)?,
                        ),
                    };
                    let shared = if e.n_shared > 0 {
                        Some(ffn_of(e.n_shared * fe, "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", WeightUse::Expert)?)
                    } else {
                        None
                    };
                    Ffn::Moe { router, gate_exps, up_exps, down_exps, shared }
                }
                _ => Ffn::Dense(dense(cfg.ff_dense, "ffn_gate", "ffn_up", "ffn_down")?),
            };
            let mut wkv_a = mat("attn_kv_a_mqa", h, kl + rd)?;
            // q and kv_a multiply the same rows: the backend may keep them side by side, for
            // one product of both (norm_qkv_rope_cache).
            if let QProj::Plain { wq } = &mut q {
                be.join_products(&mut [wq, &mut wkv_a]);
            }
            layers.push(Layer {
                attn_norm: vec("attn_norm", h)?,
                q,
                wkv_a,
                kv_a_norm: vec("attn_kv_a_norm", kl)?,
                w_uk,
                w_uv,
                wo: mat("attn_output", nh * vd, h)?,
                ffn_norm: vec("ffn_norm", h)?,
                ffn,
                cache: be.alloc_latent_cache(rows, cfg.cache_width(), kl, nh)?,
            });
        }
        let unused: Vec<String> = b.unused().into_iter().filter(|n| !n.contains("rotary_emb.inv_freq")).collect();
        if !unused.is_empty() {
            return Err(ModelError::Tensor {
                path: src.path().to_string(),
                tensor: unused[0].clone(),
                what: format!("not used by the deepseek2 forward ({} unused tensors): the file does not match its config", unused.len()),
            });
        }
        let rope = be.upload_rope(&cfg.rope_spec())?;
        let mb = opts.max_batch.max(1);
        let one = |w: usize| be.alloc((mb * w).max(1));
        let s = Scratch {
            x: one(h)?,
            h: one(h)?,
            y: one(h)?,
            qa: one(cfg.q_lora.unwrap_or(0))?,
            q: one(nh * qk)?,
            kv: one(kl + rd)?,
            qm: one(nh * (kl + rd))?,
            lat: one(nh * kl)?,
            av: one(nh * vd)?,
            g: one(cfg.ff_max())?,
            u: one(cfg.ff_max())?,
            rl: one(cfg.moe.map_or(0, |e| e.n_experts))?,
            logits: one(nv)?,
        };
        // Bytes per cached value as the backend stores the latent rows (f16 on the CUDA tensor-core path).
        let vb = layers.first().map_or(4, |l| be.cache_value_bytes(&l.cache));
        let info = Self::describe(src, &cfg, layout, &b, vb);
        let batch = be.alloc_batch(mb)?;
        Ok(DeepSeek2 { be, cfg, info, opts, tok_embd, output_norm, output, layers, rope, batch, s })
    }

    /// `vb`: bytes per cached value (4, or 2 for a backend's f16 latent cache).
    fn describe(src: &dyn TensorSource, cfg: &DeepSeek2Config, layout: Layout, b: &Binder<'_, B>, vb: usize) -> ModelInfo {
        let c = cfg;
        let mut details = vec![
            (
                "attention".into(),
                format!(
                    "MLA, {} heads, q {}, kv_lora {}, head dims nope {} + rope {}, v {}",
                    c.n_heads,
                    c.q_lora.map_or("plain".to_string(), |r| format!("low-rank {r}")),
                    c.kv_lora,
                    c.nope,
                    c.rope_dim,
                    c.v_dim
                ),
            ),
            (
                "kv_b".into(),
                match layout {
                    Layout::GgufMla => "attn_k_b / attn_v_b from the file".into(),
                    _ => "W_UK / W_UV split from kv_b at open (f32)".into(),
                },
            ),
            (
                "cache".into(),
                format!(
                    "{} values per token per layer ([c ; k_pe]), {} B per token ({})",
                    c.cache_width(),
                    c.n_layers * c.cache_width() * vb,
                    if vb == 2 { "f16" } else { "f32" }
                ),
            ),
            (
                "rope".into(),
                match &c.yarn {
                    None => format!("normal pairs, base {}, {} dims, score scale {:.5}", c.rope_theta, c.rope_dim, c.attn_scale),
                    Some(y) => format!(
                        "YaRN factor {} (orig ctx {}, beta {}/{}), base {}, {} dims, magnitude {:.5}, score scale {:.5}",
                        y.factor, y.orig_ctx, y.beta_fast, y.beta_slow, c.rope_theta, c.rope_dim, c.rope_mscale, c.attn_scale
                    ),
                },
            ),
            ("dense ffn".into(), format!("{} lead layers, SwiGLU width {}", c.n_dense_lead, c.ff_dense)),
        ];
        if let Some(e) = &c.moe {
            details.push((
                "experts".into(),
                format!(
                    "{} routed (top {}), {} shared (fused width {}), width {}, {:?} gating, {}, scale {}{}",
                    e.n_experts,
                    e.k,
                    e.n_shared,
                    e.n_shared * e.ff_exp,
                    e.ff_exp,
                    e.gating,
                    if e.norm_topk { "renormalised" } else { "not renormalised" },
                    e.scale,
                    if e.n_group > 1 { format!(", {} groups, {} used", e.n_group, e.topk_group) } else { String::new() }
                ),
            ));
        }
        ModelInfo {
            arch: "deepseek2".into(),
            name: src.metadata().get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string(),
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_layers: c.n_layers,
            n_embd: c.n_embd,
            n_params: *b.n_params.borrow(),
            weight_bytes: *b.bytes.borrow(),
            weight_copy_bytes: *b.copy_bytes.borrow(),
            cache_bytes_per_token: (c.n_layers * c.cache_width() * vb) as u64,
            details,
            // Every op of the forward is per row given the matrices' products: the absorbed MLA
            // weights (host-built ones are F32) go through the Binder like the rest, and the
            // MoE's expert products and router-weighted sums give a token the same bits however
            // the batch groups tokens by expert (ts-cpu's `moe_rows_are_batch_invariant`,
            // ts-models' `deepseek2_is_batch_invariant_on_the_cpu`).
            batch_invariant: b.batch_invariant.get(),
        }
    }

    pub fn config(&self) -> &DeepSeek2Config {
        &self.cfg
    }
}

/// Stack HF experts `model.layers.L.mlp.experts.E.<proj>.weight` (each GGML `[in, out]`) into one
/// `[in, out, E]` weight. All experts must share a dtype; bytes are concatenated as stored.
fn stack_experts<B: Backend>(b: &Binder<'_, B>, l: usize, proj: &str, shape: [usize; 2], n_experts: usize) -> Result<B::Weight> {
    let name = |e: usize| format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight");
    let first = b.raw(&name(0), &shape)?;
    let mut buf = Vec::with_capacity(first.data.len() * n_experts);
    for e in 0..n_experts {
        let t = b.raw(&name(e), &shape)?;
        if t.dtype != first.dtype {
            return Err(b.err(&name(e), format!("type {} differs from expert 0's {}", t.dtype.name(), first.dtype.name())));
        }
        buf.extend_from_slice(t.data);
    }
    if !first.dtype.is_supported_weight() {
        return Err(b.err(&name(0), format!("type {} is not supported", first.dtype.name())));
    }
    let stacked = format!("model.layers.{l}.mlp.experts.*.{proj}.weight");
    b.upload(
        &TensorData { name: &stacked, dtype: first.dtype, shape: &[shape[0], shape[1], n_experts], data: &buf, keep: None },
        WeightUse::Expert,
    )
}

// ================================================================================================
// Forward
// ================================================================================================

impl<B: Backend> Model for DeepSeek2<B> {
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
        let w = self.cfg.cache_width();
        for l in &self.layers {
            self.be.cache_copy(&l.cache, w, s0, d0, n)?;
        }
        Ok(())
    }

    fn forward_outputs(&mut self, batch: &BatchMeta, mut out: Outputs<'_>) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        check_batch(batch, &self.opts, c.n_vocab, &out, self.be.chains_argmax())?;
        self.be.upload_batch(batch, &mut self.batch)?;
        // The step's ops depend only on this model, the token count, whether the tokens share
        // one slot, and the number of output rows, so a backend may record them once and replay
        // them (CUDA graphs); token ids, positions, slots and the output rows' indices are read
        // from the device batch uploaded above.
        // Whether all tokens share one slot also picks the attention kernel, so it is in the key,
        // as is whatever else the backend picks kernels by (`graph_class`: the context length).
        let one_slot = batch.tokens.iter().all(|t| t.slot == batch.tokens[0].slot);
        let class = self.be.graph_class(batch);
        let mut key = 0xcbf2_9ce4_8422_2325u64;
        for v in [self as *const Self as usize as u64, n as u64, one_slot as u64, batch.outputs.len() as u64, class] {
            key = (key ^ v).wrapping_mul(0x0100_0000_01b3);
        }
        let be = self.be.as_ref();
        if !be.graph_begin(key, n) {
            self.enqueue(batch)?;
            if !be.graph_end() {
                self.enqueue(batch)?;
            }
        }
        let no = batch.outputs.len();
        if no > 0 {
            out.deliver(be, &self.s.logits, Rows::packed(no, c.n_vocab), 0)?;
        }
        Ok(())
    }
}

impl<B: Backend> DeepSeek2<B> {
    /// Enqueue every op of one forward step (the uploaded batch), up to the output logits in
    /// `s.logits` (`[outputs, n_vocab]`); nothing is read back.
    fn enqueue(&self, batch: &BatchMeta) -> Result<()> {
        let c = &self.cfg;
        let n = batch.len();
        let be = self.be.as_ref();
        let s = &self.s;
        let (h, nh, kl, rd, nope, vd) = (c.n_embd, c.n_heads, c.kv_lora, c.rope_dim, c.nope, c.v_dim);
        let qk = c.qk_dim();
        let cw = c.cache_width();
        let bt = &self.batch;
        let rx = Rows::packed(n, h);
        be.embed(&self.tok_embd, bt, 1.0, &s.x, rx);
        let mla = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: c.attn_scale };
        // Views (shapes as rows x width):
        let rq = Rows::packed(n, nh * qk); // q: [n, nh*(nope+rope)]
        let heads = rq.split(nh); // q per head: [n*nh, nope+rope]
        let q_nope = heads.cols(0, nope); // [n*nh, nope]
        let q_pe = heads.cols(nope, rd); // [n*nh, rope]
        let rkv = Rows::packed(n, cw); // kv_a out = cache rows: [n, kv_lora+rope]
        let rqm = Rows::packed(n * nh, cw); // absorbed query per head: [n*nh, kv_lora+rope]
        let rlat = Rows::packed(n * nh, kl); // latent attention output: [n*nh, kv_lora]
        let rav = Rows::packed(n * nh, vd); // per-head v output [n*nh, v] == [n, nh*v]

        // `pending`: `s.y` holds a delta (the previous layer's FFN output) not yet added to the
        // residual; the add is fused with the next norm (`add_rms_norm_matmul_many`). A MoE op
        // that added its output into x itself (`moe_shared_residual`) leaves nothing pending.
        let mut pending = false;
        for l in &self.layers {
            // ---- attention ----
            if pending {
                // The attention's weights, which the layer's first products and its output side
                // read: a backend may fetch them while this norm runs.
                let wq = match &l.q {
                    QProj::Plain { wq } => wq,
                    QProj::LowRank { wq_a, .. } => wq_a,
                };
                // ... and the routed experts' gate and up, which a decode batch reads first
                // after its routing (a backend may ask for their first experts' bytes).
                match &l.ffn {
                    Ffn::Moe { gate_exps, up_exps, down_exps, .. } => {
                        be.prefetch_hint(&[wq, &l.wkv_a, &l.w_uk, &l.w_uv, &l.wo, gate_exps, up_exps, down_exps])
                    }
                    Ffn::Dense(_) => be.prefetch_hint(&[wq, &l.wkv_a, &l.w_uk, &l.w_uv, &l.wo]),
                }
            }
            // q (or its low-rank first half) and kv_a read the same input: one op, with the
            // residual add and the norm before it (one op again where the backend can).
            let ra = Rows::packed(n, c.q_lora.unwrap_or(0)); // [n, q_lora]
            let first = match &l.q {
                QProj::Plain { wq } => (wq, &s.q, rq),
                QProj::LowRank { wq_a, .. } => (wq_a, &s.qa, ra),
            };
            let jobs = [first, (&l.wkv_a, &s.kv, rkv)];
            // c = rmsnorm(c) * kv_a_norm, k_pe = rope(k_pe), cache row <- [c ; k_pe].
            // ... and the roped q_pe into the absorbed query's last columns, in the same op.
            let q_rope = (&s.q, q_pe, &s.qm, rqm.cols(kl, rd), nh);
            // ... and q_abs = q_nope . W_uk ([n*nh, kv_lora], its first columns), also in that op.
            let absorb = Some((&l.w_uk, q_nope, rqm.cols(0, kl)));
            if let QProj::Plain { .. } = &l.q {
                // The norm, both products and the cache write in one op (q and kv are its scratch).
                let delta = pending.then_some((&s.y, rx));
                let kv_norm = (kl, Some(&l.kv_a_norm));
                be.norm_qkv_rope_cache(
                    (&s.x, rx),
                    delta,
                    Some(&l.attn_norm),
                    c.eps,
                    (&s.h, rx),
                    jobs,
                    kv_norm,
                    q_rope,
                    absorb,
                    bt,
                    &self.rope,
                    &l.cache,
                );
            } else {
                if pending {
                    be.add_rms_norm_matmul_many((&s.x, rx), (&s.y, rx), Some(&l.attn_norm), c.eps, (&s.h, rx), &jobs);
                } else {
                    be.rms_norm_matmul_many((&s.x, rx), Some(&l.attn_norm), c.eps, (&s.h, rx), &jobs);
                }
                if let QProj::LowRank { q_a_norm, wq_b, .. } = &l.q {
                    be.rms_norm(&s.qa, ra, Some(q_a_norm), c.eps, &s.qa, ra);
                    be.matmul(&s.qa, ra, wq_b, &s.q, rq);
                }
                be.mla_rope_cache_write(&s.kv, rkv, kl, Some(&l.kv_a_norm), c.eps, q_rope, absorb, bt, &self.rope, &l.cache);
            }
            // The MoE's weights known before its routing (router, shared experts) are read right
            // after the attention: a backend may fetch them while it runs.
            match &l.ffn {
                Ffn::Moe { router, shared: Some(f), gate_exps, up_exps, down_exps } => {
                    be.prefetch_hint(&[router, &f.gate, &f.up, &f.down, gate_exps, up_exps, down_exps])
                }
                Ffn::Moe { router, gate_exps, up_exps, down_exps, .. } => be.prefetch_hint(&[router, gate_exps, up_exps, down_exps]),
                Ffn::Dense(_) => {}
            }
            // A MoE layer's routing: its parameters, and the router logits of h ([n, E]) with the
            // norm where the backend can (and the routing itself, for the MoE op below).
            let moe = c.moe.map(|e| MoeParams {
                n_experts: e.n_experts,
                k: e.k,
                gating: e.gating,
                norm_topk: e.norm_topk && e.k > 1,
                scale: e.scale,
                n_group: e.n_group,
                topk_group: e.topk_group,
                glu: Glu::SwiGlu,
            });
            let router = match (&l.ffn, &moe) {
                (Ffn::Moe { router, .. }, Some(p)) => Some(MoeNext { router, logits: (&s.rl, Rows::packed(n, p.n_experts)), params: p }),
                _ => None,
            };
            // lat = attention(q_abs, cache); av = lat . W_uv per head; y = av . W_o; x += y; h = norm(x).
            be.mla_attention_out(
                (&s.qm, rqm),
                &l.cache,
                bt,
                &mla,
                (&l.w_uv, &l.wo),
                (&s.lat, rlat, &s.av, rav, Rows::packed(n, nh * vd)),
                (&s.x, rx, &s.y),
                Some(&l.ffn_norm),
                c.eps,
                &s.h,
                rx,
                router,
            );
            // ---- FFN (its output in s.y, added to x by the next layer or after the loop; or
            // added to x by the MoE op itself, where the backend can) ----
            pending = match &l.ffn {
                Ffn::Dense(f) => {
                    swiglu(be, s, f, n, h);
                    true
                }
                Ffn::Moe { gate_exps, up_exps, down_exps, shared, .. } => {
                    let Some(p) = moe else { return Err(ModelError::Run("MoE layer without an expert config".into())) };
                    let rr = Rows::packed(n, p.n_experts); // router logits: [n, E], made above
                    let experts = || Experts { gate: gate_exps, up: up_exps, down: down_exps };
                    match shared {
                        Some(f) => {
                            let sh = || Experts { gate: &f.gate, up: &f.up, down: &f.down };
                            // Routed and shared experts in one op where the backend has one,
                            // added into x by it where it can.
                            if be.moe_shared_residual(&s.h, rx, &s.rl, rr, experts(), sh(), &p, &s.x, rx) {
                                false
                            } else {
                                if !be.moe_shared(&s.h, rx, &s.rl, rr, experts(), sh(), &p, &s.y, rx) {
                                    be.moe(&s.h, rx, &s.rl, rr, experts(), &p, &s.y, rx);
                                    be.add(&s.x, rx, &s.y, rx, &s.x, rx);
                                    swiglu(be, s, f, n, h);
                                }
                                true
                            }
                        }
                        None => {
                            be.moe(&s.h, rx, &s.rl, rr, experts(), &p, &s.y, rx);
                            true
                        }
                    }
                }
            };
        }
        if pending {
            be.add(&s.x, rx, &s.y, rx, &s.x, rx);
        }
        // Output rows: gathered, normed, projected (llama::output_logits without the read).
        let no = batch.outputs.len();
        if no > 0 {
            let ro = Rows::packed(no, h);
            // The output rows' indices come from the uploaded batch, so a recorded step serves
            // every set of `no` output rows.
            be.gather_outputs(&s.x, Rows::packed(n, h), bt, &s.h, ro);
            be.rms_norm(&s.h, ro, Some(&self.output_norm), c.eps, &s.h, ro);
            be.matmul(&s.h, ro, &self.output, &s.logits, Rows::packed(no, c.n_vocab));
        }
        Ok(())
    }
}

/// `y = (silu(h Wg) * (h Wu)) Wd` for the `n` rows of `s.h`.
fn swiglu<B: Backend>(be: &B, s: &Scratch<B>, f: &DenseFfn<B>, n: usize, h: usize) {
    let (rx, rf) = (Rows::packed(n, h), Rows::packed(n, f.ff)); // [n, H], [n, ff]
    be.matmul_many(&s.h, rx, &[(&f.gate, &s.g, rf), (&f.up, &s.u, rf)]);
    be.glu(Glu::SwiGlu, &s.g, rf, &s.u, rf, &s.g, rf);
    be.matmul(&s.g, rf, &f.down, &s.y, rx);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v2_lite() -> DeepSeek2Config {
        DeepSeek2Config {
            n_embd: 2048,
            n_layers: 27,
            n_vocab: 102400,
            n_ctx_train: 163840,
            n_heads: 16,
            q_lora: None,
            kv_lora: 512,
            nope: 128,
            rope_dim: 64,
            v_dim: 128,
            n_dense_lead: 1,
            ff_dense: 10944,
            moe: None,
            eps: 1e-6,
            rope_theta: 10000.0,
            yarn: Some(Yarn { factor: 40.0, orig_ctx: 4096.0, beta_fast: 32.0, beta_slow: 1.0, truncate: true }),
            rope_mscale: 1.0,
            attn_scale: (yarn_get_mscale(40.0, 0.707).powi(2) / 192f64.sqrt()) as f32,
        }
    }

    #[test]
    fn v2_lite_yarn_numbers() {
        let c = v2_lite();
        assert!((yarn_get_mscale(40.0, 0.707) - 1.26080).abs() < 1e-5);
        assert!((c.attn_scale - 0.11472).abs() < 1e-5);
        let r = c.rope_spec();
        assert_eq!(r.freqs.len(), 32);
        // cd(32) = 64 ln(4096/(64 pi)) / (2 ln 1e4) = 10.04 -> low 10; cd(1) = 22.9 -> high 23.
        assert!((r.freqs[0] - 1.0).abs() < 1e-7, "pair 0 is extrapolated");
        assert!((r.freqs[10] - 1e4f32.powf(-20.0 / 64.0)).abs() < 1e-7, "pair 10 is still extrapolated");
        assert!((r.freqs[31] - 1e4f32.powf(-62.0 / 64.0) / 40.0).abs() < 1e-9, "pair 31 is interpolated");
        let mid = 1e4f64.powf(-34.0 / 64.0);
        let t = (17.0 - 10.0) / 13.0;
        assert!((r.freqs[17] as f64 - (mid / 40.0 * t + mid * (1.0 - t))).abs() < 1e-7);
    }

    #[test]
    fn names_map() {
        assert_eq!(layer_name(Layout::Hf, 3, "attn_kv_a_mqa"), "model.layers.3.self_attn.kv_a_proj_with_mqa.weight");
        assert_eq!(layer_name(Layout::GgufMla, 3, "attn_k_b"), "blk.3.attn_k_b.weight");
        assert_eq!(layer_name(Layout::GgufLegacy, 0, "exp_probs_b"), "blk.0.exp_probs_b.bias");
        assert_eq!(layer_name(Layout::Hf, 1, "exp_probs_b"), "model.layers.1.mlp.gate.e_score_correction_bias");
    }
}
