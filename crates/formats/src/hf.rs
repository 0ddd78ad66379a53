//! Hugging Face checkpoint folders: `config.json` plus safetensors weights.
//!
//! [`HfFolder::open`] reads `config.json`, then the weights from the first of:
//! 1. `model.safetensors`;
//! 2. the shards named in `model.safetensors.index.json` (its `weight_map`);
//! 3. every `*.safetensors` file in the folder (sorted by name).
//!
//! Every weight file is memory-mapped; tensor data is borrowed from the maps, never copied.
//!
//! ## Tensors
//! Only BF16, F16 and F32 tensors are accepted (as [`GgmlType::BF16`], [`GgmlType::F16`],
//! [`GgmlType::F32`]); any other dtype is an error naming the tensor. Shapes are **reversed into
//! GGML order**: a safetensors `[out, in]` weight has `shape == [in, out]`; a 0-d tensor has shape
//! `[1]`; more than 4 dimensions is an error. The bytes are exactly as stored (little-endian);
//! note safetensors does not guarantee any alignment of a tensor's bytes beyond 1.
//!
//! ## Metadata
//! `config.json` is flattened into keys `hf.<key>`; nested objects are joined with `.`
//! (`hf.rope_scaling.factor`). JSON `null` values are omitted. Integers become `Value::I64`
//! (or `Value::U64` above `i64::MAX`), other numbers `Value::F64`, booleans `Value::Bool`,
//! strings `Value::String`, arrays `Value::Array` (inside arrays, objects and nulls are kept as
//! `Value::String` holding their JSON text so positions are preserved). In addition,
//! `general.architecture` is the config's `model_type` (when it is a string).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::{FormatError, GgmlType, Keep, Result, TensorData, TensorSource, Value};

/// The name of the single-file weights.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

struct Shard {
    path: PathBuf,
    mmap: Arc<Mmap>,
    /// `mmap` again, as the tensors hand it out (see [`TensorData::keep`]).
    keep: Keep,
}

struct HfTensor {
    name: String,
    dtype: GgmlType,
    /// GGML order.
    shape: Vec<usize>,
    shard: usize,
    /// Absolute byte range in the shard file.
    start: usize,
    end: usize,
}

