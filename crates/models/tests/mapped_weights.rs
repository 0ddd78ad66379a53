//! The CPU backend reads weights in place from the file's memory map by default
//! (`TensorData::keep`); `copy_weights` (`--no-mmap`) copies them. Both must give the same logits,
//! and a mapped model must keep working after the file object it was loaded from is dropped.

use std::sync::Arc;

use ts_core::{BatchMeta, TokenMeta};
use ts_cpu::CpuBackend;
use ts_models::RuntimeOptions;
use ts_testkit::{Fill, TempPath, TinyLlama};

const OPTS: RuntimeOptions = RuntimeOptions { ctx: 32, n_slots: 1, max_batch: 8 };

fn logits(copy: bool, path: &std::path::Path) -> Vec<f32> {
    let be = CpuBackend::new(Some(1)).expect("cpu backend");
    let be = Arc::new(if copy { be.copy_weights() } else { be });
    let mut model = {
        let src = ts_formats::open_model(path).expect("open");
        ts_models::load(src.as_ref(), be, OPTS).expect("load")
        // `src` (and its handle on the map) is dropped here: mapped weights hold their own.
    };
    let tokens: Vec<TokenMeta> =
        [3u32, 1, 4, 1, 5].iter().enumerate().map(|(p, &t)| TokenMeta { token: t, pos: p as u32, slot: 0 }).collect();
    let n = tokens.len();
    let meta = BatchMeta { tokens, outputs: (0..n as u32).collect(), slot_len: OPTS.ctx as u32 };
    let nv = model.info().n_vocab;
    let mut out = vec![0f32; n * nv];
    model.forward(&meta, &mut out).expect("forward");
    out
}

#[test]
fn mapped_and_copied_weights_give_the_same_logits() {
    let p = TempPath::new("ts-models-mapped", "tiny.gguf");
    // Random weights (Ramp would make every logit alike).
    TinyLlama { hidden: 256, ff: 256, fill: Fill::Random, ..Default::default() }.write(&p);
    let (mapped, copied) = (logits(false, &p), logits(true, &p));
    assert!(mapped.iter().all(|v| v.is_finite()));
    assert!(mapped.iter().any(|&v| v != mapped[0]), "degenerate logits");
    assert_eq!(mapped, copied);
}
