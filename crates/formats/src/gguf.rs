//! GGUF v2/v3: a memory-mapped, bounds-checked reader ([`GgufFile`]) and a streaming writer
//! ([`GgufWriter`]).
//!
//! ## Layout (little-endian throughout)
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type u32, value)
//! tensor_count × (name: string, n_dims u32, n_dims × ne u64, dtype u32, offset u64)
//! padding to `general.alignment` (default 32)
//! data section: each tensor at `data_start + offset`, offsets multiples of the alignment
//! ```
//! A string is a u64 byte length followed by that many UTF-8 bytes; an array is an element type
//! u32, a u64 element count, then the elements (arrays may contain arrays).
//!
//! ## Validation
//! The reader treats the file as untrusted. Every count and length is checked against the bytes
//! left in the file *before* anything is allocated, all offset arithmetic is checked, and every
//! tensor's data must lie inside the file, be aligned, not overlap another tensor, and have the
//! size its dtype and shape imply. Every error names the file and the field or tensor it is about.
//! Nothing in here panics on any input.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::{FormatError, GgmlType, Keep, Result, TensorData, TensorSource, Value};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data-section alignment (bytes) when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Maximum number of tensor dimensions (GGML's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// The version [`GgufWriter`] writes.
pub const WRITE_VERSION: u32 = 3;
/// Deepest nesting of arrays inside arrays the reader accepts (guards the stack).
const MAX_ARRAY_DEPTH: usize = 8;

// GGUF metadata value type ids.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// Fewest bytes a value of GGUF type `ty` occupies on disk; `None` for an unknown type id.
fn min_value_size(ty: u32) -> Option<usize> {
    Some(match ty {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 => 8,
        T_STRING => 8,    // length
        T_ARRAY => 4 + 8, // element type + count
        _ => return None,
    })
}

/// The GGUF value type id of `v`.
fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => T_U8,
        Value::I8(_) => T_I8,
        Value::U16(_) => T_U16,
        Value::I16(_) => T_I16,
        Value::U32(_) => T_U32,
        Value::I32(_) => T_I32,
        Value::F32(_) => T_F32,
        Value::Bool(_) => T_BOOL,
        Value::String(_) => T_STRING,
        Value::Array(_) => T_ARRAY,
        Value::U64(_) => T_U64,
        Value::I64(_) => T_I64,
        Value::F64(_) => T_F64,
    }
}

/// One tensor as declared in a GGUF file's tensor-info table (already validated).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Element type / block format.
    pub dtype: GgmlType,
    /// GGML order (innermost first), 1 to 4 dimensions. A tensor stored with `n_dims == 0`
    /// (a scalar) is reported as `[1]`.
    pub shape: Vec<usize>,
    /// Byte offset of the data relative to the start of the data section
    /// ([`GgufFile::data_start`]); a multiple of the file's alignment.
    pub offset: usize,
    /// Size of the data in bytes: `dtype.row_bytes(shape[0]) * shape[1..].product()`.
    pub size: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Byte size of a tensor of `dtype` and `shape` (GGML order), or a reason why it has none.
