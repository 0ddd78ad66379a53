//! GGUF writer → reader round trips, and every class of malformed file.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{bytes, TempDir};
use ts_formats::gguf::{GgufFile, GgufWriter};
use ts_formats::{open_model, FormatError, GgmlType, TensorSource, Value};

// ---------------------------------------------------------------------------------------------
// A raw GGUF byte builder, for files the writer refuses to produce.
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, tensors: u64, kvs: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(tensors).u64(kvs);
        r
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// A u32 metadata entry.
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to `align` and appends `n` data bytes.
    fn data(&mut self, align: usize, n: usize) -> &mut Self {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        let d = bytes(n, 7);
        self.raw(&d)
    }
    fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

/// Writes `data` to a file in `dir` and opens it.
fn open_bytes(dir: &TempDir, data: &[u8]) -> Result<GgufFile, FormatError> {
    let p = dir.join("t.gguf");
    std::fs::write(&p, data).unwrap();
    GgufFile::open(&p)
}

/// Opens `data`, expecting an error whose text contains every needle; returns the text.
fn expect_err(data: &[u8], needles: &[&str]) -> String {
    let dir = TempDir::new("err");
    let e = match open_bytes(&dir, data) {
        Ok(f) => panic!("expected an error containing {needles:?}, file opened: {f:?}"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("t.gguf"), "error does not name the file: {e}");
    assert!(!e.contains('\n'), "error is not one line: {e}");
    for n in needles {
        assert!(e.contains(n), "error {e:?} does not contain {n:?}");
    }
    eprintln!("{e}");
    e
}

// ---------------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------------

fn all_metadata() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60000)),
        ("t.i16", Value::I16(-30000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX - 3)),
        ("t.i64", Value::I64(i64::MIN + 5)),
        ("t.f32", Value::F32(-1.5e-7)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("t.bool.true", Value::Bool(true)),
        ("t.bool.false", Value::Bool(false)),
        ("t.string.empty", Value::String(String::new())),
        ("t.string.unicode", Value::String("héllo ▁wörld 🦀\n\t\0end".into())),
        ("t.arr.u8", Value::Array(vec![Value::U8(1), Value::U8(255)])),
        ("t.arr.i8", Value::Array(vec![Value::I8(-1), Value::I8(1)])),
        ("t.arr.u16", Value::Array(vec![Value::U16(1), Value::U16(2)])),
        ("t.arr.i16", Value::Array(vec![Value::I16(-1)])),
        ("t.arr.u32", Value::Array(vec![Value::U32(7); 5])),
        ("t.arr.i32", Value::Array((0..100).map(|i| Value::I32(i - 50)).collect())),
        ("t.arr.u64", Value::Array(vec![Value::U64(1 << 40)])),
        ("t.arr.i64", Value::Array(vec![Value::I64(-(1 << 40))])),
        ("t.arr.f32", Value::Array(vec![Value::F32(0.5), Value::F32(-0.25)])),
        ("t.arr.f64", Value::Array(vec![Value::F64(1e300)])),
        ("t.arr.bool", Value::Array(vec![Value::Bool(true), Value::Bool(false)])),
        ("tokenizer.ggml.tokens", Value::Array(["<s>", "</s>", "▁the", "é", ""].iter().map(|s| Value::String(s.to_string())).collect())),
        ("t.arr.empty", Value::Array(vec![])),
        (
            "t.arr.nested",
            Value::Array(vec![
                Value::Array(vec![Value::I32(1), Value::I32(2)]),
                Value::Array(vec![Value::String("x".into())]),
                Value::Array(vec![]),
                Value::Array(vec![Value::Array(vec![Value::F64(2.5)])]),
            ]),
        ),
    ]
}

struct T {
    name: &'static str,
    dtype: GgmlType,
    shape: Vec<usize>,
}

