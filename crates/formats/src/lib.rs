//! # ts-formats — model files and tensor formats
//!
//! This crate knows nothing of backends or models. It hands out *named tensors*: a [`TensorData`]
//! is a dtype, a shape and a borrowed byte slice (memory-mapped from the file, never copied).
//!
//! * [`gguf`]   — GGUF v2/v3 reader (memory-mapped, bounds-checked) and writer (for `synth`).
//! * [`hf`]     — Hugging Face checkpoint folders: `config.json` + `model.safetensors` or shards.
//! * [`quant`]  — the GGML block formats: sizes, reference dequantisation and quantisation.
//!
//! [`open_model`] picks the reader for a path (directory → HF folder, GGUF magic → GGUF file).
//!
//! ## Shape convention (one for the whole project)
//! Shapes are in **GGML order**: `shape[0]` is the innermost (contiguous) dimension. A weight
//! matrix `W` with `out` rows of `in` values (PyTorch `[out, in]`) has `shape == [in, out]`.
//! The HF reader reverses safetensors shapes so both sources agree.

pub mod gguf;
pub mod hf;
pub mod quant;

pub use quant::GgmlType;

use std::collections::BTreeMap;

/// Errors of this crate. Every variant names the file, field or tensor it is about.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not a GGUF file (magic {magic:?})")]
    NotGguf { path: String, magic: [u8; 4] },
    #[error("{path}: {what}")]
    Corrupt { path: String, what: String },
    #[error("{path}: tensor '{tensor}': {what}")]
    BadTensor { path: String, tensor: String, what: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

/// A metadata value as GGUF stores it (HF `config.json` values are mapped onto the same type).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer type (and a bool) as u64; `None` for negative numbers, floats, strings, arrays.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            Value::Bool(b) => Some(b as u64),
            _ => None,
        }
    }
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// Any number as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    /// A short human rendering for `inspect` (arrays are abbreviated).
    pub fn short(&self) -> String {
        match self {
            Value::String(s) => {
                let s: String = s.chars().take(60).collect::<String>().replace('\n', "\\n");
                format!("{s:?}")
            }
            Value::Array(a) => {
                let head: Vec<String> = a.iter().take(4).map(|v| v.short()).collect();
                format!("[{}{}] ({} items)", head.join(", "), if a.len() > 4 { ", …" } else { "" }, a.len())
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(v) => format!("{v}"),
            other => other.as_i64().map(|v| v.to_string()).unwrap_or_default(),
        }
    }
}

/// Shared ownership of the memory a [`TensorData`]'s bytes lie in: a file's read-only memory
/// map. Whoever holds a clone keeps the map, and so the bytes, alive.
pub type Keep = std::sync::Arc<dyn std::any::Any + Send + Sync>;

/// One tensor of a model file, borrowed from the (memory-mapped) file.
///
/// Invariant: `data.len() == dtype.row_bytes(shape[0]) * shape[1..].product()`, checked when the
/// file is opened, so consumers may index without further checks.
#[derive(Debug, Clone, Copy)]
pub struct TensorData<'a> {
    /// Name as stored in the file (GGUF: `blk.0.attn_q.weight`; HF: `model.layers.0...`).
    pub name: &'a str,
    pub dtype: GgmlType,
    /// GGML order, innermost first; at most 4 dimensions (unused trailing ones are absent).
    pub shape: &'a [usize],
    /// Raw bytes in `dtype`'s block layout.
    pub data: &'a [u8],
    /// Set when `data` lies in the file's memory map held by this [`Keep`]: a backend may then
    /// keep using the bytes after the file object is gone, without copying them, by holding a
    /// clone (the CPU backend does). `None` for bytes in a buffer of their own (built by a model
    /// loader, or a file read into memory): those must be copied to be kept.
    pub keep: Option<&'a Keep>,
}

impl TensorData<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Shape padded to 4 dims with 1s (`[ne0, ne1, ne2, ne3]`).
    pub fn ne(&self) -> [usize; 4] {
        let mut ne = [1usize; 4];
        for (i, &d) in self.shape.iter().enumerate().take(4) {
            ne[i] = d;
        }
        ne
    }
}

/// Opens a model: a directory is read as a Hugging Face folder ([`hf::HfFolder`]), a file that
/// starts with the GGUF magic as a GGUF file ([`gguf::GgufFile`]). Anything else, or a missing
/// path, is an error naming the path.
pub fn open_model(path: &std::path::Path) -> Result<Box<dyn TensorSource>> {
    use std::io::Read;
    let shown = path.display().to_string();
    let io = |source| FormatError::Io { path: shown.clone(), source };
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.is_dir() {
        return Ok(Box::new(hf::HfFolder::open(path)?));
    }
    let mut magic = [0u8; 4];
    let mut got = 0;
    let mut file = std::fs::File::open(path).map_err(io)?;
    while got < magic.len() {
        match file.read(&mut magic[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io(e)),
        }
    }
    if got == magic.len() && magic == gguf::GGUF_MAGIC {
        return Ok(Box::new(gguf::GgufFile::open(path)?));
    }
    Err(FormatError::Corrupt {
        path: shown,
        what: "not a GGUF file or a Hugging Face folder (expected a file starting with the magic \"GGUF\" \
               or a directory with config.json and *.safetensors weights)"
            .into(),
    })
}

/// Anything that hands out named tensors and metadata: a GGUF file or an HF folder.
pub trait TensorSource: Send + Sync {
    /// Path shown in error messages.
    fn path(&self) -> &str;
    fn tensor(&self, name: &str) -> Option<TensorData<'_>>;
    fn tensor_names(&self) -> Vec<&str>;
    /// Metadata in GGUF key form (an HF folder maps config.json onto GGUF keys, see [`hf`]).
    fn metadata(&self) -> &BTreeMap<String, Value>;
}