fn tensor_byte_size(dtype: GgmlType, shape: &[usize]) -> std::result::Result<usize, String> {
    let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if numel.is_none_or(|n| i64::try_from(n).is_err()) {
        return Err(format!("shape {shape:?} has too many elements"));
    }
    let ne0 = shape.first().copied().unwrap_or(1);
    if !ne0.is_multiple_of(dtype.block_size()) {
        return Err(format!("ne0 = {ne0} is not a whole number of {} blocks ({} elements each)", dtype.name(), dtype.block_size()));
    }
    dtype
        .row_bytes(ne0)
        .and_then(|row| shape.iter().skip(1).try_fold(row, |a, &d| a.checked_mul(d)))
        .ok_or_else(|| format!("byte size of shape {shape:?} as {} overflows", dtype.name()))
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
fn align_up(x: usize, align: usize) -> Option<usize> {
    let mask = align.checked_sub(1)?;
    x.checked_add(mask).map(|v| v & !mask)
}

// ---------------------------------------------------------------------------------------------
// Reader
// ---------------------------------------------------------------------------------------------

/// A bounds-checked little-endian cursor. Errors are plain strings; callers prefix the field.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.pos.checked_add(n);
        match end.and_then(|end| self.buf.get(self.pos..end).map(|s| (s, end))) {
            Some((s, end)) => {
                self.pos = end;
                Ok(s)
            }
            None => Err(format!("truncated (need {n} bytes at offset {}, the file has {} bytes)", self.pos, self.buf.len())),
        }
    }

    fn bytes<const N: usize>(&mut self) -> std::result::Result<[u8; N], String> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> std::result::Result<u64, String> {
        self.bytes().map(u64::from_le_bytes)
    }

    /// A u64 count of items, each at least `min_item` (≥ 1) bytes, checked against the bytes left
    /// in the file, so that allocating `count` items is bounded by the file size.
    fn count(&mut self, min_item: usize) -> std::result::Result<usize, String> {
        let n = self.u64()?;
        let left = self.remaining();
        let max = left / min_item.max(1);
        match usize::try_from(n) {
            Ok(n) if n <= max => Ok(n),
            _ => Err(format!(
                "{n} exceeds what the remaining {left} bytes of the file can hold \
                 (at least {} byte{} each)",
                min_item.max(1),
                if min_item > 1 { "s" } else { "" }
            )),
        }
    }

    /// A GGUF string (u64 length + UTF-8 bytes).
    fn string(&mut self) -> std::result::Result<String, String> {
        let n = self.count(1).map_err(|e| format!("string length {e}"))?;
        let b = self.take(n).map_err(|e| format!("string bytes: {e}"))?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(format!("string of {n} bytes is not valid UTF-8 (invalid byte at position {})", e.valid_up_to())),
        }
    }

    /// A metadata value of type `ty`; `depth` counts enclosing arrays.
    fn value(&mut self, ty: u32, depth: usize) -> std::result::Result<Value, String> {
        Ok(match ty {
            T_U8 => Value::U8(u8::from_le_bytes(self.bytes()?)),
            T_I8 => Value::I8(i8::from_le_bytes(self.bytes()?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            T_I16 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            T_U32 => Value::U32(u32::from_le_bytes(self.bytes()?)),
            T_I32 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            T_F32 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            T_U64 => Value::U64(u64::from_le_bytes(self.bytes()?)),
            T_I64 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            T_F64 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            T_BOOL => match self.bytes::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("bool byte is {b}, not 0 or 1")),
            },
            T_STRING => Value::String(self.string()?),
            T_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"));
                }
                let elem_ty = self.u32().map_err(|e| format!("array element type: {e}"))?;
                let min = min_value_size(elem_ty).ok_or_else(|| format!("array element type id {elem_ty} is unknown"))?;
                let n = self.count(min).map_err(|e| format!("array length {e}"))?;
                // `n * min <= remaining bytes`: the allocation is bounded by the file size.
                let mut items = Vec::with_capacity(n);
                for i in 0..n {
                    items.push(self.value(elem_ty, depth + 1).map_err(|e| format!("array element {i}: {e}"))?);
                }
                Value::Array(items)
            }
            other => return Err(format!("value type id {other} is unknown")),
        })
    }
}