fn all_tensors() -> Vec<T> {
    vec![
        T { name: "token_embd.weight", dtype: GgmlType::F32, shape: vec![4, 3] },
        T { name: "odd.f16", dtype: GgmlType::F16, shape: vec![7] },
        T { name: "cube.bf16", dtype: GgmlType::BF16, shape: vec![2, 3, 2] },
        T { name: "blk.0.attn_q.weight", dtype: GgmlType::Q8_0, shape: vec![64, 3] },
        T { name: "blk.0.ffn_down.weight", dtype: GgmlType::Q4K, shape: vec![256, 2, 1, 2] },
        T { name: "q4_0", dtype: GgmlType::Q4_0, shape: vec![32] },
        T { name: "ids.i32", dtype: GgmlType::I32, shape: vec![5] },
        T { name: "empty", dtype: GgmlType::F32, shape: vec![0, 4] },
        T { name: "q6k", dtype: GgmlType::Q6K, shape: vec![512] },
    ]
}

fn tensor_bytes(t: &T, seed: u32) -> Vec<u8> {
    let n = t.dtype.row_bytes(t.shape[0]).unwrap() * t.shape[1..].iter().product::<usize>();
    bytes(n, seed)
}

#[test]
fn round_trip_every_metadata_type_and_several_dtypes() {
    let dir = TempDir::new("rt");
    let path = dir.join("m.gguf");
    let meta = all_metadata();
    let tensors = all_tensors();
    let mut w = GgufWriter::create(&path).unwrap();
    for (k, v) in &meta {
        w.add(*k, v.clone()).unwrap();
    }
    for t in &tensors {
        w.add_tensor_info(t.name, t.dtype, &t.shape).unwrap();
    }
    w.write_header().unwrap();
    for (i, t) in tensors.iter().enumerate() {
        assert_eq!(w.next_tensor(), Some(t.name));
        w.write_tensor_data(&tensor_bytes(t, i as u32)).unwrap();
    }
    assert_eq!(w.next_tensor(), None);
    w.finish().unwrap();

    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.data_start() % 32, 0);
    let expect: BTreeMap<String, Value> = meta.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    assert_eq!(f.metadata(), &expect);
    assert_eq!(f.get("t.u32"), Some(&Value::U32(4_000_000_000)));
    assert_eq!(f.get("nope"), None);
    assert_eq!(f.tensor_infos().len(), tensors.len());
    assert_eq!(f.tensor_names(), tensors.iter().map(|t| t.name).collect::<Vec<_>>());
    for (i, t) in tensors.iter().enumerate() {
        let info = &f.tensor_infos()[i];
        assert_eq!(info.name, t.name);
        assert_eq!(info.dtype, t.dtype);
        assert_eq!(info.shape, t.shape);
        assert_eq!(info.offset % 32, 0);
        let want = tensor_bytes(t, i as u32);
        assert_eq!(info.size, want.len());
        let td = f.tensor(t.name).unwrap();
        assert_eq!(td.name, t.name);
        assert_eq!(td.dtype, t.dtype);
        assert_eq!(td.shape, &t.shape[..]);
        assert_eq!(td.data, &want[..], "data of {}", t.name);
        assert_eq!(td.numel(), t.shape.iter().product::<usize>());
    }
    assert!(f.tensor("missing").is_none());

    // The same file through open_model.
    let m = open_model(&path).unwrap();
    assert_eq!(m.metadata().get("general.architecture").and_then(|v| v.as_str()), Some("llama"));
    assert_eq!(m.tensor("cube.bf16").unwrap().shape, &[2, 3, 2]);
    assert_eq!(m.path(), path.display().to_string());
}

#[test]
fn writer_streams_chunks_and_custom_alignment() {
    let mut w = GgufWriter::new(Vec::new());
    w.add("general.alignment", Value::U32(64)).unwrap();
    w.add_tensor_info("a", GgmlType::F32, &[10]).unwrap();
    w.add_tensor_info("b", GgmlType::Q8_0, &[32, 2]).unwrap();
    assert_eq!(w.tensor_size("b"), Some(68));
    let a = bytes(40, 1);
    let b = bytes(68, 2);
    for chunk in a.chunks(7) {
        w.write_tensor_chunk(chunk).unwrap();
    }
    w.write_tensor_chunk(&b[..1]).unwrap();
    w.write_tensor_chunk(&b[1..]).unwrap();
    let out = w.finish().unwrap();
    assert_eq!(out.len() % 64, 0);

    let dir = TempDir::new("chunks");
    let f = open_bytes(&dir, &out).unwrap();
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_start() % 64, 0);
    assert_eq!(f.tensor_infos()[1].offset, 64);
    assert_eq!(f.tensor("a").unwrap().data, &a[..]);
    assert_eq!(f.tensor("b").unwrap().data, &b[..]);
}

