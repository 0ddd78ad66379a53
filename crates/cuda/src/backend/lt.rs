//! A decode batch's cuBLAS products with each shape's algorithm picked by timing
//! ([`Path::BlasTune`]): the products of 9-128 rows (q and kv_a, W_uk, W_uv, W_o, the dense lead
//! FFN, the output head) are skinny (tens of rows against thousands of weight rows) and
//! latency-bound: Nsight had cuBLAS's own choice at 7-27% of DRAM for them. cuBLASLt lists its
//! candidate algorithms for a shape (`cublasLtMatmulAlgoGetHeuristic`: tile shapes, split-K,
//! stages); the first eager sight of a shape times each of them, and cuBLAS's own call, on the
//! step's own operands, and keeps the fastest for every later call of that shape, in eager
//! steps and in recorded ones alike. The other algorithms sum in other orders (split K): a
//! product's values move within f32 rounding, and which algorithm wins may differ from one
//! process to the next.
//!
//! Why by hand: no crate picks cuBLASLt algorithms by measurement; the tuning loop is short and
//! runs on the device's own clock (events).

use super::*;
use cudarc::cublaslt::{result as lt, sys as lt_sys};

/// Bytes of cuBLASLt workspace (split-K partials) for the tuned algorithms; none that asks for
/// more is a candidate.
const LT_WORKSPACE: usize = 32 << 20;
/// Candidates asked of the heuristic for a shape.
const LT_CANDIDATES: usize = 16;
/// Timed runs of each candidate (after one untimed).
const LT_RUNS: usize = 5;

/// One product's shape, types and strides: what an algorithm is chosen for.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct LtKey {
    /// Output rows, tokens, inner dimension.
    pub mnk: (usize, usize, usize),
    /// Leading dimensions (elements) of the weights, the input and the output.
    pub lds: (usize, usize, usize),
    /// Batch strides (elements) of the weights, the input and the output, and the batch count.
    pub strides: (i64, i64, i64, i32),
    /// The weights', the input's and the output's types (cuBLAS's numbering).
    pub types: (u32, u32, u32),
    /// The three pointers' alignments in bytes (powers of two, at most 16): an algorithm timed
    /// on aligned operands may refuse less aligned ones.
    pub align: (u8, u8, u8),
}

/// A pointer's alignment in bytes, at most 16.
pub(super) fn lt_align(p: u64) -> u8 {
    1u8 << p.trailing_zeros().min(4)
}

/// A shape's descriptors and its chosen algorithm.
struct LtPlan {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    d: lt_sys::cublasLtMatrixLayout_t,
    algo: lt_sys::cublasLtMatmulAlgo_t,
    ws: usize,
}