/// What [`parse`] finds in a file's header.
struct Parsed {
    version: u32,
    alignment: usize,
    data_start: usize,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

/// Parses and validates the whole header of `buf` (the complete file) named `path`.
fn parse(path: &str, buf: &[u8]) -> Result<Parsed> {
    let corrupt = |what: String| FormatError::Corrupt { path: path.to_string(), what };
    let mut c = Cursor { buf, pos: 0 };

    // Header.
    let magic: [u8; 4] = c.bytes().map_err(|_| corrupt(format!("too short for the GGUF magic ({} bytes)", buf.len())))?;
    if magic != GGUF_MAGIC {
        return Err(FormatError::NotGguf { path: path.to_string(), magic });
    }
    let version = c.u32().map_err(|e| corrupt(format!("version: {e}")))?;
    match version {
        2 | 3 => {}
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(corrupt(format!("big-endian GGUF (version field {v:#010x}) is not supported; only little-endian v2 and v3")))
        }
        v => return Err(corrupt(format!("unsupported GGUF version {v} (only versions 2 and 3 are supported)"))),
    }
    // Minimum on-disk sizes: a tensor info is name length + n_dims + dtype + offset; a metadata
    // entry is key length + value type + at least one byte of value.
    const MIN_TENSOR_INFO: usize = 8 + 4 + 4 + 8;
    const MIN_KV: usize = 8 + 4 + 1;
    let tensor_count = c.count(MIN_TENSOR_INFO).map_err(|e| corrupt(format!("tensor count {e}")))?;
    let kv_count = c.count(MIN_KV).map_err(|e| corrupt(format!("metadata kv count {e}")))?;
    let need = tensor_count.checked_mul(MIN_TENSOR_INFO).and_then(|a| kv_count.checked_mul(MIN_KV).and_then(|b| a.checked_add(b)));
    if need.is_none_or(|n| n > c.remaining()) {
        return Err(corrupt(format!(
            "tensor count {tensor_count} and metadata kv count {kv_count} together exceed what the \
             remaining {} bytes of the file can hold",
            c.remaining()
        )));
    }

    // Metadata.
    let mut metadata = BTreeMap::new();
    for i in 0..kv_count {
        let key = c.string().map_err(|e| corrupt(format!("metadata entry #{i}: key: {e}")))?;
        let ty = c.u32().map_err(|e| corrupt(format!("metadata {key:?}: value type: {e}")))?;
        let value = c.value(ty, 0).map_err(|e| corrupt(format!("metadata {key:?}: {e}")))?;
        if metadata.contains_key(&key) {
            return Err(corrupt(format!("duplicate metadata key {key:?} (entry #{i})")));
        }
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = match v {
                Value::Bool(_) => None,
                v => v.as_u64().and_then(|a| usize::try_from(a).ok()),
            };
            match a {
                Some(a) if a.is_power_of_two() => a,
                _ => return Err(corrupt(format!("metadata \"general.alignment\": {} is not a power of two", v.short()))),
            }
        }
    };

    // Tensor infos.
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(tensor_count);
    let mut by_name: HashMap<String, usize> = HashMap::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = c.string().map_err(|e| corrupt(format!("tensor info #{i}: name: {e}")))?;
        let bad = |what: String| FormatError::BadTensor { path: path.to_string(), tensor: name.clone(), what };
        let n_dims = c.u32().map_err(|e| bad(format!("n_dims: {e}")))?;
        if n_dims as usize > MAX_DIMS {
            return Err(bad(format!("n_dims {n_dims} exceeds the maximum of {MAX_DIMS}")));
        }
        let mut shape = Vec::with_capacity(MAX_DIMS);
        for d in 0..n_dims {
            let ne = c.u64().map_err(|e| bad(format!("dimension {d}: {e}")))?;
            let ne = usize::try_from(ne)
                .ok()
                .filter(|&n| i64::try_from(n).is_ok())
                .ok_or_else(|| bad(format!("dimension {d} = {ne} is too large")))?;
            shape.push(ne);
        }
        if shape.is_empty() {
            shape.push(1);
        }
        let ty = c.u32().map_err(|e| bad(format!("dtype: {e}")))?;
        let dtype = GgmlType::from_id(ty).ok_or_else(|| bad(format!("unknown dtype id {ty}")))?;
        let offset = c.u64().map_err(|e| bad(format!("offset: {e}")))?;
        let size = tensor_byte_size(dtype, &shape).map_err(&bad)?;
        let offset =
            usize::try_from(offset).map_err(|_| bad(format!("offset {offset} lies past the end of the file ({} bytes)", buf.len())))?;
        if !offset.is_multiple_of(alignment) {
            return Err(bad(format!("offset {offset} is not a multiple of the alignment {alignment}")));
        }
        if let Some(&prev) = by_name.get(&name) {
            return Err(bad(format!("duplicate tensor name (tensor infos #{prev} and #{i})")));
        }
        by_name.insert(name.clone(), i);
        tensors.push(TensorInfo { name, dtype, shape, offset, size });
    }

    // Data section.
    let data_start = align_up(c.pos, alignment).ok_or_else(|| corrupt(format!("data section start overflows (alignment {alignment})")))?;
    let mut ranges: Vec<(usize, usize, usize)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let bad = |what: String| FormatError::BadTensor { path: path.to_string(), tensor: t.name.clone(), what };
        let range = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.size).map(|e| (s, e)));
        match range {
            Some((start, end)) if end <= buf.len() => {
                if start < end {
                    ranges.push((start, end, i));
                }
            }
            _ => {
                return Err(bad(format!(
                    "data ({} bytes of {} {:?} at offset {} after the data section start {data_start}) \
                     lies past the end of the file ({} bytes)",
                    t.size,
                    t.dtype.name(),
                    t.shape,
                    t.offset,
                    buf.len()
                )))
            }
        }
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b.0 < a.1 {
            let (first, second) = (&tensors[a.2], &tensors[b.2]);
            return Err(FormatError::BadTensor {
                path: path.to_string(),
                tensor: second.name.clone(),
                what: format!("data (bytes {}..{}) overlaps tensor '{}' (bytes {}..{})", b.0, b.1, first.name, a.0, a.1),
            });
        }
    }

    Ok(Parsed { version, alignment, data_start, metadata, tensors, by_name })
}