#[test]
fn metadata_only_file() {
    let mut w = GgufWriter::new(Vec::new());
    w.add("general.name", Value::String("vocab only".into())).unwrap();
    let out = w.finish().unwrap();
    let dir = TempDir::new("metaonly");
    let f = open_bytes(&dir, &out).unwrap();
    assert!(f.tensor_infos().is_empty());
    assert_eq!(f.get("general.name").and_then(|v| v.as_str()), Some("vocab only"));
}

#[test]
fn reads_version_2() {
    let mut w = GgufWriter::new(Vec::new());
    w.add_tensor_info("x", GgmlType::F16, &[4]).unwrap();
    w.write_tensor_data(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let mut out = w.finish().unwrap();
    out[4..8].copy_from_slice(&2u32.to_le_bytes());
    let dir = TempDir::new("v2");
    let f = open_bytes(&dir, &out).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensor("x").unwrap().data, &[1, 2, 3, 4, 5, 6, 7, 8]);
}

#[test]
fn zero_dim_tensor_is_a_scalar() {
    let data = Raw::header(3, 1, 0).tensor("s", &[], 0, 0).data(32, 4).done();
    let dir = TempDir::new("scalar");
    let f = open_bytes(&dir, &data).unwrap();
    assert_eq!(f.tensor("s").unwrap().shape, &[1]);
    assert_eq!(f.tensor("s").unwrap().data.len(), 4);
}

#[test]
fn writer_misuse_is_an_error() {
    let e = |r: Result<(), FormatError>| r.unwrap_err().to_string();

    let mut w = GgufWriter::new(Vec::new());
    w.add("k", Value::U8(1)).unwrap();
    assert!(e(w.add("k", Value::U8(2))).contains("duplicate metadata key \"k\""));
    assert!(e(w.add("arr", Value::Array(vec![Value::U8(1), Value::I8(1)]))).contains("homogeneous"));
    assert!(e(w.add("general.alignment", Value::U32(48))).contains("power of two"));
    assert!(e(w.add("general.alignment", Value::U64(64))).contains("U32"));
    w.add_tensor_info("t", GgmlType::F32, &[4]).unwrap();
    assert!(e(w.add_tensor_info("t", GgmlType::F32, &[4])).contains("duplicate tensor name"));
    assert!(e(w.add_tensor_info("q", GgmlType::Q4_0, &[33])).contains("'q'"));
    assert!(e(w.add_tensor_info("five", GgmlType::F32, &[1, 1, 1, 1, 1])).contains("'five'"));
    assert!(e(w.add_tensor_info("none", GgmlType::F32, &[])).contains("'none'"));
    w.add_tensor_info("u", GgmlType::F16, &[2]).unwrap();
    // Wrong byte count names the tensor, and writes nothing.
    let msg = e(w.write_tensor_data(&[0; 15]));
    assert!(msg.contains("'t'") && msg.contains("15"), "{msg}");
    w.write_header().unwrap();
    assert!(e(w.add("late", Value::U8(0))).contains("after the header"));
    assert!(e(w.add_tensor_info("late", GgmlType::F32, &[1])).contains("after the header"));
    assert!(e(w.write_header()).contains("twice"));
    // Chunk overflowing the current tensor.
    w.write_tensor_chunk(&[0; 10]).unwrap();
    assert!(e(w.write_tensor_chunk(&[0; 7])).contains("'t'"));
    assert!(e(w.write_tensor_data(&[0; 6])).contains("partial"));
    w.write_tensor_chunk(&[0; 6]).unwrap();
    // Finishing with tensor 'u' unwritten.
    let msg = w.finish().unwrap_err().to_string();
    assert!(msg.contains("'u'") && msg.contains("incomplete"), "{msg}");

    // Too many tensor writes.
    let mut w = GgufWriter::new(Vec::new());
    w.add_tensor_info("only", GgmlType::F32, &[1]).unwrap();
    w.write_tensor_data(&[0; 4]).unwrap();
    assert!(e(w.write_tensor_data(&[0; 4])).contains("declared tensors are done"));
    w.finish().unwrap();

    // Zero-byte tensors need no write.
    let mut w = GgufWriter::new(Vec::new());
    w.add_tensor_info("z", GgmlType::F32, &[0]).unwrap();
    let out = w.finish().unwrap();
    let dir = TempDir::new("zero");
    assert_eq!(open_bytes(&dir, &out).unwrap().tensor("z").unwrap().data.len(), 0);
}