impl Drop for LtPlan {
    fn drop(&mut self) {
        unsafe {
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// [`Path::BlasTune`]'s state: the cuBLASLt handle, its workspace, and per shape the plan that
/// won its timing (None: cuBLAS's own call won, or cuBLASLt could not take the shape).
pub(super) struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    ws: DevMem,
    plans: Mutex<HashMap<LtKey, Option<LtPlan>>>,
    /// Shapes timed, and of those the ones a cuBLASLt algorithm won (for the tests).
    pub tuned: AtomicU64,
    pub won: AtomicU64,
}

// The raw handles are used under the plans' lock or by the one thread that drives the stream.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}
unsafe impl Send for LtPlan {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|e| e.into_inner()).clear();
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// cuBLAS's data type numbers in cuBLASLt's enum (the same values; the two crates' enums differ).
fn lt_type(t: u32) -> Option<lt_sys::cudaDataType> {
    Some(match t {
        0 => lt_sys::cudaDataType::CUDA_R_32F,
        2 => lt_sys::cudaDataType::CUDA_R_16F,
        14 => lt_sys::cudaDataType::CUDA_R_16BF,
        _ => return None,
    })
}

impl Lt {
    /// None where libcublasLt cannot be loaded or the handle not made (the path then stays on
    /// cuBLAS's own calls).
    pub(super) fn new(be: &CudaBackend) -> Option<Lt> {
        if !unsafe { lt_sys::is_culib_present() } {
            return None;
        }
        let handle = lt::create_handle().ok()?;
        let ws = be.alloc_mem(LT_WORKSPACE, "cuBLASLt workspace").ok()?;
        Some(Lt { handle, ws, plans: Mutex::new(HashMap::new()), tuned: AtomicU64::new(0), won: AtomicU64::new(0) })
    }

    /// The descriptors of `key` with the transposes and batch of `gemm_ex_c` (C_b[m, n] =
    /// W_b^T X_b, column-major), and up to [`LT_CANDIDATES`] algorithms for them.
    fn describe(&self, key: &LtKey) -> Option<(LtPlan, Vec<lt_sys::cublasLtMatmulHeuristicResult_t>)> {
        let (m, n, k) = key.mnk;
        let (lda, ldx, ldc) = key.lds;
        let (sw, sx, sc, batch) = key.strides;
        let (wt, xt, ct) = (lt_type(key.types.0)?, lt_type(key.types.1)?, lt_type(key.types.2)?);
        let desc = lt::create_matmul_desc(lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt_sys::cudaDataType::CUDA_R_32F).ok()?;
        let layout = |t, rows: usize, cols: usize, ld: usize, stride: i64| -> Option<lt_sys::cublasLtMatrixLayout_t> {
            let l = lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64).ok()?;
            if batch > 1 {
                unsafe {
                    let bc = batch;
                    lt::set_matrix_layout_attribute(
                        l,
                        lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        &bc as *const i32 as *const _,
                        4,
                    )
                    .ok()?;
                    lt::set_matrix_layout_attribute(
                        l,
                        lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                        &stride as *const i64 as *const _,
                        8,
                    )
                    .ok()?;
                }
            }
            Some(l)
        };
        // (a plan owns what it holds from here: dropped on any failure below)
        let mut plan = LtPlan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            ws: 0,
        };
        let op_t: i32 = 1; // CUBLAS_OP_T
        unsafe {
            lt::set_matmul_desc_attribute(
                plan.desc,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &op_t as *const i32 as *const _,
                4,
            )
            .ok()?;
        }
        // A: the weights as stored (k x m, ld lda), transposed; B: the input (k x n, ld ldx);
        // D (and C, unused at beta 0): m x n, ld ldc.
        plan.a = layout(wt, k, m, lda, sw)?;
        plan.b = layout(xt, k, n, ldx, sx)?;
        plan.d = layout(ct, m, n, ldc, sc)?;
        let pref = lt::create_matmul_pref().ok()?;
        let max_ws = LT_WORKSPACE as u64;
        let found = unsafe {
            // (the workspace, a u64, and the operands' alignments, u32s, so that every candidate
            // takes them)
            use lt_sys::cublasLtMatmulPreferenceAttributes_t as P;
            let set64 = |attr, v: u64| lt::set_matmul_pref_attribute(pref, attr, &v as *const u64 as *const _, 8).is_ok();
            let set32 = |attr, v: u8| lt::set_matmul_pref_attribute(pref, attr, &(v as u32) as *const u32 as *const _, 4).is_ok();
            let (aw, ax, ac) = key.align;
            let ok = set64(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws)
                && set32(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aw)
                && set32(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ax)
                && set32(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ac)
                && set32(P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ac);
            let mut res = vec![std::mem::zeroed::<lt_sys::cublasLtMatmulHeuristicResult_t>(); LT_CANDIDATES];
            let mut count = 0i32;
            let st = lt_sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                pref,
                LT_CANDIDATES as i32,
                res.as_mut_ptr(),
                &mut count,
            );
            let _ = lt::destroy_matmul_pref(pref);
            if !ok || st != lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return None;
            }
            res.truncate(count.max(0) as usize);
            res.retain(|r| r.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= LT_WORKSPACE);
            res
        };
        (!found.is_empty()).then_some((plan, found))
    }

    /// One product with `plan`'s descriptors and `algo` on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn matmul(
        &self,
        plan: &LtPlan,
        (algo, ws): (&lt_sys::cublasLtMatmulAlgo_t, usize),
        (w, x, c): (u64, u64, u64),
        stream: &CudaStream,
    ) -> bool {
        let (alpha, beta) = (1.0f32, 0.0f32);
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                w as *const _,
                plan.a,
                x as *const _,
                plan.b,
                c as *const _,
                plan.d,
                c as *mut _,
                plan.d,
                algo as *const _,
                if ws > 0 { self.ws.ptr as *mut _ } else { std::ptr::null_mut() },
                ws,
                stream.cu_stream() as _,
            )
            .is_ok()
        }
    }
}

