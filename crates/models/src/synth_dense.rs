//! Random-weight llama and gemma3 GGUF files with the quantisation mixes of the real small models
//! (SmolLM2: Q8_0 embedding + Q4_1 matrices; Gemma 3 Q4_K_M: Q8_0, Q4_K, Q5_0, Q6_K, Q4_0).
//!
//! They exist so a backend can be checked against the CPU referee on every weight type and every
//! family where the real file cannot travel (the GPU machine reaches no registry). Weights are
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
}

impl DensePreset {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llama-tiny" => Some(DensePreset::LlamaTiny),
            "gemma3-tiny" => Some(DensePreset::Gemma3Tiny),
            _ => None,
        }
    }
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
    let gemma = preset == DensePreset::Gemma3Tiny;
    let arch = if gemma { "gemma3" } else { "llama" };
    let (h, nl, nh, nkv, d, ff, v) = if gemma { (512, 6, 4, 1, 128, 1536, 4096) } else { (576, 4, 9, 3, 64, 1536, 4096) };
    // (name, shape (GGML order), type, is_norm)
    let mut plan: Vec<(String, Vec<usize>, GgmlType, bool)> = vec![("token_embd.weight".into(), vec![h, v], GgmlType::Q8_0, false)];
    let mat = if gemma { GgmlType::Q4K } else { GgmlType::Q4_1 };
    for l in 0..nl {
        let n = |r: &str| format!("blk.{l}.{r}.weight");
        plan.push((n("attn_norm"), vec![h], GgmlType::F32, true));
        plan.push((n("attn_q"), vec![h, nh * d], mat, false));
        plan.push((n("attn_k"), vec![h, nkv * d], mat, false));
        plan.push((n("attn_v"), vec![h, nkv * d], if gemma { GgmlType::Q5_0 } else { mat }, false));
        plan.push((n("attn_output"), vec![nh * d, h], if gemma { GgmlType::Q4_0 } else { mat }, false));
        plan.push((n("ffn_norm"), vec![h], GgmlType::F32, true));
        plan.push((n("ffn_gate"), vec![h, ff], mat, false));
        plan.push((n("ffn_up"), vec![h, ff], mat, false));
        plan.push((n("ffn_down"), vec![ff, h], if gemma { GgmlType::Q6K } else { mat }, false));
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
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        ("general.name".into(), s(if gemma { "gemma3 tiny (random weights)" } else { "llama tiny (random weights)" })),
        ("tokenizer.ggml.model".into(), s("none")),
    ];
    let u = |x: usize| Value::U32(x as u32);
    for (k, val) in [
        ("block_count", u(nl)),
        ("embedding_length", u(h)),
        ("feed_forward_length", u(ff)),
        ("attention.head_count", u(nh)),
        ("attention.head_count_kv", u(nkv)),
        ("context_length", u(8192)),
        ("vocab_size", u(v)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("rope.freq_base", Value::F32(if gemma { 1_000_000.0 } else { 100_000.0 })),
    ] {
        kv.push((format!("{arch}.{k}"), val));
    }
    if gemma {
        kv.push(("gemma3.attention.key_length".into(), u(d)));
        kv.push(("gemma3.attention.value_length".into(), u(d)));
        kv.push(("gemma3.attention.sliding_window".into(), u(64)));
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
