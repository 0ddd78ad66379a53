//! The loader's warm-up forward (run at open for backends that size scratch on first use) leaves
//! the model giving exactly the logits of a model that was never warmed up.

use std::sync::Arc;

use ts_core::BatchMeta;
use ts_models::{
    synth_dense::{synth_dense, DensePreset},
    RuntimeOptions,
};

#[test]
fn warm_up_does_not_change_results() {
    let dir = std::env::temp_dir().join(format!("ts-warm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("llama-tiny.gguf");
    synth_dense(DensePreset::LlamaTiny, 3, &path).unwrap();
    let src = ts_formats::open_model(&path).unwrap();
    let opts = RuntimeOptions { ctx: 64, n_slots: 2, max_batch: 16 };
    let toks: Vec<u32> = (0..10).map(|i| (i * 37 + 5) % 4096).collect();
    let run = |warm: bool| {
        let be = Arc::new(ts_cpu::CpuBackend::new(Some(2)).unwrap());
        let mut m = ts_models::load(src.as_ref(), be, opts).unwrap();
        if warm {
            ts_models::warm_up(m.as_mut()).unwrap();
        }
        let nv = m.info().n_vocab;
        let mut lg = vec![0f32; toks.len() * nv];
        m.forward(&BatchMeta::sequence(&toks, 0, 64, true), &mut lg).unwrap();
        lg
    };
    assert_eq!(run(false), run(true));
    let _ = std::fs::remove_dir_all(&dir);
}
