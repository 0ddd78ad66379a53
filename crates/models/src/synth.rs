//! `turbospark synth`: random-weight deepseek2 models at real shapes, for benchmarks and tests.
//!
//! Writes a GGUF file (llama.cpp key and tensor names, MLA layout by default, or the legacy
//! `attn_kv_b` layout; `tokenizer.ggml.model = "none"` plus `deepseek2.vocab_size`) with
//! [`GgufWriter`], or an HF folder (`config.json` + one `model.safetensors`, F32/F16/BF16 only).
//!
//! ## Weights
//! Matrices are N(0, 1/fan_in) (`fan_in` = the GGML inner dimension), the embedding N(0, 1),
//! norm weights `1 + 0.05 N(0, 1)`. "Normal" values are the sum of four 16-bit uniforms (Irwin-Hall,
//! rescaled to unit variance: bounded tails at ±3.46, plenty for a benchmark and ~10x cheaper than
//! Box-Muller). Every matrix row has its own stream seeded from `(seed, tensor key, row)`, so the
//! values do not depend on thread count or write order, and one seed gives the **same weights** in
//! every format: the GGUF expert stack `ffn_gate_exps` row `e*ff + r` is HF expert `e`'s row `r`,
//! and MLA `attn_k_b`/`attn_v_b` are split from the same `kv_b` the legacy layout and HF store.
//!
//! ## Streaming
//! Tensors are generated and written one piece (≤ [`PIECE_ELEMS`] values, whole rows) at a time:
//! rayon generates and quantises piece `i+1` while piece `i` is written, so memory stays at two
//! pieces whatever the model size. 1-D tensors and the router (`ffn_gate_inp`) stay F32 in GGUF,
//! as llama.cpp does; a matrix whose rows are not whole blocks of the requested type falls back
//! to F16.

use std::io::{BufWriter, Write};
use std::path::Path;

use rayon::prelude::*;
use ts_formats::gguf::GgufWriter;
use ts_formats::{quant, GgmlType, Value};

use crate::{ModelError, Result};

/// Values generated per written piece (whole rows; a row longer than this is one piece).
pub const PIECE_ELEMS: usize = 1 << 23;

/// Named geometries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// DeepSeek-V2-Lite: 27 layers, H 2048, 16 heads, kv_lora 512, 64 experts (top 6) + 2 shared.
    DeepSeekV2Lite,
    /// A few MB, same structure (1 dense lead + 2 MoE layers, YaRN), for tests.
    Tiny,
}

impl Preset {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "deepseek-v2-lite" => Some(Preset::DeepSeekV2Lite),
            "tiny" => Some(Preset::Tiny),
            _ => None,
        }
    }
    pub fn spec(self) -> SynthSpec {
        match self {
            Preset::DeepSeekV2Lite => SynthSpec {
                name: "DeepSeek-V2-Lite (random weights)".into(),
                n_vocab: 102400,
                n_embd: 2048,
                n_layers: 27,
                n_heads: 16,
                q_lora: None,
                kv_lora: 512,
                nope: 128,
                rope_dim: 64,
                v_dim: 128,
                n_dense_lead: 1,
                ff_dense: 10944,
                n_experts: 64,
                n_used: 6,
                n_shared: 2,
                ff_exp: 1408,
                norm_topk: false,
                routed_scale: 1.0,
                n_group: 1,
                topk_group: 1,
                n_ctx_train: 163840,
                rope_theta: 10000.0,
                yarn: Some(SynthYarn {
                    factor: 40.0,
                    orig_ctx: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 0.707,
                    mscale_all_dim: 0.707,
                }),
                eps: 1e-6,
                bos: 100000,
                eos: 100001,
            },
            Preset::Tiny => SynthSpec {
                name: "deepseek2 tiny (random weights)".into(),
                n_vocab: 1024,
                n_embd: 128,
                n_layers: 3,
                n_heads: 4,
                q_lora: None,
                kv_lora: 64,
                nope: 32,
                rope_dim: 16,
                v_dim: 32,
                n_dense_lead: 1,
                ff_dense: 256,
                n_experts: 8,
                n_used: 2,
                n_shared: 2,
                ff_exp: 64,
                norm_topk: false,
                routed_scale: 1.0,
                n_group: 1,
                topk_group: 1,
                n_ctx_train: 163840,
                rope_theta: 10000.0,
                yarn: Some(SynthYarn {
                    factor: 40.0,
                    orig_ctx: 4096,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    mscale: 0.707,
                    mscale_all_dim: 0.707,
                }),
                eps: 1e-6,
                bos: 1,
                eos: 2,
            },
        }
    }
}

