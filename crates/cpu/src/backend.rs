//! [`CpuBackend`]: the reference implementation of every [`Backend`] op, multithreaded with rayon.
//!
//! Matmuls quantise each activation row once to the weight type's dot format (Q8_0, Q8_1, Q8_K
//! or f32, see [`crate::quant_dot`]) and stream weight rows through the SIMD tile kernel, split
//! over threads by output rows. Everything else is plain scalar code, written to be read.
//!
//! Buffers are `Arc`'d boxed slices behind `UnsafeCell`: ops take shared handles (as device
//! pointers are on a GPU) and may alias where the op's doc allows it, so element-wise ops work
//! through raw pointers and never hold overlapping Rust references.

use std::sync::{Arc, Mutex};

use rayon::prelude::*;
use ts_core::{
    AttnParams, Backend, BackendError, BatchMeta, Experts, Gating, GgmlType, Glu, MlaParams, MoeParams, Result, RopeMode,
    RopeSpec, Rows, TensorData, TokenMeta, WeightInfo, WeightUse,
};
use ts_formats::quant;

use crate::quant_dot;

/// Shared f32 storage (an owned allocation behind a raw pointer). See the module doc for the
/// aliasing rules.
pub struct RawBuf {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: ops on one backend run one at a time from the caller's thread; inside an op, threads
// write disjoint elements (each op documents its split).
unsafe impl Sync for RawBuf {}
unsafe impl Send for RawBuf {}

impl RawBuf {
    fn new(len: usize) -> Self {
        let b: Box<[f32]> = vec![0f32; len].into_boxed_slice();
        RawBuf { ptr: Box::into_raw(b) as *mut f32, len }
    }
    fn ptr(&self) -> *mut f32 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: ptr/len came from Box::into_raw of a boxed slice of exactly len elements.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len))) };
    }
}

/// An f32 activation (or cache) buffer.
#[derive(Clone)]
pub struct CpuBuf(Arc<RawBuf>);

impl CpuBuf {
    fn new(len: usize) -> Self {
        CpuBuf(Arc::new(RawBuf::new(len)))
    }
    fn check(&self, r: Rows) {
        assert!(r.end() <= self.0.len(), "rows {r:?} outside a buffer of {} elements", self.0.len());
    }
    /// Row `i` of `r` as a shared slice. Caller guarantees no live mutable alias.
    unsafe fn row(&self, r: Rows, i: usize) -> &[f32] {
        std::slice::from_raw_parts(self.0.ptr().add(r.off + i * r.stride), r.width)
    }
    /// Row `i` of `r` as a mutable slice. Caller guarantees exclusivity of that row.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row_mut(&self, r: Rows, i: usize) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.0.ptr().add(r.off + i * r.stride), r.width)
    }
}

/// A weight as uploaded: the file's bytes (copied, so the file may be closed) in its own format.
/// Vectors (norm weights) are converted to f32 at upload.
pub struct CpuWeight {
    dtype: GgmlType,
    shape: Vec<usize>,
    data: Vec<u8>,
    /// Bytes of one row of `shape[0]` elements.
    row_bytes: usize,
    /// f32 copy for `WeightUse::Vector`.
    vec: Vec<f32>,
}

impl WeightInfo for CpuWeight {
    fn dtype(&self) -> GgmlType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn bytes(&self) -> usize {
        self.data.len() + self.vec.len() * 4
    }
}

impl CpuWeight {
    fn ne(&self, i: usize) -> usize {
        self.shape.get(i).copied().unwrap_or(1)
    }
    /// Bytes of matrix `g` of a 3-D weight.
    fn matrix(&self, g: usize) -> &[u8] {
        let per = self.row_bytes * self.ne(1);
        &self.data[g * per..(g + 1) * per]
    }
}

/// The batch on the CPU is just the host description.
pub struct CpuBatch {
    meta: BatchMeta,
    max_tokens: usize,
}

pub struct CpuRope(RopeSpec);

