//! Shape-checked tensor binding: every tensor the forward uses is looked up at open, with its
//! expected shape, and the error names the tensor.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;

use rayon::prelude::*;
use ts_core::{Backend, WeightUse};
use ts_formats::{GgmlType, TensorData, TensorSource};

use crate::{ModelError, Result};

/// A load's progress hook: (bytes uploaded so far, total bytes of the source's tensors).
pub(crate) type ProgressHook = Box<dyn FnMut(u64, u64)>;

thread_local! {
    /// Progress hook for loads on this thread: called with (bytes uploaded so far, total bytes of
    /// the source's tensors). Set by [`crate::load_with_progress`]; families need not know.
    pub(crate) static PROGRESS: RefCell<Option<ProgressHook>> = RefCell::new(None);
    /// Quantise float weight matrices to this type as they load (`--quant`). Set by
    /// [`crate::load_with_progress`]; families need not know.
    pub(crate) static REQUANT: Cell<Option<GgmlType>> = const { Cell::new(None) };
}

/// The type a tensor is quantised to at load under `--quant target`, or None to keep it: only
/// matrices (`WeightUse::Matmul`) stored as f32/f16/bf16 whose rows are whole blocks of the
/// target, and never a MoE router (`ffn_gate_inp` in GGUF, `mlp.gate` in Hugging Face names),
/// which llama.cpp's quantiser also keeps in f32: its logits pick the experts, and 8-bit
/// rounding there moves near-tied choices.
pub fn requant_target(t: &TensorData<'_>, usage: WeightUse, target: Option<GgmlType>) -> Option<GgmlType> {
    let ty = target?;
    let router = t.name.ends_with("ffn_gate_inp.weight") || t.name.ends_with("mlp.gate.weight");
    let float = matches!(t.dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let whole = t.shape.first().is_some_and(|&k| k > 0 && k % ty.block_size() == 0);
    (matches!(usage, WeightUse::Matmul | WeightUse::Expert) && float && whole && !router && ty != t.dtype).then_some(ty)
}

/// `t`'s bytes quantised to `ty` (rows of `shape[0]` values, in parallel over row chunks).
pub fn requantize(t: &TensorData<'_>, ty: GgmlType) -> std::result::Result<Vec<u8>, String> {
    let k = t.shape[0];
    let rows = t.numel() / k;
    let (src_row, dst_row) = (
        t.dtype.row_bytes(k).ok_or_else(|| format!("{} rows of {k}", t.dtype.name()))?,
        ty.row_bytes(k).ok_or_else(|| format!("{} rows of {k}", ty.name()))?,
    );
    if t.data.len() != rows * src_row {
        return Err(format!("{} bytes for {rows} rows of {src_row}", t.data.len()));
    }
    let mut out = vec![0u8; rows * dst_row];
    // About 1 Mi values per chunk: a chunk's f32 copy stays small.
    let per = (1 << 20) / k + 1;
    out.par_chunks_mut(per * dst_row).zip(t.data.par_chunks(per * src_row)).try_for_each(|(d, s)| {
        let n = s.len() / src_row;
        let mut f = vec![0f32; n * k];
        ts_formats::quant::dequantize(t.dtype, s, &mut f).map_err(|e| e.to_string())?;
        ts_formats::quant::quantize(ty, &f, d).map_err(|e| e.to_string())
    })?;
    Ok(out)
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
    /// Bytes of the backend's second layouts of them ([`ts_core::WeightInfo::copy_bytes`]).
    pub copy_bytes: RefCell<u64>,
    /// Source bytes uploaded so far / in all (for progress).
    src_bytes_done: RefCell<u64>,
    src_bytes_total: u64,
    /// Quantise-at-load target (`--quant`), from [`REQUANT`] at construction.
    requant: Option<GgmlType>,
    /// Whether every matrix uploaded so far (two or more dimensions, as stored) is of a type
    /// whose products the backend computes batch-invariantly ([`Backend::batch_invariant`]).
    pub batch_invariant: std::cell::Cell<bool>,
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
            copy_bytes: RefCell::new(0),
            src_bytes_done: RefCell::new(0),
            src_bytes_total: total,
            batch_invariant: std::cell::Cell::new(true),
            requant: REQUANT.with(Cell::get),
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

    /// Upload an already-checked (possibly host-built) tensor, quantised first under `--quant`
    /// ([`requant_target`]).
    pub fn upload(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<B::Weight> {
        let src_len = t.data.len() as u64;
        let target = requant_target(t, usage, self.requant);
        if t.shape.iter().filter(|&&d| d > 1).count() >= 2 && !self.be.batch_invariant(target.unwrap_or(t.dtype)) {
            self.batch_invariant.set(false);
        }
        let left = self.src_bytes_total.saturating_sub(*self.src_bytes_done.borrow() + src_len);
        self.be.load_remaining(left);
        let w = match target {
            Some(ty) => {
                let bytes = requantize(t, ty).map_err(|e| self.err(t.name, format!("quantising to {}: {e}", ty.name())))?;
                let q = TensorData { name: t.name, dtype: ty, shape: t.shape, data: &bytes, keep: None };
                self.be.upload_weight(&q, usage)?
            }
            None => self.be.upload_weight(t, usage)?,
        };
        let done = {
            let mut d = self.src_bytes_done.borrow_mut();
            *d += src_len;
            *d
        };
        PROGRESS.with(|p| {
            if let Some(f) = p.borrow_mut().as_mut() {
                f(done, self.src_bytes_total);
            }
        });
        *self.bytes.borrow_mut() += ts_core::WeightInfo::bytes(&w) as u64;
        *self.copy_bytes.borrow_mut() += ts_core::WeightInfo::copy_bytes(&w) as u64;
        Ok(w)
    }

    /// Tensors in the source that no binding asked for.
    pub fn unused(&self) -> Vec<String> {
        let used = self.used.borrow();
        self.src.tensor_names().into_iter().filter(|n| !used.contains(*n)).map(str::to_string).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn td<'a>(name: &'a str, dtype: GgmlType, shape: &'a [usize], data: &'a [u8]) -> TensorData<'a> {
        TensorData { name, dtype, shape, data, keep: None }
    }

    /// Which tensors `--quant q8_0` converts: float matrices of whole blocks, not routers,
    /// vectors, embeddings or quantised tensors.
    #[test]
    fn requant_picks_float_matrices_only() {
        let q = Some(GgmlType::Q8_0);
        let m = |name, ty, shape: &[usize], usage| requant_target(&td(name, ty, shape, &[]), usage, q);
        assert_eq!(m("blk.0.attn_q.weight", GgmlType::BF16, &[64, 8], WeightUse::Matmul), q);
        assert_eq!(m("model.layers.0.mlp.experts.0.up_proj.weight", GgmlType::F32, &[64, 8], WeightUse::Matmul), q);
        assert_eq!(m("blk.3.ffn_gate_inp.weight", GgmlType::F32, &[64, 8], WeightUse::Matmul), None);
        assert_eq!(m("model.layers.3.mlp.gate.weight", GgmlType::BF16, &[64, 8], WeightUse::Matmul), None);
        assert_eq!(m("blk.0.attn_norm.weight", GgmlType::F32, &[64], WeightUse::Vector), None);
        assert_eq!(m("token_embd.weight", GgmlType::F16, &[64, 8], WeightUse::Embedding), None);
        assert_eq!(m("blk.0.attn_q.weight", GgmlType::Q4K, &[256, 8], WeightUse::Matmul), None);
        assert_eq!(m("blk.0.attn_q.weight", GgmlType::F16, &[48, 8], WeightUse::Matmul), None); // not whole blocks
        assert_eq!(requant_target(&td("w", GgmlType::F32, &[64, 8], &[]), WeightUse::Matmul, None), None);
    }

    /// Quantising at load gives the bytes quantising the dequantised rows directly gives, over
    /// several parallel chunks.
    #[test]
    fn requantize_matches_quantize() {
        let (k, rows) = (96usize, 20_000usize);
        let vals: Vec<f32> = (0..k * rows).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        let shape = [k, rows];
        let got = requantize(&td("w", GgmlType::BF16, &shape, &bytes), GgmlType::Q8_0).unwrap();
        let mut f = vec![0f32; k * rows];
        ts_formats::quant::dequantize(GgmlType::BF16, &bytes, &mut f).unwrap();
        let mut want = vec![0u8; GgmlType::Q8_0.row_bytes(k).unwrap() * rows];
        ts_formats::quant::quantize(GgmlType::Q8_0, &f, &mut want).unwrap();
        assert_eq!(got, want);
    }
}