/// Output container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthFormat {
    /// GGUF, MLA layout (`attn_k_b` / `attn_v_b`), as llama.cpp's converter writes since April 2025.
    Gguf,
    /// GGUF, legacy layout (one `attn_kv_b`).
    GgufLegacy,
    /// HF folder: `config.json` + `model.safetensors` (F32, F16 or BF16).
    Hf,
}

/// YaRN parameters as an HF config states them (GGUF gets `yarn_log_multiplier = 0.1*mscale_all_dim`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthYarn {
    pub factor: f64,
    /// Original context, positions.
    pub orig_ctx: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

/// Geometry of a synthetic model (the fields of an HF DeepSeek-V2 config.json).
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// `general.name`.
    pub name: String,
    pub n_vocab: usize,
    /// Hidden width `H`.
    pub n_embd: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Low-rank q (`q_a`/`q_b`) rank; `None` = plain `q_proj`.
    pub q_lora: Option<usize>,
    pub kv_lora: usize,
    pub nope: usize,
    /// Even.
    pub rope_dim: usize,
    pub v_dim: usize,
    /// Leading dense layers (`first_k_dense_replace`); all layers when `n_experts == 0`.
    pub n_dense_lead: usize,
    /// Dense FFN width.
    pub ff_dense: usize,
    /// Routed experts per MoE layer; 0 = a dense model.
    pub n_experts: usize,
    /// Experts per token.
    pub n_used: usize,
    pub n_shared: usize,
    /// Width of one expert.
    pub ff_exp: usize,
    pub norm_topk: bool,
    pub routed_scale: f32,
    /// `n_group > 1` writes `topk_method = group_limited_greedy`.
    pub n_group: usize,
    pub topk_group: usize,
    pub n_ctx_train: usize,
    pub rope_theta: f64,
    pub yarn: Option<SynthYarn>,
    pub eps: f64,
    pub bos: u32,
    pub eos: u32,
}

impl SynthSpec {
    fn is_moe(&self, l: usize) -> bool {
        self.n_experts > 0 && l >= self.n_dense_lead
    }
    /// Total parameters (elements of every tensor written, MLA layout).
    pub fn n_params(&self) -> u64 {
        plan(self, SynthFormat::Gguf).iter().map(|t| t.shape.iter().product::<usize>() as u64).sum()
    }
}

/// How a tensor's values are made.
#[derive(Debug, Clone)]
enum Gen {
    /// Rows `row0..row0+rows` of the logical random matrix `key`: `mean + std * N(0,1)`.
    Rand { key: String, row0: usize, mean: f32, std: f32 },
    /// MLA `attn_k_b` `[nope, kv_lora, nh]` split from the layer's `kv_b` (key given).
    KB { key: String },
    /// MLA `attn_v_b` `[kv_lora, v, nh]` split from the layer's `kv_b`.
    VB { key: String },
}

/// One tensor to write.
#[derive(Debug, Clone)]
struct Planned {
    /// File name (GGUF or HF naming).
    name: String,
    /// GGML order.
    shape: Vec<usize>,
    /// Kept F32 whatever the requested type (1-D tensors, the router).
    keep_f32: bool,
    /// Where its values come from.
    gen: Gen,
}