/// The bytes of a GGUF file: a read-only memory map ([`GgufFile::open`]) or an owned buffer
/// ([`GgufFile::from_bytes`]).
enum Backing {
    Map(Arc<Mmap>),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A GGUF file, memory-mapped and validated on open. Tensor data is borrowed from the map.
///
/// Like every memory-mapped reader, this assumes the file is not modified or truncated while it
/// is open.
pub struct GgufFile {
    path: String,
    mmap: Backing,
    /// The map, shared with the tensors handed out (see [`TensorData::keep`]); `None` when owned.
    keep: Option<Keep>,
    version: u32,
    alignment: usize,
    data_start: usize,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens, memory-maps and validates a GGUF v2/v3 file.
    ///
    /// Errors: [`FormatError::Io`] if it cannot be opened or mapped, [`FormatError::NotGguf`] if
    /// the magic is wrong, [`FormatError::Corrupt`] / [`FormatError::BadTensor`] naming the
    /// offending field or tensor for anything malformed.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let p = path.as_ref();
        let shown = p.display().to_string();
        let io = |source| FormatError::Io { path: shown.clone(), source };
        let file = File::open(p).map_err(io)?;
        if file.metadata().map_err(io)?.is_dir() {
            return Err(FormatError::Corrupt { path: shown, what: "is a directory, not a GGUF file".into() });
        }
        // SAFETY: the map is read-only; as documented on `GgufFile`, the file must not be
        // modified while open (the same contract as every mmap-based model loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::from_backing(shown, Backing::Map(Arc::new(mmap)))
    }