/// The CPU backend. `threads` rayon workers (default: all cores).
pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    /// Quantised activations of the current matmul (grown to the widest use, then reused).
    act_scratch: Mutex<Vec<u8>>,
    /// MoE intermediates, grown to the widest use and then reused (the forward allocates nothing
    /// once warm).
    moe_scratch: Mutex<MoeScratch>,
    /// Referee mode: matmuls dequantise weight rows to f32 and keep activations in f32 (no
    /// 8-bit activation quantisation), to compare against f32 implementations like transformers.
    exact: bool,
}

impl CpuBackend {
    pub fn new(threads: Option<usize>) -> Result<Self> {
        let threads = threads.filter(|&t| t > 0).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ts-cpu-{i}"))
            .build()
            .map_err(|e| BackendError::Device(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(CpuBackend { pool, threads, act_scratch: Mutex::new(Vec::new()), moe_scratch: Mutex::new(MoeScratch::default()), exact: false })
    }
    /// The referee mode (see the `exact` field): slower, f32 activations throughout.
    pub fn exact(mut self) -> Self {
        self.exact = true;
        self
    }
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// `out[j] = W x[j]` for the rows of one weight matrix given as raw bytes (`m` rows of `k`).
    /// Threads split the output columns.
    fn matmul_bytes(&self, dtype: GgmlType, wdata: &[u8], m: usize, k: usize, x: &CpuBuf, xr: Rows, out: &CpuBuf, o: Rows) {
        assert_eq!(xr.width, k, "matmul: activation width {} != weight input {k}", xr.width);
        assert_eq!(o.width, m, "matmul: output width {} != weight rows {m}", o.width);
        assert_eq!(xr.n, o.n);
        x.check(xr);
        out.check(o);
        let n = xr.n;
        if n == 0 || m == 0 {
            return;
        }
        if self.exact {
            return self.matmul_exact(dtype, wdata, m, k, x, xr, out, o);
        }
        let at = quant_dot::act_type(dtype);
        let arb = at.row_bytes(k).expect("activation width is a whole number of blocks");
        let mut scratch = self.act_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.len() < n * arb {
            scratch.resize(n * arb, 0);
        }
        let acts = &mut scratch[..n * arb];
        for j in 0..n {
            // SAFETY: read-only view of x; out (possibly another buffer) not touched yet.
            let row = unsafe { x.row(xr, j) };
            quant_dot::quantize_act(dtype, row, &mut acts[j * arb..(j + 1) * arb]);
        }
        let acts: &[u8] = acts;
        let wrb = dtype.row_bytes(k).expect("weight rows are whole blocks");
        // Chunks of output columns: enough chunks to balance the threads, each a multiple of 8.
        let chunks = (self.threads * 4).max(1);
        let chunk = m.div_ceil(chunks).next_multiple_of(8).max(8);
        let optr = SendPtr(out.0.ptr());
        self.pool.install(|| {
            (0..m.div_ceil(chunk)).into_par_iter().for_each(|c| {
                let i0 = c * chunk;
                let mc = chunk.min(m - i0);
                let w = &wdata[i0 * wrb..(i0 + mc) * wrb];
                if n == 1 {
                    // SAFETY: chunks write disjoint column ranges [i0, i0+mc) of the one output row.
                    let dst = unsafe { std::slice::from_raw_parts_mut(optr.get().add(o.off + i0), mc) };
                    quant_dot::gemm(dtype, w, mc, k, acts, 1, dst, mc);
                    return;
                }
                TILE.with(|t| {
                    let mut tile = t.borrow_mut();
                    if tile.len() < n * mc {
                        tile.resize(n * mc, 0.0);
                    }
                    quant_dot::gemm(dtype, w, mc, k, acts, n, &mut tile[..n * mc], mc);
                    for j in 0..n {
                        // SAFETY: each chunk writes its own columns [i0, i0+mc) of every row.
                        let dst = unsafe { std::slice::from_raw_parts_mut(optr.get().add(o.off + j * o.stride + i0), mc) };
                        dst.copy_from_slice(&tile[j * mc..(j + 1) * mc]);
                    }
                });
            })
        });
    }
}

impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    fn matmul_exact(&self, dtype: GgmlType, wdata: &[u8], m: usize, k: usize, x: &CpuBuf, xr: Rows, out: &CpuBuf, o: Rows) {
        let wrb = dtype.row_bytes(k).expect("weight rows are whole blocks");
        let optr = SendPtr(out.0.ptr());
        let xs: Vec<&[f32]> = (0..xr.n).map(|j| unsafe { x.row(xr, j) }).collect();
        self.pool.install(|| {
            (0..m).into_par_iter().for_each_init(|| vec![0f32; k], |row: &mut Vec<f32>, i| {
                quant::dequantize(dtype, &wdata[i * wrb..(i + 1) * wrb], row).expect("weight row dequantises");
                for (j, xj) in xs.iter().enumerate() {
                    let d: f64 = row.iter().zip(xj.iter()).map(|(a, b)| (*a as f64) * (*b as f64)).sum();
                    // SAFETY: each i writes its own column.
                    unsafe { *optr.get().add(o.off + j * o.stride + i) = d as f32 };
                }
            })
        });
    }
}

/// Per-call MoE state kept between calls: token lists per expert and gathered rows.
#[derive(Default)]
struct MoeScratch {
    by_expert: Vec<Vec<(usize, f32)>>,
    sel: Vec<(usize, f32)>,
    /// (rows, hidden, ff) the buffers below were sized for.
    dims: (usize, usize, usize),
    bufs: Option<[CpuBuf; 4]>,
}

thread_local! {
    /// Per-thread gemm output tile for multi-row matmuls (grown once, reused).
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// In-place softmax over `s`.
fn softmax(s: &mut [f32]) {
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in s.iter_mut() {
        *v *= inv;
    }
}

/// Expert choice for one token: `(expert, weight)` pairs, per [`MoeParams`]. Public so the
/// CUDA backend's tests can share the reference.
pub fn route(logits: &[f32], p: &MoeParams, out: &mut Vec<(usize, f32)>) {
    let e = p.n_experts;
    let mut scores: Vec<f32> = logits[..e].to_vec();
    match p.gating {
        Gating::Softmax => softmax(&mut scores),
        Gating::Sigmoid => scores.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
    }
    let mut eligible = vec![true; e];
    if p.n_group > 1 && p.topk_group < p.n_group {
        let gs = e / p.n_group;
        let mut gmax: Vec<(usize, f32)> =
            (0..p.n_group).map(|g| (g, scores[g * gs..(g + 1) * gs].iter().copied().fold(f32::NEG_INFINITY, f32::max))).collect();
        gmax.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for &(g, _) in &gmax[p.topk_group..] {
            eligible[g * gs..(g + 1) * gs].iter_mut().for_each(|v| *v = false);
        }
    }
    out.clear();
    for _ in 0..p.k {
        let mut best: Option<usize> = None;
        for i in 0..e {
            if eligible[i] && best.is_none_or(|b| scores[i] > scores[b]) {
                best = Some(i);
            }
        }
        let Some(b) = best else { break };
        eligible[b] = false;
        out.push((b, scores[b]));
    }
    if p.norm_topk {
        let sum: f32 = out.iter().map(|x| x.1).sum::<f32>() + 1e-20;
        out.iter_mut().for_each(|x| x.1 /= sum);
    }
    out.iter_mut().for_each(|x| x.1 *= p.scale);
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type Cache = CpuBuf;
    type Weight = CpuWeight;
    type Batch = CpuBatch;
    type Rope = CpuRope;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn alloc(&self, len: usize) -> Result<CpuBuf> {
        Ok(CpuBuf::new(len))
    }
    fn alloc_cache(&self, rows: usize, width: usize) -> Result<CpuBuf> {
        let len = rows.checked_mul(width).ok_or_else(|| BackendError::OutOfMemory { device: "cpu".into(), what: "cache size overflows".into() })?;
        Ok(CpuBuf::new(len))
    }
    fn upload_weight(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<CpuWeight> {
        let err = |what: String| BackendError::Weight { name: t.name.to_string(), what };
        if !t.dtype.is_supported_weight() {
            return Err(err(format!("type {} is not supported", t.dtype.name())));
        }
        let ne0 = t.shape.first().copied().unwrap_or(1);
        let row_bytes = t.dtype.row_bytes(ne0).ok_or_else(|| err(format!("row of {ne0} is not whole {} blocks", t.dtype.name())))?;
        let mut w = CpuWeight { dtype: t.dtype, shape: t.shape.to_vec(), data: Vec::new(), row_bytes, vec: Vec::new() };
        if usage == WeightUse::Vector {
            let mut v = vec![0f32; t.numel()];
            quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| err(e.to_string()))?;
            w.vec = v;
            w.dtype = GgmlType::F32;
            w.row_bytes = ne0 * 4;
        } else {
            w.data = t.data.to_vec();
        }
        Ok(w)
    }
    fn upload_rope(&self, spec: &RopeSpec) -> Result<CpuRope> {
        Ok(CpuRope(spec.clone()))
    }
    fn alloc_batch(&self, max_tokens: usize) -> Result<CpuBatch> {
        Ok(CpuBatch { meta: BatchMeta { tokens: Vec::with_capacity(max_tokens), ..Default::default() }, max_tokens })
    }
    fn upload_batch(&self, meta: &BatchMeta, batch: &mut CpuBatch) -> Result<()> {
        if meta.len() > batch.max_tokens {
            return Err(BackendError::Unsupported(format!("batch of {} tokens exceeds the {} it was sized for", meta.len(), batch.max_tokens)));
        }
        batch.meta.tokens.clear();
        batch.meta.tokens.extend_from_slice(&meta.tokens);
        batch.meta.outputs.clear();
        batch.meta.outputs.extend_from_slice(&meta.outputs);
        batch.meta.slot_len = meta.slot_len;
        Ok(())
    }
    fn write(&self, dst: &CpuBuf, off: usize, src: &[f32]) -> Result<()> {
        dst.check(Rows { off, n: 1, width: src.len(), stride: src.len() });
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0.ptr().add(off), src.len()) };
        Ok(())
    }
    fn read(&self, buf: &CpuBuf, rows: Rows, dst: &mut [f32]) -> Result<()> {
        buf.check(rows);
        assert_eq!(dst.len(), rows.n * rows.width);
        for i in 0..rows.n {
            dst[i * rows.width..(i + 1) * rows.width].copy_from_slice(unsafe { buf.row(rows, i) });
        }
        Ok(())
    }