/// A Hugging Face model folder opened for reading (see the [module docs](self)).
///
/// Like every memory-mapped reader, this assumes the files are not modified while it is open.
pub struct HfFolder {
    dir: PathBuf,
    path: String,
    config: serde_json::Value,
    metadata: BTreeMap<String, Value>,
    shards: Vec<Shard>,
    tensors: Vec<HfTensor>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for HfFolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfFolder")
            .field("path", &self.path)
            .field("shards", &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn shown(p: &Path) -> String {
    p.display().to_string()
}

fn io_err(p: &Path) -> impl FnOnce(std::io::Error) -> FormatError + '_ {
    move |source| FormatError::Io { path: shown(p), source }
}

fn read_json(p: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(p).map_err(io_err(p))?;
    serde_json::from_str(&text).map_err(|e| FormatError::Corrupt { path: shown(p), what: format!("invalid JSON: {e}") })
}

impl HfFolder {
    /// Opens the folder `dir`: parses `config.json`, finds and memory-maps the weight files and
    /// validates every tensor header. Errors name the file and tensor concerned.
    pub fn open(dir: impl AsRef<Path>) -> Result<HfFolder> {
        let dir = dir.as_ref().to_path_buf();
        let path = shown(&dir);
        let config_path = dir.join("config.json");
        if !dir.is_dir() {
            return Err(FormatError::Corrupt { path, what: "not a directory".into() });
        }
        if !config_path.is_file() {
            return Err(FormatError::Corrupt { path, what: "not a Hugging Face folder: it has no config.json".into() });
        }
        let config = read_json(&config_path)?;
        if !config.is_object() {
            return Err(FormatError::Corrupt { path: shown(&config_path), what: "top level is not a JSON object".into() });
        }
        let mut metadata = BTreeMap::new();
        flatten("hf", &config, &mut metadata);
        if let Some(arch) = config.get("model_type").and_then(|v| v.as_str()) {
            metadata.insert("general.architecture".to_string(), Value::String(arch.to_string()));
        }

        // Which files hold the weights, and (with an index) which tensor should be where.
        let single = dir.join(SINGLE_FILE);
        let index_path = dir.join(INDEX_FILE);
        let (files, weight_map): (Vec<PathBuf>, Option<BTreeMap<String, String>>) = if single.is_file() {
            (vec![single], None)
        } else if index_path.is_file() {
            let (files, map) = read_index(&dir, &index_path)?;
            (files, Some(map))
        } else {
            let mut files = Vec::new();
            for entry in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
                let entry = entry.map_err(io_err(&dir))?;
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
                    files.push(p);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(FormatError::Corrupt {
                    path,
                    what: format!("no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file in the folder"),
                });
            }
            (files, None)
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors: Vec<HfTensor> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        for (si, file_path) in files.into_iter().enumerate() {
            let file = File::open(&file_path).map_err(io_err(&file_path))?;
            // SAFETY: read-only map; the files must not be modified while open (documented).
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&file_path))?;
            let mut found = read_shard_tensors(&file_path, &mmap, si)?;
            found.sort_by_key(|t| t.start);
            for t in found {
                if let Some(&prev) = by_name.get(&t.name) {
                    let first = tensors.get(prev).and_then(|p| shards.get(p.shard)).map(|s: &Shard| shown(&s.path));
                    return Err(FormatError::BadTensor {
                        path: shown(&file_path),
                        tensor: t.name,
                        what: format!("also present in {}", first.unwrap_or_default()),
                    });
                }
                by_name.insert(t.name.clone(), tensors.len());
                tensors.push(t);
            }
            let mmap = Arc::new(mmap);
            shards.push(Shard { path: file_path, keep: mmap.clone(), mmap });
        }

        if let Some(map) = weight_map {
            for (name, file) in &map {
                let ok = by_name
                    .get(name)
                    .and_then(|&i| tensors.get(i))
                    .and_then(|t| shards.get(t.shard))
                    .is_some_and(|s| s.path == dir.join(file));
                if !ok {
                    return Err(FormatError::BadTensor {
                        path: shown(&index_path),
                        tensor: name.clone(),
                        what: format!("weight_map puts it in '{file}', but that file does not hold it"),
                    });
                }
            }
        }

        Ok(HfFolder { dir, path, config, metadata, shards, tensors, by_name })
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw parsed `config.json`.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// The memory-mapped weight files, in load order.
    pub fn weight_files(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// The weight file that holds tensor `name`.
    pub fn tensor_file(&self, name: &str) -> Option<&Path> {
        let t = self.tensors.get(*self.by_name.get(name)?)?;
        self.shards.get(t.shard).map(|s| s.path.as_path())
    }
}

/// Reads `model.safetensors.index.json`: the distinct shard paths (sorted) and the weight map.
fn read_index(dir: &Path, index_path: &Path) -> Result<(Vec<PathBuf>, BTreeMap<String, String>)> {
    let corrupt = |what: String| FormatError::Corrupt { path: shown(index_path), what };
    let index = read_json(index_path)?;
    let map = index.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| corrupt("no \"weight_map\" object".into()))?;
    let mut weight_map = BTreeMap::new();
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| corrupt(format!("weight_map entry {name:?} is not a string")))?;
        let rel = Path::new(file);
        if file.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(corrupt(format!("weight_map entry {name:?}: shard name {file:?} is not a file inside the folder")));
        }
        let p = dir.join(rel);
        if !files.contains(&p) {
            files.push(p);
        }
        weight_map.insert(name.clone(), file.to_string());
    }
    if files.is_empty() {
        return Err(corrupt("weight_map is empty".into()));
    }
    files.sort();
    Ok((files, weight_map))
}