// ---------------------------------------------------------------------------------------------
// Malformed files
// ---------------------------------------------------------------------------------------------

/// A small valid file with metadata of several kinds and three tensors.
fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new());
    w.add("general.architecture", Value::String("llama".into())).unwrap();
    w.add("llama.block_count", Value::U32(1)).unwrap();
    w.add("tok", Value::Array(vec![Value::String("a".into()), Value::String("bc".into())])).unwrap();
    w.add("nest", Value::Array(vec![Value::Array(vec![Value::I16(1)])])).unwrap();
    w.add("f", Value::F64(1.0)).unwrap();
    w.add("b", Value::Bool(true)).unwrap();
    w.add_tensor_info("w1", GgmlType::F32, &[3, 2]).unwrap();
    w.add_tensor_info("w2", GgmlType::Q8_0, &[32]).unwrap();
    w.add_tensor_info("w3", GgmlType::F16, &[5]).unwrap();
    w.write_tensor_data(&bytes(24, 1)).unwrap();
    w.write_tensor_data(&bytes(34, 2)).unwrap();
    w.write_tensor_data(&bytes(10, 3)).unwrap();
    w.finish().unwrap()
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let full = small_file();
    let dir = TempDir::new("trunc");
    let f = open_bytes(&dir, &full).unwrap();
    let last = f.tensor_infos().iter().map(|t| f.data_start() + t.offset + t.size).max().unwrap();
    drop(f);
    let mut kinds = std::collections::BTreeSet::new();
    for len in 0..full.len() {
        let r = open_bytes(&dir, &full[..len]);
        if len < last {
            let e = match r {
                Ok(_) => panic!("file truncated to {len} of {} bytes opened", full.len()),
                Err(e) => e.to_string(),
            };
            assert!(e.contains("t.gguf") && !e.contains('\n'), "{e}");
            assert!(
                e.contains("truncated") || e.contains("past the end") || e.contains("exceed") || e.contains("too short"),
                "len {len}: {e}"
            );
            // Name the place: a field of the header, a metadata key or a tensor.
            assert!(
                ["magic", "version", "count", "metadata", "tensor"].iter().any(|w| e.contains(w)),
                "len {len}: error names no field: {e}"
            );
            kinds.insert(e.split(':').nth(1).unwrap_or("").trim().to_string());
        } else {
            // Only trailing padding is missing: still valid.
            r.unwrap();
        }
    }
    assert!(kinds.len() > 10, "expected many distinct error sites, got {kinds:?}");
}

#[test]
fn from_bytes_matches_open_on_every_truncation() {
    // The in-memory reader (used by the fuzz target) validates exactly as the mmap path.
    let full = small_file();
    let dir = TempDir::new("frombytes");
    for len in (0..=full.len()).step_by(7).chain([full.len()]) {
        let a = open_bytes(&dir, &full[..len]).map(|f| (f.tensor_infos().to_vec(), f.metadata().clone(), f.data_start()));
        let b = GgufFile::from_bytes(dir.join("t.gguf").display().to_string(), full[..len].to_vec())
            .map(|f| (f.tensor_infos().to_vec(), f.metadata().clone(), f.data_start()));
        match (a, b) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "len {len}"),
            (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "len {len}"),
            (a, b) => panic!("len {len}: open {:?} vs from_bytes {:?}", a.is_ok(), b.is_ok()),
        }
    }
    let f = GgufFile::from_bytes("mem.gguf", full.clone()).expect("valid");
    for name in f.tensor_names() {
        let t = f.tensor(name).expect("tensor");
        assert_eq!(t.data.len(), f.tensor_info(name).expect("info").size);
    }
    assert_eq!(f.file_size(), full.len());
}

