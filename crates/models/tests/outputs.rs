//! `Model::forward_outputs`: the arg-max rows and a subset of full rows must be exactly what the
//! full logits say ([`ts_core::argmax`] of each row, the same rows bit for bit), for every family
//! path that delivers logits: llama's single read, deepseek2's recorded step, and gemma3's chunks
//! of 16 output rows (full rows on both sides of a chunk boundary).

use std::sync::Arc;

use ts_core::{BatchMeta, TokenMeta};
use ts_cpu::CpuBackend;
use ts_formats::GgmlType;
use ts_models::synth::{synth_spec, Preset, SynthFormat};
use ts_models::synth_dense::{synth_dense, DensePreset};
use ts_models::{Model, Outputs, RuntimeOptions};
use ts_testkit::{Fill, TempPath, TinyLlama};

const OPTS: RuntimeOptions = RuntimeOptions { ctx: 32, n_slots: 3, max_batch: 32 };

/// Two sequences of `len` tokens (ids below 13: the tiny llama has 16) in slots 0 and 1, every
/// token an output row.
fn batch(len: usize) -> BatchMeta {
    let mut tokens = Vec::new();
    for slot in 0..2u32 {
        for p in 0..len as u32 {
            tokens.push(TokenMeta { token: (7 * p + 3 * slot + 1) % 13, pos: p, slot });
        }
    }
    let n = tokens.len() as u32;
    BatchMeta { tokens, outputs: (0..n).collect(), slot_len: OPTS.ctx as u32 }
}

/// `len` tokens per sequence; `full`: the output rows whose logits are asked for beside the
/// arg-max of all.
fn check(model: &mut dyn Model, len: usize, full: &[u32]) {
    let b = batch(len);
    let (no, nv) = (b.outputs.len(), model.info().n_vocab);
    let mut all = vec![0f32; no * nv];
    model.forward(&b, &mut all).expect("forward");
    assert!(all.iter().any(|&v| v != all[0]), "degenerate logits");
    let want: Vec<u32> = all.chunks(nv).map(ts_core::argmax).collect();
    assert!(want.iter().any(|&w| w != want[0]), "every row picks the same token: a weak test");

    // Arg-max only: no logits at all.
    let mut ids = vec![u32::MAX; no];
    model
        .forward_outputs(&b, Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut ids), queue_argmax: false })
        .expect("argmax only");
    assert_eq!(ids, want);

    // Arg-max of every row and the full logits of some (the cache rows are rewritten with the
    // same values, so the logits must be bit-identical).
    let mut some = vec![f32::NAN; full.len() * nv];
    let mut ids = vec![u32::MAX; no];
    model
        .forward_outputs(&b, Outputs { full_rows: Some(full), logits: &mut some, argmax: Some(&mut ids), queue_argmax: false })
        .expect("subset");
    assert_eq!(ids, want);
    for (k, &r) in full.iter().enumerate() {
        assert_eq!(&some[k * nv..(k + 1) * nv], &all[r as usize * nv..(r as usize + 1) * nv], "full row {r}");
    }

    // Malformed requests are errors, not panics.
    let mut short = vec![0u32; no - 1];
    assert!(model
        .forward_outputs(&b, Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut short), queue_argmax: false })
        .is_err());
    let mut one = vec![0f32; nv];
    assert!(model.forward_outputs(&b, Outputs { full_rows: Some(&[5, 5]), logits: &mut one, argmax: None, queue_argmax: false }).is_err());
    assert!(model
        .forward_outputs(&b, Outputs { full_rows: Some(&[no as u32]), logits: &mut one, argmax: None, queue_argmax: false })
        .is_err());
}

/// [`check`] on the model file at `path`, on the CPU backend.
fn check_file(path: &std::path::Path, len: usize, full: &[u32]) {
    let src = ts_formats::open_model(path).expect("open");
    let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut m = ts_models::load(src.as_ref(), be, OPTS).expect("load");
    check(m.as_mut(), len, full);
}

#[test]
fn llama_outputs_agree_with_full_logits() {
    let p = TempPath::new("ts-models-outputs", "tiny.gguf");
    TinyLlama { hidden: 256, ff: 256, fill: Fill::Random, ..Default::default() }.write(&p);
    check_file(&p, 5, &[1, 4, 9]);
}

#[test]
fn deepseek2_outputs_agree_with_full_logits() {
    let p = TempPath::new("ts-models-outputs", "ds2.gguf");
    let mut spec = Preset::Tiny.spec();
    spec.n_vocab = 320;
    synth_spec(&spec, GgmlType::Q8_0, 3, &p, SynthFormat::Gguf).expect("synth");
    check_file(&p, 5, &[1, 4, 9]);
}

#[test]
fn argmax_rule() {
    use ts_core::argmax;
    assert_eq!(argmax(&[]), 0);
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1, "ties go to the lowest index");
    assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1, "NaN counts as -inf");
    assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0, "all -inf: the first");
    assert_eq!(argmax(&[-0.0, 0.0]), 1, "+0 above -0 (total order)");
    assert_eq!(argmax(&[0.0, -0.0]), 0);
    assert_eq!(argmax(&[f32::NEG_INFINITY, -3.0e38, f32::INFINITY]), 2);
}

