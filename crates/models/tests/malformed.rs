//! Malformed model files at the model level (the file itself is well-formed GGUF or HF, but
//! what it says does not add up): every case is an error naming the tensor or key at fault,
//! returned quickly and without a huge allocation.
//!
//! File-level corruption (truncation, offsets past the end, overlapping tensors, absurd counts)
//! is covered by `crates/formats/tests/gguf.rs` and `hf.rs`; NaN/Inf weights by
//! `turbospark inspect --check` in `crates/cli/tests/cli_errors.rs`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ts_cpu::CpuBackend;
use ts_models::RuntimeOptions;
use ts_testkit::{TempPath, TinyLlama};

const OPTS: RuntimeOptions = RuntimeOptions { ctx: 32, n_slots: 1, max_batch: 8 };

fn tmpdir(name: &str) -> TempPath {
    TempPath::dir("ts-models-malformed", name)
}

/// A tiny llama GGUF (hidden 64, 4 heads, 2 kv heads, one layer, vocab 16) with `meta` added to
/// (or replacing) the llama keys and `shapes` replacing tensor shapes by name.
fn tiny_llama(path: &Path, meta: &[(&str, u32)], shapes: &[(&str, Vec<usize>)]) {
    TinyLlama { meta, shapes, ..Default::default() }.write(path);
}

/// Opens `path` as a model on the CPU; the error text, which must come within a second.
fn open_err(path: &Path) -> String {
    let t = Instant::now();
    let src = match ts_formats::open_model(path) {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let r = ts_models::load(src.as_ref(), be, OPTS);
    assert!(t.elapsed() < Duration::from_secs(5), "opening took {:?}", t.elapsed());
    match r {
        Ok(_) => panic!("{}: opening should fail", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_tiny_llama_itself_opens() {
    let d = tmpdir("ok");
    let p = d.join("ok.gguf");
    tiny_llama(&p, &[], &[]);
    let src = ts_formats::open_model(&p).expect("open");
    let be = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    ts_models::load(src.as_ref(), be, OPTS).expect("the unmodified tiny llama loads");
}

#[test]
fn attn_q_shape_disagreeing_with_head_count_names_the_tensor() {
    let d = tmpdir("attnq");
    // attn_q stored for 2 heads of 16 (32 outputs) while the metadata says 4 heads of 16.
    let p = d.join("q.gguf");
    tiny_llama(&p, &[], &[("blk.0.attn_q.weight", vec![64, 32])]);
    let e = open_err(&p);
    assert!(e.contains("blk.0.attn_q.weight") && e.contains("shape"), "{e}");
    // The other way round: tensors as written, head_count changed to 8 (head dim 8).
    let p = d.join("heads.gguf");
    tiny_llama(&p, &[("llama.attention.head_count", 8), ("llama.attention.head_count_kv", 8)], &[]);
    let e = open_err(&p);
    assert!(e.contains("blk.0.attn_k.weight") && e.contains("shape"), "{e}");
}

#[test]
fn zero_or_absurd_geometry_is_refused_before_allocating() {
    let d = tmpdir("absurd");
    for (i, (key, val, needle)) in [
        ("llama.attention.head_count", 0, "heads"),
        ("llama.attention.head_count_kv", 0, "kv heads"),
        ("llama.attention.head_count_kv", 3, "kv heads"),
        ("llama.block_count", 0, "layers"),
        ("llama.block_count", u32::MAX, "layers"),
        ("llama.embedding_length", u32::MAX, "hidden size"),
        ("llama.vocab_size", u32::MAX, "vocab"),
        ("llama.feed_forward_length", 0, "ffn width"),
    ]
    .into_iter()
    .enumerate()
    {
        let p = d.join(format!("m{i}.gguf"));
        tiny_llama(&p, &[(key, val)], &[]);
        let e = open_err(&p);
        assert!(e.contains(needle) || e.contains(key), "{key} = {val}: {e}");
    }
    // Within the per-key range but far beyond the file: 16M layers must not reserve gigabytes
    // for layers that are not there; the first missing tensor is named.
    let p = d.join("layers.gguf");
    tiny_llama(&p, &[("llama.block_count", 1 << 24)], &[]);
    let e = open_err(&p);
    assert!(e.contains("blk.1."), "{e}");
    // A vocabulary far larger than token_embd.
    let p = d.join("vocab.gguf");
    tiny_llama(&p, &[("llama.vocab_size", 1 << 24)], &[]);
    let e = open_err(&p);
    assert!(e.contains("token_embd.weight"), "{e}");
}

/// Safetensors bytes holding one F32 tensor.
fn one_tensor_safetensors(name: &str, shape: &[usize]) -> Vec<u8> {
    let n: usize = shape.iter().product();
    let header = format!(r#"{{"{name}":{{"dtype":"F32","shape":{shape:?},"data_offsets":[0,{}]}}}}"#, n * 4);
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(0u8, n * 4));
    out
}

#[test]
fn hf_folder_of_an_unsupported_family() {
    let d = tmpdir("hf-mamba");
    std::fs::write(d.join("config.json"), r#"{"model_type": "mamba", "hidden_size": 8, "num_hidden_layers": 1}"#).expect("config");
    std::fs::write(d.join("model.safetensors"), one_tensor_safetensors("backbone.embeddings.weight", &[4, 8])).expect("weights");
    let e = open_err(&d);
    assert!(e.contains("architecture 'mamba' is not supported"), "{e}");
    // No model_type at all.
    std::fs::write(d.join("config.json"), r#"{"hidden_size": 8}"#).expect("config");
    let e = open_err(&d);
    assert!(e.contains("architecture") || e.contains("model_type"), "{e}");
    // A supported family whose config lacks what it needs names the key.
    std::fs::write(d.join("config.json"), r#"{"model_type": "llama", "hidden_size": 8}"#).expect("config");
    let e = open_err(&d);
    assert!(e.contains("num_hidden_layers") || e.contains("intermediate_size") || e.contains("num_attention_heads"), "{e}");
}