fn plan(s: &SynthSpec, fmt: SynthFormat) -> Vec<Planned> {
    let hf = fmt == SynthFormat::Hf;
    let (h, nh, qk, kl, rd, vd) = (s.n_embd, s.n_heads, s.nope + s.rope_dim, s.kv_lora, s.rope_dim, s.v_dim);
    let mut v = Vec::new();
    let rand = |key: &str, row0: usize, mean: f32, std: f32| Gen::Rand { key: key.to_string(), row0, mean, std };
    let mat = |name: String, key: &str, i: usize, o: usize| Planned {
        name,
        shape: vec![i, o],
        keep_f32: false,
        gen: rand(key, 0, 0.0, 1.0 / (i as f32).sqrt()),
    };
    let norm = |name: String, key: &str, n: usize| Planned { name, shape: vec![n], keep_f32: true, gen: rand(key, 0, 1.0, 0.05) };
    let g = |hfn: &str, gg: &str| if hf { hfn.to_string() } else { gg.to_string() };
    v.push(Planned {
        name: g("model.embed_tokens.weight", "token_embd.weight"),
        shape: vec![h, s.n_vocab],
        keep_f32: false,
        gen: rand("embd", 0, 0.0, 1.0),
    });
    for l in 0..s.n_layers {
        let n = |role: &str| {
            if hf {
                format!("model.layers.{l}.{}", crate::deepseek2::hf_layer_name(role).unwrap_or(role))
            } else {
                format!("blk.{l}.{role}.weight")
            }
        };
        let k = |role: &str| format!("{l}.{role}");
        v.push(norm(n("attn_norm"), &k("attn_norm"), h));
        match s.q_lora {
            None => v.push(mat(n("attn_q"), &k("attn_q"), h, nh * qk)),
            Some(r) => {
                v.push(mat(n("attn_q_a"), &k("attn_q_a"), h, r));
                v.push(norm(n("attn_q_a_norm"), &k("attn_q_a_norm"), r));
                v.push(mat(n("attn_q_b"), &k("attn_q_b"), r, nh * qk));
            }
        }
        v.push(mat(n("attn_kv_a_mqa"), &k("attn_kv_a_mqa"), h, kl + rd));
        v.push(norm(n("attn_kv_a_norm"), &k("attn_kv_a_norm"), kl));
        match fmt {
            SynthFormat::Gguf => {
                v.push(Planned { name: n("attn_k_b"), shape: vec![s.nope, kl, nh], keep_f32: false, gen: Gen::KB { key: k("attn_kv_b") } });
                v.push(Planned { name: n("attn_v_b"), shape: vec![kl, vd, nh], keep_f32: false, gen: Gen::VB { key: k("attn_kv_b") } });
            }
            _ => v.push(mat(n("attn_kv_b"), &k("attn_kv_b"), kl, nh * (s.nope + vd))),
        }
        v.push(mat(n("attn_output"), &k("attn_output"), nh * vd, h));
        v.push(norm(n("ffn_norm"), &k("ffn_norm"), h));
        if s.is_moe(l) {
            let (ne, fe) = (s.n_experts, s.ff_exp);
            v.push(Planned {
                name: n("ffn_gate_inp"),
                shape: vec![h, ne],
                keep_f32: true,
                gen: rand(&k("ffn_gate_inp"), 0, 0.0, 1.0 / (h as f32).sqrt()),
            });
            for (role, proj, i, o) in
                [("ffn_gate_exps", "gate_proj", h, fe), ("ffn_up_exps", "up_proj", h, fe), ("ffn_down_exps", "down_proj", fe, h)]
            {
                let std = 1.0 / (i as f32).sqrt();
                if hf {
                    for e in 0..ne {
                        v.push(Planned {
                            name: format!("model.layers.{l}.mlp.experts.{e}.{proj}.weight"),
                            shape: vec![i, o],
                            keep_f32: false,
                            gen: rand(&k(role), e * o, 0.0, std),
                        });
                    }
                } else {
                    v.push(Planned { name: n(role), shape: vec![i, o, ne], keep_f32: false, gen: rand(&k(role), 0, 0.0, std) });
                }
            }
            if s.n_shared > 0 {
                let sf = s.n_shared * fe;
                v.push(mat(n("ffn_gate_shexp"), &k("ffn_gate_shexp"), h, sf));
                v.push(mat(n("ffn_up_shexp"), &k("ffn_up_shexp"), h, sf));
                v.push(mat(n("ffn_down_shexp"), &k("ffn_down_shexp"), sf, h));
            }
        } else {
            v.push(mat(n("ffn_gate"), &k("ffn_gate"), h, s.ff_dense));
            v.push(mat(n("ffn_up"), &k("ffn_up"), h, s.ff_dense));
            v.push(mat(n("ffn_down"), &k("ffn_down"), s.ff_dense, h));
        }
    }
    v.push(norm(g("model.norm.weight", "output_norm.weight"), "output_norm", h));
    v.push(mat(g("lm_head.weight", "output.weight"), "output", h, s.n_vocab));
    v
}