    fn embed(&self, table: &CpuWeight, batch: &CpuBatch, scale: f32, out: &CpuBuf, o: Rows) {
        let dim = table.ne(0);
        assert_eq!(o.width, dim);
        assert_eq!(o.n, batch.meta.len());
        out.check(o);
        for (t, tm) in batch.meta.tokens.iter().enumerate() {
            let id = tm.token as usize;
            assert!(id < table.ne(1), "token id {id} outside the vocabulary of {}", table.ne(1));
            let row = unsafe { out.row_mut(o, t) };
            let src = &table.data[id * table.row_bytes..(id + 1) * table.row_bytes];
            quant::dequantize(table.dtype, src, row).expect("embedding row dequantises");
            if scale != 1.0 {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
    }

    fn rms_norm(&self, x: &CpuBuf, xr: Rows, w: Option<&CpuWeight>, eps: f32, out: &CpuBuf, o: Rows) {
        assert_eq!((xr.n, xr.width), (o.n, o.width));
        x.check(xr);
        out.check(o);
        let wv = w.map(|w| {
            assert_eq!(w.vec.len(), xr.width, "norm weight length {} != row width {}", w.vec.len(), xr.width);
            &w.vec[..]
        });
        let (xp, op) = (x.0.ptr(), out.0.ptr());
        for r in 0..xr.n {
            let mut ss = 0.0f32;
            for i in 0..xr.width {
                let v = unsafe { *xp.add(xr.off + r * xr.stride + i) };
                ss += v * v;
            }
            let inv = 1.0 / (ss / xr.width as f32 + eps).sqrt();
            for i in 0..xr.width {
                let v = unsafe { *xp.add(xr.off + r * xr.stride + i) } * inv;
                let v = wv.map_or(v, |w| v * w[i]);
                unsafe { *op.add(o.off + r * o.stride + i) = v };
            }
        }
    }

    fn matmul(&self, x: &CpuBuf, xr: Rows, w: &CpuWeight, out: &CpuBuf, o: Rows) {
        assert!(w.ne(2) == 1, "matmul with a 3-D weight {:?}: use matmul_grouped", w.shape);
        self.matmul_bytes(w.dtype, &w.data, w.ne(1), w.ne(0), x, xr, out, o);
    }

    fn matmul_grouped(&self, x: &CpuBuf, xr: Rows, w: &CpuWeight, out: &CpuBuf, o: Rows) {
        let g = w.ne(2);
        assert_eq!(xr.n % g, 0, "grouped matmul: {} rows is not a multiple of {g} groups", xr.n);
        // Rows of group h are h, h+g, h+2g, …: a strided view per group.
        for h in 0..g {
            let xs = Rows { off: xr.off + h * xr.stride, n: xr.n / g, width: xr.width, stride: xr.stride * g };
            let os = Rows { off: o.off + h * o.stride, n: o.n / g, width: o.width, stride: o.stride * g };
            self.matmul_bytes(w.dtype, w.matrix(h), w.ne(1), w.ne(0), x, xs, out, os);
        }
    }

    fn add(&self, a: &CpuBuf, ar: Rows, b: &CpuBuf, br: Rows, out: &CpuBuf, o: Rows) {
        assert!(ar.n == br.n && ar.n == o.n && ar.width == br.width && ar.width == o.width);
        a.check(ar);
        b.check(br);
        out.check(o);
        let (ap, bp, op) = (a.0.ptr(), b.0.ptr(), out.0.ptr());
        for r in 0..o.n {
            for i in 0..o.width {
                unsafe { *op.add(o.off + r * o.stride + i) = *ap.add(ar.off + r * ar.stride + i) + *bp.add(br.off + r * br.stride + i) };
            }
        }
    }

    fn scale(&self, x: &CpuBuf, xr: Rows, s: f32) {
        x.check(xr);
        for r in 0..xr.n {
            unsafe { x.row_mut(xr, r) }.iter_mut().for_each(|v| *v *= s);
        }
    }

    fn glu(&self, kind: Glu, gate: &CpuBuf, gr: Rows, up: &CpuBuf, ur: Rows, out: &CpuBuf, o: Rows) {
        assert!(gr.n == ur.n && gr.n == o.n && gr.width == ur.width && gr.width == o.width);
        gate.check(gr);
        up.check(ur);
        out.check(o);
        let (gp, up_, op) = (gate.0.ptr(), up.0.ptr(), out.0.ptr());
        for r in 0..o.n {
            for i in 0..o.width {
                unsafe {
                    let g = *gp.add(gr.off + r * gr.stride + i);
                    let u = *up_.add(ur.off + r * ur.stride + i);
                    let a = match kind {
                        Glu::SwiGlu => silu(g),
                        Glu::GeGluTanh => gelu_tanh(g),
                    };
                    *op.add(o.off + r * o.stride + i) = a * u;
                }
            }
        }
    }

    fn softcap(&self, x: &CpuBuf, xr: Rows, cap: f32) {
        x.check(xr);
        for r in 0..xr.n {
            unsafe { x.row_mut(xr, r) }.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
    }

    fn copy(&self, src: &CpuBuf, sr: Rows, dst: &CpuBuf, dr: Rows) {
        assert!(sr.n == dr.n && sr.width == dr.width);
        src.check(sr);
        dst.check(dr);
        for r in 0..sr.n {
            unsafe { std::ptr::copy(src.0.ptr().add(sr.off + r * sr.stride), dst.0.ptr().add(dr.off + r * dr.stride), sr.width) };
        }
    }

    fn rope(&self, x: &CpuBuf, xr: Rows, heads_per_token: usize, batch: &CpuBatch, rope: &CpuRope) {
        let spec = &rope.0;
        assert!(spec.dim <= xr.width && spec.dim % 2 == 0);
        assert_eq!(xr.n, batch.meta.len() * heads_per_token, "rope: rows != tokens * heads");
        x.check(xr);
        let half = spec.dim / 2;
        for r in 0..xr.n {
            let pos = batch.meta.tokens[r / heads_per_token].pos as f32;
            let row = unsafe { x.row_mut(xr, r) };
            for i in 0..half {
                let (s, c) = (pos * spec.freqs[i]).sin_cos();
                let (s, c) = (s * spec.mscale, c * spec.mscale);
                let (a, b) = match spec.mode {
                    RopeMode::Normal => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + half),
                };
                let (x0, x1) = (row[a], row[b]);
                row[a] = x0 * c - x1 * s;
                row[b] = x0 * s + x1 * c;
            }
        }
    }

    fn cache_write(&self, cache: &CpuBuf, src: &CpuBuf, sr: Rows, batch: &CpuBatch) {
        assert_eq!(sr.n, batch.meta.len());
        src.check(sr);
        let sl = batch.meta.slot_len as usize;
        for (t, tm) in batch.meta.tokens.iter().enumerate() {
            assert!((tm.pos as usize) < sl, "position {} beyond the slot length {sl}", tm.pos);
            let dst = Rows { off: 0, n: 1, width: sr.width, stride: sr.width }.rows(tm.slot as usize * sl + tm.pos as usize, 1);
            cache.check(dst);
            unsafe { std::ptr::copy(src.0.ptr().add(sr.off + t * sr.stride), cache.0.ptr().add(dst.off), sr.width) };
        }
    }

    fn attention(&self, q: &CpuBuf, qr: Rows, k: &CpuBuf, v: &CpuBuf, batch: &CpuBatch, p: &AttnParams, out: &CpuBuf, o: Rows) {
        let (nh, nkv, hd, vd) = (p.n_heads, p.n_kv_heads, p.head_dim, p.v_dim);
        assert_eq!(qr.width, nh * hd);
        assert_eq!(o.width, nh * vd);
        assert_eq!(qr.n, batch.meta.len());
        assert_eq!(nh % nkv, 0);
        q.check(qr);
        out.check(o);
        let sl = batch.meta.slot_len as usize;
        let (kw, vw) = (nkv * hd, nkv * vd);
        let (kp, vp, qp, op) = (SendPtr(k.0.ptr()), SendPtr(v.0.ptr()), SendPtr(q.0.ptr()), SendPtr(out.0.ptr()));
        let (klen, vlen) = (k.0.len(), v.0.len());
        let toks = &batch.meta.tokens;
        self.pool.install(|| {
            (0..qr.n * nh).into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, th| {
                let (t, h) = (th / nh, th % nh);
                let TokenMeta { pos, slot, .. } = toks[t];
                let g = h / (nh / nkv);
                let base = slot as usize * sl;
                let start = p.window.map_or(0, |w| (pos + 1).saturating_sub(w)) as usize;
                let end = pos as usize + 1;
                assert!((base + end) * kw <= klen && (base + end) * vw <= vlen, "attention reads past the cache");
                let qv = unsafe { std::slice::from_raw_parts(qp.get().add(qr.off + t * qr.stride + h * hd), hd) };
                scores.clear();
                for j in start..end {
                    let kr = unsafe { std::slice::from_raw_parts(kp.get().add((base + j) * kw + g * hd), hd) };
                    let mut s = qv.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * p.scale;
                    if let Some(c) = p.softcap {
                        s = c * (s / c).tanh();
                    }
                    scores.push(s);
                }
                softmax(scores);
                let orow = unsafe { std::slice::from_raw_parts_mut(op.get().add(o.off + t * o.stride + h * vd), vd) };
                orow.iter_mut().for_each(|x| *x = 0.0);
                for (jj, j) in (start..end).enumerate() {
                    let vr = unsafe { std::slice::from_raw_parts(vp.get().add((base + j) * vw + g * vd), vd) };
                    let w = scores[jj];
                    orow.iter_mut().zip(vr).for_each(|(a, b)| *a += w * b);
                }
            })
        });
    }

    fn mla_attention(&self, q: &CpuBuf, qr: Rows, cache: &CpuBuf, batch: &CpuBatch, p: &MlaParams, out: &CpuBuf, o: Rows) {
        let (nh, kl, rd) = (p.n_heads, p.kv_lora, p.rope_dim);
        let w = kl + rd;
        assert_eq!(qr.width, w);
        assert_eq!(o.width, kl);
        assert_eq!(qr.n, batch.meta.len() * nh);
        q.check(qr);
        out.check(o);
        let sl = batch.meta.slot_len as usize;
        let (cp, qp, op) = (SendPtr(cache.0.ptr()), SendPtr(q.0.ptr()), SendPtr(out.0.ptr()));
        let clen = cache.0.len();
        let toks = &batch.meta.tokens;
        self.pool.install(|| {
            (0..qr.n).into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, r| {
                let TokenMeta { pos, slot, .. } = toks[r / nh];
                let base = slot as usize * sl;
                let end = pos as usize + 1;
                assert!((base + end) * w <= clen, "mla attention reads past the cache");
                let qv = unsafe { std::slice::from_raw_parts(qp.get().add(qr.off + r * qr.stride), w) };
                scores.clear();
                for j in 0..end {
                    let cr = unsafe { std::slice::from_raw_parts(cp.get().add((base + j) * w), w) };
                    scores.push(qv.iter().zip(cr).map(|(a, b)| a * b).sum::<f32>() * p.scale);
                }
                softmax(scores);
                let orow = unsafe { std::slice::from_raw_parts_mut(op.get().add(o.off + r * o.stride), kl) };
                orow.iter_mut().for_each(|x| *x = 0.0);
                for j in 0..end {
                    let cr = unsafe { std::slice::from_raw_parts(cp.get().add((base + j) * w), kl) };
                    let s = scores[j];
                    orow.iter_mut().zip(cr).for_each(|(a, b)| *a += s * b);
                }
            })
        });
    }