/// Parses one safetensors file's header and validates each tensor.
fn read_shard_tensors(file_path: &Path, buf: &[u8], shard: usize) -> Result<Vec<HfTensor>> {
    let (header_len, meta) = SafeTensors::read_metadata(buf)
        .map_err(|e| FormatError::Corrupt { path: shown(file_path), what: format!("safetensors header: {e}") })?;
    let data_start = header_len.checked_add(8);
    let mut out = Vec::new();
    for (name, info) in meta.tensors() {
        let bad = |what: String| FormatError::BadTensor { path: shown(file_path), tensor: name.clone(), what };
        let dtype = match info.dtype {
            Dtype::BF16 => GgmlType::BF16,
            Dtype::F16 => GgmlType::F16,
            Dtype::F32 => GgmlType::F32,
            other => return Err(bad(format!("dtype {other:?} is not supported (only BF16, F16 and F32)"))),
        };
        if info.shape.len() > crate::gguf::MAX_DIMS {
            return Err(bad(format!("shape {:?} has more than {} dimensions", info.shape, crate::gguf::MAX_DIMS)));
        }
        let mut shape: Vec<usize> = info.shape.iter().rev().copied().collect();
        if shape.is_empty() {
            shape.push(1);
        }
        let (s, e) = info.data_offsets;
        let range = data_start.and_then(|d| Some((d.checked_add(s)?, d.checked_add(e)?)));
        let Some((start, end)) = range.filter(|&(a, b)| a <= b && b <= buf.len()) else {
            return Err(bad(format!("data offsets {s}..{e} lie outside the file ({} bytes)", buf.len())));
        };
        let ne0 = shape.first().copied().unwrap_or(1);
        let expected = dtype.row_bytes(ne0).and_then(|row| shape.iter().skip(1).try_fold(row, |a, &d| a.checked_mul(d)));
        if expected != Some(end - start) {
            return Err(bad(format!("{} bytes of data do not match {} shape {:?}", end - start, dtype.name(), info.shape)));
        }
        out.push(HfTensor { name, dtype, shape, shard, start, end });
    }
    Ok(out)
}

/// Flattens a JSON value into `out` under `key` (see the module docs for the mapping).
fn flatten(key: &str, v: &serde_json::Value, out: &mut BTreeMap<String, Value>) {
    match v {
        serde_json::Value::Null => {}
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                flatten(&format!("{key}.{k}"), v, out);
            }
        }
        other => {
            if let Some(v) = json_scalar(other) {
                out.insert(key.to_string(), v);
            }
        }
    }
}

/// A non-object JSON value as a [`Value`]; `None` for null (and for objects, handled by the caller).
fn json_scalar(v: &serde_json::Value) -> Option<Value> {
    use serde_json::Value as J;
    Some(match v {
        J::Null | J::Object(_) => return None,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::I64(i)
            } else if let Some(u) = n.as_u64() {
                Value::U64(u)
            } else {
                Value::F64(n.as_f64()?)
            }
        }
        J::String(s) => Value::String(s.clone()),
        J::Array(items) => {
            Value::Array(items.iter().map(|item| json_scalar(item).unwrap_or_else(|| Value::String(item.to_string()))).collect())
        }
    })
}

impl TensorSource for HfFolder {
    fn path(&self) -> &str {
        &self.path
    }

    fn tensor(&self, name: &str) -> Option<TensorData<'_>> {
        let t = self.tensors.get(*self.by_name.get(name)?)?;
        let data = self.shards.get(t.shard)?.mmap.get(t.start..t.end)?;
        let shard = self.shards.get(t.shard)?;
        Some(TensorData { name: &t.name, dtype: t.dtype, shape: &t.shape, data, keep: Some(&shard.keep) })
    }

    /// Names ordered by weight file, then by position in the file.
    fn tensor_names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }

    fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }
}
