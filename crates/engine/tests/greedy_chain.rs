//! `Session::greedy_chain` against one `feed_greedy` after another: the same picks, and the
//! session left as the sequential feeds leave it, whether the chain runs to `max`, is stopped by
//! its callback, or meets the context's end. On the CPU backend, whose queued arg-max and
//! `TOKEN_FROM_ARGMAX` tokens are the twin of the CUDA backend's chained steps (the GPU's own
//! check is ts-cuda's `chained_argmax_tokens` and the benchmark's token hash, docs/GPU.md).

use std::sync::Arc;

use ts_cpu::CpuBackend;
use ts_engine::session::Session;
use ts_formats::GgmlType;
use ts_models::synth::{synth_spec, Preset, SynthFormat};
use ts_models::synth_dense::{synth_dense, DensePreset};
use ts_models::{Model, RuntimeOptions};
use ts_testkit::TempPath;

const OPTS: RuntimeOptions = RuntimeOptions { ctx: 24, n_slots: 2, max_batch: 8 };

fn load(path: &std::path::Path) -> Box<dyn Model> {
    let src = ts_formats::open_model(path).expect("open");
    ts_models::load(src.as_ref(), Arc::new(CpuBackend::new(Some(1)).expect("cpu")), OPTS).expect("load")
}

/// The picks of `n` sequential `feed_greedy` calls after `prompt`, and the session's (pos, tokens).
fn sequential(m: &mut dyn Model, prompt: &[u32], n: usize) -> (Vec<u32>, usize, Vec<u32>) {
    let mut s = Session::new(m, 1);
    s.feed(&prompt[..prompt.len() - 1]).expect("prompt");
    let mut t = prompt[prompt.len() - 1];
    let mut picks = Vec::new();
    for _ in 0..n {
        if s.pos >= s.ctx() {
            break;
        }
        t = s.feed_greedy(&[t]).expect("feed");
        picks.push(t);
    }
    (picks, s.pos, s.tokens.clone())
}

/// The same through `greedy_chain` (`stop_after`: the callback returns false at that pick).
fn chained(m: &mut dyn Model, prompt: &[u32], n: usize, stop_after: Option<usize>) -> (Vec<u32>, usize, Vec<u32>) {
    let mut s = Session::new(m, 1);
    s.feed(&prompt[..prompt.len() - 1]).expect("prompt");
    let mut picks = Vec::new();
    let got = s
        .greedy_chain(prompt[prompt.len() - 1], n, |id| {
            picks.push(id);
            stop_after != Some(picks.len())
        })
        .expect("chain");
    assert_eq!(got, picks.len());
    (picks, s.pos, s.tokens.clone())
}

/// `varied`: the picks must not all be one token (the small random llama and gemma3 settle on
/// one; the deepseek2 does not).
fn check(path: &std::path::Path, varied: bool) {
    let mut m = load(path);
    assert!(m.chains_argmax(), "the CPU backend chains steps (its twin of the GPU's)");
    let prompt = [3u32, 9, 4, 1];
    // To `max`, stopped by the callback after 5, and past the context's end (24 - 3 = 21 feeds).
    for (n, stop) in [(12, None), (12, Some(5)), (40, None)] {
        let want = sequential(m.as_mut(), &prompt, stop.unwrap_or(n));
        let got = chained(m.as_mut(), &prompt, n, stop);
        assert!(!varied || want.0.iter().any(|&t| t != want.0[0]), "every pick the same: a weak test {:?}", want.0);
        assert_eq!(got, want, "n={n} stop={stop:?}");
    }
    // The session goes on from a stopped chain as from the sequential feeds: the step enqueued
    // past the stop is forgotten.
    let mut s = Session::new(m.as_mut(), 1);
    s.feed(&prompt).expect("prompt");
    let mut first = Vec::new();
    s.greedy_chain(7, 6, |id| {
        first.push(id);
        first.len() < 3
    })
    .expect("chain");
    let next = s.feed_greedy(&[first[2]]).expect("feed");
    let (pos, toks) = (s.pos, s.tokens.clone());
    drop(s);
    let mut s = Session::new(m.as_mut(), 1);
    s.feed(&prompt).expect("prompt");
    let mut t = 7;
    for &want in &first {
        t = s.feed_greedy(&[t]).expect("feed");
        assert_eq!(t, want);
    }
    assert_eq!(s.feed_greedy(&[t]).expect("feed"), next);
    assert_eq!((s.pos, &s.tokens), (pos, &toks));
}

#[test]
fn greedy_chain_matches_sequential_feeds_llama() {
    let p = TempPath::new("ts-engine-chain", "llama.gguf");
    synth_dense(DensePreset::LlamaTiny, 5, &p).expect("synth");
    check(&p, false);
}

#[test]
fn greedy_chain_matches_sequential_feeds_gemma3() {
    let p = TempPath::new("ts-engine-chain", "gemma3.gguf");
    synth_dense(DensePreset::Gemma3Tiny, 5, &p).expect("synth");
    check(&p, false);
}

#[test]
fn greedy_chain_matches_sequential_feeds_deepseek2() {
    let p = TempPath::new("ts-engine-chain", "ds2.gguf");
    let mut spec = Preset::Tiny.spec();
    spec.n_vocab = 320;
    synth_spec(&spec, GgmlType::Q8_0, 3, &p, SynthFormat::Gguf).expect("synth");
    check(&p, true);
}