#[test]
fn gemma3_chunked_outputs_agree_with_full_logits() {
    let p = TempPath::new("ts-models-outputs", "gemma3.gguf");
    synth_dense(DensePreset::Gemma3Tiny, 5, &p).expect("synth");
    // 20 output rows: gemma3 computes them in chunks of 16 (rows 0-15, then 16-19).
    check_file(&p, 10, &[1, 4, 15, 16, 19]);
}

/// With `CpuBackend::invariant`, a gemma3 of Q4_K / Q6_K / Q5_0 matrices (the Q4_K_M mix) is
/// batch-invariant: the model says so, and a sequence's decode logits are the same bits alone
/// (one row), beside one other sequence (two rows) and among five (the tiled kernel's groups).
/// That is what lets the server run such a model without padding its forwards. (The kernels'
/// own test shows the K-quants' single-row kernels differ from the tiled one in the last bits;
/// in a model this small the 8-bit activations of the next matrix mostly absorb such a
/// difference, so this checks the wiring and the rest of the forward, not the kernels.)
#[test]
fn gemma3_k_quants_are_batch_invariant_in_invariant_mode() {
    let p = TempPath::new("ts-models-outputs", "gemma3-inv.gguf");
    synth_dense(DensePreset::Gemma3Tiny, 7, &p).expect("synth");
    let src = ts_formats::open_model(&p).expect("open");
    let opts = RuntimeOptions { ctx: 32, n_slots: 6, max_batch: 64 };
    let plain = ts_models::load(src.as_ref(), Arc::new(CpuBackend::new(Some(1)).expect("cpu")), opts).expect("load");
    assert!(!plain.info().batch_invariant, "the K-quants' own small-batch kernels are not invariant");
    let mut m = ts_models::load(src.as_ref(), Arc::new(CpuBackend::new(Some(2)).expect("cpu").invariant()), opts).expect("load");
    assert!(m.info().batch_invariant);
    decode_is_batch_invariant(m.as_mut(), |pos, slot| (11 * pos + 5 * slot + 2) % 4000, "gemma3");
}

/// DeepSeek-V2 on the CPU is batch-invariant for its Q8_0 (and float) files, in every layout:
/// the model says so, and a sequence's decode logits are the same bits alone, beside one other
/// sequence and among five, while the MoE groups the batch's tokens by expert differently each
/// time (expert products of 1-3 rows on the invariant kernels, of 4 or more on the tiled one) and
/// the absorbed MLA weights are the file's (MLA layout) or built on the host (legacy, HF). (As
/// for gemma3 above, the next matrix's 8-bit activations mostly hide a kernel's last-bit
/// difference in a model this small: ts-cpu's `moe_rows_are_batch_invariant` is the MoE's
/// sharp test, this one the wiring and the rest of the forward.)
#[test]
fn deepseek2_is_batch_invariant_on_the_cpu() {
    for (format, quant, file) in [
        (SynthFormat::Gguf, GgmlType::Q8_0, "ds2-inv.gguf"),
        (SynthFormat::GgufLegacy, GgmlType::Q8_0, "ds2-inv-legacy.gguf"),
        (SynthFormat::Hf, GgmlType::BF16, "ds2-inv-hf"),
    ] {
        let p = TempPath::new("ts-models-outputs", file);
        synth_spec(&Preset::Tiny.spec(), quant, 11, &p, format).expect("synth");
        let src = ts_formats::open_model(&p).expect("open");
        let opts = RuntimeOptions { ctx: 32, n_slots: 6, max_batch: 64 };
        let mut m = ts_models::load(src.as_ref(), Arc::new(CpuBackend::new(Some(2)).expect("cpu")), opts).expect("load");
        assert!(m.info().batch_invariant, "{format:?}");
        decode_is_batch_invariant(m.as_mut(), |pos, slot| (37 * pos + 101 * slot + 3) % 1000, &format!("{format:?}"));
    }
}

/// Sequence 0's 5-token prompt, then its token at position 5, alone and with 1 and 4 more
/// sequences (slots 1.., 7 prompt tokens, decoding at position 7) beside it: its logits must be
/// the same bits. Token ids come from `tok(pos, slot)`.
fn decode_is_batch_invariant(m: &mut dyn Model, tok: impl Fn(u32, u32) -> u32, what: &str) {
    let nv = m.info().n_vocab;
    let mut run = |others: u32| -> Vec<f32> {
        let mut tokens = Vec::new();
        for slot in 0..=others {
            for pos in 0..if slot == 0 { 5 } else { 7 } {
                tokens.push(TokenMeta { token: tok(pos, slot), pos, slot });
            }
        }
        let n = tokens.len() as u32;
        let mut sink = vec![0f32; nv];
        m.forward(&BatchMeta { tokens, outputs: vec![n - 1], slot_len: 32 }, &mut sink).expect("prompts");
        let tokens = (0..=others).map(|slot| TokenMeta { token: tok(9, slot), pos: if slot == 0 { 5 } else { 7 }, slot }).collect();
        let mut lg = vec![0f32; nv];
        m.forward(&BatchMeta { tokens, outputs: vec![0], slot_len: 32 }, &mut lg).expect("decode");
        lg
    };
    let alone = run(0);
    assert!(alone.iter().any(|&v| v != alone[0]), "{what}: degenerate logits");
    for others in [1u32, 4] {
        let got = run(others);
        let same = alone.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: sequence 0's logits differ alone and beside {others} others");
    }
}