    fn moe(&self, x: &CpuBuf, xr: Rows, logits: &CpuBuf, lr: Rows, experts: Experts<'_, CpuWeight>, p: &MoeParams, out: &CpuBuf, o: Rows) {
        let n = xr.n;
        assert!(lr.n == n && o.n == n && lr.width == p.n_experts && o.width == xr.width);
        x.check(xr);
        logits.check(lr);
        out.check(o);
        let (hdim, ff) = (experts.gate.ne(0), experts.gate.ne(1));
        assert_eq!(hdim, xr.width);
        assert_eq!(experts.gate.ne(2), p.n_experts);
        // Route every token, then group tokens by expert so each expert's weights are read once.
        let mut guard = self.moe_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        sc.by_expert.resize_with(p.n_experts, Vec::new);
        sc.by_expert.iter_mut().for_each(|v| v.clear());
        for r in 0..n {
            route(unsafe { logits.row(lr, r) }, p, &mut sc.sel);
            for &(e, wgt) in &sc.sel {
                sc.by_expert[e].push((r, wgt));
            }
        }
        for r in 0..n {
            unsafe { out.row_mut(o, r) }.iter_mut().for_each(|v| *v = 0.0);
        }
        let max_rows = sc.by_expert.iter().map(|v| v.len()).max().unwrap_or(0);
        if max_rows == 0 {
            return;
        }
        let (cr, ch, cf) = sc.dims;
        if sc.bufs.is_none() || cr < max_rows || ch < hdim || cf < ff {
            let (r, h, f) = (cr.max(max_rows), ch.max(hdim), cf.max(ff));
            sc.bufs = Some([CpuBuf::new(r * h), CpuBuf::new(r * f), CpuBuf::new(r * f), CpuBuf::new(r * h)]);
            sc.dims = (r, h, f);
        }
        let Some([xs, g, u, y]) = sc.bufs.as_ref() else { return };
        for (e, rows) in sc.by_expert.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            for (i, &(r, _)) in rows.iter().enumerate() {
                unsafe { xs.row_mut(Rows::packed(m, hdim), i) }.copy_from_slice(unsafe { x.row(xr, r) });
            }
            let (rx, rf) = (Rows::packed(m, hdim), Rows::packed(m, ff));
            self.matmul_bytes(experts.gate.dtype, experts.gate.matrix(e), ff, hdim, xs, rx, g, rf);
            self.matmul_bytes(experts.up.dtype, experts.up.matrix(e), ff, hdim, xs, rx, u, rf);
            self.glu(p.glu, g, rf, u, rf, g, rf);
            self.matmul_bytes(experts.down.dtype, experts.down.matrix(e), hdim, ff, g, rf, y, rx);
            for (i, &(r, wgt)) in rows.iter().enumerate() {
                let yr = unsafe { y.row(rx, i) };
                unsafe { out.row_mut(o, r) }.iter_mut().zip(yr).for_each(|(a, b)| *a += wgt * b);
            }
        }
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}
