//! Shape-checked tensor binding: every tensor the forward uses is looked up at open, with its
//! expected shape, and the error names the tensor.

use std::cell::RefCell;
use std::collections::BTreeSet;

use ts_core::{Backend, WeightUse};
use ts_formats::{TensorData, TensorSource};

use crate::{ModelError, Result};

thread_local! {
    /// Progress hook for loads on this thread: called with (bytes uploaded so far, total bytes of
    /// the source's tensors). Set by [`crate::load_with_progress`]; families need not know.
    pub(crate) static PROGRESS: RefCell<Option<Box<dyn FnMut(u64, u64)>>> = RefCell::new(None);
}

/// Binds tensors from a source onto a backend and remembers which were used.
pub struct Binder<'a, B: Backend> {
    pub src: &'a dyn TensorSource,
    pub be: &'a B,
    used: RefCell<BTreeSet<String>>,
    /// Parameters (elements) of the file's tensors bound so far (each tensor counted once).
    pub n_params: RefCell<u64>,
    /// Bytes uploaded so far.
    pub bytes: RefCell<u64>,
    /// Source bytes uploaded so far / in all (for progress).
    src_bytes_done: RefCell<u64>,
    src_bytes_total: u64,
}

impl<'a, B: Backend> Binder<'a, B> {
    pub fn new(src: &'a dyn TensorSource, be: &'a B) -> Self {
        let total = src.tensor_names().iter().filter_map(|n| src.tensor(n)).map(|t| t.data.len() as u64).sum();
        Binder {
            src,
            be,
            used: RefCell::new(BTreeSet::new()),
            n_params: RefCell::new(0),
            bytes: RefCell::new(0),
            src_bytes_done: RefCell::new(0),
            src_bytes_total: total,
        }
    }

    pub fn err(&self, tensor: &str, what: impl Into<String>) -> ModelError {
        ModelError::Tensor { path: self.src.path().to_string(), tensor: tensor.to_string(), what: what.into() }
    }

    pub fn has(&self, name: &str) -> bool {
        self.src.tensor(name).is_some()
    }

    /// The tensor `name` with GGML-order shape `shape` (trailing 1s ignored), unuploaded.
    pub fn raw(&self, name: &str, shape: &[usize]) -> Result<TensorData<'a>> {
        let t = self.src.tensor(name).ok_or_else(|| self.err(name, "missing (the forward needs it)"))?;
        let strip = |s: &[usize]| {
            let mut v = s.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if strip(t.shape) != strip(shape) {
            return Err(self.err(name, format!("shape {:?} where the config implies {:?}", t.shape, shape)));
        }
        if self.used.borrow_mut().insert(name.to_string()) {
            *self.n_params.borrow_mut() += t.numel() as u64;
        }
        Ok(t)
    }

    /// Upload `name` (shape-checked) for `usage`.
    pub fn get(&self, name: &str, shape: &[usize], usage: WeightUse) -> Result<B::Weight> {
        let t = self.raw(name, shape)?;
        if !t.dtype.is_supported_weight() {
            return Err(self.err(
                name,
                format!(
                    "type {} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)",
                    t.dtype.name()
                ),
            ));
        }
        self.upload(&t, usage)
    }

    /// Upload an already-checked (possibly host-built) tensor.
    pub fn upload(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<B::Weight> {
        let w = self.be.upload_weight(t, usage)?;
        let done = {
            let mut d = self.src_bytes_done.borrow_mut();
            *d += t.data.len() as u64;
            *d
        };
        PROGRESS.with(|p| {
            if let Some(f) = p.borrow_mut().as_mut() {
                f(done, self.src_bytes_total);
            }
        });
        *self.bytes.borrow_mut() += ts_core::WeightInfo::bytes(&w) as u64;
        Ok(w)
    }

    /// Tensors in the source that no binding asked for.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        self.src.tensor_names().into_iter().filter(|n| !used.contains(*n)).map(str::to_string).collect()
    }
}