#[test]
fn bad_magic() {
    let mut d = small_file();
    d[0] = b'X';
    let dir = TempDir::new("magic");
    match open_bytes(&dir, &d) {
        Err(FormatError::NotGguf { magic, .. }) => assert_eq!(&magic, b"XGUF"),
        other => panic!("{other:?}"),
    }
    expect_err(b"GG", &["magic"]);
    expect_err(b"", &["magic"]);
    let e = GgufFile::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
}

#[test]
fn unsupported_versions() {
    for v in [0u32, 1, 4, 0xFFFF_FFFF] {
        let mut d = small_file();
        d[4..8].copy_from_slice(&v.to_le_bytes());
        expect_err(&d, &["version", &v.to_string()]);
    }
    let mut d = small_file();
    d[4..8].copy_from_slice(&3u32.to_be_bytes());
    expect_err(&d, &["big-endian"]);
}

#[test]
fn absurd_counts_fail_fast_without_allocating() {
    let t0 = Instant::now();
    expect_err(&Raw::header(3, 0, 1 << 60).done(), &["kv count", "1152921504606846976"]);
    expect_err(&Raw::header(3, 1 << 60, 0).done(), &["tensor count"]);
    expect_err(&Raw::header(3, u64::MAX, u64::MAX).done(), &["count"]);
    // Counts that fit alone but not together.
    let mut r = Raw::header(3, 2, 2);
    r.raw(&[0u8; 60]);
    expect_err(&r.done(), &["together"]);
    // Key length 2^62.
    let d = Raw::header(3, 0, 1).u64(1 << 62).raw(b"abc").u32(0).raw(&[0]).done();
    expect_err(&d, &["metadata entry #0", "key", "string length", "4611686018427387904"]);
    // String value length 2^62.
    let d = Raw::header(3, 0, 1).str("general.name").u32(8).u64(1 << 62).raw(&[0; 16]).done();
    expect_err(&d, &["\"general.name\"", "string length"]);
    // Array length 2^60 of u32, of strings, of arrays.
    for ty in [4u32, 8, 9] {
        let d = Raw::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(9).u32(ty).u64(1 << 60).raw(&[0; 32]).done();
        expect_err(&d, &["\"tokenizer.ggml.tokens\"", "array length"]);
    }
    // Nested array with an absurd inner length.
    let d = Raw::header(3, 0, 1).str("n").u32(9).u32(9).u64(1).u32(0).u64(1 << 61).raw(&[0; 8]).done();
    expect_err(&d, &["\"n\"", "array element 0", "array length"]);
    // Tensor name length 2^62.
    let d = Raw::header(3, 1, 0).u64(1 << 62).raw(&[0; 40]).done();
    expect_err(&d, &["tensor info #0", "name", "string length"]);
    // A dimension of 2^62 elements.
    let d = Raw::header(3, 1, 0).tensor("big", &[1 << 62, 1 << 62], 0, 0).data(32, 64).done();
    expect_err(&d, &["'big'", "too many elements"]);
    let d = Raw::header(3, 1, 0).tensor("huge", &[1 << 40], 0, 0).data(32, 64).done();
    expect_err(&d, &["'huge'", "past the end"]);
    // Arrays nested too deeply (a stack guard).
    let mut r = Raw::header(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..100 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    expect_err(&r.done(), &["\"deep\"", "nested"]);
    assert!(t0.elapsed() < Duration::from_secs(2), "absurd counts were slow: {:?}", t0.elapsed());
}

#[test]
fn bad_values() {
    // Invalid UTF-8 in a value names the key.
    let d = Raw::header(3, 0, 1).str("tokenizer.ggml.tokens").u32(9).u32(8).u64(2).str("ok").u64(2).raw(&[0xC3, 0x28]).done();
    expect_err(&d, &["\"tokenizer.ggml.tokens\"", "array element 1", "UTF-8"]);
    // Invalid UTF-8 in a key.
    let d = Raw::header(3, 0, 1).u64(2).raw(&[0xFF, 0xFE]).u32(0).raw(&[1]).done();
    expect_err(&d, &["metadata entry #0", "key", "UTF-8"]);
    // Invalid UTF-8 in a tensor name.
    let d = Raw::header(3, 1, 0).u64(1).raw(&[0x80]).u32(1).u64(1).u32(0).u64(0).data(32, 4).done();
    expect_err(&d, &["tensor info #0", "name", "UTF-8"]);
    // Unknown value type; unknown array element type.
    let d = Raw::header(3, 0, 1).str("k").u32(13).raw(&[0; 8]).done();
    expect_err(&d, &["\"k\"", "type id 13"]);
    let d = Raw::header(3, 0, 1).str("k").u32(9).u32(77).u64(0).done();
    expect_err(&d, &["\"k\"", "element type id 77"]);
    // Bool other than 0/1.
    let d = Raw::header(3, 0, 1).str("flag").u32(7).raw(&[2]).done();
    expect_err(&d, &["\"flag\"", "bool"]);
    // Duplicate key.
    let d = Raw::header(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2).done();
    expect_err(&d, &["duplicate metadata key \"a.b\""]);
    // Alignment not a power of two, zero, or not an integer.
    for (ty, payload) in [
        (4u32, 48u32.to_le_bytes().to_vec()),
        (4, vec![0; 4]),
        (8, {
            let mut v = 2u64.to_le_bytes().to_vec();
            v.extend_from_slice(b"32");
            v
        }),
    ] {
        let d = Raw::header(3, 0, 1).str("general.alignment").u32(ty).raw(&payload).done();
        expect_err(&d, &["general.alignment", "power of two"]);
    }
}

#[test]
fn n_dims_5() {
    let d = Raw::header(3, 1, 0).tensor("blk.0.five", &[1, 1, 1, 1, 1], 0, 0).data(32, 4).done();
    expect_err(&d, &["'blk.0.five'", "n_dims 5"]);
    let d = Raw::header(3, 1, 0).str("wide").u32(u32::MAX).raw(&[0; 64]).done();
    expect_err(&d, &["'wide'", "n_dims 4294967295"]);
}

#[test]
fn unknown_dtype_id() {
    let d = Raw::header(3, 1, 0).tensor("blk.3.weird", &[4], 99, 0).data(32, 16).done();
    expect_err(&d, &["'blk.3.weird'", "unknown dtype id 99"]);
    // Ids in the gap of removed ggml types (Q4_2 = 4) are unknown too.
    let d = Raw::header(3, 1, 0).tensor("q4_2", &[32], 4, 0).data(32, 64).done();
    expect_err(&d, &["'q4_2'", "unknown dtype id 4"]);
}

#[test]
fn tensor_data_out_of_bounds_misaligned_overlapping() {
    // Offset past the end.
    let d = Raw::header(3, 1, 0).tensor("far", &[4], 0, 1 << 20).data(32, 16).done();
    expect_err(&d, &["'far'", "past the end"]);
    // Offset so large that data_start + offset overflows.
    let d = Raw::header(3, 1, 0).tensor("wrap", &[4], 0, u64::MAX - 31).data(32, 16).done();
    expect_err(&d, &["'wrap'"]);
    // Data running one byte past the end.
    let d = Raw::header(3, 1, 0).tensor("short", &[4], 0, 0).data(32, 15).done();
    expect_err(&d, &["'short'", "past the end"]);
    // Misaligned offset.
    let d = Raw::header(3, 2, 0).tensor("a", &[4], 0, 0).tensor("mis", &[4], 0, 16).data(32, 64).done();
    expect_err(&d, &["'mis'", "offset 16", "alignment 32"]);
    // Misaligned with a custom alignment.
    let d = Raw::header(3, 1, 1).kv_u32("general.alignment", 64).tensor("m64", &[4], 0, 32).data(64, 128).done();
    expect_err(&d, &["'m64'", "alignment 64"]);
    // Overlapping: b starts inside a.
    let d = Raw::header(3, 2, 0).tensor("a", &[16], 0, 0).tensor("b", &[8], 0, 32).data(32, 128).done();
    expect_err(&d, &["overlaps", "'a'", "'b'"]);
    // Overlapping: identical offsets, declared in reverse order.
    let d = Raw::header(3, 2, 0).tensor("y", &[8], 0, 32).tensor("x", &[8], 0, 32).data(32, 128).done();
    expect_err(&d, &["overlaps"]);
    // Adjacent but not overlapping is fine, in any declaration order.
    let d = Raw::header(3, 2, 0).tensor("b", &[8], 0, 32).tensor("a", &[8], 0, 0).data(32, 64).done();
    let dir = TempDir::new("adj");
    let f = open_bytes(&dir, &d).unwrap();
    assert_eq!(f.tensor("b").unwrap().data.len(), 32);
}

#[test]
fn size_not_matching_dtype_and_shape() {
    // ne0 not a whole number of blocks.
    let d = Raw::header(3, 1, 0).tensor("blk.0.attn_k.weight", &[33, 2], 2, 0).data(32, 64).done();
    expect_err(&d, &["'blk.0.attn_k.weight'", "ne0 = 33", "Q4_0"]);
    let d = Raw::header(3, 1, 0).tensor("k", &[128], 12, 0).data(32, 144).done();
    expect_err(&d, &["'k'", "Q4_K"]);
    // The file holds less data than the shape needs (Q8_0 [64, 2] = 136 bytes, file has 100).
    let d = Raw::header(3, 1, 0).tensor("q", &[64, 2], 8, 0).data(32, 100).done();
    expect_err(&d, &["'q'", "136 bytes", "past the end"]);
    // Element count overflow.
    let d = Raw::header(3, 1, 0).tensor("ovf", &[1 << 32, 1 << 32, 1 << 32], 0, 0).data(32, 4).done();
    expect_err(&d, &["'ovf'"]);
}

#[test]
fn duplicate_tensor_names() {
    let d = Raw::header(3, 2, 0).tensor("same", &[4], 0, 0).tensor("same", &[4], 0, 32).data(32, 64).done();
    expect_err(&d, &["'same'", "duplicate tensor name"]);
}

#[test]
fn corrupting_every_header_byte_never_panics() {
    // Flip each header byte to a few values; any result is fine but a panic.
    let full = small_file();
    let dir = TempDir::new("flip");
    let header_len = GgufFile::open({
        let p = dir.join("ok.gguf");
        std::fs::write(&p, &full).unwrap();
        p
    })
    .unwrap()
    .data_start();
    for i in 0..header_len {
        for v in [0x00u8, 0xFF, 0x80, 0x05] {
            let mut d = full.clone();
            if d[i] == v {
                continue;
            }
            d[i] = v;
            if let Err(e) = open_bytes(&dir, &d) {
                let e = e.to_string();
                assert!(e.contains("t.gguf") && !e.contains('\n'), "{e}");
            }
        }
    }
}

/// Reads a real llama.cpp file when one is available (`TS_GGUF_SAMPLE`, or the SmolLM2 file in
/// the turbospark model cache); silently passes otherwise.
#[test]
fn real_llama_cpp_file_if_present() {
    let path = std::env::var_os("TS_GGUF_SAMPLE").map(std::path::PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").unwrap_or_default();
        std::path::Path::new(&home).join(".cache/turbospark/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    if !path.is_file() {
        eprintln!("skipped: {} not present", path.display());
        return;
    }
    let f = GgufFile::open(&path).unwrap();
    assert!(f.version() == 2 || f.version() == 3);
    assert!(f.get("general.architecture").and_then(|v| v.as_str()).is_some());
    let tokens = f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).unwrap();
    assert!(tokens.len() > 1000);
    assert!(!f.tensor_infos().is_empty());
    let mut total = 0;
    for t in f.tensor_infos() {
        let td = f.tensor(&t.name).unwrap();
        assert_eq!(td.data.len(), t.size);
        total += t.size;
    }
    assert!(total <= f.file_size());
    eprintln!(
        "{}: v{}, {} keys, {} tensors, {} tokens",
        path.display(),
        f.version(),
        f.metadata().len(),
        f.tensor_infos().len(),
        tokens.len()
    );
}