impl CudaBackend {
    /// [`Path::BlasTune`]: the product `key` of the operands `(w, x, c)` on the main stream
    /// with the algorithm its timing chose, timing it first at its first sight outside a
    /// capture (`legacy` runs cuBLAS's own call, a candidate too). False, having enqueued
    /// nothing, where cuBLAS's own call is to run: it won, the shape has no cuBLASLt plan, or
    /// the shape is first seen inside a capture.
    pub(super) fn lt_gemm(&self, key: LtKey, ops: (u64, u64, u64), legacy: &dyn Fn()) -> bool {
        let Some(lt) = self.lt.get() else { return false };
        let mut plans = lt.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = plans.get(&key) {
            // (a call the plan refuses, which validation does before enqueueing anything, goes
            // to cuBLAS's own call)
            return p.as_ref().is_some_and(|plan| lt.matmul(plan, (&plan.algo, plan.ws), ops, &self.stream));
        }
        if self.graphs.lock().unwrap_or_else(|e| e.into_inner()).capturing.is_some() {
            return false;
        }
        lt.tuned.fetch_add(1, Ordering::Relaxed);
        let Some((mut plan, cands)) = lt.describe(&key) else {
            plans.insert(key, None);
            return false;
        };
        // Time cuBLAS's own call and each candidate on these operands (they are ready once the
        // stream is; every run writes the same output, which the winner writes again below).
        let time = |run: &dyn Fn() -> bool| -> Option<f32> {
            let ev = || self.ctx.new_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)).ok();
            let (e0, e1) = (ev()?, ev()?);
            if !run() {
                return None;
            }
            e0.record(&self.stream).ok()?;
            for _ in 0..LT_RUNS {
                if !run() {
                    return None;
                }
            }
            e1.record(&self.stream).ok()?;
            e1.synchronize().ok()?;
            e0.elapsed_ms(&e1).ok()
        };
        let base = time(&|| {
            legacy();
            true
        });
        let mut best: Option<(f32, usize)> = None;
        for (i, c) in cands.iter().enumerate() {
            if let Some(t) = time(&|| lt.matmul(&plan, (&c.algo, c.workspaceSize), ops, &self.stream)) {
                if best.is_none_or(|(bt, _)| t < bt) {
                    best = Some((t, i));
                }
            }
        }
        // (a failed run leaves the context's error for the step to report; the winner below
        // rewrites the output either way)
        match (best, base) {
            (Some((t, i)), Some(b)) if t < b => {
                plan.algo = cands[i].algo;
                plan.ws = cands[i].workspaceSize;
                lt.won.fetch_add(1, Ordering::Relaxed);
                let ok = lt.matmul(&plan, (&plan.algo, plan.ws), ops, &self.stream);
                plans.insert(key, Some(plan));
                ok
            }
            _ => {
                plans.insert(key, None);
                false
            }
        }
    }

    /// [`Path::BlasTune`]'s counts: shapes timed, and of those the ones a cuBLASLt algorithm
    /// won (for the tests and the bench's notes).
    pub fn blas_tuned(&self) -> (u64, u64) {
        self.lt.get().map_or((0, 0), |lt| (lt.tuned.load(Ordering::Relaxed), lt.won.load(Ordering::Relaxed)))
    }
}
