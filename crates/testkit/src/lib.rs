//! Test support shared by the integration tests of several crates (a dev-dependency only): a
//! one-layer llama GGUF small enough to write in a test, with the knobs the error tests need
//! (another architecture name, an unsupported embedding type, keys and shapes that do not add
//! up). Before this crate the CLI's and the model layer's error tests each had their own copy.

use std::path::Path;

use ts_formats::gguf::GgufWriter;
use ts_formats::{GgmlType, Value};

/// How the tensors' bytes are filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Pseudo-random bytes (an LCG from 1); F32 tensors get small finite values (bytes 0, 0,
    /// 0x80 and a random exponent byte below 0x3d), other types raw random blocks.
    Random,
    /// F32 values `(i % 7) * 0.01` by element (every tensor must be F32).
    Ramp,
}

/// A one-layer llama GGUF: `general.architecture` = `arch`, keys `<arch>.block_count` (1),
/// `embedding_length` (`hidden`), `feed_forward_length` (`ff`), `attention.head_count` (4),
/// `attention.head_count_kv` (2), `context_length` (64), `vocab_size` (`vocab`), tokenizer model
/// "none"; tensors `token_embd` (`embd_type`), `output_norm` and the block's nine (F32).
#[derive(Debug, Clone)]
pub struct TinyLlama<'a> {
    pub arch: &'a str,
    /// Hidden width (a multiple of 4: the k and v projections are half as wide).
    pub hidden: usize,
    pub ff: usize,
    pub vocab: usize,
    pub embd_type: GgmlType,
    /// Keys (full names) that replace the ones above or are added after them.
    pub meta: &'a [(&'a str, u32)],
    /// Tensor shapes replaced by name (`blk.0.attn_q.weight`, …).
    pub shapes: &'a [(&'a str, Vec<usize>)],
    pub fill: Fill,
}

impl Default for TinyLlama<'_> {
    fn default() -> Self {
        TinyLlama { arch: "llama", hidden: 64, ff: 64, vocab: 16, embd_type: GgmlType::F32, meta: &[], shapes: &[], fill: Fill::Ramp }
    }
}

impl TinyLlama<'_> {
    /// Write the file to `path`. Panics on I/O errors or an unknown tensor name in `shapes`
    /// (a test's own mistake).
    pub fn write(&self, path: &Path) {
        let (h, v, ff, arch) = (self.hidden, self.vocab, self.ff, self.arch);
        let mut keys: Vec<(String, u32)> = [
            ("block_count", 1u32),
            ("embedding_length", h as u32),
            ("feed_forward_length", ff as u32),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("context_length", 64),
            ("vocab_size", v as u32),
        ]
        .iter()
        .map(|(k, x)| (format!("{arch}.{k}"), *x))
        .collect();
        for (k, x) in self.meta {
            match keys.iter_mut().find(|(kk, _)| kk == k) {
                Some(e) => e.1 = *x,
                None => keys.push((k.to_string(), *x)),
            }
        }
        let mut w = GgufWriter::create(path).expect("create the GGUF file");
        w.add("general.architecture", Value::String(arch.into())).expect("add key");
        for (k, x) in &keys {
            w.add(k.clone(), Value::U32(*x)).expect("add key");
        }
        w.add("tokenizer.ggml.model", Value::String("none".into())).expect("add key");
        let mut tensors: Vec<(String, GgmlType, Vec<usize>)> =
            vec![("token_embd.weight".into(), self.embd_type, vec![h, v]), ("output_norm.weight".into(), GgmlType::F32, vec![h])];
        for (n, s) in [
            ("attn_norm", vec![h]),
            ("attn_q", vec![h, h]),
            ("attn_k", vec![h, h / 2]),
            ("attn_v", vec![h, h / 2]),
            ("attn_output", vec![h, h]),
            ("ffn_norm", vec![h]),
            ("ffn_gate", vec![h, ff]),
            ("ffn_up", vec![h, ff]),
            ("ffn_down", vec![ff, h]),
        ] {
            tensors.push((format!("blk.0.{n}.weight"), GgmlType::F32, s));
        }
        for (name, s) in self.shapes {
            let t = tensors.iter_mut().find(|(n, _, _)| n == name).expect("known tensor name");
            t.2 = s.clone();
        }
        for (n, t, s) in &tensors {
            w.add_tensor_info(n.clone(), *t, s).expect("tensor info");
        }
        let mut x = 1u32;
        for (_, t, s) in &tensors {
            let n: usize = s.iter().product();
            let data: Vec<u8> = match self.fill {
                Fill::Ramp => {
                    assert_eq!(*t, GgmlType::F32, "Fill::Ramp writes F32 tensors only");
                    (0..n).flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes()).collect()
                }
                Fill::Random => {
                    let bytes = t.row_bytes(s[0]).expect("whole blocks") * (n / s[0]);
                    (0..bytes)
                        .map(|i| {
                            x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                            if *t == GgmlType::F32 {
                                [0x00, 0x00, 0x80, (x >> 24) as u8 & 0x3c][i % 4]
                            } else {
                                (x >> 24) as u8
                            }
                        })
                        .collect()
                }
            };
            w.write_tensor_data(&data).expect("tensor data");
        }
        w.finish().expect("finish the GGUF file");
    }
}

/// A path under the system's temp folder, `<prefix>-<process id>-<name>`, removed (file or
/// folder, recursively) when dropped, so test runs do not leave model files behind. Anything
/// already there is removed first.
#[derive(Debug)]
pub struct TempPath(std::path::PathBuf);

impl TempPath {
    /// The path, not created (a test writes a file or folder there).
    pub fn new(prefix: &str, name: &str) -> TempPath {
        let p = std::env::temp_dir().join(format!("{prefix}-{}-{name}", std::process::id()));
        remove(&p);
        TempPath(p)
    }
    /// The path, created as an empty folder.
    pub fn dir(prefix: &str, name: &str) -> TempPath {
        let t = TempPath::new(prefix, name);
        std::fs::create_dir_all(&t.0).expect("create the temp folder");
        t
    }
}

fn remove(p: &Path) {
    if p.is_dir() {
        let _ = std::fs::remove_dir_all(p);
    } else {
        let _ = std::fs::remove_file(p);
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        remove(&self.0);
    }
}

impl std::ops::Deref for TempPath {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempPath {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}