    /// Validates a GGUF file held in memory (tests, fuzzing, files received over the network).
    /// `name` stands for the path in error messages. The same checks as [`GgufFile::open`].
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_backing(name.into(), Backing::Owned(bytes))
    }

    fn from_backing(shown: String, mmap: Backing) -> Result<GgufFile> {
        let parsed = parse(&shown, &mmap)?;
        let keep = match &mmap {
            Backing::Map(m) => Some(m.clone() as Keep),
            Backing::Owned(_) => None,
        };
        Ok(GgufFile {
            path: shown,
            mmap,
            keep,
            version: parsed.version,
            alignment: parsed.alignment,
            data_start: parsed.data_start,
            metadata: parsed.metadata,
            tensors: parsed.tensors,
            by_name: parsed.by_name,
        })
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment in bytes (`general.alignment`, default 32; a power of two).
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute byte offset of the data section in the file (a multiple of [`Self::alignment`]).
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// Total file size in bytes.
    pub fn file_size(&self) -> usize {
        self.mmap.len()
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The tensor-info table in file order.
    pub fn tensor_infos(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of the tensor called `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    fn data_of(&self, t: &TensorInfo) -> Option<&[u8]> {
        let start = self.data_start.checked_add(t.offset)?;
        self.mmap.get(start..start.checked_add(t.size)?)
    }
}

impl TensorSource for GgufFile {
    fn path(&self) -> &str {
        &self.path
    }

    fn tensor(&self, name: &str) -> Option<TensorData<'_>> {
        let t = self.tensor_info(name)?;
        Some(TensorData { name: &t.name, dtype: t.dtype, shape: &t.shape, data: self.data_of(t)?, keep: self.keep.as_ref() })
    }

    /// Names in file order.
    fn tensor_names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }

    fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }
}

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------

struct PendingTensor {
    name: String,
    dtype: GgmlType,
    shape: Vec<usize>,
    size: usize,
}

/// Streaming GGUF v3 writer.
///
/// Use it in three phases:
/// 1. [`add`](Self::add) metadata and declare tensors with
///    [`add_tensor_info`](Self::add_tensor_info) (any interleaving);
/// 2. [`write_header`](Self::write_header) (optional: the first tensor write does it);
/// 3. write each tensor's bytes **in declaration order** with
///    [`write_tensor_data`](Self::write_tensor_data) (whole tensor) or
///    [`write_tensor_chunk`](Self::write_tensor_chunk) (pieces), then [`finish`](Self::finish).
///
/// Only one tensor (or one chunk) is ever held by the caller, so multi-GB files stream. The
/// alignment is 32 bytes unless a `general.alignment` value (`Value::U32`, a power of two) is
/// added. Each tensor is followed by zero padding to the alignment. Misuse (metadata after the
/// header, wrong byte counts, too many or too few tensors, duplicates) is an error.
pub struct GgufWriter<W: Write> {
    out: W,
    dest: String,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
    alignment: usize,
    header_written: bool,
    /// Index of the tensor being written next.
    current: usize,
    /// Bytes of the current tensor written so far.
    current_done: usize,
    /// Bytes written to `out` so far.
    pos: usize,
    /// Set after an I/O error: the output is unusable.
    failed: bool,
}

impl GgufWriter<BufWriter<File>> {
    /// Creates (truncates) the file at `path` and returns a writer to it.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        let p = path.as_ref();
        let shown = p.display().to_string();
        let file = File::create(p).map_err(|source| FormatError::Io { path: shown.clone(), source })?;
        let mut w = GgufWriter::new(BufWriter::with_capacity(1 << 20, file));
        w.dest = shown;
        Ok(w)
    }
}

impl<W: Write> GgufWriter<W> {
    /// A writer to any byte sink (errors call it `<GGUF writer>`).
    pub fn new(out: W) -> Self {
        GgufWriter {
            out,
            dest: "<GGUF writer>".to_string(),
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
            alignment: DEFAULT_ALIGNMENT,
            header_written: false,
            current: 0,
            current_done: 0,
            pos: 0,
            failed: false,
        }
    }

    fn misuse(&self, what: String) -> FormatError {
        FormatError::Corrupt { path: self.dest.clone(), what: format!("GGUF writer: {what}") }
    }

    fn bad_tensor(&self, tensor: &str, what: String) -> FormatError {
        FormatError::BadTensor { path: self.dest.clone(), tensor: tensor.to_string(), what }
    }

    /// Alignment in bytes that the file will use.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Adds a metadata entry. Keys must be unique; arrays must be homogeneous (all elements the
    /// same `Value` variant; nested arrays may differ from each other) and at most 8 deep. An
    /// empty array is written with element type u8 (GGUF has no untyped arrays).
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        if self.header_written {
            return Err(self.misuse(format!("metadata {key:?} added after the header was written")));
        }
        if self.keys.contains(&key) {
            return Err(self.misuse(format!("duplicate metadata key {key:?}")));
        }
        check_value(&value, 0).map_err(|e| self.misuse(format!("metadata {key:?}: {e}")))?;
        if key == "general.alignment" {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = a as usize,
                _ => return Err(self.misuse(format!("metadata \"general.alignment\" must be a U32 power of two, got {value:?}"))),
            }
        }
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(())
    }

    /// Declares a tensor: `shape` in GGML order (innermost first), 1 to 4 dimensions, `shape[0]`
    /// a whole number of `dtype` blocks. Its data must later be written in declaration order.
    pub fn add_tensor_info(&mut self, name: impl Into<String>, dtype: GgmlType, shape: &[usize]) -> Result<()> {
        let name = name.into();
        if self.header_written {
            return Err(self.bad_tensor(&name, "declared after the header was written".into()));
        }
        if shape.is_empty() || shape.len() > MAX_DIMS {
            return Err(self.bad_tensor(&name, format!("shape {shape:?} must have 1 to {MAX_DIMS} dimensions")));
        }
        if self.names.contains(&name) {
            return Err(self.bad_tensor(&name, "duplicate tensor name".into()));
        }
        let size = tensor_byte_size(dtype, shape).map_err(|e| self.bad_tensor(&name, e))?;
        self.names.insert(name.clone());
        self.tensors.push(PendingTensor { name, dtype, shape: shape.to_vec(), size });
        Ok(())
    }

    /// Byte size the data of declared tensor `name` must have.
    pub fn tensor_size(&self, name: &str) -> Option<usize> {
        self.tensors.iter().find(|t| t.name == name).map(|t| t.size)
    }

    fn emit(&mut self, bytes: &[u8]) -> Result<()> {
        if self.failed {
            return Err(self.misuse("an earlier write failed".into()));
        }
        if let Err(source) = self.out.write_all(bytes) {
            self.failed = true;
            return Err(FormatError::Io { path: self.dest.clone(), source });
        }
        self.pos = self.pos.saturating_add(bytes.len());
        Ok(())
    }

    fn pad(&mut self) -> Result<()> {
        let target = align_up(self.pos, self.alignment).ok_or_else(|| self.misuse("file size overflows".into()))?;
        let zeros = [0u8; 64];
        let mut left = target - self.pos;
        while left > 0 {
            let n = left.min(zeros.len());
            self.emit(&zeros[..n])?;
            left -= n;
        }
        Ok(())
    }

    /// Writes the header, metadata and tensor infos, padded to the alignment. Called
    /// automatically by the first tensor write or by [`finish`](Self::finish); calling it twice
    /// is an error.
    pub fn write_header(&mut self) -> Result<()> {
        if self.header_written {
            return Err(self.misuse("header written twice".into()));
        }
        let mut h = Vec::with_capacity(4096);
        h.extend_from_slice(&GGUF_MAGIC);
        h.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_string(&mut h, k);
            h.extend_from_slice(&value_type_id(v).to_le_bytes());
            put_value(&mut h, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_string(&mut h, &t.name);
            h.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for &d in &t.shape {
                h.extend_from_slice(&(d as u64).to_le_bytes());
            }
            h.extend_from_slice(&(t.dtype as u32).to_le_bytes());
            h.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = offset
                .checked_add(t.size)
                .and_then(|o| align_up(o, self.alignment))
                .ok_or_else(|| self.bad_tensor(&t.name, "data offset overflows".into()))?;
        }
        self.header_written = true;
        self.emit(&h)?;
        self.pad()
    }

    /// Writes the complete data of the next declared tensor (exactly its byte size), followed by
    /// padding. Writes the header first if that has not happened yet.
    pub fn write_tensor_data(&mut self, bytes: &[u8]) -> Result<()> {
        if self.current_done != 0 {
            let name = self.tensors.get(self.current).map(|t| t.name.clone()).unwrap_or_default();
            return Err(self.bad_tensor(&name, "write_tensor_data after a partial write_tensor_chunk".into()));
        }
        let Some(t) = self.tensors.get(self.current) else {
            return Err(self.misuse(format!("tensor data written but all {} declared tensors are done", self.tensors.len())));
        };
        if bytes.len() != t.size {
            return Err(
                self.bad_tensor(&t.name, format!("got {} bytes, the {} shape {:?} needs {}", bytes.len(), t.dtype.name(), t.shape, t.size))
            );
        }
        self.write_tensor_chunk(bytes)
    }

    /// Writes the next piece of the current tensor's data (tensors in declaration order). When
    /// the tensor's bytes are complete, padding is written and the next tensor begins. A chunk
    /// that would run past the current tensor's size is an error (nothing of it is written).
    pub fn write_tensor_chunk(&mut self, bytes: &[u8]) -> Result<()> {
        if !self.header_written {
            self.write_header()?;
        }
        let Some(t) = self.tensors.get(self.current) else {
            return Err(self.misuse(format!("tensor data written but all {} declared tensors are done", self.tensors.len())));
        };
        let size = t.size;
        let done = self.current_done.saturating_add(bytes.len());
        if done > size {
            let what = format!("{done} bytes written, more than its size of {size}");
            return Err(self.bad_tensor(&t.name, what));
        }
        self.emit(bytes)?;
        self.current_done = done;
        if done == size {
            self.pad()?;
            self.current += 1;
            self.current_done = 0;
        }
        Ok(())
    }

    /// Name of the tensor whose data is expected next (`None` when all are written).
    pub fn next_tensor(&self) -> Option<&str> {
        self.tensors.get(self.current).map(|t| t.name.as_str())
    }

    /// Checks that every declared tensor was written, flushes, and returns the sink. Writes the
    /// header if nothing else did (a file with no tensors).
    pub fn finish(mut self) -> Result<W> {
        if !self.header_written {
            self.write_header()?;
        }
        // Zero-byte tensors need no call; write them implicitly.
        while let Some(t) = self.tensors.get(self.current) {
            if t.size != 0 || self.current_done != 0 {
                let name = t.name.clone();
                let what = format!(
                    "data incomplete at finish ({} of {} bytes; {} tensors not written)",
                    self.current_done,
                    t.size,
                    self.tensors.len() - self.current
                );
                return Err(self.bad_tensor(&name, what));
            }
            self.current += 1;
        }
        if self.failed {
            return Err(self.misuse("an earlier write failed".into()));
        }
        self.out.flush().map_err(|source| FormatError::Io { path: self.dest.clone(), source })?;
        Ok(self.out)
    }
}

/// Validates that `v` is writable: arrays homogeneous and not nested too deep.
fn check_value(v: &Value, depth: usize) -> std::result::Result<(), String> {
    if let Value::Array(items) = v {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"));
        }
        if let Some(first) = items.first() {
            let ty = value_type_id(first);
            for (i, item) in items.iter().enumerate() {
                if value_type_id(item) != ty {
                    return Err(format!("array is not homogeneous (element {i} is {item:?}, element 0 is {first:?})"));
                }
                check_value(item, depth + 1).map_err(|e| format!("array element {i}: {e}"))?;
            }
        }
    }
    Ok(())
}

fn put_string(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I8(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => h.push(*x as u8),
        Value::String(s) => put_string(h, s),
        Value::Array(items) => {
            let ty = items.first().map(value_type_id).unwrap_or(T_U8);
            h.extend_from_slice(&ty.to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(h, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn align_up_works() {
        assert_eq!(align_up(0, 32), Some(0));
        assert_eq!(align_up(1, 32), Some(32));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(usize::MAX, 32), None);
    }

    #[test]
    fn parse_in_memory_round_trip() {
        let mut w = GgufWriter::new(Vec::new());
        w.add("a", Value::U32(7)).unwrap();
        w.add_tensor_info("t", GgmlType::F32, &[3]).unwrap();
        w.write_tensor_data(&[0u8; 12]).unwrap();
        let bytes = w.finish().unwrap();
        let p = parse("mem", &bytes).unwrap();
        assert_eq!(p.version, 3);
        assert_eq!(p.metadata.get("a"), Some(&Value::U32(7)));
        assert_eq!(p.tensors[0].size, 12);
        assert_eq!(p.data_start % 32, 0);
        assert_eq!(bytes.len() % 32, 0);
    }
}