// ---- random numbers ---------------------------------------------------------------------------

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor key.
fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Row `row` of the logical matrix `key`: `mean + std * N(0,1)` (Irwin-Hall of 4 uniforms).
fn fill_row(seed: u64, key: u64, row: usize, mean: f32, std: f32, out: &mut [f32]) {
    let mut st = seed ^ key.rotate_left(17) ^ (row as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    splitmix(&mut st);
    // Sum of 4 uniforms on [0, 65535]: mean 2*65535, std 65536/sqrt(3).
    let k = std * (3f32.sqrt() / 65536.0);
    for v in out.iter_mut() {
        let r = splitmix(&mut st);
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        *v = mean + (s as f32 - 131070.0) * k;
    }
}

// ---- writing ----------------------------------------------------------------------------------

fn err(what: impl Into<String>) -> ModelError {
    ModelError::Run(format!("synth: {}", what.into()))
}

fn ferr(e: ts_formats::FormatError) -> ModelError {
    err(e.to_string())
}

/// Storage type of a planned tensor for a requested type.
fn dtype_for(t: &Planned, want: GgmlType) -> GgmlType {
    if t.keep_f32 || t.shape.len() == 1 {
        GgmlType::F32
    } else if want.row_bytes(t.shape[0]).is_none() {
        GgmlType::F16
    } else {
        want
    }
}

/// Generates and encodes pieces of tensors.
struct Encoder {
    /// The user's seed; every row's stream derives from it.
    seed: u64,
}

impl Encoder {
    /// Bytes of rows `[r0, r0 + n)` of tensor `t` (`ne0` values per row) in `dtype`, into `out`.
    fn piece(&self, s: &SynthSpec, t: &Planned, dtype: GgmlType, r0: usize, n: usize, out: &mut Vec<u8>, kvb: &[f32]) -> Result<()> {
        let ne0 = t.shape[0];
        let rb = dtype.row_bytes(ne0).ok_or_else(|| err(format!("{}: row of {ne0} is not whole {} blocks", t.name, dtype.name())))?;
        out.clear();
        out.resize(n * rb, 0);
        let seed = self.seed;
        let (nope, kl, vd) = (s.nope, s.kv_lora, s.v_dim);
        out.par_chunks_mut(rb).enumerate().try_for_each_init(
            || vec![0f32; ne0],
            |row, (i, bytes)| {
                let r = r0 + i;
                match &t.gen {
                    Gen::Rand { key, row0, mean, std } => fill_row(seed, key_hash(key), row0 + r, *mean, *std, row),
                    // k_b row r = (head hh, latent c): K rows i of head hh, column c.
                    Gen::KB { .. } => {
                        let (hh, c) = (r / kl, r % kl);
                        for (i, v) in row.iter_mut().enumerate() {
                            *v = kvb[(hh * (nope + vd) + i) * kl + c];
                        }
                    }
                    // v_b row r = (head hh, v index j) = kv_b row hh*(nope+v) + nope + j.
                    Gen::VB { .. } => {
                        let (hh, j) = (r / vd, r % vd);
                        let src = (hh * (nope + vd) + nope + j) * kl;
                        row.copy_from_slice(&kvb[src..src + kl]);
                    }
                }
                quant::quantize(dtype, row, bytes).map_err(|e| err(format!("{}: {e}", t.name)))
            },
        )
    }
}

/// Write `spec` with random weights (`seed`) to `out`: a GGUF file, or an HF folder (created).
/// `quant` is the type of the matrices (GGUF: any type `ts_formats::quant::quantize` supports;
/// HF: F32, F16 or BF16).
pub fn synth_spec(spec: &SynthSpec, quant: GgmlType, seed: u64, out: &Path, format: SynthFormat) -> Result<()> {
    if format == SynthFormat::Hf && !matches!(quant, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(err(format!("an HF folder holds F32, F16 or BF16 weights, not {}", quant.name())));
    }
    let s = spec;
    if !s.rope_dim.is_multiple_of(2) || s.n_heads == 0 || s.n_layers == 0 || (s.n_experts > 0 && (s.n_used == 0 || s.n_used > s.n_experts))
    {
        return Err(err(format!("inconsistent geometry: {s:?}")));
    }
    let tensors = plan(s, format);
    // An HF checkpoint stores every tensor (norms and router included) in its one dtype.
    let dtypes: Vec<GgmlType> = tensors.iter().map(|t| if format == SynthFormat::Hf { quant } else { dtype_for(t, quant) }).collect();
    match format {
        SynthFormat::Hf => {
            std::fs::create_dir_all(out).map_err(|e| err(format!("{}: {e}", out.display())))?;
            std::fs::write(out.join("config.json"), hf_config(s, quant))
                .map_err(|e| err(format!("{}: {e}", out.join("config.json").display())))?;
            let path = out.join("model.safetensors");
            let file = std::fs::File::create(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
            let mut w = BufWriter::with_capacity(1 << 22, file);
            let header = safetensors_header(&tensors, &dtypes)?;
            w.write_all(&(header.len() as u64).to_le_bytes())
                .and_then(|_| w.write_all(header.as_bytes()))
                .map_err(|e| err(format!("{}: {e}", path.display())))?;
            stream(s, &tensors, &dtypes, seed, |b| w.write_all(b).map_err(|e| err(format!("{}: {e}", path.display()))))?;
            w.flush().map_err(|e| err(format!("{}: {e}", path.display())))?;
        }
        _ => {
            let mut w = GgufWriter::create(out).map_err(ferr)?;
            for (k, v) in gguf_metadata(s, quant, format) {
                w.add(k, v).map_err(ferr)?;
            }
            for (t, &d) in tensors.iter().zip(&dtypes) {
                w.add_tensor_info(t.name.clone(), d, &t.shape).map_err(ferr)?;
            }
            w.write_header().map_err(ferr)?;
            stream(s, &tensors, &dtypes, seed, |b| w.write_tensor_chunk(b).map_err(ferr))?;
            w.finish().map_err(ferr)?;
        }
    }
    Ok(())
}

/// [`synth_spec`] for a named preset.
pub fn synth(preset: Preset, quant: GgmlType, seed: u64, out: &Path, format: SynthFormat) -> Result<()> {
    synth_spec(&preset.spec(), quant, seed, out, format)
}

/// Generate every tensor in order, piece by piece, handing the bytes to `sink`; the next piece is
/// generated (on the rayon pool) while the previous one is written.
fn stream(
    s: &SynthSpec,
    tensors: &[Planned],
    dtypes: &[GgmlType],
    seed: u64,
    mut sink: impl FnMut(&[u8]) -> Result<()> + Send,
) -> Result<()> {
    // The work list: (tensor index, first row, rows).
    let mut work = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        let ne0 = t.shape[0];
        let rows: usize = t.shape[1..].iter().product();
        let per = (PIECE_ELEMS / ne0).max(1);
        let mut r = 0;
        while r < rows {
            let n = per.min(rows - r);
            work.push((i, r, n));
            r += n;
        }
    }
    let enc = Encoder { seed };
    // kv_b of the current layer, for the MLA halves (regenerated when the key changes).
    let mut kvb_key = String::new();
    let mut kvb: Vec<f32> = Vec::new();
    let (mut cur, mut next) = (Vec::new(), Vec::new());
    let mut have = false;
    for &(i, r0, n) in &work {
        let t = &tensors[i];
        if let Gen::KB { key } | Gen::VB { key } = &t.gen {
            if *key != kvb_key {
                let rows = s.n_heads * (s.nope + s.v_dim);
                kvb.resize(rows * s.kv_lora, 0.0);
                let std = 1.0 / (s.kv_lora as f32).sqrt();
                let kh = key_hash(key);
                kvb.par_chunks_mut(s.kv_lora).enumerate().for_each(|(r, row)| fill_row(seed, kh, r, 0.0, std, row));
                kvb_key = key.clone();
            }
        }
        let (gen_res, write_res) =
            rayon::join(|| enc.piece(s, t, dtypes[i], r0, n, &mut next, &kvb), || if have { sink(&cur) } else { Ok(()) });
        gen_res?;
        write_res?;
        std::mem::swap(&mut cur, &mut next);
        have = true;
    }
    if have {
        sink(&cur)?;
    }
    Ok(())
}

fn st_dtype(d: GgmlType) -> &'static str {
    match d {
        GgmlType::F16 => "F16",
        GgmlType::BF16 => "BF16",
        _ => "F32",
    }
}

