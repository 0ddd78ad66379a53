//! Hugging Face folder reader, and `open_model` dispatch.

mod common;

use common::{bytes, TempDir};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use ts_formats::hf::HfFolder;
use ts_formats::{open_model, GgmlType, TensorSource, Value};

const CONFIG: &str = r#"{
  "model_type": "llama",
  "architectures": ["LlamaForCausalLM"],
  "hidden_size": 8,
  "num_hidden_layers": 2,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "bos_token_id": 1,
  "eos_token_id": [2, 3],
  "pad_token_id": null,
  "big": 18446744073709551615,
  "neg": -7,
  "rope_scaling": {"factor": 8.0, "rope_type": "llama3", "nested": {"deep": 1, "gone": null}},
  "mixed": [1, null, {"a": 1}, "s"]
}"#;

/// One tensor to serialise: name, dtype, safetensors shape (PyTorch order), bytes.
struct St {
    name: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn st(name: &'static str, dtype: Dtype, shape: &[usize], seed: u32) -> St {
    let n: usize = shape.iter().product::<usize>() * dtype.bitsize() / 8;
    St { name, dtype, shape: shape.to_vec(), data: bytes(n, seed) }
}

fn write_st(path: &std::path::Path, tensors: &[&St]) {
    let views: Vec<(&str, TensorView<'_>)> =
        tensors.iter().map(|t| (t.name, TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    let buf = safetensors::serialize(views, None).unwrap();
    std::fs::write(path, buf).unwrap();
}

fn folder(config: &str) -> TempDir {
    let d = TempDir::new("hf");
    std::fs::write(d.join("config.json"), config).unwrap();
    d
}

fn check_tensor(src: &dyn TensorSource, t: &St) {
    let td = src.tensor(t.name).unwrap_or_else(|| panic!("missing {}", t.name));
    let want_dtype = match t.dtype {
        Dtype::BF16 => GgmlType::BF16,
        Dtype::F16 => GgmlType::F16,
        Dtype::F32 => GgmlType::F32,
        _ => unreachable!(),
    };
    assert_eq!(td.dtype, want_dtype);
    let reversed: Vec<usize> = t.shape.iter().rev().copied().collect();
    assert_eq!(td.shape, &reversed[..], "{}", t.name);
    assert_eq!(td.data, &t.data[..], "{}", t.name);
    assert_eq!(td.name, t.name);
}

#[test]
fn single_file_shapes_reversed_bytes_as_stored_metadata_flattened() {
    let d = folder(CONFIG);
    let emb = st("model.embed_tokens.weight", Dtype::BF16, &[5, 8], 1); // [vocab, hidden]
    let norm = st("model.norm.weight", Dtype::F32, &[8], 2);
    let q = st("model.layers.0.self_attn.q_proj.weight", Dtype::F16, &[4, 8], 3); // [out, in]
    let cube = st("cube", Dtype::BF16, &[2, 3, 4], 4);
    write_st(&d.join("model.safetensors"), &[&emb, &norm, &q, &cube]);
    // A stray extra safetensors file is ignored when model.safetensors exists.
    write_st(&d.join("consolidated.safetensors"), &[&emb]);

    let f = HfFolder::open(d.path()).unwrap();
    for t in [&emb, &norm, &q, &cube] {
        check_tensor(&f, t);
    }
    // [out, in] = [4, 8] becomes shape [in, out] = [8, 4].
    assert_eq!(f.tensor("model.layers.0.self_attn.q_proj.weight").unwrap().shape, &[8, 4]);
    assert_eq!(f.tensor("model.embed_tokens.weight").unwrap().ne(), [8, 5, 1, 1]);
    assert_eq!(f.tensor_names().len(), 4);
    assert_eq!(f.weight_files().len(), 1);
    assert!(f.tensor("nope").is_none());

    let m = f.metadata();
    assert_eq!(m.get("general.architecture"), Some(&Value::String("llama".into())));
    assert_eq!(m.get("hf.model_type"), Some(&Value::String("llama".into())));
    assert_eq!(m.get("hf.hidden_size"), Some(&Value::I64(8)));
    assert_eq!(m.get("hf.neg"), Some(&Value::I64(-7)));
    assert_eq!(m.get("hf.big"), Some(&Value::U64(u64::MAX)));
    assert_eq!(m.get("hf.rms_norm_eps"), Some(&Value::F64(1e-5)));
    assert_eq!(m.get("hf.rope_theta"), Some(&Value::F64(10000.0)));
    assert_eq!(m.get("hf.tie_word_embeddings"), Some(&Value::Bool(false)));
    assert_eq!(m.get("hf.eos_token_id"), Some(&Value::Array(vec![Value::I64(2), Value::I64(3)])));
    assert_eq!(m.get("hf.architectures"), Some(&Value::Array(vec![Value::String("LlamaForCausalLM".into())])));
    assert_eq!(m.get("hf.rope_scaling.factor"), Some(&Value::F64(8.0)));
    assert_eq!(m.get("hf.rope_scaling.rope_type"), Some(&Value::String("llama3".into())));
    assert_eq!(m.get("hf.rope_scaling.nested.deep"), Some(&Value::I64(1)));
    assert!(!m.contains_key("hf.rope_scaling.nested.gone"));
    assert!(!m.contains_key("hf.pad_token_id"));
    assert!(!m.contains_key("hf.rope_scaling"));
    assert_eq!(
        m.get("hf.mixed"),
        Some(&Value::Array(vec![
            Value::I64(1),
            Value::String("null".into()),
            Value::String("{\"a\":1}".into()),
            Value::String("s".into())
        ]))
    );
    assert_eq!(f.config()["rope_scaling"]["factor"], 8.0);
    assert_eq!(f.config()["pad_token_id"], serde_json::Value::Null);

    // open_model on the folder.
    let src = open_model(d.path()).unwrap();
    check_tensor(src.as_ref(), &q);
    assert_eq!(src.metadata().get("hf.num_hidden_layers").and_then(|v| v.as_u64()), Some(2));
}

#[test]
fn bf16_bytes_are_exactly_as_stored() {
    let d = folder(r#"{"model_type": "x"}"#);
    let vals = [1.0f32, -2.5, 3.0e-3, 65504.0, -0.0, 7.0];
    let data: Vec<u8> = vals.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let t = St { name: "w", dtype: Dtype::BF16, shape: vec![2, 3], data };
    write_st(&d.join("model.safetensors"), &[&t]);
    let f = HfFolder::open(d.path()).unwrap();
    let td = f.tensor("w").unwrap();
    assert_eq!(td.shape, &[3, 2]);
    let back: Vec<f32> = td.data.chunks(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect();
    let want: Vec<f32> = vals.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
    assert_eq!(back, want);
}

#[test]
fn index_with_two_shards() {
    let d = folder(CONFIG);
    let a = st("model.layers.0.mlp.up_proj.weight", Dtype::BF16, &[16, 8], 1);
    let b = st("model.layers.0.mlp.down_proj.weight", Dtype::BF16, &[8, 16], 2);
    let c = st("lm_head.weight", Dtype::F16, &[5, 8], 3);
    write_st(&d.join("model-00001-of-00002.safetensors"), &[&a, &b]);
    write_st(&d.join("model-00002-of-00002.safetensors"), &[&c]);
    // A file not in the index is not loaded.
    write_st(&d.join("other.safetensors"), &[&a]);
    let index = serde_json::json!({
        "metadata": {"total_size": 0},
        "weight_map": {
            a.name: "model-00001-of-00002.safetensors",
            b.name: "model-00001-of-00002.safetensors",
            c.name: "model-00002-of-00002.safetensors",
        }
    });
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let f = HfFolder::open(d.path()).unwrap();
    for t in [&a, &b, &c] {
        check_tensor(&f, t);
    }
    assert_eq!(f.weight_files().len(), 2);
    assert_eq!(f.tensor_file(c.name).unwrap(), d.join("model-00002-of-00002.safetensors"));
    let mut names = f.tensor_names();
    names.sort();
    assert_eq!(names, vec![c.name, b.name, a.name]);
    assert_eq!(f.tensor(a.name).unwrap().shape, &[8, 16]);
}

#[test]
fn glob_fallback_and_duplicates_across_shards() {
    let d = folder(CONFIG);
    let a = st("a", Dtype::F32, &[3], 1);
    let b = st("b", Dtype::F32, &[3], 2);
    write_st(&d.join("part1.safetensors"), &[&a]);
    write_st(&d.join("part2.safetensors"), &[&b]);
    let f = HfFolder::open(d.path()).unwrap();
    check_tensor(&f, &a);
    check_tensor(&f, &b);

    // The same name in two shards.
    write_st(&d.join("part3.safetensors"), &[&a]);
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("part3.safetensors") && e.contains("'a'") && e.contains("part1.safetensors"), "{e}");

    // Also through an index listing both shards.
    let index = serde_json::json!({"weight_map": {"a": "part1.safetensors", "b": "part3.safetensors"}});
    std::fs::write(d.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("'a'") && e.contains("also present"), "{e}");
}

#[test]
fn index_errors() {
    let d = folder(CONFIG);
    let a = st("a", Dtype::F32, &[3], 1);
    write_st(&d.join("s1.safetensors"), &[&a]);
    let idx = d.join("model.safetensors.index.json");

    // Tensor listed in the wrong shard.
    write_st(&d.join("s2.safetensors"), &[&st("b", Dtype::F32, &[1], 2)]);
    std::fs::write(&idx, r#"{"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors"}}"#).unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("index.json") && e.contains("'a'") && e.contains("s2.safetensors"), "{e}");

    // Shard missing.
    std::fs::write(&idx, r#"{"weight_map": {"a": "missing.safetensors"}}"#).unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("missing.safetensors"), "{e}");

    // Path escaping the folder.
    std::fs::write(&idx, r#"{"weight_map": {"a": "../s1.safetensors"}}"#).unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("not a file inside the folder"), "{e}");

    // No weight_map; invalid JSON.
    std::fs::write(&idx, r#"{"metadata": {}}"#).unwrap();
    assert!(HfFolder::open(d.path()).unwrap_err().to_string().contains("weight_map"));
    std::fs::write(&idx, "{not json").unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("index.json") && e.contains("invalid JSON"), "{e}");
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let d = folder(CONFIG);
    let ok = st("ok", Dtype::F32, &[2], 1);
    let bad = st("model.rotary.inv_freq", Dtype::I64, &[4], 2);
    write_st(&d.join("model.safetensors"), &[&ok, &bad]);
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("'model.rotary.inv_freq'") && e.contains("I64"), "{e}");
}

#[test]
fn more_than_four_dims_is_an_error() {
    let d = folder(CONFIG);
    write_st(&d.join("model.safetensors"), &[&st("five", Dtype::F32, &[1, 2, 1, 2, 1], 1)]);
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("'five'"), "{e}");
}

#[test]
fn missing_or_bad_config_and_weights() {
    // No config.json.
    let d = TempDir::new("noconf");
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("config.json"), "{e}");
    // Config not an object / not JSON.
    std::fs::write(d.join("config.json"), "[1]").unwrap();
    assert!(HfFolder::open(d.path()).unwrap_err().to_string().contains("not a JSON object"));
    std::fs::write(d.join("config.json"), "{").unwrap();
    assert!(HfFolder::open(d.path()).unwrap_err().to_string().contains("invalid JSON"));
    // No weights.
    std::fs::write(d.join("config.json"), "{}").unwrap();
    let e = HfFolder::open(d.path()).unwrap_err().to_string();
    eprintln!("{e}");
    assert!(e.contains("no model.safetensors"), "{e}");
    // A config without model_type has no general.architecture.
    write_st(&d.join("model.safetensors"), &[&st("x", Dtype::F16, &[2], 1)]);
    let f = HfFolder::open(d.path()).unwrap();
    assert!(f.metadata().get("general.architecture").is_none());
    // Truncated / corrupt safetensors at every length: an error naming the file, never a panic.
    let full = std::fs::read(d.join("model.safetensors")).unwrap();
    for len in 0..full.len() {
        std::fs::write(d.join("model.safetensors"), &full[..len]).unwrap();
        let e = HfFolder::open(d.path()).unwrap_err().to_string();
        eprintln!("{e}");
        assert!(e.contains("model.safetensors") && !e.contains('\n'), "{e}");
    }
}

#[test]
fn scalar_tensor_has_shape_1() {
    let d = folder("{}");
    write_st(&d.join("model.safetensors"), &[&st("s", Dtype::F32, &[], 1)]);
    let f = HfFolder::open(d.path()).unwrap();
    assert_eq!(f.tensor("s").unwrap().shape, &[1]);
    assert_eq!(f.tensor("s").unwrap().data.len(), 4);
}

#[test]
fn open_model_dispatch_and_errors() {
    let d = TempDir::new("open");
    // Missing path.
    let missing = d.join("does-not-exist.gguf");
    let e = model_err(open_model(&missing));
    eprintln!("{e}");
    assert!(e.contains("does-not-exist.gguf"), "{e}");
    // A text file, an empty file, a short file.
    for (name, content) in [("notes.txt", &b"hello world"[..]), ("empty.bin", b""), ("gg.bin", b"GG")] {
        let p = d.join(name);
        std::fs::write(&p, content).unwrap();
        let e = model_err(open_model(&p));
        eprintln!("{e}");
        assert!(e.contains(name) && e.contains("not a GGUF file or a Hugging Face folder"), "{e}");
        assert!(!e.contains('\n'));
    }
    // A GGUF file.
    let p = d.join("m.gguf");
    let mut w = ts_formats::gguf::GgufWriter::create(&p).unwrap();
    w.add("general.architecture", Value::String("qwen2".into())).unwrap();
    w.add_tensor_info("t", GgmlType::F32, &[2]).unwrap();
    w.write_tensor_data(&[0; 8]).unwrap();
    w.finish().unwrap();
    let src = open_model(&p).unwrap();
    assert_eq!(src.tensor_names(), vec!["t"]);
    // A folder that is not an HF folder: the error names config.json.
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let e = model_err(open_model(&sub));
    eprintln!("{e}");
    assert!(e.contains("config.json"), "{e}");
}

fn model_err(r: ts_formats::Result<Box<dyn TensorSource>>) -> String {
    match r {
        Ok(src) => panic!("{} opened", src.path()),
        Err(e) => e.to_string(),
    }
}
