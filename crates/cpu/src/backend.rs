//! [`CpuBackend`]: the reference implementation of every [`Backend`] op, multithreaded on a
//! small fork-join pool ([`crate::pool`]; why not rayon is explained there).
//!
//! Matmuls quantise each activation row once to the weight type's dot format (Q8_0, Q8_1, Q8_K
//! or f32, see [`crate::quant_dot`]) and stream weight rows through the SIMD tile kernel, split
//! over threads by chunks of output rows; [`Backend::matmul_many`] runs several weights of one
//! input (q/k/v, gate/up) as one parallel region. Norms, GLU, softmax and the attention dot
//! products use the 8-lane helpers of [`crate::simd`]; the rest is plain scalar code.
//!
//! Buffers are `Arc`'d boxed slices behind `UnsafeCell`: ops take shared handles (as device
//! pointers are on a GPU) and may alias where the op's doc allows it, so element-wise ops work
//! through raw pointers and never hold overlapping Rust references.

use std::sync::{Arc, Mutex};

use ts_core::{
    AttnParams, Backend, BackendError, BatchMeta, Experts, Gating, GgmlType, Glu, MlaParams, MoeParams, Result, RopeMode, RopeSpec, Rows,
    TensorData, TokenMeta, WeightInfo, WeightUse,
};
use ts_formats::{quant, Keep};

use crate::pool::Pool;
use crate::quant_dot;
use crate::simd;

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

/// The bytes of a weight: read in place from the model file's memory map (the default: no copy,
/// the load takes no time and the pages are shared with the page cache) or copied into memory of
/// the backend's own ([`CpuBackend::copy_weights`], and bytes a loader built itself).
enum WeightBytes {
    Owned(Vec<u8>),
    /// `len` bytes at `ptr`, inside the map that `_keep` holds alive (read-only, never moved).
    Mapped {
        _keep: Keep,
        ptr: *const u8,
        len: usize,
    },
}
// SAFETY: the mapped bytes are read-only and live as long as `_keep` (an Arc of the map).
unsafe impl Send for WeightBytes {}
unsafe impl Sync for WeightBytes {}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            WeightBytes::Owned(v) => v,
            // SAFETY: see `Mapped`.
            WeightBytes::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

