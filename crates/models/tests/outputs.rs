//! `Model::forward_outputs`: the arg-max rows and a subset of full rows must be exactly what the
//! full logits say ([`ts_core::argmax`] of each row, the same rows bit for bit), for every family
//! path that delivers logits (llama's single read, deepseek2's recorded step, gemma3's chunks are
//! covered by the shared `Outputs::deliver`).

use std::sync::Arc;

use ts_core::{BatchMeta, TokenMeta};
use ts_cpu::CpuBackend;
use ts_formats::GgmlType;
use ts_models::synth::{synth_spec, Preset, SynthFormat};
use ts_models::{Model, Outputs, RuntimeOptions};
use ts_testkit::{Fill, TempPath, TinyLlama};

const OPTS: RuntimeOptions = RuntimeOptions { ctx: 32, n_slots: 3, max_batch: 16 };

/// Two sequences in slots 0 and 1, every token an output row.
fn batch() -> BatchMeta {
    let mut tokens = Vec::new();
    for (slot, seq) in [[3u32, 1, 4, 1, 5], [9, 2, 6, 5, 3]].iter().enumerate() {
        for (p, &t) in seq.iter().enumerate() {
            tokens.push(TokenMeta { token: t, pos: p as u32, slot: slot as u32 });
        }
    }
    let n = tokens.len() as u32;
    BatchMeta { tokens, outputs: (0..n).collect(), slot_len: OPTS.ctx as u32 }
}

fn check(model: &mut dyn Model) {
    let b = batch();
    let (no, nv) = (b.outputs.len(), model.info().n_vocab);
    let mut all = vec![0f32; no * nv];
    model.forward(&b, &mut all).expect("forward");
    assert!(all.iter().any(|&v| v != all[0]), "degenerate logits");
    let want: Vec<u32> = all.chunks(nv).map(ts_core::argmax).collect();
    assert!(want.iter().any(|&w| w != want[0]), "every row picks the same token: a weak test");

    // Arg-max only: no logits at all.
    let mut ids = vec![u32::MAX; no];
    model.forward_outputs(&b, Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut ids) }).expect("argmax only");
    assert_eq!(ids, want);

    // Arg-max of every row and the full logits of rows 1, 4 and 9 (the cache rows are rewritten
    // with the same values, so the logits must be bit-identical).
    let full = [1u32, 4, 9];
    let mut some = vec![f32::NAN; full.len() * nv];
    let mut ids = vec![u32::MAX; no];
    model.forward_outputs(&b, Outputs { full_rows: Some(&full), logits: &mut some, argmax: Some(&mut ids) }).expect("subset");
    assert_eq!(ids, want);
    for (k, &r) in full.iter().enumerate() {
        assert_eq!(&some[k * nv..(k + 1) * nv], &all[r as usize * nv..(r as usize + 1) * nv], "full row {r}");
    }

    // Malformed requests are errors, not panics.
    let mut short = vec![0u32; no - 1];
    assert!(model.forward_outputs(&b, Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut short) }).is_err());
    let mut one = vec![0f32; nv];
    assert!(model.forward_outputs(&b, Outputs { full_rows: Some(&[5, 5]), logits: &mut one, argmax: None }).is_err());
    assert!(model.forward_outputs(&b, Outputs { full_rows: Some(&[no as u32]), logits: &mut one, argmax: None }).is_err());
}

#[test]
fn llama_outputs_agree_with_full_logits() {
    let p = TempPath::new("ts-models-outputs", "tiny.gguf");
    TinyLlama { hidden: 256, ff: 256, fill: Fill::Random, ..Default::default() }.write(&p);
    let src = ts_formats::open_model(&p).expect("open");
    let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut m = ts_models::load(src.as_ref(), be, OPTS).expect("load");
    check(m.as_mut());
}

#[test]
fn deepseek2_outputs_agree_with_full_logits() {
    let p = TempPath::new("ts-models-outputs", "ds2.gguf");
    let mut spec = Preset::Tiny.spec();
    spec.n_vocab = 320;
    synth_spec(&spec, GgmlType::Q8_0, 3, &p, SynthFormat::Gguf).expect("synth");
    let src = ts_formats::open_model(&p).expect("open");
    let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut m = ts_models::load(src.as_ref(), be, OPTS).expect("load");
    check(m.as_mut());
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