/// The safetensors JSON header, padded with spaces to a multiple of 8 bytes.
fn safetensors_header(tensors: &[Planned], dtypes: &[GgmlType]) -> Result<String> {
    let mut m = serde_json::Map::new();
    m.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut off = 0usize;
    for (t, &d) in tensors.iter().zip(dtypes) {
        let bytes = d.row_bytes(t.shape.iter().product()).ok_or_else(|| err(format!("{}: size", t.name)))?;
        let shape: Vec<usize> = t.shape.iter().rev().copied().collect();
        m.insert(t.name.clone(), serde_json::json!({"dtype": st_dtype(d), "shape": shape, "data_offsets": [off, off + bytes]}));
        off += bytes;
    }
    let mut h = serde_json::Value::Object(m).to_string();
    while !h.len().is_multiple_of(8) {
        h.push(' ');
    }
    Ok(h)
}

fn hf_config(s: &SynthSpec, q: GgmlType) -> String {
    let mut c = serde_json::json!({
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": s.n_vocab,
        "hidden_size": s.n_embd,
        "intermediate_size": s.ff_dense,
        "moe_intermediate_size": s.ff_exp,
        "num_hidden_layers": s.n_layers,
        "num_attention_heads": s.n_heads,
        "num_key_value_heads": s.n_heads,
        "q_lora_rank": s.q_lora,
        "kv_lora_rank": s.kv_lora,
        "qk_nope_head_dim": s.nope,
        "qk_rope_head_dim": s.rope_dim,
        "v_head_dim": s.v_dim,
        "n_shared_experts": s.n_shared,
        "n_routed_experts": if s.n_experts > 0 { serde_json::json!(s.n_experts) } else { serde_json::Value::Null },
        "num_experts_per_tok": s.n_used,
        "first_k_dense_replace": s.n_dense_lead,
        "moe_layer_freq": 1,
        "scoring_func": "softmax",
        "topk_method": if s.n_group > 1 { "group_limited_greedy" } else { "greedy" },
        "n_group": s.n_group,
        "topk_group": s.topk_group,
        "norm_topk_prob": s.norm_topk,
        "routed_scaling_factor": s.routed_scale,
        "hidden_act": "silu",
        "max_position_embeddings": s.n_ctx_train,
        "rms_norm_eps": s.eps,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": false,
        "bos_token_id": s.bos,
        "eos_token_id": s.eos,
        "attention_bias": false,
        "torch_dtype": match q { GgmlType::BF16 => "bfloat16", GgmlType::F16 => "float16", _ => "float32" },
    });
    if let (Some(y), Some(o)) = (&s.yarn, c.as_object_mut()) {
        o.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "yarn", "factor": y.factor, "original_max_position_embeddings": y.orig_ctx, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim}),
        );
    }
    serde_json::to_string_pretty(&c).unwrap_or_default()
}

