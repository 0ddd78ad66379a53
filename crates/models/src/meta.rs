//! Typed access to model metadata with errors that name the key.

use std::collections::BTreeMap;

use ts_formats::{TensorSource, Value};

use crate::{ModelError, Result};

/// The architecture name: GGUF `general.architecture`, or HF `model_type` (mapped by the HF reader).
pub fn architecture(src: &dyn TensorSource) -> Result<String> {
    let m = src.metadata();
    let a = m.get("general.architecture").and_then(Value::as_str).ok_or_else(|| ModelError::Config {
        path: src.path().to_string(),
        what: "no general.architecture (GGUF) or model_type (config.json): cannot tell the model family".into(),
    })?;
    Ok(a.to_string())
}

/// Reads keys under a prefix (`llama.`, `deepseek2.`, or `hf.`), with one-line errors.
pub struct Meta<'a> {
    pub map: &'a BTreeMap<String, Value>,
    pub path: &'a str,
    pub prefix: String,
}

impl<'a> Meta<'a> {
    pub fn new(src: &'a dyn TensorSource, prefix: &str) -> Self {
        Meta { map: src.metadata(), path: src.path(), prefix: prefix.to_string() }
    }
    pub fn err(&self, what: impl Into<String>) -> ModelError {
        ModelError::Config { path: self.path.to_string(), what: what.into() }
    }
    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }
    pub fn raw(&self, k: &str) -> Option<&'a Value> {
        self.map.get(&self.key(k))
    }
    /// A required non-negative integer.
    pub fn usize(&self, k: &str) -> Result<usize> {
        let key = self.key(k);
        match self.map.get(&key) {
            None => Err(self.err(format!("missing metadata key {key}"))),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| self.err(format!("{key} must be a non-negative integer, found {}", v.short()))),
        }
    }
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        if self.raw(k).is_none() {
            Ok(None)
        } else {
            self.usize(k).map(Some)
        }
    }
    /// A required number.
    pub fn f64(&self, k: &str) -> Result<f64> {
        let key = self.key(k);
        match self.map.get(&key) {
            None => Err(self.err(format!("missing metadata key {key}"))),
            Some(v) => v.as_f64().ok_or_else(|| self.err(format!("{key} must be a number, found {}", v.short()))),
        }
    }
    pub fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        if self.raw(k).is_none() {
            Ok(None)
        } else {
            self.f64(k).map(Some)
        }
    }
    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        let key = self.key(k);
        match self.map.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .or_else(|| v.as_u64().map(|x| x != 0))
                .map(Some)
                .ok_or_else(|| self.err(format!("{key} must be a bool, found {}", v.short()))),
        }
    }
    pub fn opt_str(&self, k: &str) -> Result<Option<&'a str>> {
        let key = self.key(k);
        match self.map.get(&key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(format!("{key} must be a string, found {}", v.short()))),
        }
    }
    /// A global (unprefixed) string key such as `general.name`.
    pub fn global_str(&self, k: &str) -> Option<&'a str> {
        self.map.get(k).and_then(Value::as_str)
    }
}