/// A weight as uploaded, in the file's own format: the file's bytes in place (memory-mapped) or
/// copied (see [`WeightBytes`]). Vectors (norm weights) are converted to f32 at upload.
pub struct CpuWeight {
    dtype: GgmlType,
    shape: Vec<usize>,
    data: WeightBytes,
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

/// [`CpuBackend`]'s queued arg-maxes: (ids waiting to be handed out, the last arg-max's ids,
/// spent id lists kept for reuse).
type ArgQueue = (std::collections::VecDeque<Vec<u32>>, Vec<u32>, Vec<Vec<u32>>);

/// The CPU backend. `threads` threads including the caller's (default: all cores).
pub struct CpuBackend {
    pool: Pool,
    threads: usize,
    /// Quantised activations and task list of the current matmul.
    mm_scratch: Mutex<MmScratch>,
    /// MoE intermediates, grown to the widest use and then reused (the forward allocates nothing
    /// once warm).
    moe_scratch: Mutex<MoeScratch>,
    /// Referee mode: matmuls dequantise weight rows to f32 and keep activations in f32 (no
    /// 8-bit activation quantisation), to compare against f32 implementations like transformers.
    exact: bool,
    /// Copy every weight into memory of its own at upload instead of reading it in place from
    /// the file's memory map ([`CpuBackend::copy_weights`]; `--no-mmap`).
    copy_weights: bool,
    /// Batch-invariant products for every quantised type with the tiled kernel
    /// ([`CpuBackend::invariant`]): a server's rows then get the same bits alone or batched
    /// without padding its forwards.
    invariant: bool,
    /// Queued arg-maxes ([`Backend::argmax_rows_queued`]): computed at once, handed out oldest
    /// first; `.1` the ids of the last arg-max (queued or not), which
    /// [`ts_core::TOKEN_FROM_ARGMAX`] tokens stand for. The CPU twin of the CUDA backend's
    /// chained steps (nothing overlaps here: the point is the same semantics). `.2`: id lists
    /// collected, kept for reuse (a warm chain allocates nothing).
    argq: Mutex<ArgQueue>,
}

impl CpuBackend {
    pub fn new(threads: Option<usize>) -> Result<Self> {
        let threads = threads.filter(|&t| t > 0).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let pool = Pool::new(threads, "ts-cpu").map_err(|e| BackendError::Device(format!("cannot start {threads} CPU threads: {e}")))?;
        Ok(CpuBackend {
            pool,
            threads,
            mm_scratch: Mutex::new(MmScratch::default()),
            moe_scratch: Mutex::new(MoeScratch::default()),
            exact: false,
            copy_weights: false,
            invariant: false,
            argq: Mutex::new(Default::default()),
        })
    }
    /// Copy the weights at upload (more memory, a slower load) instead of reading them from the
    /// model file's memory map: for files that may change on disk while the model runs (a
    /// mapped file that is truncated under a running process faults it).
    pub fn copy_weights(mut self) -> Self {
        self.copy_weights = true;
        self
    }
    /// Products of one to three activation rows with Q4_K, Q5_K or Q6_K weights on the tiled
    /// prompt kernel (`quant_dot::gemm_mode`), so that those types are batch-invariant too
    /// ([`Backend::batch_invariant`]): for the server, which then need not pad its forwards to
    /// four rows. Costs those matrices about half their single-row decode speed.
    pub fn invariant(mut self) -> Self {
        self.invariant = true;
        self
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
    #[allow(clippy::too_many_arguments)]
    fn matmul_bytes(&self, dtype: GgmlType, wdata: &[u8], m: usize, k: usize, x: &CpuBuf, xr: Rows, out: &CpuBuf, o: Rows) {
        self.matmul_jobs(x, xr, k, &[MmJob { dtype, wdata, m, out, o }]);
    }

    /// Several matmuls of one input (q/k/v, gate/up) in one parallel region. Each activation
    /// row is quantised once per activation format; the threads then take chunks of output
    /// rows of all the weights from one queue.
    fn matmul_jobs(&self, x: &CpuBuf, xr: Rows, k: usize, jobs: &[MmJob<'_>]) {
        assert_eq!(xr.width, k, "matmul: activation width {} != weight input {k}", xr.width);
        x.check(xr);
        for j in jobs {
            assert_eq!(j.o.width, j.m, "matmul: output width {} != weight rows {}", j.o.width, j.m);
            assert_eq!(xr.n, j.o.n);
            j.out.check(j.o);
        }
        let n = xr.n;
        if n == 0 || jobs.iter().all(|j| j.m == 0) {
            return;
        }
        if self.exact {
            for j in jobs {
                self.matmul_exact(j.dtype, j.wdata, j.m, k, x, xr, j.out, j.o);
            }
            return;
        }
        let mut guard = self.mm_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let sc = &mut *guard;
        // Quantise the activations once per distinct activation format (usually one).
        sc.fmts.clear();
        let mut total = 0;
        for j in jobs {
            let at = quant_dot::act_type(j.dtype);
            if !sc.fmts.iter().any(|f| f.0 == at) {
                let arb = at.row_bytes(k).expect("activation width is a whole number of blocks");
                sc.fmts.push((at, total, arb));
                total += n * arb;
            }
        }
        if sc.acts.len() < total {
            sc.acts.resize(total, 0);
        }
        for &(at, off, arb) in &sc.fmts {
            for r in 0..n {
                // SAFETY: read-only view of x; the outputs are not written yet.
                let row = unsafe { x.row(xr, r) };
                quant_dot::quantize_act_as(at, row, &mut sc.acts[off + r * arb..off + (r + 1) * arb]);
            }
        }
        // Tasks: chunks of output rows, a multiple of 8 rows, about 4 per thread over all jobs
        // (dynamic claiming evens out the rest), at least ~16 KiB of weights each.
        let wbytes: usize = jobs.iter().map(|j| j.wdata.len().min(j.m * j.dtype.row_bytes(k).unwrap_or(0))).sum();
        let per_task = (wbytes / (self.threads * 4)).max(16 << 10);
        sc.tasks.clear();
        for (ji, j) in jobs.iter().enumerate() {
            let wrb = j.dtype.row_bytes(k).expect("weight rows are whole blocks");
            let chunk = if self.threads == 1 { j.m } else { (per_task / wrb).next_multiple_of(8).max(8) };
            let mut i0 = 0;
            while i0 < j.m {
                let mc = chunk.min(j.m - i0);
                sc.tasks.push((ji, i0, mc));
                i0 += mc;
            }
        }
        let (acts, fmts, tasks) = (&sc.acts[..], &sc.fmts[..], &sc.tasks[..]);
        self.pool.run(tasks.len(), &|t| {
            let (ji, i0, mc) = tasks[t];
            let j = &jobs[ji];
            let at = quant_dot::act_type(j.dtype);
            let &(_, aoff, arb) = fmts.iter().find(|f| f.0 == at).expect("format quantised above");
            let acts = &acts[aoff..aoff + n * arb];
            let wrb = j.dtype.row_bytes(k).expect("weight rows are whole blocks");
            let w = &j.wdata[i0 * wrb..(i0 + mc) * wrb];
            let optr = j.out.0.ptr();
            if n == 1 {
                // SAFETY: tasks write disjoint column ranges [i0, i0+mc) of the output row.
                let dst = unsafe { std::slice::from_raw_parts_mut(optr.add(j.o.off + i0), mc) };
                quant_dot::gemm_mode(j.dtype, w, mc, k, acts, 1, dst, mc, self.invariant);
                return;
            }
            TILE.with(|t| {
                let mut tile = t.borrow_mut();
                if tile.len() < n * mc {
                    tile.resize(n * mc, 0.0);
                }
                quant_dot::gemm_mode(j.dtype, w, mc, k, acts, n, &mut tile[..n * mc], mc, self.invariant);
                for r in 0..n {
                    // SAFETY: each task writes its own columns [i0, i0+mc) of every row.
                    let dst = unsafe { std::slice::from_raw_parts_mut(optr.add(j.o.off + r * j.o.stride + i0), mc) };
                    dst.copy_from_slice(&tile[r * mc..(r + 1) * mc]);
                }
            });
        });
    }
}

/// One weight of [`CpuBackend::matmul_jobs`]: `out[o] = W x` with `W` = `m` rows of `wdata`.
struct MmJob<'a> {
    dtype: GgmlType,
    wdata: &'a [u8],
    m: usize,
    out: &'a CpuBuf,
    o: Rows,
}

/// Matmul scratch kept between calls (grown to the widest use, then reused).
#[derive(Default)]
struct MmScratch {
    /// Quantised activations, one run of `n` rows per format in `fmts`.
    acts: Vec<u8>,
    /// (format, byte offset in `acts`, bytes per row).
    fmts: Vec<(GgmlType, usize, usize)>,
    /// (job, first output row, rows).
    tasks: Vec<(usize, usize, usize)>,
}

impl CpuBackend {
    #[allow(clippy::too_many_arguments)]
    fn matmul_exact(&self, dtype: GgmlType, wdata: &[u8], m: usize, k: usize, x: &CpuBuf, xr: Rows, out: &CpuBuf, o: Rows) {
        let wrb = dtype.row_bytes(k).expect("weight rows are whole blocks");
        let optr = SendPtr(out.0.ptr());
        let xs: Vec<&[f32]> = (0..xr.n).map(|j| unsafe { x.row(xr, j) }).collect();
        let chunk = 16;
        self.pool.run(m.div_ceil(chunk), &|c| {
            let mut row = vec![0f32; k];
            for i in c * chunk..((c + 1) * chunk).min(m) {
                quant::dequantize(dtype, &wdata[i * wrb..(i + 1) * wrb], &mut row).expect("weight row dequantises");
                for (j, xj) in xs.iter().enumerate() {
                    let d = dot_f64(&row, xj);
                    // SAFETY: each i writes its own column.
                    unsafe { *optr.get().add(o.off + j * o.stride + i) = d as f32 };
                }
            }
        });
    }
}

/// `a · b` accumulated in f64 over 8 independent lanes (so the compiler vectorises it; the
/// referee wants accuracy, not the last bit of speed).
fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] as f64 * y[l] as f64;
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| *x as f64 * *y as f64).sum();
    acc.iter().sum::<f64>() + tail
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
    /// Per-thread attention scores (grown once, reused).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
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
        let len = rows
            .checked_mul(width)
            .ok_or_else(|| BackendError::OutOfMemory { device: "cpu".into(), what: "cache size overflows".into() })?;
        Ok(CpuBuf::new(len))
    }
    fn batch_invariant(&self, w: GgmlType) -> bool {
        !self.exact && crate::quant_dot::batch_invariant_mode(w, self.invariant)
    }

    fn upload_weight(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<CpuWeight> {
        let err = |what: String| BackendError::Weight { name: t.name.to_string(), what };
        if !t.dtype.is_supported_weight() {
            return Err(err(format!("type {} is not supported", t.dtype.name())));
        }
        let ne0 = t.shape.first().copied().unwrap_or(1);
        let row_bytes = t.dtype.row_bytes(ne0).ok_or_else(|| err(format!("row of {ne0} is not whole {} blocks", t.dtype.name())))?;
        let mut w = CpuWeight { dtype: t.dtype, shape: t.shape.to_vec(), data: WeightBytes::Owned(Vec::new()), row_bytes, vec: Vec::new() };
        if usage == WeightUse::Vector {
            let mut v = vec![0f32; t.numel()];
            quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| err(e.to_string()))?;
            w.vec = v;
            w.dtype = GgmlType::F32;
            w.row_bytes = ne0 * 4;
        } else {
            w.data = match t.keep {
                Some(keep) if !self.copy_weights => WeightBytes::Mapped { _keep: keep.clone(), ptr: t.data.as_ptr(), len: t.data.len() },
                _ => WeightBytes::Owned(t.data.to_vec()),
            };
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
            return Err(BackendError::Unsupported(format!(
                "batch of {} tokens exceeds the {} it was sized for",
                meta.len(),
                batch.max_tokens
            )));
        }
        if meta.outputs.len() > batch.max_tokens {
            return Err(BackendError::Unsupported(format!(
                "{} output rows exceed the {} the batch was sized for",
                meta.outputs.len(),
                batch.max_tokens
            )));
        }
        batch.meta.tokens.clear();
        batch.meta.tokens.extend_from_slice(&meta.tokens);
        if meta.tokens.iter().any(|t| t.token >= ts_core::TOKEN_FROM_ARGMAX) {
            let q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
            for t in batch.meta.tokens.iter_mut().filter(|t| t.token >= ts_core::TOKEN_FROM_ARGMAX) {
                let r = (t.token - ts_core::TOKEN_FROM_ARGMAX) as usize;
                t.token = *q.1.get(r).ok_or_else(|| {
                    BackendError::Unsupported(format!("a token takes row {r} of the last arg-max, which had {} rows", q.1.len()))
                })?;
            }
        }
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

    fn argmax_rows(&self, x: &CpuBuf, xr: Rows, out: &mut [u32]) -> Result<()> {
        x.check(xr);
        assert_eq!(out.len(), xr.n);
        for (i, o) in out.iter_mut().enumerate() {
            *o = ts_core::argmax(unsafe { x.row(xr, i) });
        }
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        q.1.clear();
        q.1.extend_from_slice(out);
        Ok(())
    }

    fn chains_argmax(&self) -> bool {
        true
    }

    fn argmax_rows_queued(&self, x: &CpuBuf, xr: Rows) -> Result<()> {
        if self.argq.lock().unwrap_or_else(|e| e.into_inner()).0.len() >= 2 {
            return Err(BackendError::Unsupported("a third queued arg-max before the first was collected".into()));
        }
        let mut ids = self.argq.lock().unwrap_or_else(|e| e.into_inner()).2.pop().unwrap_or_default();
        ids.resize(xr.n, 0);
        self.argmax_rows(x, xr, &mut ids)?;
        self.argq.lock().unwrap_or_else(|e| e.into_inner()).0.push_back(ids);
        Ok(())
    }

    fn argmax_collect(&self, out: &mut [u32]) -> Result<()> {
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        let ids = q.0.pop_front().ok_or_else(|| BackendError::Unsupported("no queued arg-max to collect".into()))?;
        let r = if ids.len() == out.len() {
            out.copy_from_slice(&ids);
            Ok(())
        } else {
            Err(BackendError::Unsupported(format!("the queued arg-max has {} rows, not {}", ids.len(), out.len())))
        };
        q.2.push(ids);
        r
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
        let wp = wv.map_or(std::ptr::null(), |w| w.as_ptr());
        for r in 0..xr.n {
            // SAFETY: rows checked above; x and out may be the same row (in place), so only
            // raw pointers are used for the write.
            unsafe {
                let src = xp.add(xr.off + r * xr.stride);
                let ss = simd::sum_sq(std::slice::from_raw_parts(src, xr.width));
                let inv = 1.0 / (ss / xr.width as f32 + eps).sqrt();
                simd::scale_mul_ptr(src, inv, wp, op.add(o.off + r * o.stride), xr.width);
            }
        }
    }

    fn matmul(&self, x: &CpuBuf, xr: Rows, w: &CpuWeight, out: &CpuBuf, o: Rows) {
        assert!(w.ne(2) == 1, "matmul with a 3-D weight {:?}: use matmul_grouped", w.shape);
        self.matmul_bytes(w.dtype, &w.data, w.ne(1), w.ne(0), x, xr, out, o);
    }

    fn matmul_many(&self, x: &CpuBuf, xr: Rows, jobs: &[(&CpuWeight, &CpuBuf, Rows)]) {
        let k = xr.width;
        let mj: Vec<MmJob<'_>> = jobs
            .iter()
            .map(|&(w, out, o)| {
                assert!(w.ne(2) == 1, "matmul with a 3-D weight {:?}: use matmul_grouped", w.shape);
                assert_eq!(w.ne(0), k, "matmul: activation width {k} != weight input {}", w.ne(0));
                MmJob { dtype: w.dtype, wdata: &w.data, m: w.ne(1), out, o }
            })
            .collect();
        self.matmul_jobs(x, xr, k, &mj);
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
            // SAFETY: rows checked above; element-wise, so in place is fine.
            unsafe { simd::add_ptr(ap.add(ar.off + r * ar.stride), bp.add(br.off + r * br.stride), op.add(o.off + r * o.stride), o.width) };
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
        let (gelu, f): (bool, fn(f32) -> f32) = match kind {
            Glu::SwiGlu => (false, silu),
            Glu::GeGluTanh => (true, gelu_tanh),
        };
        let rows = |r0: usize, r1: usize| {
            for r in r0..r1 {
                // SAFETY: rows checked above; element-wise, so in place is fine; callers of
                // this closure take disjoint row ranges.
                unsafe {
                    simd::glu_ptr(
                        gelu,
                        gp.add(gr.off + r * gr.stride),
                        up_.add(ur.off + r * ur.stride),
                        op.add(o.off + r * o.stride),
                        o.width,
                        f,
                    )
                };
            }
        };
        // Prompt-sized GLUs (n × ff exps) are worth a parallel region; a decode row is not.
        if o.n * o.width >= 1 << 15 && self.threads > 1 {
            let (gp, up_, op) = (SendPtr(gp), SendPtr(up_), SendPtr(op));
            let per = o.n.div_ceil(self.threads * 4);
            self.pool.run(o.n.div_ceil(per), &|c| {
                let (gp, up_, op) = (gp.get(), up_.get(), op.get());
                for r in c * per..((c + 1) * per).min(o.n) {
                    // SAFETY: as above; tasks take disjoint rows.
                    unsafe {
                        simd::glu_ptr(
                            gelu,
                            gp.add(gr.off + r * gr.stride),
                            up_.add(ur.off + r * ur.stride),
                            op.add(o.off + r * o.stride),
                            o.width,
                            f,
                        )
                    };
                }
            });
        } else {
            rows(0, o.n);
        }
    }

    fn softcap(&self, x: &CpuBuf, xr: Rows, cap: f32) {
        x.check(xr);
        for r in 0..xr.n {
            unsafe { x.row_mut(xr, r) }.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
    }

    fn gather_outputs(&self, x: &CpuBuf, xr: Rows, batch: &CpuBatch, out: &CpuBuf, o: Rows) {
        let outs = &batch.meta.outputs;
        assert_eq!((xr.n, o.n, xr.width), (batch.meta.len(), outs.len(), o.width));
        x.check(xr);
        out.check(o);
        for (i, &t) in outs.iter().enumerate() {
            // (ptr::copy: `out` may be `x`, as in `copy`.)
            unsafe { std::ptr::copy(x.0.ptr().add(xr.off + t as usize * xr.stride), out.0.ptr().add(o.off + i * o.stride), o.width) };
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
        assert!(spec.dim <= xr.width && spec.dim.is_multiple_of(2));
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

    fn cache_copy(&self, cache: &CpuBuf, width: usize, src: usize, dst: usize, n: usize) -> Result<()> {
        let rows = |r: usize| Rows { off: r * width, n, width, stride: width };
        let (s, d) = (rows(src), rows(dst));
        let fits = |r: Rows| r.off.checked_add(n * width).is_some_and(|e| e <= cache.0.len());
        if !(fits(s) && fits(d)) || (src < dst + n && dst < src + n) {
            return Err(BackendError::Unsupported(format!(
                "cache copy of {n} rows from row {src} to row {dst} (width {width}) leaves the cache or overlaps"
            )));
        }
        // SAFETY: both ranges lie inside the buffer and do not overlap; ops run one at a time.
        unsafe { std::ptr::copy_nonoverlapping(cache.0.ptr().add(s.off), cache.0.ptr().add(d.off), n * width) };
        Ok(())
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
        let span = |pos: u32| (pos as usize + 1) - p.window.map_or(0, |w| (pos + 1).saturating_sub(w)) as usize;
        let task = |th: usize| {
            let (t, h) = (th / nh, th % nh);
            let TokenMeta { pos, slot, .. } = toks[t];
            let g = h / (nh / nkv);
            let base = slot as usize * sl;
            let start = p.window.map_or(0, |w| (pos + 1).saturating_sub(w)) as usize;
            let end = pos as usize + 1;
            assert!((base + end) * kw <= klen && (base + end) * vw <= vlen, "attention reads past the cache");
            SCORES.with(|sc| {
                let mut scores = sc.borrow_mut();
                // SAFETY: bounds asserted above; each (token, head) task writes its own output slice.
                let qv = unsafe { std::slice::from_raw_parts(qp.get().add(qr.off + t * qr.stride + h * hd), hd) };
                scores.clear();
                for j in start..end {
                    let kr = unsafe { std::slice::from_raw_parts(kp.get().add((base + j) * kw + g * hd), hd) };
                    let mut s = simd::dot(qv, kr) * p.scale;
                    if let Some(c) = p.softcap {
                        s = c * (s / c).tanh();
                    }
                    scores.push(s);
                }
                simd::softmax(&mut scores);
                let orow = unsafe { std::slice::from_raw_parts_mut(op.get().add(o.off + t * o.stride + h * vd), vd) };
                orow.iter_mut().for_each(|x| *x = 0.0);
                for (jj, j) in (start..end).enumerate() {
                    let vr = unsafe { std::slice::from_raw_parts(vp.get().add((base + j) * vw + g * vd), vd) };
                    simd::axpy(orow, scores[jj], vr);
                }
            });
        };
        // Short contexts (a decode step early in a sequence) are cheaper than a parallel region.
        let work: usize = toks.iter().map(|t| span(t.pos)).sum::<usize>() * nh * (hd + vd);
        if self.threads == 1 || work < 1 << 15 {
            (0..qr.n * nh).for_each(task);
        } else {
            self.pool.run(qr.n * nh, &task);
        }
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
        let task = |r: usize| {
            let TokenMeta { pos, slot, .. } = toks[r / nh];
            let base = slot as usize * sl;
            let end = pos as usize + 1;
            assert!((base + end) * w <= clen, "mla attention reads past the cache");
            SCORES.with(|sc| {
                let mut scores = sc.borrow_mut();
                // SAFETY: bounds asserted above; each row task writes its own output row.
                let qv = unsafe { std::slice::from_raw_parts(qp.get().add(qr.off + r * qr.stride), w) };
                scores.clear();
                for j in 0..end {
                    let cr = unsafe { std::slice::from_raw_parts(cp.get().add((base + j) * w), w) };
                    scores.push(simd::dot(qv, cr) * p.scale);
                }
                simd::softmax(&mut scores);
                let orow = unsafe { std::slice::from_raw_parts_mut(op.get().add(o.off + r * o.stride), kl) };
                orow.iter_mut().for_each(|x| *x = 0.0);
                for j in 0..end {
                    let cr = unsafe { std::slice::from_raw_parts(cp.get().add((base + j) * w), kl) };
                    simd::axpy(orow, scores[j], cr);
                }
            });
        };
        let work: usize = toks.iter().map(|t| t.pos as usize + 1).sum::<usize>() * nh * (w + kl);
        if self.threads == 1 || work < 1 << 15 {
            (0..qr.n).for_each(task);
        } else {
            self.pool.run(qr.n, &task);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use ts_core::WeightUse;
    use ts_formats::TensorData;

    /// `cache_copy` moves whole rows, leaves the rest alone, and refuses ranges that leave the
    /// cache or overlap.
    #[test]
    fn cache_copy_rows() {
        let be = CpuBackend::new(Some(1)).expect("cpu backend");
        let (rows, w) = (10, 3);
        let c = be.alloc_cache(rows, w).expect("cache");
        let all = Rows { off: 0, n: 1, width: rows * w, stride: rows * w };
        unsafe { c.row_mut(all, 0) }.iter_mut().enumerate().for_each(|(i, v)| *v = i as f32);
        be.cache_copy(&c, w, 1, 6, 3).expect("copy");
        let got = unsafe { c.row(all, 0) }.to_vec();
        let want: Vec<f32> = (0..rows * w).map(|i| if (18..27).contains(&i) { (i - 15) as f32 } else { i as f32 }).collect();
        assert_eq!(got, want);
        assert!(be.cache_copy(&c, w, 0, 8, 3).is_err(), "past the end");
        assert!(be.cache_copy(&c, w, 2, 4, 3).is_err(), "overlapping");
        be.cache_copy(&c, w, 2, 9, 0).expect("nothing to copy");
    }

    /// `moe` gives a token the same bits alone and in any batch, for Q8_0 experts: its expert
    /// products see 1-3 rows or 4 and more depending on the batch (the invariant kernels and the
    /// tiled one), and its router-weighted sums run in expert order per token. This is what lets
    /// deepseek2 report `batch_invariant` (a whole model's logits mostly hide a last-bit
    /// difference behind the next matrix's 8-bit activations; the MoE output does not).
    #[test]
    fn moe_rows_are_batch_invariant() {
        if !crate::quant_dot::batch_invariant(GgmlType::Q8_0) {
            return;
        }
        let (hdim, ff, ne, k) = (256usize, 128usize, 4usize, 2usize);
        let mut seed = 7u64;
        let mut rnd = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let be = CpuBackend::new(Some(2)).expect("backend");
        let up = |shape: &[usize], v: &[f32]| {
            let mut q = vec![0u8; GgmlType::Q8_0.row_bytes(shape[0]).unwrap() * v.len() / shape[0]];
            ts_formats::quant::quantize(GgmlType::Q8_0, v, &mut q).unwrap();
            be.upload_weight(&TensorData { name: "w", dtype: GgmlType::Q8_0, shape, data: &q, keep: None }, WeightUse::Matmul).unwrap()
        };
        let (gw, uw, dw) = (rnd(hdim * ff * ne), rnd(hdim * ff * ne), rnd(ff * hdim * ne));
        let gate = up(&[hdim, ff, ne], &gw);
        let upw = up(&[hdim, ff, ne], &uw);
        let down = up(&[ff, hdim, ne], &dw);
        let p = MoeParams::top_k(ne, k);
        let n = 9;
        let (x, lg) = (rnd(n * hdim), rnd(n * ne));
        let run = |rows: &[usize]| -> Vec<Vec<f32>> {
            let m = rows.len();
            let xb = CpuBuf::new(m * hdim);
            let lb = CpuBuf::new(m * ne);
            for (i, &r) in rows.iter().enumerate() {
                unsafe { xb.row_mut(Rows::packed(m, hdim), i) }.copy_from_slice(&x[r * hdim..(r + 1) * hdim]);
                unsafe { lb.row_mut(Rows::packed(m, ne), i) }.copy_from_slice(&lg[r * ne..(r + 1) * ne]);
            }
            let ob = CpuBuf::new(m * hdim);
            let ex = Experts { gate: &gate, up: &upw, down: &down };
            be.moe(&xb, Rows::packed(m, hdim), &lb, Rows::packed(m, ne), ex, &p, &ob, Rows::packed(m, hdim));
            (0..m).map(|i| unsafe { ob.row(Rows::packed(m, hdim), i) }.to_vec()).collect()
        };
        let all = run(&(0..n).collect::<Vec<_>>());
        for (r, among) in all.iter().enumerate() {
            let alone = run(&[r]);
            assert!(alone[0].iter().zip(among).all(|(a, b)| a.to_bits() == b.to_bits()), "token {r}: alone vs among {n}");
        }
        let pair = run(&[2, 5]);
        assert!(pair[1].iter().zip(&all[5]).all(|(a, b)| a.to_bits() == b.to_bits()), "token 5 in a pair vs among {n}");
    }

    /// Bytes that come with a [`Keep`] are used in place (unless `copy_weights`), and stay valid
    /// after every other owner of the memory is gone; bytes without one are copied.
    #[test]
    fn weights_with_a_keep_are_used_in_place() {
        let bytes: Vec<u8> = (0..64u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let keep: Keep = Arc::new(bytes);
        let data: &[u8] = keep.downcast_ref::<Vec<u8>>().expect("vec");
        let t = TensorData { name: "w", dtype: GgmlType::F32, shape: &[16, 4], data, keep: Some(&keep) };
        let be = CpuBackend::new(Some(1)).expect("backend");
        let w = be.upload_weight(&t, WeightUse::Matmul).expect("upload");
        assert_eq!(w.data.as_ptr(), data.as_ptr(), "mapped bytes are not copied");
        let copied = CpuBackend::new(Some(1)).expect("backend").copy_weights().upload_weight(&t, WeightUse::Matmul).expect("upload");
        assert_ne!(copied.data.as_ptr(), data.as_ptr());
        let owned = be.upload_weight(&TensorData { keep: None, ..t }, WeightUse::Matmul).expect("upload");
        assert_ne!(owned.data.as_ptr(), data.as_ptr());
        drop(keep);
        assert_eq!(&w.data[4..8], &1f32.to_le_bytes(), "the weight keeps its memory alive");
        assert_eq!(&*w.data, &*copied.data);
    }

    /// A batch sized for n tokens refuses more tokens or more output rows (as the CUDA upload
    /// does), and keeps its previous contents then.
    #[test]
    fn upload_refuses_what_the_batch_cannot_hold() {
        use ts_core::{BatchMeta, TokenMeta};
        let be = CpuBackend::new(Some(1)).expect("backend");
        let mut b = be.alloc_batch(2).expect("batch");
        let tok = |pos| TokenMeta { token: 1, pos, slot: 0 };
        let ok = BatchMeta { tokens: vec![tok(0), tok(1)], outputs: vec![1, 0], slot_len: 8 };
        be.upload_batch(&ok, &mut b).expect("fits");
        let long = BatchMeta { tokens: vec![tok(0), tok(1), tok(2)], outputs: vec![2], slot_len: 8 };
        let e = be.upload_batch(&long, &mut b).expect_err("3 tokens in a batch of 2");
        assert!(e.to_string().contains("exceeds the 2"), "{e}");
        let outs = BatchMeta { tokens: vec![tok(0)], outputs: vec![0, 0, 0], slot_len: 8 };
        let e = be.upload_batch(&outs, &mut b).expect_err("3 output rows in a batch of 2");
        assert!(e.to_string().contains("3 output rows exceed the 2"), "{e}");
        assert_eq!(b.meta.tokens.len(), 2, "a refused upload leaves the batch as it was");
        assert_eq!(b.meta.outputs, vec![1, 0]);
    }
}