fn gguf_metadata(s: &SynthSpec, q: GgmlType, fmt: SynthFormat) -> Vec<(String, Value)> {
    let a = |k: &str| format!("deepseek2.{k}");
    let u = |x: usize| Value::U32(x as u32);
    let mut m = vec![
        ("general.architecture".to_string(), Value::String("deepseek2".into())),
        ("general.name".to_string(), Value::String(s.name.clone())),
        (
            "general.file_type".to_string(),
            Value::U32(match q {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q8_0 => 7,
                GgmlType::BF16 => 32,
                _ => 0,
            }),
        ),
        (a("block_count"), u(s.n_layers)),
        (a("context_length"), u(s.n_ctx_train)),
        (a("embedding_length"), u(s.n_embd)),
        (a("feed_forward_length"), u(s.ff_dense)),
        (a("vocab_size"), u(s.n_vocab)),
        (a("attention.head_count"), u(s.n_heads)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(s.eps as f32)),
        (a("attention.kv_lora_rank"), u(s.kv_lora)),
        (a("rope.freq_base"), Value::F32(s.rope_theta as f32)),
        (a("rope.dimension_count"), u(s.rope_dim)),
        ("tokenizer.ggml.model".to_string(), Value::String("none".into())),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(s.bos)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(s.eos)),
    ];
    if let Some(r) = s.q_lora {
        m.push((a("attention.q_lora_rank"), u(r)));
    }
    if fmt == SynthFormat::Gguf {
        m.push((a("attention.head_count_kv"), u(1)));
        m.push((a("attention.key_length"), u(s.kv_lora + s.rope_dim)));
        m.push((a("attention.value_length"), u(s.kv_lora)));
        m.push((a("attention.key_length_mla"), u(s.nope + s.rope_dim)));
        m.push((a("attention.value_length_mla"), u(s.v_dim)));
    } else {
        m.push((a("attention.head_count_kv"), u(s.n_heads)));
        m.push((a("attention.key_length"), u(s.nope + s.rope_dim)));
        m.push((a("attention.value_length"), u(s.v_dim)));
    }
    if s.n_experts > 0 {
        m.push((a("leading_dense_block_count"), u(s.n_dense_lead)));
        m.push((a("expert_count"), u(s.n_experts)));
        m.push((a("expert_used_count"), u(s.n_used)));
        m.push((a("expert_shared_count"), u(s.n_shared)));
        m.push((a("expert_feed_forward_length"), u(s.ff_exp)));
        m.push((a("expert_weights_scale"), Value::F32(s.routed_scale)));
        if s.norm_topk {
            m.push((a("expert_weights_norm"), Value::Bool(true)));
        }
        m.push((a("expert_gating_func"), Value::U32(1)));
        if s.n_group > 1 {
            m.push((a("expert_group_count"), u(s.n_group)));
            m.push((a("expert_group_used_count"), u(s.topk_group)));
        }
    }
    if let Some(y) = &s.yarn {
        m.push((a("rope.scaling.type"), Value::String("yarn".into())));
        m.push((a("rope.scaling.factor"), Value::F32(y.factor as f32)));
        m.push((a("rope.scaling.original_context_length"), u(y.orig_ctx)));
        m.push((a("rope.scaling.yarn_log_multiplier"), Value::F32((0.1 * y.mscale_all_dim) as f32)));
        m.push((a("rope.scaling.yarn_beta_fast"), Value::F32(y.beta_fast as f32)));
        m.push((a("rope.scaling.yarn_beta_slow"), Value::F32(y.beta_slow as f32)));
    }
    m
}
