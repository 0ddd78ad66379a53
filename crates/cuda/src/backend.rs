//! [`CudaBackend`]: every [`Backend`] op on one NVIDIA GPU, enqueued on one stream.
//!
//! * Buffers, caches, weights and batches are plain device allocations addressed by raw device
//!   pointers; kernels take `(pointer, offset, stride)` triples, so `Rows` views and in-place ops
//!   cost nothing. Event tracking is off (one stream orders everything).
//! * Ops cannot return errors (the trait's signature); a failure inside one (a launch error, a
//!   scratch allocation that does not fit, a token id outside the table) is kept and returned by
//!   the next [`Backend::read`] or [`Backend::synchronize`]. Shape-contract violations panic, as
//!   in the CPU reference.
//! * Decode fast paths (`kernels/fast.cu`): Q8_0 matmuls of up to 8 tokens use a dp4a GEMV that
//!   quantises the activations to Q8_0 in shared memory (as the CPU backend and llama.cpp do);
//!   Q8_0 MoE at up to 8 tokens is route + gate/up/GLU + down/weighted-sum (3 launches); MLA at
//!   up to 8 tokens is split over the context (all heads per block) plus a merge; f32 routers use
//!   a split-K GEMV. Steps of up to 8 tokens are recorded as CUDA graphs when the model brackets
//!   them with `graph_begin`/`graph_end` (no other thread may use the backend during a capture).
//! * Matmul: up to 8 tokens per matrix, `gemv_*` kernels read the quantised weights directly; more
//!   tokens dequantise the weight into a bf16 scratch and call `cublasGemmStridedBatchedEx`
//!   (bf16 in, f32 accumulate and out); F32 weights go to cuBLAS in f32 without a copy.
//! * Scratch (bf16 weights/activations, MoE routing and expert intermediates) grows to the
//!   largest use and is then reused; nothing else is allocated after open.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;
use ts_core::{
    AttnParams, Backend, BackendError, BatchMeta, Experts, Gating, GgmlType, Glu, MlaParams, MoeNext, MoeParams, Result, RopeMode,
    RopeSpec, Rows, StepCounts, TensorData, TokenMeta, WeightInfo, WeightUse, TOKEN_FROM_ARGMAX,
};
use ts_formats::quant;

use crate::kernels;

/// One device allocation; freed (stream-ordered) on drop.
struct DevMem {
    _slice: CudaSlice<u8>,
    ptr: u64,
    bytes: usize,
}

/// An f32 activation buffer (a cheap handle; clones share storage).
#[derive(Clone)]
pub struct CudaBuf(Arc<DevMem>);

impl CudaBuf {
    /// Length in f32 elements.
    pub fn len(&self) -> usize {
        self.0.bytes / 4
    }
    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn check(&self, r: Rows) {
        assert!(r.end() <= self.len(), "rows {r:?} outside a buffer of {} elements", self.len());
    }
}

/// A KV cache: `rows` of `width` values, f32 (an MLA latent cache may be f16: `half`); a separate
/// type from activations so its element can differ.
pub struct CudaCache {
    mem: DevMem,
    rows: usize,
    width: usize,
    /// f16 values (u16 bits) instead of f32: an MLA latent cache the tensor-core kernels read
    /// ([`Backend::alloc_latent_cache`]; the `_h` kernels), rounded as they round f32 keys.
    half: bool,
}

impl CudaCache {
    /// (rows, width) as allocated.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.width)
    }
    /// Whether the values are f16 (else f32).
    pub fn is_f16(&self) -> bool {
        self.half
    }
    /// `name`, or its f16-cache twin `name_h`, on the stack.
    fn kernel(&self, name: &str) -> KName {
        if self.half {
            KName::of(format_args!("{name}_h"))
        } else {
            KName::of(format_args!("{name}"))
        }
    }
}

/// A weight on the device in its file format, repacked so every block starts on a 4-byte
/// boundary (Q4_0, Q5_0 get 2 bytes after the scale, Q6_K 2 bytes at the end; Q8_0 goes in groups
/// of 4 blocks with the quants 16-byte aligned, see [`repack`]). Norm
/// vectors are converted to f32 at upload.
pub struct CudaWeight {
    dtype: GgmlType,
    shape: Vec<usize>,
    mem: DevMem,
    /// Device bytes of one row of `shape[0]` elements.
    row_bytes: usize,
    /// A second copy of a 3-D Q8_0 stack ([`CudaBackend::moe_tiled`]): each matrix in tiles of
    /// 16 rows (padded with zero rows), each tile's group in the order `mmq_q8_rows`' lanes
    /// load it ([`tile16`]): a warp reads 512 contiguous bytes a load, and the grouped expert
    /// products (`mmq_q8_rows`) read this copy instead of the row-major one.
    tiled: Option<DevMem>,
    /// An f16 copy of a Q8_0 MoE weight for prompt-size products ([`CudaBackend::f16_copy`]):
    /// each value `f16(q * d)` of its block, in 8 KB tiles of 64 rows x 64 values (`q8_to_f16`;
    /// `shape[0]` a multiple of 128, `shape[1]` of 64); the grouped expert products of prompts
    /// read it on the f16 tensor cores (`mmf16_256`) instead of the int8 ones. Row-major
    /// instead (`half_rm`) for the shared FFN on cuBLAS ([`CudaBackend::shared_blas`]).
    half: Option<DevMem>,
    /// `half` is row-major (`shape[0]` halves a row, matrix after matrix), not tiled.
    half_rm: bool,
}

impl WeightInfo for CudaWeight {
    fn dtype(&self) -> GgmlType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn bytes(&self) -> usize {
        self.mem.bytes
    }
    fn copy_bytes(&self) -> usize {
        self.tiled.as_ref().map_or(0, |t| t.bytes) + self.half.as_ref().map_or(0, |t| t.bytes)
    }
}

impl CudaWeight {
    fn ne(&self, i: usize) -> usize {
        self.shape.get(i).copied().unwrap_or(1)
    }
    fn mat_bytes(&self) -> usize {
        self.row_bytes * self.ne(1)
    }
    /// Bytes of one matrix of the tiled copy ([`CudaWeight::tiled`]).
    fn tiled_mat_bytes(&self) -> usize {
        tile16_mat_bytes(self.row_bytes, self.ne(1))
    }
    fn tiled_ptr(&self) -> u64 {
        self.tiled.as_ref().map_or(0, |t| t.ptr)
    }
    /// The f16 copy ([`CudaWeight::half`]), if there is one: (pointer, bytes from one 64-row
    /// tile to the next, matrix bytes).
    fn half(&self) -> Option<(u64, usize, usize)> {
        let k = self.ne(0);
        self.half.as_ref().filter(|_| !self.half_rm).map(|h| (h.ptr, 128 * k, 2 * k * self.ne(1)))
    }
    /// The row-major f16 copy's pointer ([`CudaWeight::half_rm`]), if there is one.
    fn half_rm(&self) -> Option<u64> {
        self.half.as_ref().filter(|_| self.half_rm).map(|h| h.ptr)
    }
}

/// A batch on the device: `token`, `pos`, `slot` arrays of `max_tokens` i32 each, plus the host
/// copy used for bounds checks (never read back from the device).
pub struct CudaBatch {
    /// `[token ids | positions | slots | output rows]`, `max_tokens` i32 each.
    mem: DevMem,
    max_tokens: usize,
    tokens: Vec<TokenMeta>,
    /// How many output rows the uploaded batch has (their indices are on the device).
    n_outputs: usize,
    slot_len: u32,
    /// Host staging of `mem`'s contents (sized once: uploading allocates nothing).
    host: Vec<u8>,
    /// Two page-locked copies of `host` taken in turn, each with the event recorded after its
    /// upload: an upload from page-locked memory never waits for the stream (one from pageable
    /// memory may), so a chained step is enqueued while the one before it runs; a copy is
    /// rewritten only once its last upload has been done. None where none could be had.
    pinned: Option<[HostPinned; 2]>,
    sent: [Option<CudaEvent>; 2],
    flip: usize,
}

/// The runs of a batch's tokens that are picks of the last arg-max (`TOKEN_FROM_ARGMAX + row`):
/// (first token, first row, count) for consecutive tokens taking consecutive rows, so that each
/// run is one device copy; found as they are walked (an upload allocates nothing).
struct FedRuns<'a> {
    tokens: &'a [TokenMeta],
    at: usize,
}
impl<'a> FedRuns<'a> {
    fn of(tokens: &'a [TokenMeta]) -> Self {
        FedRuns { tokens, at: 0 }
    }
}
impl Iterator for FedRuns<'_> {
    type Item = (usize, usize, usize);
    fn next(&mut self) -> Option<Self::Item> {
        let row = |t: &TokenMeta| (t.token >= TOKEN_FROM_ARGMAX).then(|| (t.token - TOKEN_FROM_ARGMAX) as usize);
        let t0 = self.at + self.tokens[self.at..].iter().position(|t| row(t).is_some())?;
        let r0 = row(&self.tokens[t0])?;
        let mut c = 1;
        while self.tokens.get(t0 + c).and_then(row) == Some(r0 + c) {
            c += 1;
        }
        self.at = t0 + c;
        Some((t0, r0, c))
    }
}

impl CudaBatch {
    /// Keep the uploaded batch's host description.
    fn set_meta(&mut self, meta: &BatchMeta) {
        self.tokens.clear();
        self.tokens.extend_from_slice(&meta.tokens);
        self.n_outputs = meta.outputs.len();
        self.slot_len = meta.slot_len;
    }
    fn tok_ptr(&self) -> u64 {
        self.mem.ptr
    }
    fn pos_ptr(&self) -> u64 {
        self.mem.ptr + 4 * self.max_tokens as u64
    }
    fn slot_ptr(&self) -> u64 {
        self.mem.ptr + 8 * self.max_tokens as u64
    }
    fn out_ptr(&self) -> u64 {
        self.mem.ptr + 12 * self.max_tokens as u64
    }
}

/// A rope table: per-pair frequencies on the device.
pub struct CudaRope {
    freqs: DevMem,
    dim: usize,
    mode: RopeMode,
    mscale: f32,
}

/// The expert stacks of `CudaBackend::moe_mmh`: row-major f16 copies (gate, up, down), or the
/// Q8_0 stacks themselves as (pointer, row bytes).
enum MmhWeights {
    F16(u64, u64, u64),
    Q8([(u64, usize); 3]),
}

/// A kernel argument.
#[derive(Clone, Copy)]
enum A {
    P(u64),
    L(i64),
    I(i32),
    F(f32),
    /// A TMA descriptor passed by value (a `__grid_constant__ TmaMap` parameter, kernels/mmh.cu);
    /// the pointee must live until the launch call returns (the driver copies it then).
    T(*const drv_sys::CUtensorMap),
}

fn l(v: usize) -> A {
    A::L(v as i64)
}
/// A count from the environment variable `name`, if it is set and parses.
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn i(v: usize) -> A {
    A::I(v as i32)
}

/// Named growable scratch buffers.
#[derive(Clone, Copy)]
enum S {
    WBf16 = 0,
    XBf16,
    SelE,
    SelW,
    Cnt,
    Off,
    Perm,
    G,
    U,
    Y,
    /// Per-split partial results of the split MLA decode kernel.
    Part,
    /// Activation rows quantised to Q8_0 groups for the tensor-core products (`mmq_q8`).
    Xq,
    /// The MoE's GLU output, quantised the same way (input of the down projection).
    Hq,
    /// Row arg-max ids on their way to the host, then the first pass's keys (`argmax_rows`).
    Ids,
    /// Activation rows in f16 for the f16 products (`f16_rows`, `mmf16_*`).
    Xh,
    /// The MoE's GLU output in f16 (input of the f16 down projection).
    Hh,
    /// The shared FFN on cuBLAS ([`CudaBackend::shared_blas`]): its gate then up rows (f32),
    /// its GLU rows (f16), its output rows (f32).
    Gu,
    Hs,
    Ys,
    /// The prompt MoE's input rows in f16, one per (token, slot) pair in expert order
    /// (`moe_gather_h`, the input of `mmh_gu`).
    Xs,
    /// One token's attention output per head (`mla_out_q8`: `[n_heads, H]`), which
    /// `add_rms_norm_parts` adds up.
    Ho,
    /// The one-launch decode MoE's slot counters (`moe_sh_q8_one`: `k + n_shared` of them, one
    /// for its down units, its routing's ready flag; zero between launches).
    Sync,
    /// Counts of blocks done reading the residual (u32s; zero between launches: the last block
    /// writes the residual and resets its word): word 0 `add_rms_norm_parts_router`'s, word 1
    /// `gemv_q8_multi_norm_1`'s.
    NormSync,
    /// The one-token MoE's routing made ahead, in the norm's launch ([`CudaBackend::pre_route`]):
    /// its k expert ids (i32), their weights (f32), its input row in Q8_0 groups. Written by
    /// that launch only, read by the `moe_shared` that follows it.
    PreE,
    PreW,
    PreXq,
    /// A decode batch's FFN norm output quantised in the norm's launch (`add_rms_norm_q8`,
    /// [`Path::NormQ8`]) for the MoE after it ([`CudaBackend::norm_xq`]). Written by that launch
    /// only.
    NormXq,
    /// A decode batch's attention values (`[n, heads * v]`) as Q8_0 groups, written by the W_uv
    /// product's split sum for the W_o product ([`Path::SumQ8`]).
    SumXq,
}
const N_SCRATCH: usize = 28;

/// Fast-path kernels that take more than the default 48 KiB of dynamic shared memory.
const BIG_SMEM_KERNELS: &[&str] = &[
    "gemv_q8_1",
    "gemv_q8_2",
    "gemv_q8_4",
    "gemv_q8_8",
    "moe_gateup_q8",
    "moe_down_q8",
    "gemv_q8_multi_1",
    "gemv_q8_multi_2",
    "gemv_q8_multi_4",
    "gemv_q8_multi_8",
    "moe_gateup_sh_q8q",
    "moe_down_sh_q8",
    "moe_down_sh_q8_w4",
    "mla_prefill",
    "mla_prefill_h",
    "mla_prefill_ha",
    "mla_split_tc",
    "mla_split_tc_h",
    "mla_split_tc_he",
    "mla_split_tc_hb",
    "mmq_q8_64",
    "mmq_q8_64e",
    "mmq_q8_64_jobs",
    "mmq_q8_64_jobse",
    "mmq_q8_64ws",
    "mmq_q8_16",
    "mmq_q8_16g1",
    "mmq_q8_rows",
    "mmq_q8_rows_r2",
    "mmq_q8_rows_d",
    "mla_out_q8",
    "mla_out_bf16",
    "mla_out_f16",
];
/// The f16 prompt products (kernels/mmq.cu, `MMF_INST`, `MMF_GU_INST`): (plain kernel, gate-up-GLU
/// kernel, stages in flight), the first whose shared memory the device gives. Both take 256
/// threads, 256 weight rows (128 ff rows of gate and of up for the GLU one) and 64 tokens a
/// block, `stages * 320 * 144` bytes of shared memory. Four stages (184 KB) measured on the H200
/// against three (same call): pp512 21,249 -> 21,842, pp2048 19,361 -> 19,760; a 128-row tile of
/// four stages (two blocks an SM) was +0.6% against three and dropped. `TS_CUDA_MMF=s3` forces
/// three.
const MMF_TILES: [(&str, &str, usize); 2] = [("mmf16_256s4", "mmf16_gu_s4", 4), ("mmf16_256", "mmf16_gu", 3)];
/// Shared memory of an `mmfq_*` stage.
const MMFQ_STAGE: usize = 256 * 144 + 64 * 288;
/// Dynamic shared memory of the `mmh_*` kernels (kernels/mmh.cu): four stages of 128 pair rows
/// and 256 weight rows of 128 bytes, plus 1 KB to align the first stage to 1,024 bytes (the
/// 128-byte swizzle's period).
const MMH_SMEM: usize = 4 * (128 + 256) * 128 + 1024;
/// Dynamic shared memory of the `mmh8_*` kernels: three stages, each with the raw Q8_0 rows (256
/// rows of 64 quants and of a 16-byte group header) beside the f16 ones made from them.
const MMH8_SMEM: usize = 3 * ((128 + 256) * 128 + 256 * (64 + 16)) + 1024;
/// `mla_out_q8` (kernels/fused.cu): value rows a head (V2's v_head_dim), heads it takes (the
/// norm adds one row per head), and its dynamic shared memory for `kl` latent values, W_uv rows
/// of `uv_row_bytes` and `r` rows of W_o: the W_uv and W_o slices, the 8 warps' merge sums, the
/// latent and value rows' Q8_0 copies, the split weights and a reduction area (the kernel's
/// layout).
const MO_VD: usize = 128;
/// Slots (routed + shared experts a token) the decode MoE kernels take (`MOE_SH_MAX_SLOTS` in
/// kernels/fused.cu).
const MOE_SH_MAX_SLOTS: usize = 64;
const MO_MAX_PARTS: usize = 16;
const fn mla_out_smem(kl: usize, uv_row_bytes: usize, r: usize) -> usize {
    MO_VD * uv_row_bytes + r * 144 + 4 * 8 * kl + kl + 4 * (kl / 32) + MO_VD + 4 * (MO_VD / 32) + 4 * (256 + 16)
}
/// `mla_out_<t>` (kernels/fused.cu, 16-bit W_uv / W_o): blocks a head (one cluster), and its
/// dynamic shared memory for `kl` latent values and an output row of `hd`: 16 W_uv rows of
/// `2 kl` bytes, `hd / 8` W_o rows of 256 bytes, the warps' merge sums, the latent and value
/// rows, the split weights and a reduction area (the kernel's layout).
const MH_CLUSTER: usize = 8;
const fn mla_out_h16_smem(kl: usize, hd: usize) -> usize {
    MO_VD / MH_CLUSTER * 2 * kl + hd / MH_CLUSTER * 2 * MO_VD + 4 * (8 * kl + kl + MO_VD + 256 + 16)
}
/// (Token, slot) pairs a tile of the `mmh_*` kernels.
const MMH_BM: usize = 128;
/// The most dynamic shared memory the fast paths ask for (the activation rows, quantised).
const FAST_SMEM_MAX: usize = 160 * 1024;
/// Dynamic shared memory of an `mmq_q8` kernel: `nst` stages of 64 + `bn` rows of `gps` groups
/// of 144 bytes (plus 16 pad bytes per row when `gps > 1`; kernels/mmq.cu).
const fn mmq_smem(bn: usize, gps: usize, nst: usize) -> usize {
    nst * (64 + bn) * if gps == 1 { 144 } else { gps * 144 + 16 }
}
const MMQ_SMEM: usize = mmq_smem(64, 1, 3);
/// Smallest size of the `Part` scratch (split-MLA decode partials, split-K partial products): one
/// size for both, so the first decode step (run at open) allocates it for good.
const PART_MIN_BYTES: usize = 16 << 20;
/// Values per block of the arg-max's first pass (`argmax_part`): a 102,400-wide row in 50 blocks.
const ARGMAX_CHUNK: usize = 2048;
/// Dynamic shared memory of `mla_split_tc` (the 16 query rows, one tile of `kt` keys, the scores
/// of two dim halves) and of `mla_split_tc_h` with `nb` key tiles in its cp.async ring (`MS_NB`
/// in kernels/mla_prefill.cu: the next `nb - 1` stream in while one is used). A tile is
/// `MS_T` = 32 keys. The score buffer has room for rows of `MS_SLD_MAX` = 40 floats (`MS_SLD`
/// in kernels/mla_prefill.cu, a measurement define, that by default).
const MS_SMEM: usize = (16 + 32) * 584 * 2 + 2 * 16 * 40 * 4;
const fn ms_smem_h(nb: usize) -> usize {
    (16 + nb * 32) * 584 * 2 + 2 * 16 * 40 * 4
}
/// Dynamic shared memory of `mla_prefill` / `mla_prefill_h` (kernels/mla_prefill.cu): the 64
/// query rows of 4 row groups, one 32-key tile, the scores of 4 row groups.
const MP_SMEM: usize = (64 + 32) * 584 * 2 + 4 * 16 * 32 * 4;
/// `mla_prefill_ha`'s: two key tiles (the cp.async double buffer).
const MP_SMEM_A: usize = MP_SMEM + 32 * 584 * 2;
/// `mla_split_tc_h`'s default ring depth (`TS_CUDA_MS_NB` to measure 2..=4). H200, tg64 @16k:
/// 2 tiles 402, 3 431, 4 334 tok/s (same tokens).
const MS_NB: usize = 3;
/// The batch kernel's ring (`mla_split_tc_hb`, [`Path::SplitBatch`]; `TS_CUDA_MS_NB_B` to
/// measure 1..=4): two tiles, 96 KB, two blocks an SM, so that a 64-sequence step's 256 blocks
/// (4 splits each) run in one wave (at three tiles, 133 KB, they took two).
const MS_NB_B: usize = 2;
/// Whether the one-warp-per-token routing (`moe_route_warp`, and the fused decode MoE built on it)
/// covers this routing: at most 256 experts, top 32, and no expert-group limit that binds.
fn warp_route(p: &MoeParams) -> bool {
    p.n_experts <= 256 && p.k <= 32 && (p.n_group == 1 || p.topk_group >= p.n_group)
}
/// What `CudaBackend::mmq_dense` does with split K's partial outputs.
#[derive(Clone, Copy)]
enum SplitSum {
    /// Sums them into the output (`mmq_sum_splits`).
    Plain,
    /// Sums them into the output and writes its rows as Q8_0 groups here too
    /// (`mmq_sum_splits_q8` where the rows are whole groups; [`Path::SumQ8`]).
    Q8(u64),
    /// Leaves them for the kernel after it to sum (`add_rms_norm_q8`'s delta; [`Path::SumQ8`]).
    Leave,
}

/// A batch's rows quantised ahead ([`CudaBackend::norm_xq`]): the rows (buffer, offset, stride,
/// count, width) and where their Q8_0 groups are.
#[derive(Clone, Copy, PartialEq, Eq)]
struct NormXq {
    rows: (u64, usize, usize, usize, usize),
    xq: u64,
}

/// A one-token routing made ahead of its MoE ([`CudaBackend::pre_route`]): the logits' and the
/// input row's places (pointer, offset in floats) and the parameters it used.
#[derive(Clone, Copy)]
struct Routed {
    logits: (u64, usize),
    input: (u64, usize),
    p: MoeParams,
}
impl Routed {
    fn serves(&self, logits: (u64, usize), input: (u64, usize), p: &MoeParams) -> bool {
        let q = &self.p;
        self.logits == logits
            && self.input == input
            && (q.n_experts, q.k, q.norm_topk, q.scale.to_bits()) == (p.n_experts, p.k, p.norm_topk, p.scale.to_bits())
            && matches!(q.gating, Gating::Sigmoid) == matches!(p.gating, Gating::Sigmoid)
            && warp_route(p)
    }
}
/// A grouped `mmq_q8` product's expert lists (`moe_group`'s `cnt`, `off`, `perm` over `n_exp`
/// experts) and, for experts from `e_sh` on, a shared FFN's chunks: `sh` = (matrix, row bytes,
/// bytes between chunks, e_sh). `pair` = (experts, shared matrix or 0, output): a second
/// product of the same shapes and input in the same launch (the upper half of `grid.0`).
#[derive(Clone, Copy)]
struct MmqGroups {
    cnt: u64,
    off: u64,
    perm: u64,
    n_exp: usize,
    sh: Option<(u64, usize, usize, usize)>,
    pair: Option<(u64, u64, u64)>,
    /// The pair's weights in 16-row tiles ([`CudaWeight::tiled`]), or 0.
    pair_tiled: u64,
    /// (token, slot) pairs over all `n_exp` experts (picks the rows kernel's row sets).
    pairs: usize,
    /// Tokens of the batch: each shared chunk's (with `sh`) pairs.
    tokens: usize,
}
impl MmqGroups {
    const NONE: MmqGroups = MmqGroups { cnt: 0, off: 0, perm: 0, n_exp: 0, sh: None, pair: None, pair_tiled: 0, pairs: 0, tokens: 0 };
}
/// Split-MLA decode: most splits per token (mla_combine's shared table).
const MLA_MAX_SPLITS: usize = 256;

/// `add_rms_norm`'s arguments (and the first of `add_rms_norm_q8`'s): the rows `x`, the delta
/// (pointer, 0 for none; rows), the norm's weights and eps, the output rows, the width.
fn add_norm_args((x, xr): (&CudaBuf, Rows), (d, dr): (u64, Rows), w: Option<&CudaWeight>, eps: f32, (out, o): (&CudaBuf, Rows)) -> [A; 13] {
    [
        A::P(x.0.ptr),
        l(xr.off),
        l(xr.stride),
        A::P(d),
        l(dr.off),
        l(dr.stride),
        A::P(w.map_or(0, |w| w.mem.ptr)),
        A::I(w.is_some() as i32),
        A::F(eps),
        A::P(out.0.ptr),
        l(o.off),
        l(o.stride),
        i(xr.width),
    ]
}

/// [`CudaBackend::tc_batch_splits`] for `sm` SMs, `n` tokens, at most `kps` keys a split at
/// one block an SM (0: no such wave), the batch's last position `max_pos`.
fn tc_batch_splits(sm: usize, n: usize, kps: usize, max_pos: Option<u32>) -> usize {
    let (lo, hi) = ((sm / n).max(1), (2 * sm / n).max(1));
    match max_pos {
        Some(p) if kps > 0 && (p as usize) < kps * lo => lo,
        _ => hi,
    }
}

/// Two argument lists as one kernel's, in a fixed array (launching allocates nothing). The
/// lengths are checked when this compiles: an array one too long or short would otherwise
/// panic on the host before the launch (gpu-next59's first run).
fn cat<const N: usize, const M: usize, const T: usize>(a: [A; N], b: [A; M]) -> [A; T] {
    const { assert!(N + M == T, "kernel arguments: the two lists' lengths do not add up to the array's") };
    let mut v = [A::I(0); T];
    v[..N].copy_from_slice(&a);
    v[N..].copy_from_slice(&b);
    v
}

/// The arguments of the decode MoE's gate/up kernels (`moe_gateup_sh_q8q`, `moe_gateup_sh_<t>`):
/// the routed experts' and the shared FFN's gate and up weights, (ff, hdim, k, shared chunks),
/// the slots' expert ids and router weights, then the kernel's own input and output arguments.
/// A fixed array (launching allocates nothing): `N` = 12 + the kernel's own `T` arguments.
fn moe_gateup_args<const T: usize, const N: usize>(
    experts: &Experts<'_, CudaWeight>,
    shared: &Experts<'_, CudaWeight>,
    (ff, hdim, k, nsh): (usize, usize, usize, usize),
    (sel_e, sel_w): (u64, u64),
    tail: [A; T],
) -> [A; N] {
    cat(
        [
            A::P(experts.gate.mem.ptr),
            A::P(experts.up.mem.ptr),
            l(experts.gate.row_bytes),
            l(experts.gate.mat_bytes()),
            i(ff),
            i(hdim),
            A::P(sel_e),
            A::P(sel_w),
            i(k),
            A::P(shared.gate.mem.ptr),
            A::P(shared.up.mem.ptr),
            i(nsh),
        ],
        tail,
    )
}

/// The arguments of the decode MoE's down kernels (`moe_down_sh_q8`, `moe_down_sh_<t>`): the
/// routed experts' and the shared FFN's down weights, (hdim, ff, k, shared chunks), the slots'
/// expert ids, their inputs (`act`: a row per slot every `arow` elements or bytes: f32 GLU rows,
/// or their Q8_0 groups) and the output view.
#[allow(clippy::too_many_arguments)]
/// The job table of `gemv_q8_multi_*` for up to 3 jobs sharing an input of width k: (W,
/// row_bytes, m, out, ooff, ostride) per job (zeros past the last), then the tile bounds t1, t2
/// and the tile count; with the lanes a row and the tile count.
fn multi_jobs(jobs: &[(&CudaWeight, &CudaBuf, Rows)], k: usize) -> ([A; 21], usize, usize) {
    let lpr = (k / 16).next_power_of_two().min(32);
    let (args, total) = multi_job_table(jobs, 8 * (32 / lpr));
    (args, lpr, total)
}

/// The job table of the multi-product kernels (three jobs' weights, row bytes, rows and output
/// views, then the cumulative tile counts t1, t2, ntiles) for tiles of `rows_per_tile` rows.
fn multi_job_table(jobs: &[(&CudaWeight, &CudaBuf, Rows)], rows_per_tile: usize) -> ([A; 21], usize) {
    let mut args = [A::I(0); 21];
    let mut total = 0usize;
    for j in 0..3 {
        let six = match jobs.get(j) {
            Some(&(w, out, o)) => {
                out.check(o);
                total += w.ne(1).div_ceil(rows_per_tile);
                [A::P(w.mem.ptr), l(w.row_bytes), i(w.ne(1)), A::P(out.0.ptr), l(o.off), l(o.stride)]
            }
            None => [A::P(0), l(0), i(0), A::P(0), l(0), l(0)],
        };
        args[6 * j..6 * j + 6].copy_from_slice(&six);
        if j < 2 {
            args[18 + j] = i(total);
        }
    }
    args[20] = i(total);
    (args, total)
}

fn moe_down_args(
    down: &CudaWeight,
    shared: &CudaWeight,
    (hdim, ff, k, nsh): (usize, usize, usize, usize),
    sel_e: u64,
    (act, arow): (u64, usize),
    out: &CudaBuf,
    o: Rows,
) -> [A; 15] {
    [
        A::P(down.mem.ptr),
        l(down.row_bytes),
        l(down.mat_bytes()),
        i(hdim),
        i(ff),
        i(k),
        A::P(sel_e),
        A::P(shared.mem.ptr),
        l(shared.row_bytes),
        i(nsh),
        A::P(act),
        l(arow),
        A::P(out.0.ptr),
        l(o.off),
        l(o.stride),
    ]
}

/// A kernel name built on the stack from `format_args!` (launching allocates nothing). Names are
/// short; one longer than the buffer comes out cut, and the launch then reports it not loaded.
struct KName {
    buf: [u8; 48],
    len: usize,
}
impl KName {
    fn of(args: std::fmt::Arguments) -> KName {
        let mut k = KName { buf: [0; 48], len: 0 };
        let _ = std::fmt::Write::write_fmt(&mut k, args);
        k
    }
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}
impl std::fmt::Write for KName {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let b = s.as_bytes();
        let end = self.len + b.len();
        if end > self.buf.len() {
            return Err(std::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(b);
        self.len = end;
        Ok(())
    }
}

/// True when the 16-byte vector GEMVs (`gemv_h16_*`, `moe_gemv_h16_*`) can read `w` and an f32
/// activation view at element offset `xoff` with row stride `xstride`: f16/bf16 rows of a
/// multiple of 8 values, every row and matrix 16-byte aligned, activations 16-byte aligned.
fn h16_vector_ok(w: &CudaWeight, k: usize, xoff: usize, xstride: usize) -> bool {
    matches!(w.dtype, GgmlType::F16 | GgmlType::BF16)
        && k % 8 == 0
        && w.row_bytes % 16 == 0
        && w.mat_bytes() % 16 == 0
        && w.mem.ptr % 16 == 0
        && xoff % 4 == 0
        && xstride % 4 == 0
}

/// The kernel-name suffix of a weight type, `None` when it has no kernels.
fn tname(t: GgmlType) -> Option<&'static str> {
    use GgmlType::*;
    Some(match t {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q4K => "q4_k",
        Q5K => "q5_k",
        Q6K => "q6_k",
        _ => return None,
    })
}

/// Bytes of one block on the device (see [`repack`]); Q8_0 is laid out in groups of 4 blocks,
/// see [`dev_row_bytes`].
fn dev_block_bytes(t: GgmlType) -> usize {
    use GgmlType::*;
    match t {
        Q4_0 => 20,
        Q5_0 => 24,
        Q8_0 => 36,
        Q6K => 212,
        _ => t.type_size(),
    }
}

/// Device bytes of one row of `ne0` elements.
fn dev_row_bytes(t: GgmlType, ne0: usize) -> usize {
    let nb = ne0 / t.block_size();
    if t == GgmlType::Q8_0 {
        nb.div_ceil(4) * 144
    } else {
        nb * dev_block_bytes(t)
    }
}

/// Bytes of one 16-row tile's group in the tiled copy (`MMQ_TG` in kernels/mmq.cu).
const TILE_GROUP: usize = 2176;

/// Bytes of one matrix of `rows` rows of `rb` device bytes in the tiled copy.
fn tile16_mat_bytes(rb: usize, rows: usize) -> usize {
    rows.next_multiple_of(16) / 16 * (rb / 144) * TILE_GROUP
}

/// The tiled copy of a stack of Q8_0 matrices in the device layout (`rows` rows of `rb` bytes
/// each; [`CudaWeight::tiled`]): per matrix, per tile of 16 rows, per 144-byte group,
/// [`TILE_GROUP`] bytes in the order `mmq_q8_rows`' lanes load them: 16-byte chunk `c < 8` holds
/// the 4 f16 scales of rows `c` and `c + 8` of the tile; chunk `8 + 32*bl + 4*g + t` holds bytes
/// `8t..8t+8` of block `bl` of rows `g` and `g + 8` word by word (4 bytes of row `g`, 4 of row
/// `g + 8`, the next 4 of each: the int8 mma's A fragment in register order); the 8 pad bytes of
/// each row's group are left out. Rows past `rows` are zeros. The CPU reference of the
/// `tile16_q8` kernel, which makes the copy on the device at load.
pub fn tile16(data: &[u8], rb: usize, rows: usize) -> Vec<u8> {
    let ng = rb / 144;
    let mats = data.len() / (rb * rows).max(1);
    let tiles = rows.next_multiple_of(16) / 16;
    let mut out = vec![0u8; mats * tile16_mat_bytes(rb, rows)];
    let piece = |e: usize, r: usize, at: usize| -> [u8; 8] {
        if r < rows {
            data[(e * rows + r) * rb + at..][..8].try_into().expect("8 bytes")
        } else {
            [0; 8]
        }
    };
    for e in 0..mats {
        for tile in 0..tiles {
            for gi in 0..ng {
                let grp = ((e * tiles + tile) * ng + gi) * TILE_GROUP;
                for c in 0..TILE_GROUP / 16 {
                    let (r, o) = if c < 8 { (c, 0) } else { ((c - 8) % 32 / 4, 16 + 32 * ((c - 8) / 32) + 8 * ((c - 8) % 4)) };
                    let ra = tile * 16 + r;
                    let (a, b) = (piece(e, ra, gi * 144 + o), piece(e, ra + 8, gi * 144 + o));
                    let chunk = &mut out[grp + 16 * c..][..16];
                    if c < 8 {
                        chunk[..8].copy_from_slice(&a);
                        chunk[8..].copy_from_slice(&b);
                    } else {
                        // Words a0, b0, a1, b1.
                        for (w, src) in [&a[..4], &b[..4], &a[4..], &b[4..]].into_iter().enumerate() {
                            chunk[4 * w..][..4].copy_from_slice(src);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The file's blocks -> the device layout (see `kernels/common.cuh`): 4-byte aligned blocks, and
/// Q8_0 regrouped so that each group of 4 blocks is `[4 f16 scales, 8 pad bytes, 128 quants]`
/// (144 bytes, 16-byte aligned; each row padded with zero blocks to a whole group).
fn repack(t: GgmlType, data: &[u8], ne0: usize) -> Vec<u8> {
    use GgmlType::*;
    let ts = t.type_size();
    match t {
        Q8_0 => {
            let nb = ne0 / 32;
            let rows = data.len() / (nb * ts).max(1);
            let rb = dev_row_bytes(t, ne0);
            let mut out = vec![0u8; rows * rb];
            for (r, row) in data.chunks_exact(nb * ts).enumerate() {
                let o = &mut out[r * rb..(r + 1) * rb];
                for (b, blk) in row.chunks_exact(ts).enumerate() {
                    let g = (b / 4) * 144;
                    let j = b % 4;
                    o[g + 2 * j..g + 2 * j + 2].copy_from_slice(&blk[..2]);
                    o[g + 16 + 32 * j..g + 48 + 32 * j].copy_from_slice(&blk[2..34]);
                }
            }
            out
        }
        Q4_0 | Q5_0 => {
            let mut out = Vec::with_capacity(data.len() / ts * (ts + 2));
            for b in data.chunks_exact(ts) {
                out.extend_from_slice(&b[..2]);
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&b[2..]);
            }
            out
        }
        Q6K => {
            let mut out = Vec::with_capacity(data.len() / ts * (ts + 2));
            for b in data.chunks_exact(ts) {
                out.extend_from_slice(b);
                out.extend_from_slice(&[0, 0]);
            }
            out
        }
        _ => data.to_vec(),
    }
}

/// Every kernel name the module must export.
fn kernel_names() -> Vec<String> {
    let mut v: Vec<String> = [
        "rms_norm",
        "add_rows",
        "scale_rows",
        "softcap_rows",
        "argmax_part",
        "argmax_final",
        "gather_rows",
        "copy_rows",
        "tile16_q8",
        "glu_rows",
        "rope_rows",
        "cache_write",
        "rows_to_bf16",
        "attention_4",
        "attention_8",
        "attention_16",
        "moe_route",
        "moe_group",
        "moe_combine",
        "gemv_q8_1",
        "gemv_q8_2",
        "gemv_q8_4",
        "gemv_q8_8",
        "moe_route_warp",
        "moe_gateup_q8",
        "moe_down_q8",
        "mla_split_18_16",
        "mla_split_18_16_h",
        "mla_split_5_4",
        "mla_split_tc",
        "mla_split_tc_h",
        "mla_split_tc_he",
        "mla_split_tc_hb",
        "mla_prefill_h",
        "mla_prefill_ha",
        "norm_rope_cache_h",
        "mla_rope_absorb_1_h",
        "cache_write_h",
        "mla_combine",
        "mla_combine_few",
        "gemv_f32_split",
        "add_rms_norm",
        "add_rms_norm_q8",
        "add_rms_norm_parts",
        "add_rms_norm_parts_router",
        "mla_out_q8",
        "mla_out_bf16",
        "mla_out_f16",
        "moe_sh_q8_one",
        "rope_copy_rows",
        "norm_rope_cache",
        "mla_rope_absorb_1",
        "mla_rope_absorb_bf16_1",
        "mla_rope_absorb_bf16_1_h",
        "mla_rope_absorb_f16_1",
        "mla_rope_absorb_f16_1_h",
        "gemv_q8_multi_1",
        "gemv_q8_multi_2",
        "gemv_q8_multi_4",
        "gemv_q8_multi_8",
        "gemv_q8_multi_norm_1",
        "gemv_h16_multi_norm_f16_1",
        "gemv_h16_multi_norm_bf16_1",
        "moe_down_sh_q8",
        "moe_down_sh_q8_w4",
        "moe_down_sh_f16_w4",
        "moe_down_sh_bf16_w4",
        "moe_gateup_sh_f16",
        "moe_down_sh_f16",
        "moe_gateup_sh_bf16",
        "moe_down_sh_bf16",
        "quant_q8_groups",
        "moe_route_quant",
        "moe_gateup_sh_q8q",
        "mmq_q8_64",
        "mmq_q8_64e",
        "mmq_q8_64_jobs",
        "mmq_q8_64_jobse",
        "mmq_q8_64ws",
        "mmq_q8_16",
        "mmq_q8_16g1",
        "mmq_q8_rows",
        "mmq_q8_rows_r2",
        "mmq_q8_rows_d",
        "mmq_sum_splits",
        "mmq_sum_splits_jobs",
        "mmq_sum_splits_q8",
        "q8_to_f16",
        "f16_rows",
        "mmf16_256",
        "mmf16_256s4",
        "mmf16_gu",
        "mmf16_gu_s4",
        "mmfq8_256s4",
        "mmfq8_gu_s4",
        "mmh_gu",
        "add_rms_norm_parts_router_route",
        "batch_fill_1",
        "mmh_dn",
        "mmh8_gu",
        "mmh8_dn",
        "moe_gather_h",
        "mla_prefill",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    use GgmlType::*;
    for t in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K] {
        let n = tname(t).expect("listed types have kernels");
        for k in ["embed", "dequant_bf16", "moe_gemv", "moe_gemm"] {
            v.push(format!("{k}_{n}"));
        }
        for nn in [1, 4, 8] {
            v.push(format!("gemv_{n}_{nn}"));
        }
    }
    for n in ["f16", "bf16"] {
        v.push(format!("moe_gemv_h16_{n}"));
        for nn in [1, 4, 8] {
            v.push(format!("gemv_h16_{n}_{nn}"));
        }
    }
    v
}

/// Tokens per matrix up to which matmuls use the GEMV kernels instead of cuBLAS.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Steps of up to this many tokens are recorded as CUDA graphs (decode, and the batched decode
/// of up to this many sequences); longer ones (prompts) are launched eagerly.
pub const GRAPH_MAX_TOKENS: usize = 128;
/// At most this many step recordings are kept (one per token count and output pattern).
const GRAPH_MAX_COUNT: usize = 192;

/// Decode paths switched at run time (`CudaBackend::set_path`), each counted where taken
/// (`CudaBackend::path_launches`). Each reads its environment variable at open ("0" off, anything
/// else on); docs/PERF.md has each one's measurements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// `mla_rope_cache_write` of one token with an f16 / bf16 W_uk in one launch
    /// (`mla_rope_absorb_<t>_1`: the same bits as `norm_rope_cache` then `gemv_h16_<t>_1`).
    /// On; `TS_CUDA_ABSORB16=0` turns it off (bf16 tg128 487.3 against 473.0 on the H200).
    Absorb16,
    /// `mla_attention_out` of one token with f16 / bf16 W_uv and W_o in clusters (`mla_out_<t>`:
    /// the merge or the attention, the value rows and the output's per-head rows in one launch,
    /// then the norm's launch of the Q8_0 path). On; `TS_CUDA_OUT16=0` turns it off (bf16 tg128
    /// 489.1 against 487.3 with ABSORB16 alone on the H200; W_o's sum by head moves the bf16
    /// tokens' hash).
    Out16,
    /// The tensor-core split MLA decode of one token over an f16 cache issuing its first key
    /// tiles before its PDL wait (`mla_split_tc_he`: the same copies, the same bits as
    /// `mla_split_tc_h`). On;
    /// `TS_CUDA_MS_EARLY=0` turns it off (H200, tg64 at 16k: 485.5 / 486.0 against 484.1, the
    /// same hash).
    SplitEarly,
    /// `add_rms_norm_matmul_many` / `rms_norm_matmul_many` of a decode batch whose products run
    /// on the int8 tensor cores: the norm and the input's quantisation in one launch
    /// (`add_rms_norm_q8`, the same bits as `add_rms_norm` then `quant_q8_groups`). Off until
    /// measured; `TS_CUDA_NORM_Q8=1`.
    NormQ8,
    /// `mla_attention_out` of a decode batch with Q8_0 W_uv and W_o on the int8 products: the
    /// W_uv product's split sum also writes the W_o product's quantised input
    /// (`mmq_sum_splits_q8`, the same bits as `mmq_sum_splits` then `quant_q8_groups`), and with
    /// [`Path::NormQ8`] the norm's launch sums W_o's partial outputs itself (no
    /// `mmq_sum_splits` for it; the same sums in the same order). Off until measured;
    /// `TS_CUDA_SUM_Q8=1`.
    SumQ8,
    /// `matmul_many` of a decode batch on the 64-token int8 tiles (q and kv_a: `mmq_jobs`): the
    /// jobs in one launch (`mmq_q8_64_jobs`) and their split sums in one (`mmq_sum_splits_jobs`),
    /// each block doing what it does in its own job's launch (the same bits). On;
    /// `TS_CUDA_DENSE_JOBS=0` turns it off (H200, gpu-next99/100, the same hashes: 64 sequences
    /// 8,229 -> 8,393 alone, 8,228 -> 8,471 with [`Path::DenseEarly`]).
    DenseJobs,
    /// The dense 64-token int8 tiles copy their first stages' weight rows before the PDL wait,
    /// and ask L2 for the next four stages' (`mmq_q8_64e`, `mmq_q8_64_jobse`): weights are
    /// never written by a kernel, so their DRAM latency can overlap the kernel before (Nsight:
    /// a 64-row dense product is ~7 µs whatever its bytes). The same bits. On;
    /// `TS_CUDA_DENSE_EARLY=0` turns it off (H200, gpu-next99: 64 sequences 8,229 -> 8,496;
    /// 80 sequences 8,186 -> 8,534 and 96 10,012 -> 10,386 with [`Path::DenseJobs`], 32 and 48
    /// and pp512 the same).
    DenseEarly,
    /// The f32 MoE router of decode batches of 9-128 tokens on `gemv_f32_split` (8 tokens a
    /// block row, each token's sums as when it is alone) instead of cuBLAS's SGEMM, which is
    /// launched without PDL: in the 64-row trace (gpu-next101) the norm before the MoE took
    /// 11.2-11.7 µs of the critical path where the other took 3.5, the router's product hidden
    /// in it. Other summation order than cuBLAS: other bits. On; `TS_CUDA_ROUTER_SPLIT=0` turns
    /// it off (H200, gpu-next103/104: 64 sequences 8,460 -> 8,583, 80 8,546 -> 8,617, 56
    /// 7,395 -> 7,440, 128 13,950 -> 14,018, the server 6,644 -> 6,849; each token's logits as
    /// when it is alone, test `router_split_exact`).
    RouterSplit,
    /// The merge of a batch's context splits, when there are at most 8 a token, on
    /// `mla_combine_few` (a block per (token, head), a thread per 4 outputs, no barrier) instead
    /// of `mla_combine` (a block per (token, head) and 64 outputs: 8,192 blocks at 64 sequences
    /// of 4 splits, ~12 µs a layer in the server's trace, gpu-next112). The same bits (test
    /// `mla_combine_few_exact`). `TS_CUDA_COMBINE_FEW=0` turns it off.
    CombineFew,
    /// Batches of several tokens on the tensor-core split over an f16 cache take
    /// `mla_split_tc_hb`: a ring of [`MS_NB_B`] key tiles (two blocks an SM where the
    /// single-token kernel's three fit one: 64 sequences of 4 splits in one wave, not two), its
    /// first tiles issued before the query's loads. The same copies and sums: the same bits as
    /// `mla_split_tc_h` (test `mla_split_batch_exact`). On; `TS_CUDA_MS_BATCH=0` turns it off.
    SplitBatch,
}

impl Path {
    const ALL: [Path; 10] = [
        Path::Absorb16,
        Path::Out16,
        Path::SplitEarly,
        Path::NormQ8,
        Path::SumQ8,
        Path::DenseJobs,
        Path::DenseEarly,
        Path::RouterSplit,
        Path::CombineFew,
        Path::SplitBatch,
    ];

    /// Its environment variable and its default.
    fn env(self) -> (&'static str, bool) {
        match self {
            Path::Absorb16 => ("TS_CUDA_ABSORB16", true),
            Path::Out16 => ("TS_CUDA_OUT16", true),
            Path::SplitEarly => ("TS_CUDA_MS_EARLY", true),
            Path::NormQ8 => ("TS_CUDA_NORM_Q8", false),
            Path::SumQ8 => ("TS_CUDA_SUM_Q8", false),
            Path::DenseJobs => ("TS_CUDA_DENSE_JOBS", true),
            Path::DenseEarly => ("TS_CUDA_DENSE_EARLY", true),
            Path::RouterSplit => ("TS_CUDA_ROUTER_SPLIT", true),
            Path::CombineFew => ("TS_CUDA_COMBINE_FEW", true),
            Path::SplitBatch => ("TS_CUDA_MS_BATCH", true),
        }
    }

    /// Whether it starts on: its variable's setting, else its default.
    fn env_on(self) -> bool {
        let (var, default) = self.env();
        std::env::var(var).map_or(default, |v| v != "0")
    }
}

/// The CUDA backend: one device, one stream, kernels compiled by NVRTC for the device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: Mutex<CudaBlas>,
    module: Arc<CudaModule>,
    funcs: HashMap<String, CudaFunction>,
    name: String,
    arch: String,
    kernels_from_cache: bool,
    scratch: Mutex<Vec<Option<DevMem>>>,
    /// Staging for large reads (see [`Pinned`]); grows to the largest read.
    pinned: Mutex<Option<Pinned>>,
    /// Queued arg-maxes ([`Backend::argmax_rows_queued`]).
    argq: Mutex<ArgQueue>,
    /// Chained steps without copies on the stream between them: a queued arg-max's ids written
    /// by `argmax_final` into mapped host memory, and a one-token batch written by `batch_fill_1`
    /// (its pick taken from the ids there); `TS_CUDA_BATCH_FILL=0`: the copies. Measured on the
    /// H200 (gpu-next67): tg128 706 against 697 tok/s, the same tokens.
    batch_fill: AtomicBool,
    /// Held for the whole of an op that uses scratch, so two threads sharing the backend cannot
    /// interleave their writes to (and reads of) the same scratch on the stream.
    scratch_op: Mutex<()>,
    error: Mutex<Option<String>>,
    /// Multiprocessors on the device (grid sizes of the looping kernels).
    sm_count: usize,
    /// Dynamic shared memory the fast paths may use per block (0: fast paths off).
    smem_max: usize,
    /// CUDA graphs of whole forward steps (see [`Backend::graph_begin`]).
    graphs: Mutex<GraphState>,
    graphs_on: bool,
    /// Steps of up to this many tokens are recorded ([`GRAPH_MAX_TOKENS`] by default;
    /// `TS_CUDA_GRAPH_MAX`, a measurement knob: the server's steps of 128 prompt rows plus the
    /// decode rows, ~188, run op by op, 13.6 ms each at 64 clients, gpu-next106).
    graph_max: usize,
    /// Average (token, slot) pairs an expert up to which the grouped MoE takes 16-token tiles
    /// (the int8 rows kernels) rather than 64-token ones (the prompt paths: `mmh_*`, f16).
    /// `TS_CUDA_MOE_T16`, default 16, a measurement knob: the server's 188-row steps (1,128
    /// routed pairs over 64 experts) fall just past it, onto the f16 copies (`mmh_gu` 5.2 ms,
    /// `mmh_dn` 2.6 ms a step, gpu-next106).
    moe_t16: usize,
    /// Fused decode kernels (`kernels/fused.cu`) for the trait's fused ops (`add_rms_norm`,
    /// `rope_copy`, `norm_rope_cache_write`, `matmul_many`, `moe_shared`); `TS_CUDA_FUSED=0` turns
    /// them off (each op then enqueues the plain kernels it replaces).
    fused: bool,
    /// `TS_CUDA_EXACT=1`: activations stay f32 in every matmul (no 8-bit dp4a paths, no fused
    /// Q8_0 kernels), the GPU twin of the CPU's `--exact` referee mode.
    exact: bool,
    /// Prompt-size paths on the tensor cores: Q8_0 products of more than [`GEMV_MAX_TOKENS`]
    /// tokens on int8 MMA (`kernels/mmq.cu`) and MLA attention on bf16 MMA
    /// (`kernels/mla_prefill.cu`). On for compute capability 8.0 or newer, off in exact mode and
    /// with `TS_CUDA_TC=0` (cuBLAS on bf16 copies, the f32 expert kernel and the per-token
    /// attention kernel then).
    tc: bool,
    /// `TS_CUDA_PROFILE=1`: every launch is timed with events (the stream waits after each) and
    /// a per-kernel table goes to stderr when the backend is dropped. Graphs are off then.
    profile: Option<Mutex<HashMap<String, (u64, f64)>>>,
    /// Programmatic dependent launch for every kernel (compute capability 9.0 or newer; off with
    /// `TS_CUDA_PDL=0` and when profiling): a kernel is scheduled while its predecessor finishes
    /// and loads its weights before it waits for the predecessor's results.
    pdl: bool,
    /// `TS_CUDA_MMQ16=1`: 16-token tiles stream one group per stage (`mmq_q8_16g1`, the previous
    /// kernel) instead of two (`mmq_q8_16`); to compare.
    mmq16: u8,
    /// `TS_CUDA_MLA_SPLITS=n`: the split MLA decode cuts a token's context into n runs (1..=256)
    /// instead of 2 per SM over the batch's tokens; to measure.
    mla_splits: usize,
    /// Fewest keys a split of a batched SIMT MLA decode takes ([`CudaBackend::batch_mla_splits`]),
    /// 0 = no limit (one wave of splits, as before); `TS_CUDA_MLA_KEYS`, default 256.
    mla_keys: usize,
    /// Most keys a split of a batched tensor-core MLA decode takes at one block an SM before
    /// the batch gets two ([`CudaBackend::tc_batch_splits`]); 0 = always two blocks an SM
    /// (`2 * sm_count / n`, the rule before); `TS_CUDA_MLA_KPS_B`, default 128.
    mla_kps_b: usize,
    /// One token's attention output side in one kernel ([`Backend::mla_attention_out`]:
    /// `mla_out_q8` + `add_rms_norm_parts`) with this many W_o rows a block; 0 = the plain chain
    /// (merge, W_uv and W_o GEMVs, add_rms_norm). `TS_CUDA_MLA_OUT` (0 or the row count),
    /// default 256.
    mla_out: AtomicUsize,
    /// One token of V2's MLA shapes (f16 cache) at a position below this: `mla_out_q8`'s blocks
    /// attend themselves (`mo_attend`: each of a head's blocks reads the head's keys) instead of
    /// the split kernel's launch before it (`TS_CUDA_MO_ATT=n`, 0 = never). Part of the step's
    /// graph key ([`Backend::graph_class`]).
    mo_att: AtomicU32,
    /// One-token attentions done that way (for the tests: [`CudaBackend::short_attentions`]).
    mo_att_done: AtomicU64,
    /// MLA latent caches in f16 where the kernels allow (`alloc_latent_cache`);
    /// `TS_CUDA_MLA_F16=0` keeps them f32, to compare.
    mla_f16: bool,
    /// The 16-head MLA decode takes the tensor-core split kernel once a batch's furthest position
    /// reaches this (the SIMT one is faster at short contexts, bound by its shared-memory reads
    /// at long ones); 0: never. `TS_CUDA_MLA_LONG`; the step's graph key holds the choice
    /// ([`Backend::graph_class`]). Default 2560: on the H200 with the f16 cache, tg64 from 2048
    /// SIMT 527 vs tensor cores 492 tok/s, from 3072 459 vs 487.
    mla_long: u32,
    /// The same for batches of several tokens (the server's steps), whose one-split SIMT blocks
    /// (one token's 16 heads each, 64 blocks for 64 sequences on 132 SMs) walk every key alone.
    /// `TS_CUDA_MLA_LONG_BATCH`, 0: never. Default 64: on the H200 at 64 clients (server
    /// contexts of 32-160 tokens) the SIMT attention took 51-56 us a layer, 1.4 ms of an 8.8 ms
    /// step (trace, gpu-next106), and the tensor cores gave 6,819 -> 7,240 tok/s (gpu-next107);
    /// below 32 keys (`bench --parallel 64 -n 32`) SIMT wins, 8,459 against 8,067.
    mla_long_batch: u32,
    /// Key tiles in `mla_split_tc_h`'s cp.async ring, 2..=4 (the kernels are built with
    /// `-DMS_NB=n` when it is not [`MS_NB`]). `TS_CUDA_MS_NB`; a measurement knob.
    ms_nb: usize,
    /// Key tiles in `mla_split_tc_hb`'s ring, 1..=4 (`-DMS_NB_B=n` when not [`MS_NB_B`]).
    /// `TS_CUDA_MS_NB_B`; a measurement knob.
    ms_nb_b: usize,
    /// Batched MoE with the shared FFN folded into the grouped expert products (`moe_shared`
    /// above the decode size); `TS_CUDA_MOE_SH=0` leaves it to the caller's chain, to compare.
    moe_sh: bool,
    /// The grouped MoE's gate and up products in one launch (`mmq_q8`'s `W2`);
    /// `TS_CUDA_MOE_GU=0`: two launches, to compare.
    moe_gu: bool,
    /// Grouped expert products on 16-token tiles read their weights straight into the mma
    /// fragments (`mmq_q8_rows`, the same bits as `mmq_q8_16`); `TS_CUDA_MOE_ROWS=0` (or
    /// [`CudaBackend::set_moe_rows`]) takes `mmq_q8_16`, to compare.
    moe_rows: AtomicBool,
    /// Q8_0 expert stacks also uploaded in 16-row tiles for `mmq_q8_rows` ([`CudaWeight::tiled`],
    /// twice their memory; --parallel 64 decode 6,656 -> 7,228 tok/s on the H200): 2 = when
    /// memory allows (the default: see [`CudaBackend::tile_fits`]), 1 = always, 0 = never
    /// (`TS_CUDA_MOE_TILED=auto|1|0`).
    moe_tiled: AtomicU8,
    /// Q8_0 MoE matrices ([`WeightUse::Expert`]: expert stacks and shared FFNs, rows a multiple
    /// of 128 values) also uploaded as f16 ([`CudaWeight::half`], 1.9 times their memory) for
    /// the prompt MoE's f16 tensor-core products (`mmf16_*`): 2 = when memory allows (the
    /// default, [`CudaBackend::tile_fits`]), 1 = always, 0 = never (`TS_CUDA_F16=auto|1|0`).
    /// Measured on the H200 (synthetic V2-Lite Q8_0, same call, `mmf16_256` on the 64 x 64-tiled
    /// copy): pp512 17,963 -> 19,522, pp2048 16,811 -> 17,874 tok/s (+8.7%, +6.3%); decode
    /// untouched (same hashes).
    f16_copy: AtomicU8,
    /// Prompt MoEs on the f16 products where the copies exist; `TS_CUDA_MOE_F16=0` keeps them on
    /// the int8 ones, to compare.
    moe_f16: bool,
    /// The f16 products' kernels ([`MMF_TILES`]: plain, gate-up-GLU, shared bytes), or
    /// None where the device lacks its shared memory (prompt MoEs then stay on int8).
    mmf: Option<(&'static str, &'static str, usize)>,
    /// The prompt MoE's gate, up and GLU in one f16 launch (`mmf16_gu`, the same bits as gate,
    /// up and `f16_rows`); default on, `TS_CUDA_MMF_GU=0` or [`CudaBackend::set_mmf_gu`] for the
    /// three launches. Measured on the H200: pp512 19,949 -> 21,538, pp2048 18,229 -> 19,454.
    mmf_gu: AtomicBool,
    /// Prompt MoEs on the f16 tensor cores straight from the Q8_0 weights (`mmfq8_*`, each
    /// weight fragment turned into f16 in registers: no f16 copies needed, half the bytes a
    /// launch): 2 = where the f16 copies are absent (the default), 1 = always, 0 = never (the
    /// int8 products then); `TS_CUDA_MMF_Q8=auto|1|0` or [`CudaBackend::set_mmf_q8`]. Measured
    /// on the H200 (gpu-next35, synthetic V2-Lite Q8_0, same call, without copies): pp512
    /// 21,882 and pp2048 19,630 tok/s against 22,001 and 19,747 from the f16 copies (-0.5%,
    /// -0.6%) and ~18,000 / ~16,900 on the int8 products; the same kernel on 4 x 2 warps
    /// (each fragment converted by two warps) 20,775 / 18,661, deleted.
    mmf_q8: AtomicU8,
    /// Prompt MoEs: the shared FFN on cuBLAS from row-major f16 copies of its three matrices
    /// ([`CudaBackend::shared_blas`]), the routed experts on the grouped `mmfq8` kernels from
    /// Q8_0 (no copies of them); off: the shared FFN's chunks ride in the grouped kernels and
    /// every expert matrix gets a tiled f16 copy where it fits (the sixteenth session's path).
    /// Decides the copies at upload. `TS_CUDA_MOE_BLAS=0` or [`CudaBackend::set_moe_blas`];
    /// default on.
    moe_blas: AtomicBool,
    /// The `mmfq8_*` kernels (plain, gate-up-GLU, shared memory: 8 x 1 warps, four stages of
    /// [`MMFQ_STAGE`]) where the device gives their shared memory; None: not available.
    mmfq8: Option<(&'static str, &'static str, usize)>,
    // (The seventeenth session's `mmfw_*`, wgmma with the weights converted in registers,
    // pp512 21,510 against mmfq8's 21,745, and its producer-warpgroup twin were deleted once
    // `mmh_*` replaced both: see docs/PERF.md.)
    /// The `mmh_*` kernels (kernels/mmh.cu: wgmma with both operands from shared memory, fed by
    /// TMA from a producer warpgroup) can run here: an sm_90a build that got their shared memory.
    mmh: bool,
    /// Prompt MoEs on `mmh_*` where it can run, with the shared FFN on cuBLAS
    /// ([`CudaBackend::moe_blas`]): 0 off, 1 from row-major f16 copies of the expert stacks
    /// made at upload (where memory allows, as the other copies; `mmh_gu`, `mmh_dn`), 2
    /// straight from the Q8_0 stacks, turned into f16 in shared memory by the producer
    /// warpgroup (`mmh8_gu`, `mmh8_dn`; half the bytes, no copies), 3 (the default) the copies
    /// where they were made, else Q8_0. `TS_CUDA_MMH=0|f16|q8` or [`CudaBackend::set_mmh`]
    /// (which also decides the copies of weights uploaded after it). The same bits either way.
    /// Measured on the H200 (gpu-next51, synthetic V2-Lite Q8_0, dense products on cuBLAS,
    /// same call): pp512 29,840 from the copies, 26,346 from Q8_0 (the conversion, three
    /// stages deep, costs more than the bytes it saves).
    mmh_mode: AtomicU8,
    /// Prompt MoEs run on `mmh_*` so far (for the tests to see that the path ran).
    mmh_runs: AtomicUsize,
    /// Dense Q8_0 products of prompts (more than [`GRAPH_MAX_TOKENS`] rows) on cuBLAS in f16,
    /// from row-major f16 copies of the matrices made at upload where memory allows (rows of
    /// whole 128-value groups; `f16(q * d)` of each value) and f16 activations (`f16_rows`),
    /// instead of the int8 tiles (`mmq_q8_64`, activations rounded to 8 bits); default on,
    /// `TS_CUDA_DENSE_BLAS=0` or [`CudaBackend::set_dense_blas`] (which also decides the copies
    /// of weights uploaded after it). Batched decode keeps the int8 tiles.
    dense_blas: AtomicBool,
    /// `TS_CUDA_MOE_COUNTS=1`: each grouped MoE prints how its pairs spread over the experts
    /// ([`CudaBackend::print_moe_counts`]; a measurement mode that waits for the device).
    moe_counts: bool,
    /// Source bytes of the load's tensors still to come ([`Backend::load_remaining`]).
    load_left: AtomicU64,
    /// The decode MoE's down products with four warps a row, (Q8_0, f16/bf16): by default for
    /// f16/bf16 only (one warp a row before; bf16 tg128 413 -> 435 tok/s on the H200), not for
    /// Q8_0 (two warps; four measured 583 -> 568). `TS_CUDA_DOWN_WPR=4` for both, `=1` for
    /// neither, to compare: each choice is another summation order.
    down_w4: (bool, bool),
    /// Decode paths switched at run time, each with its count of launches ([`Path`]).
    paths: [(AtomicBool, AtomicU64); Path::ALL.len()],
    /// The Q8_0 decode MoE of one token in one launch (`moe_sh_q8_one`) on at most this many
    /// blocks (all resident at once: at most the card's occupancy for it times the SMs); 0 =
    /// off (the default), the two launches `moe_gateup_sh_q8q` + `moe_down_sh_q8`
    /// (`TS_CUDA_MOE_ONE=1` or `=N` blocks, or [`CudaBackend::set_moe_one`]). The same bits
    /// either way.
    moe_one: AtomicUsize,
    moe_one_cap: usize,
    /// With `moe_one`: the routing and the input's quantisation in its block 0, not in
    /// `moe_route_quant` before it (`TS_CUDA_MOE_ONE_ROUTE=0`); the same bits.
    moe_one_route: bool,
    /// Weights the next one-row `add_rms_norm` or one-token attention kernel asks into L2
    /// ([`Backend::prefetch_hint`]: (device pointer, bytes), up to four; zeros: none; taken by
    /// the next launch of either kernel). Ignored unless `TS_CUDA_L2PF=1` (measured slower);
    /// `=2` lets the norm use its own too (one block: slower still, tg128 310).
    l2_hint: Mutex<[(u64, usize); 4]>,
    /// `mla_attention_out`'s `next` product (the MoE router) in the norm's launch
    /// (`add_rms_norm_parts_router`); `TS_CUDA_NORM_ROUTER=0`: two launches. The same bits.
    norm_router: AtomicBool,
    /// `add_rms_norm_matmul_many` for one token as one launch (`gemv_q8_multi_norm_1`: each
    /// block normalises the row itself); `TS_CUDA_NORM_MM=0`: the norm's launch, then the
    /// products'. The same bits.
    norm_mm: AtomicBool,
    /// One token's MoE routing ahead of the MoE, in the norm's launch that makes its logits
    /// (`add_rms_norm_parts_router_route`, one cluster of 8 blocks, up to 64 experts:
    /// moe_route_quant's bodies there, the same bits, one dependent launch fewer a layer);
    /// `TS_CUDA_PRE_ROUTE=0`: `moe_route_quant` in the MoE. (A first version that met through a
    /// counter and fences in L2, without clusters, cost 4 us a layer more than it saved.)
    pre_route: AtomicBool,
    /// What that launch routed (set under `scratch_op` with the launch, taken by the next
    /// `moe_shared`, which uses [`S::PreE`] / [`S::PreW`] / [`S::PreXq`] only if its logits,
    /// input and parameters are these: stream order is `scratch_op` order, so the scratch still
    /// holds them).
    routed: Mutex<Option<Routed>>,
    /// The last `mla_attention_out` of a decode batch wrote its output rows' Q8_0 groups too
    /// ([`Path::NormQ8`]): the grouped MoE on those rows takes them instead of quantising
    /// again. Set by that op, cleared by the next one, taken by the MoE.
    norm_xq: Mutex<Option<NormXq>>,
    /// `moe_shared` ops that took a routing made ahead (for the tests: [`CudaBackend::pre_routes`]).
    pre_routed: AtomicU64,
    /// `add_rms_norm_matmul_many` / `rms_norm_matmul_many` of one token with f16 or bf16 products
    /// in one launch (`gemv_h16_multi_norm_<t>_1`: the same bits as the norm's launch, then the
    /// products'). On; `TS_CUDA_NORM_MM16=0` turns it off (bf16 tg128 +16 tok/s on the H100).
    norm_mm16: AtomicBool,
    /// `moe_shared_residual` on the one-token Q8_0 MoE (its down kernel adds the residual), and
    /// `rms_norm_matmul_many` in one launch (`gemv_q8_multi_norm_1` without a delta: no block
    /// counter, x not written). On; `TS_CUDA_MOE_RESIDUAL=0` turns it off (tg128 +7.5 tok/s on the H100).
    moe_residual: AtomicBool,
    /// [`Backend::prefetch_hint`]'s regions: 0 (default) ignored; 1 asked into L2 by the
    /// attention kernel; 2 by the norm's too. `TS_CUDA_L2PF` (measured slower, docs/PERF.md).
    l2pf: u8,
    /// Dense Q8_0 products of up to this many tokens take 16-token tiles (more blocks, less
    /// split-K), larger ones 64; `TS_CUDA_MMQ_BN16=n` (default 16) to measure.
    mmq_bn16: AtomicUsize,
    /// Dense int8 products with too few tiles for the device split K into partial outputs of
    /// at least `.0` groups (128 values) each, aiming at `.1` blocks an SM. Measurement knobs
    /// `TS_CUDA_MMQ_SPLIT_MIN` (1) and `TS_CUDA_MMQ_SPLIT_OCC` (2). On the H200 (gpu-next93, 64
    /// sequences, two rounds each): at least 2 groups 8,045 / 8,045 tok/s, 1 group 8,140 / 8,139
    /// (V2-Lite's kv_a: 16 splits instead of 8, 144 blocks instead of 72), 3 blocks an SM 8,141 /
    /// 8,134, both 8,123 / 8,123. Other splits sum in another order: other bits (the 64-sequence
    /// hash 33948fa635fb0682 became 6bbd3fa953f72f1b).
    mmq_split: (usize, usize),
    /// Dense Q8_0 products of up to this many tokens run on `mmq_q8_rows` (16-token tiles, the
    /// weights straight into the fragments, split K); `TS_CUDA_MMQ_ROWS=n`, default 48. On the
    /// H200 (tiled experts), --parallel 32 decode 3,437 -> 4,132 tok/s with them there, 48
    /// sequences 5,335 -> 5,661; at 64 (row-major experts) mmq_q8_64's tiles were 1.4% faster
    /// ([`CudaBackend::set_mmq_tiles`]).
    mmq_rows_dense: AtomicUsize,
    /// The 64-token int8 tiles with their stage copies on a producer warp (`mmq_q8_64ws`, 160
    /// threads, two blocks an SM; sm_90) in place of `mmq_q8_64`: `TS_CUDA_MMQ_WS=1`. The same
    /// bits. Written in the seventeenth session, not yet run.
    mmq_ws: bool,
    /// Row sets a warp of the grouped expert products on the rows kernel: 1 (`mmq_q8_rows`), 2
    /// (`mmq_q8_rows_r2`, 128 rows a block, the same bits), or 0 for the default: 2 from 5
    /// (token, slot) pairs an expert (V2-Lite: 42 tokens). On the H200, 128 sequences 12,663 ->
    /// 13,122 tok/s with 2, and 4 row sets lost at all sizes. With the shared chunks' tiles first
    /// (gpu-next94/96): 64 sequences 8,143 / 8,142 -> 8,222 / 8,221, 48 sequences 6,429 -> 6,484,
    /// 32 sequences 4,696 -> 4,693 (the same), the server with 64 clients 6,617 -> 6,677 (before
    /// them, 64 the same and 32 lost). `TS_CUDA_ROWS_R=1|2` ([`CudaBackend::set_rows_r`]).
    rows_r: AtomicUsize,
    /// Grouped products on the rows kernels with each expert's first tile at block y = expert,
    /// its first weight loads issued before the PDL wait (`mmq_rows_impl`'s `early`), where the
    /// batch gives at least two (token, slot) pairs an expert; `TS_CUDA_ROWS_EARLY=0` or
    /// [`CudaBackend::set_rows_early`] finds every block's tile from the counts first. The same
    /// bits either way. On the H200 (gpu-next39, same call, same hash): 64 sequences 7,669 -> 7,732.
    rows_early: AtomicBool,
    /// With `rows_early` and shared-FFN chunks in the grouped products: the chunks' tiles (every
    /// token, so full 16-token tiles, the launch's longest blocks) at the first block indices,
    /// so they run in the first wave instead of as the launch's ragged tail (`mmq_rows_impl`'s
    /// `early` = 1 + their tile count). The same bits. On the H200 (gpu-next92, same call, same
    /// hash): 64 sequences 7,726 / 7,729 -> 8,037 / 8,036, the server at 64 clients 6,372 ->
    /// 6,560. `TS_CUDA_ROWS_SH_FIRST=0` or [`CudaBackend::set_rows_shared_first`] puts them last.
    rows_sh_first: AtomicBool,
    /// With two row sets a warp (`mmq_q8_rows_r2`) and `rows_early`: the last this many tiles
    /// of the first tiles' range (the shared chunks' and every expert's first, in block order:
    /// the launch's last wave) each run as two blocks of one row set (`mmq_rows_impl`'s tail
    /// halves), so the launch's last blocks are half as long and its ragged tail shrinks; only
    /// while the routed experts average at most 8 pairs (V2-Lite: up to 85 tokens). The same
    /// bits. Default 16; on the H200 (gpu-next123, 64 sequences at -d 96, same hash) 0 / 8 /
    /// 16 / 32 / 48 / 72 (all) tiles gave 8,372 / 8,420 / 8,550 / 8,510 / 8,453 / 8,295 tok/s,
    /// 128 sequences with 32 (before the pairs rule) 13,737 against 14,032. `TS_CUDA_ROWS_TAIL=N`
    /// (tiles; 0: none) or [`CudaBackend::set_rows_tail`].
    rows_tail: AtomicUsize,
    /// The same count for the down launch (16 blocks a tile where the gate/up pair has 22), if
    /// it should differ: `TS_CUDA_ROWS_TAIL_DN=N`, a measurement knob (by default
    /// `TS_CUDA_ROWS_TAIL`'s count; `set_rows_tail` sets both).
    rows_tail_dn: AtomicUsize,
    /// Tail halves for the experts' later tiles too (every block past the first tiles' range;
    /// with few pairs most of them find no tile), at any number of pairs: past ~85 sequences
    /// the launches end on later tiles. The same bits. On by default; on the H200 (gpu-next125,
    /// same hashes) 128 sequences 14,074 -> 14,228 tok/s, 96 10,565 -> 10,569, 64 at -d 96
    /// 8,581 -> 8,575. `TS_CUDA_ROWS_TAIL_LATER=0` or [`CudaBackend::set_rows_tail_later`]: off.
    rows_tail_later: AtomicBool,
    /// One decode token's norm_rope_cache and absorbed query product in one launch
    /// (`mla_rope_absorb_1`); `TS_CUDA_RA=0` runs `norm_rope_cache` then `gemv_q8_1`, to compare.
    rope_absorb: bool,
    /// One sequence's prompt attention on an f16 cache streams its key tiles through two
    /// cp.async buffers (`mla_prefill_ha`, the same results) instead of loading each between two
    /// barriers, where the shared memory allows (measured 2026-11-30: pp512 +3%, pp2048 +8%);
    /// `TS_CUDA_MLA_PFA=0` ([`CudaBackend::set_mla_prefill_async`]) loads them between barriers.
    mla_pfa: AtomicBool,
    /// The split MLA decode on the f16 tensor cores (`mla_split_tc`): 0 where no SIMT split
    /// kernel is built for the shape (heads other than 16), 1 wherever it applies, 2 never.
    /// `TS_CUDA_MLATC=1` / `=0`, or [`CudaBackend::set_mla_tensor_cores`].
    mla_tc: AtomicU8,
    /// `TS_CUDA_SKIP=name,name`: kernels whose names start with one of these are not launched.
    /// A measurement knob only (results are wrong): the tokens/s gained by leaving a kernel out
    /// of the real, overlapped step is that kernel's share of it, which isolated timings (Nsight
    /// Compute, events) cannot show. `tools/gpu/knockout.sh` runs it per kernel.
    skip: Vec<String>,
    /// `TS_CUDA_TRACE=1`: kernels built with `-DTS_TRACE` (common.cuh) record when each launch's
    /// first block reached its wait and when the wait returned; these are the launched kernels'
    /// names in order (graph replays included), and the table goes to `TS_CUDA_TRACE_OUT`
    /// (default `/tmp/ts-trace.csv`) when the backend is dropped. A measurement mode.
    trace: Option<Mutex<Vec<String>>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(tr) = &self.trace {
            let names = std::mem::take(&mut *tr.lock().unwrap_or_else(|e| e.into_inner()));
            match self.write_trace(&names) {
                Ok(msg) => eprintln!("cuda trace: {msg}"),
                Err(e) => eprintln!("cuda trace: not written: {e}"),
            }
        }
        if let Some(p) = &self.profile {
            let p = p.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<_> = p.iter().collect();
            v.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            let total: f64 = v.iter().map(|x| x.1 .1).sum();
            eprintln!("cuda profile: {total:.3} ms in kernels");
            for (name, (n, ms)) in v.iter().take(40) {
                eprintln!(
                    "  {name:<28} {n:>8} launches {ms:>10.3} ms {:>8.2} us each {:>5.1}%",
                    1000.0 * ms / *n as f64,
                    100.0 * ms / total
                );
            }
        }
    }
}

/// Page-locked host memory for large device-to-host reads (the logits of many rows): the driver
/// copies into it at full link speed, where a pageable destination is staged in small pieces.
struct Pinned {
    ptr: *mut f32,
    len: usize,
}
// The pointer is owned (freed on drop) and only used under the backend's `pinned` mutex.
unsafe impl Send for Pinned {}
impl Drop for Pinned {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}
/// Page-locked host bytes (`cuMemAllocHost`), freed on drop.
struct HostPinned {
    ptr: *mut u8,
    len: usize,
}
// Owned; used by one owner at a time (a batch, or the arg-max queue under its mutex).
unsafe impl Send for HostPinned {}
unsafe impl Sync for HostPinned {}
impl HostPinned {
    fn new(ctx: &CudaContext, len: usize) -> Option<Self> {
        ctx.bind_to_thread().ok()?;
        let ptr = unsafe { drv::malloc_host(len.max(1), 0) }.ok()?;
        Some(HostPinned { ptr: ptr as *mut u8, len })
    }
    /// Page-locked bytes the device may write too, and their device address.
    fn mapped(ctx: &CudaContext, len: usize) -> Option<(Self, u64)> {
        ctx.bind_to_thread().ok()?;
        let ptr = unsafe { drv::malloc_host(len.max(1), drv_sys::CU_MEMHOSTALLOC_DEVICEMAP) }.ok()?;
        let pin = HostPinned { ptr: ptr as *mut u8, len };
        let mut dev: drv_sys::CUdeviceptr = 0;
        unsafe { drv_sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr, 0) }.result().ok()?;
        Some((pin, dev))
    }
    fn bytes(&mut self) -> &mut [u8] {
        // Safety: `len` bytes were allocated at `ptr` and nothing else refers to them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}
impl Drop for HostPinned {
    fn drop(&mut self) {
        unsafe {
            let _ = drv::free_host(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// The queued arg-maxes on their way to the host ([`Backend::argmax_rows_queued`]): two
/// page-locked slots of ids taken in turn, each with the event recorded after its copy, and the
/// pending ones (slot, rows) oldest first. `rows`: the row count of the last arg-max enqueued
/// (queued or not), whose ids a [`ts_core::TOKEN_FROM_ARGMAX`] token reads on the device.
#[derive(Default)]
struct ArgQueue {
    /// (ids, their device address where `argmax_final` writes them itself (0: copied), event).
    slots: [Option<(HostPinned, u64, CudaEvent)>; 2],
    pending: std::collections::VecDeque<(usize, usize)>,
    next: usize,
    rows: usize,
}

/// Reads of at least this many bytes go through [`Pinned`] staging.
const PINNED_MIN_BYTES: usize = 1 << 20;

/// An instantiated CUDA graph. The driver's graph handles may be used from any thread (with the
/// context current, which `CudaGraph::launch` ensures); every use goes through the `graphs` mutex.
struct Graph(cudarc::driver::CudaGraph);
unsafe impl Send for Graph {}

/// Recorded decode steps: a key seen once runs eagerly (so every scratch buffer reaches its
/// size), the second time it is captured, later it is replayed.
#[derive(Default)]
struct GraphState {
    seen: std::collections::HashSet<u64>,
    graphs: HashMap<u64, Graph>,
    /// `TS_CUDA_TRACE`: the kernels each recording launches, in order, and those of the capture
    /// under way.
    names: HashMap<u64, Vec<String>>,
    capture_names: Vec<String>,
    capturing: Option<u64>,
    /// Set when something that cannot be captured (a scratch allocation) happened during capture.
    spoiled: bool,
    /// Keys whose capture failed: not tried again.
    failed: std::collections::HashSet<u64>,
    /// `Backend::step_counts`.
    counts: StepCounts,
}

fn dev_err(what: &str, e: impl std::fmt::Debug) -> BackendError {
    BackendError::Device(format!("{what}: {e:?}"))
}

impl CudaBackend {
    /// Open GPU `device_ordinal`: load libcuda (probed first, so a machine without one gets an
    /// error, not a panic), create the context and stream, compile (or load from the disk cache)
    /// the kernels for the device's compute capability, and create the cuBLAS handle.
    pub fn new(device_ordinal: usize) -> Result<Self> {
        if !unsafe { drv_sys::is_culib_present() } {
            return Err(BackendError::Device("no CUDA GPU found: libcuda.so could not be loaded".into()));
        }
        let count = CudaContext::device_count()
            .map_err(|e| BackendError::Device(format!("no CUDA GPU found: the driver failed to start ({e:?})")))?;
        if count <= 0 {
            return Err(BackendError::Device("no CUDA GPU found: the driver reports no devices".into()));
        }
        if device_ordinal >= count as usize {
            return Err(BackendError::Device(format!("CUDA device {device_ordinal} does not exist (this machine has {count})")));
        }
        let ctx = CudaContext::new(device_ordinal).map_err(|e| dev_err(&format!("cannot open CUDA device {device_ordinal}"), e))?;
        // One stream orders all work: cudarc's per-allocation event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one: only those can be captured into graphs.
        let stream = ctx.new_stream().map_err(|e| dev_err("cannot create a CUDA stream", e))?;
        let dev_name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = ctx.compute_capability().map_err(|e| dev_err("cannot read the compute capability", e))?;
        // sm_90 devices (H100, H200) get the sm_90a build: the same code plus the wgmma kernels
        // (an sm_90a CUBIN runs on exactly those).
        let arch = if (major, minor) == (9, 0) { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let trace = std::env::var("TS_CUDA_TRACE").is_ok_and(|v| v == "1");
        let ms_nb = std::env::var("TS_CUDA_MS_NB").ok().and_then(|v| v.parse().ok()).unwrap_or(MS_NB).clamp(2, 4);
        let mut defs: Vec<String> = Vec::new();
        if trace {
            defs.push("-DTS_TRACE".into());
        }
        if ms_nb != MS_NB {
            defs.push(format!("-DMS_NB={ms_nb}"));
        }
        let ms_nb_b = std::env::var("TS_CUDA_MS_NB_B").ok().and_then(|v| v.parse().ok()).unwrap_or(MS_NB_B).clamp(1, 4);
        if ms_nb_b != MS_NB_B {
            defs.push(format!("-DMS_NB_B={ms_nb_b}"));
        }
        // Measurement defines for the kernels (`TS_CUDA_DEFINES="NAME=VALUE ..."`, spaces or
        // commas between, e.g. the MMQ_ROWS_* choices in kernels/mmq.cu): each becomes a `-D`
        // option (and another cache key).
        if let Ok(d) = std::env::var("TS_CUDA_DEFINES") {
            defs.extend(d.split(|c: char| c.is_whitespace() || c == ',').filter(|x| !x.is_empty()).map(|x| format!("-D{x}")));
        }
        let defs: Vec<&str> = defs.iter().map(String::as_str).collect();
        let (cubin, kernels_from_cache) = kernels::load_or_compile(&arch, &defs).map_err(BackendError::Device)?;
        let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| dev_err(&format!("cannot load the {arch} kernels"), e))?;
        let mut funcs = HashMap::new();
        for n in kernel_names() {
            let f = module.load_function(&n).map_err(|e| dev_err(&format!("kernel {n} missing from the module"), e))?;
            funcs.insert(n, f);
        }
        use drv_sys::CUdevice_attribute as DA;
        let sm_count = ctx.attribute(DA::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).unwrap_or(1).max(1) as usize;
        let optin = ctx.attribute(DA::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap_or(48 * 1024).max(0) as usize;
        let mut smem_max = optin.min(FAST_SMEM_MAX);
        for n in BIG_SMEM_KERNELS {
            if funcs[*n]
                .set_attribute(drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_max as i32)
                .is_err()
            {
                smem_max = smem_max.min(48 * 1024);
            }
        }
        // The f16 prompt kernels: the most stages whose shared memory the device gives (their own
        // attribute: four stages take more than the fast paths' cap); None (the int8 path) where
        // none fits.
        let s3 = std::env::var("TS_CUDA_MMF").is_ok_and(|v| v == "s3");
        // A tile set (plain kernel, gate-up-GLU kernel, stages) with `stage` bytes a stage: the
        // first of `tiles` (three stages only under s3) whose shared memory the device gives.
        let pick = |tiles: &[(&'static str, &'static str, usize)], stage: usize| {
            tiles.iter().filter(|t| !s3 || t.2 == 3).find_map(|&(plain, gu, nst)| {
                let smem = nst * stage;
                let set = |name: &str| {
                    funcs[name]
                        .set_attribute(drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                        .is_ok()
                };
                (smem <= optin && set(plain) && set(gu)).then_some((plain, gu, smem))
            })
        };
        // (A producer-warp twin of the copies' tiles, `mmf16_ws_*`, ran pp512 14,743 against
        // 21,786 in the eighteenth session and was deleted.)
        let mmf = pick(&MMF_TILES, 320 * 144);
        let mmfq8 = pick(&[("mmfq8_256s4", "mmfq8_gu_s4", 4)], MMFQ_STAGE);
        let mmh = arch == "sm_90a"
            && MMH_SMEM <= optin
            && MMH8_SMEM <= optin
            && [("mmh_gu", MMH_SMEM), ("mmh_dn", MMH_SMEM), ("mmh8_gu", MMH8_SMEM), ("mmh8_dn", MMH8_SMEM)].iter().all(|(n, b)| {
                funcs[*n].set_attribute(drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *b as i32).is_ok()
            });
        // Blocks of the one-launch decode MoE the card holds at once (it needs them all resident).
        let moe_one_cap =
            funcs["moe_sh_q8_one"].occupancy_max_active_blocks_per_multiprocessor(256, 0, None).map_or(0, |b| b as usize * sm_count);
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(BackendError::Device("libcublas.so.13 could not be loaded (needed for prefill matmuls)".into()));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("cannot create the cuBLAS handle", e))?;
        let exact = std::env::var("TS_CUDA_EXACT").is_ok_and(|v| v == "1");
        Ok(CudaBackend {
            ctx,
            stream,
            blas: Mutex::new(blas),
            module,
            funcs,
            name: format!("cuda:{device_ordinal} {dev_name}"),
            arch,
            kernels_from_cache,
            scratch: Mutex::new((0..N_SCRATCH).map(|_| None).collect()),
            pinned: Mutex::new(None),
            argq: Mutex::new(ArgQueue::default()),
            batch_fill: AtomicBool::new(std::env::var("TS_CUDA_BATCH_FILL").map_or(true, |v| v != "0")),
            scratch_op: Mutex::new(()),
            error: Mutex::new(None),
            sm_count,
            smem_max,
            graphs: Mutex::new(GraphState::default()),
            graphs_on: std::env::var("TS_CUDA_GRAPHS").map_or(true, |v| v != "0") && std::env::var_os("TS_CUDA_PROFILE").is_none(),
            graph_max: std::env::var("TS_CUDA_GRAPH_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(GRAPH_MAX_TOKENS),
            moe_t16: std::env::var("TS_CUDA_MOE_T16").ok().and_then(|v| v.parse().ok()).unwrap_or(16).max(1),
            profile: std::env::var_os("TS_CUDA_PROFILE").map(|_| Mutex::new(HashMap::new())),
            fused: std::env::var("TS_CUDA_FUSED").map_or(true, |v| v != "0") && !exact,
            tc: major >= 8 && !exact && std::env::var("TS_CUDA_TC").map_or(true, |v| v != "0"),
            pdl: major >= 9 && std::env::var("TS_CUDA_PDL").map_or(true, |v| v != "0") && std::env::var_os("TS_CUDA_PROFILE").is_none(),
            mmq16: std::env::var("TS_CUDA_MMQ16").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            mla_splits: std::env::var("TS_CUDA_MLA_SPLITS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            mla_keys: std::env::var("TS_CUDA_MLA_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            mla_kps_b: std::env::var("TS_CUDA_MLA_KPS_B").ok().and_then(|v| v.parse().ok()).unwrap_or(128),
            mla_out: AtomicUsize::new(std::env::var("TS_CUDA_MLA_OUT").ok().and_then(|v| v.parse().ok()).unwrap_or(256)),
            mo_att_done: AtomicU64::new(0),
            mo_att: AtomicU32::new(std::env::var("TS_CUDA_MO_ATT").ok().and_then(|v| v.parse().ok()).unwrap_or(192)),
            mla_f16: !exact && std::env::var("TS_CUDA_MLA_F16").map_or(true, |v| v != "0"),
            ms_nb,
            ms_nb_b,
            moe_sh: std::env::var("TS_CUDA_MOE_SH").map_or(true, |v| v != "0"),
            moe_gu: std::env::var("TS_CUDA_MOE_GU").map_or(true, |v| v != "0"),
            moe_rows: AtomicBool::new(std::env::var("TS_CUDA_MOE_ROWS").map_or(true, |v| v != "0")),
            f16_copy: AtomicU8::new(match std::env::var("TS_CUDA_F16").as_deref() {
                Ok("1") => 1,
                Ok("0") => 0,
                _ => 2,
            }),
            moe_f16: std::env::var("TS_CUDA_MOE_F16").map_or(true, |v| v != "0"),
            mmf,
            mmf_gu: AtomicBool::new(std::env::var("TS_CUDA_MMF_GU").map_or(true, |v| v != "0")),
            mmf_q8: AtomicU8::new(match std::env::var("TS_CUDA_MMF_Q8").as_deref() {
                Ok("1") => 1,
                Ok("0") => 0,
                _ => 2,
            }),
            mmfq8,
            moe_blas: AtomicBool::new(std::env::var("TS_CUDA_MOE_BLAS").map_or(true, |v| v != "0")),
            mmh,
            mmh_mode: AtomicU8::new(match std::env::var("TS_CUDA_MMH").as_deref() {
                Ok("0") => 0,
                Ok("f16") => 1,
                Ok("q8") => 2,
                _ => 3,
            }),
            mmh_runs: AtomicUsize::new(0),
            moe_counts: std::env::var("TS_CUDA_MOE_COUNTS").is_ok_and(|v| v == "1"),
            dense_blas: AtomicBool::new(std::env::var("TS_CUDA_DENSE_BLAS").map_or(true, |v| v != "0")),
            moe_tiled: AtomicU8::new(match std::env::var("TS_CUDA_MOE_TILED").as_deref() {
                Ok("0") => 0,
                Ok("1") => 1,
                _ => 2,
            }),
            load_left: AtomicU64::new(0),
            // Off unless asked: measured slower (docs/PERF.md, "One launch for the decode MoE").
            // `TS_CUDA_MOE_ONE=1`: on, on the card's resident blocks; `=N` (N > 1): at most N.
            moe_one: AtomicUsize::new(match std::env::var("TS_CUDA_MOE_ONE").ok().and_then(|v| v.parse::<usize>().ok()) {
                Some(1) => moe_one_cap,
                Some(n) => n.min(moe_one_cap),
                None => 0,
            }),
            moe_one_cap,
            moe_one_route: std::env::var("TS_CUDA_MOE_ONE_ROUTE").map_or(true, |v| v != "0"),
            l2_hint: Mutex::new([(0, 0); 4]),
            norm_router: AtomicBool::new(std::env::var("TS_CUDA_NORM_ROUTER").map_or(true, |v| v != "0")),
            norm_mm: AtomicBool::new(std::env::var("TS_CUDA_NORM_MM").map_or(true, |v| v != "0")),
            pre_route: AtomicBool::new(std::env::var("TS_CUDA_PRE_ROUTE").map_or(true, |v| v != "0")),
            routed: Mutex::new(None),
            norm_xq: Mutex::new(None),
            pre_routed: AtomicU64::new(0),
            moe_residual: AtomicBool::new(std::env::var("TS_CUDA_MOE_RESIDUAL").map_or(true, |v| v != "0")),
            norm_mm16: AtomicBool::new(std::env::var("TS_CUDA_NORM_MM16").map_or(true, |v| v != "0")),
            // Off unless asked: measured slower (tg128 600 against 631 without it, gpu-next59).
            l2pf: std::env::var("TS_CUDA_L2PF").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            paths: Path::ALL.map(|p| (AtomicBool::new(p.env_on()), AtomicU64::new(0))),
            down_w4: match std::env::var("TS_CUDA_DOWN_WPR").as_deref() {
                Ok("4") => (true, true),
                Ok("1" | "2") => (false, false),
                _ => (false, true),
            },
            mmq_bn16: AtomicUsize::new(std::env::var("TS_CUDA_MMQ_BN16").ok().and_then(|v| v.parse().ok()).unwrap_or(16)),
            mmq_split: (
                std::env::var("TS_CUDA_MMQ_SPLIT_MIN").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize).max(1),
                std::env::var("TS_CUDA_MMQ_SPLIT_OCC").ok().and_then(|v| v.parse().ok()).unwrap_or(2usize).max(1),
            ),
            mmq_ws: major >= 9 && std::env::var("TS_CUDA_MMQ_WS").is_ok_and(|v| v == "1"),
            mmq_rows_dense: AtomicUsize::new(std::env::var("TS_CUDA_MMQ_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(48)),
            rows_r: AtomicUsize::new(match std::env::var("TS_CUDA_ROWS_R").as_deref() {
                Ok("1") => 1,
                Ok("2") => 2,
                _ => 0,
            }),
            rows_early: AtomicBool::new(std::env::var("TS_CUDA_ROWS_EARLY").map_or(true, |v| v != "0")),
            rows_sh_first: AtomicBool::new(std::env::var("TS_CUDA_ROWS_SH_FIRST").map_or(true, |v| v != "0")),
            rows_tail: AtomicUsize::new(env_usize("TS_CUDA_ROWS_TAIL").unwrap_or(16)),
            rows_tail_dn: AtomicUsize::new(env_usize("TS_CUDA_ROWS_TAIL_DN").or(env_usize("TS_CUDA_ROWS_TAIL")).unwrap_or(16)),
            rows_tail_later: AtomicBool::new(std::env::var("TS_CUDA_ROWS_TAIL_LATER").map_or(true, |v| v != "0")),
            mla_long: std::env::var("TS_CUDA_MLA_LONG").ok().and_then(|v| v.parse().ok()).unwrap_or(2560),
            mla_long_batch: std::env::var("TS_CUDA_MLA_LONG_BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
            rope_absorb: std::env::var("TS_CUDA_RA").map_or(true, |v| v != "0"),
            mla_pfa: AtomicBool::new(std::env::var("TS_CUDA_MLA_PFA").map_or(true, |v| v != "0")),
            mla_tc: AtomicU8::new(match std::env::var("TS_CUDA_MLATC").as_deref() {
                Ok("1") => 1,
                Ok("0") => 2,
                _ => 0,
            }),
            trace: trace.then(|| Mutex::new(Vec::new())),
            skip: std::env::var("TS_CUDA_SKIP")
                .map(|v| v.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
                .unwrap_or_default(),
            exact,
        })
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        self.ctx.mem_get_info().map_err(|e| dev_err("cuMemGetInfo", e))
    }

    /// Device -> host: the whole cache (`rows * width` values, row-major) into `dst`. Waits for
    /// all enqueued work. For tests and debugging.
    pub fn read_cache(&self, cache: &CudaCache, dst: &mut [f32]) -> Result<()> {
        assert_eq!(dst.len(), cache.rows * cache.width);
        self.synchronize()?;
        if cache.half {
            let mut h = vec![0u16; dst.len()];
            unsafe { drv::memcpy_dtoh_async(&mut h[..], cache.mem.ptr, self.stream.cu_stream()) }
                .map_err(|e| dev_err("device-to-host copy", e))?;
            self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))?;
            for (d, v) in dst.iter_mut().zip(h) {
                *d = half::f16::from_bits(v).to_f32();
            }
            return Ok(());
        }
        unsafe { drv::memcpy_dtoh_async(dst, cache.mem.ptr, self.stream.cu_stream()) }.map_err(|e| dev_err("device-to-host copy", e))?;
        self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))
    }

    /// Whether the fused decode kernels are on (`TS_CUDA_FUSED=0` turns them off).
    /// Whether the tensor-core prompt paths are on (see the `tc` field).
    pub fn tensor_cores(&self) -> bool {
        self.tc
    }

    /// Split MLA decode on the tensor cores: `Some(true)` wherever it applies, `Some(false)`
    /// never, `None` only for head counts the SIMT split kernel is not built for (the default).
    pub fn set_mla_tensor_cores(&self, on: Option<bool>) {
        self.mla_tc.store(
            match on {
                None => 0,
                Some(true) => 1,
                Some(false) => 2,
            },
            Ordering::Relaxed,
        );
    }

    /// Expert stacks uploaded from now on also get a 16-row tiled copy ([`CudaWeight::tiled`]);
    /// `TS_CUDA_MOE_TILED=1` sets it at start (for the test that says so).
    pub fn set_moe_tiled(&self, on: bool) {
        self.moe_tiled.store(on as u8, Ordering::Relaxed);
    }

    /// The prompt MoE's gate, up and GLU in one launch (`mmf16_gu`) or three (false).
    pub fn set_mmf_gu(&self, on: bool) {
        self.mmf_gu.store(on, Ordering::Relaxed);
    }

    /// Q8_0 matrices uploaded from now on also get an f16 copy ([`CudaWeight::half`]); prompt
    /// MoEs whose three matrices (and shared FFN) have one run on the f16 tensor cores.
    pub fn set_f16_copy(&self, on: bool) {
        self.f16_copy.store(on as u8, Ordering::Relaxed);
    }

    /// One sequence's prompt attention on an f16 cache through `mla_prefill_ha` (true) or
    /// `mla_prefill_h`; the same results.
    pub fn set_mla_prefill_async(&self, on: bool) {
        self.mla_pfa.store(on, Ordering::Relaxed);
    }

    /// Whether a tiled copy of `bytes` may be made now (`TS_CUDA_MOE_TILED` unset): after it,
    /// the tensors still to come (their source bytes + 1/8 for the device layout's padding)
    /// must leave a quarter of the device (at least 8 GiB) free for the KV cache, the scratch
    /// and the graphs. Tiling stops where memory gets short; untiled stacks take the row-major
    /// copy (the same bits).
    /// A weight's device bytes read back: (the row-major copy, the tiled copy if any); for the
    /// test of the `tile16_q8` kernel against [`tile16`].
    pub fn weight_bytes(&self, w: &CudaWeight) -> Result<(Vec<u8>, Option<Vec<u8>>)> {
        Ok((self.read_mem(&w.mem)?, w.tiled.as_ref().map(|m| self.read_mem(m)).transpose()?))
    }

    /// A weight's f16 copy read back ([`CudaWeight::half`]), if it has one; for the test of
    /// the `q8_to_f16` kernel.
    pub fn half_bytes(&self, w: &CudaWeight) -> Result<Option<Vec<u8>>> {
        w.half.as_ref().map(|m| self.read_mem(m)).transpose()
    }

    fn read_mem(&self, m: &DevMem) -> Result<Vec<u8>> {
        let mut v = vec![0u8; m.bytes];
        self.stream.synchronize().map_err(|e| dev_err("synchronize", e))?;
        unsafe { drv::memcpy_dtoh_sync(&mut v, m.ptr) }.map_err(|e| dev_err("device-to-host copy", e))?;
        Ok(v)
    }

    fn tile_fits(&self, bytes: usize) -> bool {
        let Ok((free, total)) = self.memory_info() else { return false };
        let left = self.load_left.load(Ordering::Relaxed) as usize;
        let reserve = (total / 4).max(8 << 30);
        free.saturating_sub(bytes).saturating_sub(left + left / 8) >= reserve
    }

    /// Grouped 16-token expert tiles on `mmq_q8_rows` (true, the default) or `mmq_q8_16` (the
    /// same bits; for the test that says so).
    pub fn set_moe_rows(&self, on: bool) {
        self.moe_rows.store(on, Ordering::Relaxed);
    }

    /// Row sets a warp of the grouped products on the rows kernel: 1 or 2, 0 for the default
    /// (by pairs an expert); the same bits either way.
    pub fn set_rows_r(&self, r: usize) {
        self.rows_r.store(r.min(2), Ordering::Relaxed);
    }

    /// Grouped products' first tiles by block index, their first loads before the PDL wait
    /// (true, the default) or every tile found from the counts first; the same bits.
    pub fn set_rows_early(&self, on: bool) {
        self.rows_early.store(on, Ordering::Relaxed);
    }

    /// With [`CudaBackend::set_rows_early`] on: the shared-FFN chunks' tiles first (true) or
    /// last (false); the same bits.
    pub fn set_rows_shared_first(&self, on: bool) {
        self.rows_sh_first.store(on, Ordering::Relaxed);
    }

    /// With two row sets a warp: the last `tiles` first tiles as half blocks (0: none); the same
    /// bits either way.
    pub fn set_rows_tail(&self, tiles: usize) {
        self.rows_tail.store(tiles, Ordering::Relaxed);
        self.rows_tail_dn.store(tiles, Ordering::Relaxed);
    }

    /// Tail halves on the later tiles too (true, the default) or on the first tiles' end only;
    /// the same bits either way.
    pub fn set_rows_tail_later(&self, on: bool) {
        self.rows_tail_later.store(on, Ordering::Relaxed);
    }

    /// Dense Q8_0 products of up to `bn16` tokens on 16-token tiles, and of up to `rows` tokens
    /// on `mmq_q8_rows` (`TS_CUDA_MMQ_BN16`, `TS_CUDA_MMQ_ROWS`; for the tests that say so).
    pub fn set_mmq_tiles(&self, bn16: usize, rows: usize) {
        self.mmq_bn16.store(bn16, Ordering::Relaxed);
        self.mmq_rows_dense.store(rows, Ordering::Relaxed);
    }

    /// [`CudaBackend::moe_blas`]: the prompt MoE's shared FFN on cuBLAS; decides the f16 copies
    /// of the expert weights uploaded from now on (with it, row-major copies of 2-D ones only).
    pub fn set_moe_blas(&self, on: bool) {
        self.moe_blas.store(on, Ordering::Relaxed);
    }

    /// Prompt MoEs on `mmh_*` ([`CudaBackend::mmh_mode`]: 0 off, 1 f16 copies, 2 Q8_0, 3
    /// copies where made); weights uploaded after this get (or do not get) the row-major f16
    /// stack copies modes 1 and 3 read. False where it cannot run here.
    pub fn set_mmh(&self, mode: u8) -> bool {
        self.mmh_mode.store(mode.min(3), Ordering::Relaxed);
        self.mmh || mode == 0
    }

    /// One token's attention output side in `mla_out_q8` with `rows` W_o rows a block (0: the
    /// plain chain), as `TS_CUDA_MLA_OUT`; for steps recorded after this call.
    pub fn set_mla_out(&self, rows: usize) {
        self.mla_out.store(rows, Ordering::Relaxed);
    }

    /// The one-token Q8_0 decode MoE in one launch (`moe_sh_q8_one`) or two; for steps recorded
    /// after this call. False where it cannot run (no occupancy for it).
    pub fn set_moe_one(&self, on: bool) -> bool {
        self.moe_one.store(if on { self.moe_one_cap } else { 0 }, Ordering::Relaxed);
        !on || self.moe_one_cap > 0
    }

    /// `mla_attention_out`'s `next` product in the norm's launch or after it (the same bits);
    /// for steps recorded after this call.
    pub fn set_norm_router(&self, on: bool) {
        self.norm_router.store(on, Ordering::Relaxed);
    }

    /// `add_rms_norm_matmul_many` of one token in one launch or two (the same bits); for steps
    /// recorded after this call.
    pub fn set_norm_mm(&self, on: bool) {
        self.norm_mm.store(on, Ordering::Relaxed);
    }

    /// One token's attention in `mla_out_q8`'s blocks below this position (`CudaBackend::mo_att`;
    /// 0: never).
    pub fn set_mo_att(&self, below: u32) {
        self.mo_att.store(below, Ordering::Relaxed);
    }

    /// How many one-token attentions `mla_out_q8`'s blocks have done themselves (`mo_att`).
    pub fn short_attentions(&self) -> u64 {
        self.mo_att_done.load(Ordering::Relaxed)
    }

    /// One token's MoE routing in the norm's launch before it, or in the MoE's own
    /// (`CudaBackend::pre_route`).
    pub fn set_pre_route(&self, on: bool) {
        self.pre_route.store(on, Ordering::Relaxed);
    }

    /// A layer's first norm inside its f16 / bf16 products (`CudaBackend::norm_mm16`).
    pub fn set_norm_mm16(&self, on: bool) {
        self.norm_mm16.store(on, Ordering::Relaxed);
    }

    /// The MoE's output added into the residual by its down kernel, and the norm-only product
    /// launch (`CudaBackend::moe_residual`).
    pub fn set_moe_residual(&self, on: bool) {
        self.moe_residual.store(on, Ordering::Relaxed);
    }

    /// Chained steps without copies between them (`CudaBackend::batch_fill`); for arg-max slots
    /// allocated and batches uploaded after this call.
    pub fn set_batch_fill(&self, on: bool) {
        self.batch_fill.store(on, Ordering::Relaxed);
    }

    /// Whether the device runs thread-block clusters (sm_90 and later).
    fn clusters(&self) -> bool {
        let digits: String = self.arch.trim_start_matches("sm_").chars().take_while(|c| c.is_ascii_digit()).collect();
        digits.parse::<u32>().is_ok_and(|v| v >= 90)
    }

    /// Turn a decode path on or off (its environment variable's setting until then); for steps
    /// recorded after this call.
    pub fn set_path(&self, p: Path, on: bool) {
        self.paths[p as usize].0.store(on, Ordering::Relaxed);
    }

    /// How many ops have taken the path (for the tests: that a switch did something).
    pub fn path_launches(&self, p: Path) -> u64 {
        self.paths[p as usize].1.load(Ordering::Relaxed)
    }

    fn path_on(&self, p: Path) -> bool {
        self.paths[p as usize].0.load(Ordering::Relaxed)
    }

    /// Counts one op on the path.
    fn took(&self, p: Path) {
        self.paths[p as usize].1.fetch_add(1, Ordering::Relaxed);
    }

    /// How many `moe_shared` ops have used a routing made ahead (`pre_route`).
    pub fn pre_routes(&self) -> u64 {
        self.pre_routed.load(Ordering::Relaxed)
    }

    /// Dense Q8_0 prompt products on cuBLAS in f16 ([`CudaBackend::dense_blas`]).
    pub fn set_dense_blas(&self, on: bool) {
        self.dense_blas.store(on, Ordering::Relaxed);
    }

    /// How many prompt MoEs ran on `mmh_*` on this backend.
    pub fn mmh_runs(&self) -> usize {
        self.mmh_runs.load(Ordering::Relaxed)
    }

    /// Whether expert stacks get row-major f16 copies for `mmh_*` (with the shared FFN on cuBLAS).
    fn mmh_copies(&self) -> bool {
        self.mmh && matches!(self.mmh_mode.load(Ordering::Relaxed), 1 | 3) && self.moe_blas.load(Ordering::Relaxed)
    }

    /// Prompt MoEs straight from the Q8_0 weights on the f16 tensor cores ([`CudaBackend::mmf_q8`]):
    /// 0 never, 1 always, 2 where the f16 copies are absent. False where the device lacks the
    /// kernels' shared memory (the setting is kept; those MoEs then take another path).
    pub fn set_mmf_q8(&self, mode: u8) -> bool {
        self.mmf_q8.store(mode.min(2), Ordering::Relaxed);
        self.mmfq8.is_some()
    }

    /// Tokens per tile of the grouped expert products ([`CudaBackend::moe_mmq`]) for `pairs`
    /// (token, slot) pairs over `ne_all` experts (routed + shared chunks): 16 when the experts
    /// see few tokens each (batched decode; the block's work then shrinks with them: up to
    /// [`CudaBackend::moe_t16`] pairs an expert on average), else 64.
    fn moe_tile_tokens(&self, pairs: usize, ne_all: usize) -> usize {
        if pairs <= self.moe_t16 * ne_all {
            16
        } else {
            64
        }
    }

    /// Whether a batched MoE of `n` tokens (> [`GEMV_MAX_TOKENS`], on the tensor cores) with
    /// `k` routed slots, `nsh` shared chunks of width `ff` each and `n_experts` routed experts,
    /// Q8_0 weights without f16 copies and `hdim`-wide rows, runs its products on the f16 tensor
    /// cores straight from the Q8_0 weights (`mmfq8_*`: f16 activations, no 8-bit rounding)
    /// rather than on the int8 ones. For the tests, whose tolerances against the CPU (which
    /// rounds activations to 8 bits) depend on it.
    pub fn moe_q8_runs_f16(&self, n: usize, k: usize, n_experts: usize, nsh: usize, hdim: usize, ff: usize) -> bool {
        // (with the shared FFN on cuBLAS the grouped kernels see the routed pairs alone)
        let nsh = if nsh > 0 && self.moe_blas.load(Ordering::Relaxed) && self.mmfq8.is_some() && n > GRAPH_MAX_TOKENS { 0 } else { nsh };
        self.moe_tile_tokens(n * (k + nsh), n_experts + nsh) == 64
            && self.moe_f16
            && self.mmf_q8.load(Ordering::Relaxed) != 0
            && self.mmfq8.is_some()
            && hdim % 128 == 0
            && ff % 128 == 0
    }

    pub fn fused(&self) -> bool {
        self.fused
    }

    /// The architecture the kernels were built for (`sm_90`) and whether they came from the
    /// on-disk cache.
    pub fn kernel_build(&self) -> (&str, bool) {
        (&self.arch, self.kernels_from_cache)
    }

    /// Bytes of scratch currently held (dequantised weights, MoE intermediates).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner()).iter().flatten().map(|m| m.bytes).sum()
    }

    fn fail(&self, msg: String) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(msg);
        }
    }

    fn take_error(&self) -> Result<()> {
        match self.error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(m) => Err(BackendError::Device(m)),
            None => Ok(()),
        }
    }

    fn alloc_mem(&self, bytes: usize, what: &str) -> Result<DevMem> {
        let n = bytes.max(4);
        match self.stream.alloc_zeros::<u8>(n) {
            Ok(s) => {
                let ptr = {
                    let (p, _g) = s.device_ptr(&self.stream);
                    p
                };
                Ok(DevMem { _slice: s, ptr, bytes })
            }
            Err(e) if e.0 == drv_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = self.memory_info().unwrap_or((0, 0));
                Err(BackendError::OutOfMemory {
                    device: self.name.clone(),
                    what: format!("{what}: {} MiB requested, {} MiB free of {} MiB", bytes >> 20, free >> 20, total >> 20),
                })
            }
            Err(e) => Err(dev_err(&format!("allocation of {bytes} bytes for {what}"), e)),
        }
    }

    fn upload_bytes(&self, mem: &DevMem, off: usize, src: &[u8]) -> Result<()> {
        assert!(off + src.len() <= mem.bytes);
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        // Pageable host memory is staged before the call returns, so `src` may go right after.
        unsafe { drv::memcpy_htod_async(mem.ptr + off as u64, src, self.stream.cu_stream()) }.map_err(|e| dev_err("host-to-device copy", e))
    }

    /// The arg-max of each row of `x` into the ids at the start of [`S::Ids`] (`argmax_part`,
    /// then `argmax_final`); their device pointer, None where the scratch could not be had (the
    /// failure is recorded). Not part of a recorded step (it ends with a copy to the host), so
    /// the scratch may grow.
    /// `host`: the device address of mapped host memory that gets the ids too (0: none).
    fn enqueue_argmax(&self, x: &CudaBuf, xr: Rows, host: u64) -> Option<u64> {
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        // Keys of ARGMAX_CHUNK values per block (8-byte aligned, after the ids).
        let chunks = xr.width.div_ceil(ARGMAX_CHUNK).max(1);
        let ids_bytes = (4 * xr.n).next_multiple_of(8);
        let ids = self.scratch(S::Ids, ids_bytes + 8 * chunks * xr.n)?;
        let part = ids + ids_bytes as u64;
        self.launch(
            "argmax_part",
            (chunks as u32, xr.n as u32, 1),
            256,
            0,
            &[A::P(x.0.ptr), l(xr.off), l(xr.stride), i(xr.width), i(ARGMAX_CHUNK.min(xr.width.max(1))), A::P(part)],
        );
        self.launch("argmax_final", (xr.n as u32, 1, 1), 32, 0, &[A::P(part), i(chunks), i(xr.width), A::P(ids), A::P(host)]);
        Some(ids)
    }

    /// Device pointer of scratch slot `s` as it is (None before its first use).
    fn scratch_ptr(&self, s: S) -> Option<u64> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())[s as usize].as_ref().map(|m| m.ptr)
    }

    /// Device pointer of scratch slot `s`, grown to at least `bytes` (contents undefined).
    /// [`Backend::mla_attention`]; with `defer`, a one-token step on the split kernels leaves
    /// the merge of its splits to the caller and returns (the partial rows, the split count)
    /// (`mla_out_q8` merges them). None: `out` is written (or the backend failed).
    #[allow(clippy::too_many_arguments)]
    /// The [`Backend::prefetch_hint`] regions as a kernel's 8 trailing arguments (pointer, bytes)
    /// x 4, taken either way; zeros unless `use_them`.
    fn take_hint(&self, use_them: bool) -> [A; 8] {
        let h = std::mem::take(&mut *self.l2_hint.lock().unwrap_or_else(|e| e.into_inner()));
        let h = if use_them { h } else { [(0, 0); 4] };
        [A::P(h[0].0), l(h[0].1), A::P(h[1].0), l(h[1].1), A::P(h[2].0), l(h[2].1), A::P(h[3].0), l(h[3].1)]
    }

    fn mla_attention_run(
        &self,
        q: &CudaBuf,
        qr: Rows,
        cache: &CudaCache,
        batch: &CudaBatch,
        p: &MlaParams,
        out: &CudaBuf,
        o: Rows,
        defer: bool,
    ) -> Option<(u64, usize)> {
        // Backend::prefetch_hint's regions go with a one-token step's split kernel, and with no
        // other launch (they are taken either way).
        let hint = self.take_hint(batch.tokens.len() == 1);
        let (nh, kl, rd) = (p.n_heads, p.kv_lora, p.rope_dim);
        let w = kl + rd;
        assert_eq!(qr.width, w);
        assert_eq!(o.width, kl);
        assert_eq!(qr.n, batch.tokens.len() * nh);
        assert_eq!(cache.width, w, "mla_attention: cache width");
        q.check(qr);
        out.check(o);
        if !self.check_cache_rows(batch, cache.rows, "mla_attention") {
            return None;
        }
        let n = batch.tokens.len();
        let simt = match (w, kl, nh, cache.half) {
            (576, 512, 16, false) => Some(("mla_split_18_16", 256u32)),
            (576, 512, 16, true) => Some(("mla_split_18_16_h", 256u32)),
            (160, 128, 4, false) => Some(("mla_split_5_4", 64u32)),
            _ => None,
        };
        // The tensor-core split (kernels/mla_prefill.cu): 16-head row groups, V2's shapes; an f16
        // cache's kernel streams its key tiles through a cp.async ring.
        // (8 warps a block, a score's dims in four parts, measured slower on the H200: tg64 at
        // 16k 471.0 against 483.2; docs/PERF.md, session 27.)
        let ms_smem = if cache.half { ms_smem_h(self.ms_nb) } else { MS_SMEM };
        let tc_ok = self.tc && (w, kl) == (576, 512) && nh % 16 == 0 && qr.off % 4 == 0 && qr.stride % 4 == 0 && ms_smem <= self.smem_max;
        let use_tc = tc_ok
            && match self.mla_tc.load(Ordering::Relaxed) {
                1 => true,
                2 => simt.is_none() && cache.half, // an f16 cache has no per-(token, head) kernel
                _ => simt.is_none() || self.long_context(n, batch.tokens.iter().map(|t| t.pos)),
            };
        // One token only: its split blocks skip just its own row, and in a batch another token
        // of the same sequence has its row written by the same previous kernel.
        let early = use_tc && cache.half && n == 1 && self.path_on(Path::SplitEarly);
        if early {
            self.took(Path::SplitEarly);
        }
        let in_batch = use_tc && cache.half && n > 1 && self.path_on(Path::SplitBatch);
        let ms_smem = if in_batch { ms_smem_h(self.ms_nb_b) } else { ms_smem };
        let split = match (use_tc, cache.half, early) {
            (true, true, true) => Some(("mla_split_tc_he", 128u32)),
            (true, true, false) if in_batch => Some(("mla_split_tc_hb", 128u32)),
            (true, true, false) => Some(("mla_split_tc_h", 128u32)),
            (true, false, _) => Some(("mla_split_tc", 128u32)),
            (false, _, _) => simt,
        };
        // Prefill of one sequence: f16 tensor cores, 4 row groups of 16 heads per block
        // (kernels/mla_prefill.cu); other batches take the split kernel, or the
        // per-(token, head) kernel for shapes the split kernel is not built for.
        let one_slot = batch.tokens.iter().all(|t| t.slot == batch.tokens[0].slot);
        if self.tc
            && n > GEMV_MAX_TOKENS
            && (w, kl) == (576, 512)
            && nh % 16 == 0
            && one_slot
            && qr.off % 4 == 0
            && qr.stride % 4 == 0
            && MP_SMEM <= self.smem_max
        {
            let groups = n * nh / 16;
            let (name, smem) = match (cache.half, self.mla_pfa.load(Ordering::Relaxed) && MP_SMEM_A <= self.smem_max) {
                (true, true) => ("mla_prefill_ha", MP_SMEM_A),
                (true, false) => ("mla_prefill_h", MP_SMEM),
                (false, _) => ("mla_prefill", MP_SMEM),
            };
            self.launch(
                name,
                (groups.div_ceil(4) as u32, 1, 1),
                256,
                smem as u32,
                &[
                    A::P(q.0.ptr),
                    l(qr.off),
                    l(nh * qr.stride),
                    l(qr.stride),
                    A::P(cache.mem.ptr),
                    A::P(batch.pos_ptr()),
                    A::P(batch.slot_ptr()),
                    A::I(batch.slot_len as i32),
                    i(n),
                    i(nh),
                    A::F(p.scale),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(nh * o.stride),
                    l(o.stride),
                ],
            );
            return None;
        }
        if let Some((kname, threads)) = split {
            // Decode steps, and batches of several sequences (the server's steps): split over
            // the context, all heads of a token per block, then merge (kernels/fast.cu). The
            // tokens go in chunks whose partial results fit the fixed `Part` scratch.
            // Two blocks per SM over the batch's tokens, except the 16-head SIMT kernel (it holds
            // an SM alone at 255 registers) for batches: one wave, sm_count / n. Measured on the
            // H200: 64 sequences 5,648 tok/s with 2 splits each (the merge then 2 warps); one
            // token: one wave gave tg64 at 16k 358 vs 340 but tg128 568 vs 582, so 2 per SM there
            // (TS_CUDA_MLA_SPLITS to measure). The tensor-core kernel on one long-context token
            // (16 heads: one row group): one wave, tg64 at 16k 410 vs 382 with 2 per SM; on a
            // batch: one or two blocks an SM by its longest context (tc_batch_splits).
            let simt16 = kname.starts_with("mla_split_18_16");
            // Batches on the SIMT kernel: also no more splits than runs of `mla_keys` keys in the
            // longest context (64 sequences of short contexts: one split each, written without
            // the merge, 6,171 vs 6,069 tok/s with 2; docs/PERF.md).
            let auto = if simt16 && n > 1 {
                self.batch_mla_splits(n, batch.tokens.iter().map(|t| t.pos))
            } else if use_tc && n > 1 {
                self.tc_batch_splits(n, batch.tokens.iter().map(|t| t.pos))
            } else {
                (if use_tc && n * nh == 16 { self.sm_count } else { 2 * self.sm_count }) / n
            };
            let nsp = if self.mla_splits > 0 { self.mla_splits } else { auto }.clamp(1, MLA_MAX_SPLITS);
            let per_tok = 4 * nsp * nh * (kl + 2);
            let chunk = (PART_MIN_BYTES / per_tok).clamp(1, n);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(part) = self.scratch(S::Part, (per_tok * chunk).max(PART_MIN_BYTES)) else { return None };
            for t0 in (0..n).step_by(chunk) {
                let nc = chunk.min(n - t0);
                let (pos, slot) = (batch.pos_ptr() + 4 * t0 as u64, batch.slot_ptr() + 4 * t0 as u64);
                // The tensor-core kernel takes a block per 16-head row group of a token. The SIMT
                // kernels with one split write the output themselves (no merge to do).
                let (gy, smem) = if use_tc { (nc * nh / 16, ms_smem) } else { (nc, 0) };
                let direct = !use_tc && nsp == 1;
                let ooff = o.off + t0 * nh * o.stride;
                let args = [
                    A::P(q.0.ptr),
                    l(qr.off + t0 * nh * qr.stride),
                    l(nh * qr.stride),
                    l(qr.stride),
                    A::P(cache.mem.ptr),
                    A::P(pos),
                    A::P(slot),
                    A::I(batch.slot_len as i32),
                    i(nh),
                    A::F(p.scale),
                    A::P(part),
                    A::P(if direct { out.0.ptr } else { 0 }),
                    l(ooff),
                    l(nh * o.stride),
                    l(o.stride),
                ];
                let all: [A; 23] = cat(args, hint);
                if in_batch {
                    self.took(Path::SplitBatch);
                }
                self.launch(kname, (nsp as u32, gy as u32, 1), threads, smem as u32, &all[..if use_tc { 11 } else { 23 }]);
                if direct {
                    continue;
                }
                if defer && n == 1 {
                    return Some((part, nsp));
                }
                let cargs = [A::P(part), i(nsp), i(nh), i(kl), A::P(pos), A::P(out.0.ptr), l(ooff), l(nh * o.stride), l(o.stride)];
                if nsp <= 8 && kl % 4 == 0 && kl <= 512 && self.path_on(Path::CombineFew) {
                    // A block per (token, head), a thread per 4 outputs (the same bits).
                    self.took(Path::CombineFew);
                    self.launch("mla_combine_few", ((nc * nh) as u32, 1, 1), (kl / 4) as u32, 0, &cargs);
                    continue;
                }
                self.launch(
                    "mla_combine",
                    ((nc * nh) as u32, kl.div_ceil(64) as u32, 1),
                    32 * nsp.min(8) as u32, // a warp per split, up to 8 (MC_WARPS); float2 rows: kl (512, 128) is even
                    0,
                    &cargs,
                );
            }
            return None;
        }
        if cache.half {
            // alloc_latent_cache gives f16 only where the kernels above cover every batch.
            self.fail(format!("mla_attention: no kernel reads this f16 cache (queries at offset {} stride {})", qr.off, qr.stride));
            return None;
        }
        self.attention_launch(
            (q, qr.off, nh * qr.stride, qr.stride),
            (cache.mem.ptr, w, 0),
            (cache.mem.ptr, w, 0),
            (out, o.off, nh * o.stride, o.stride),
            batch,
            nh,
            nh,
            w,
            kl,
            p.scale,
            0,
            0.0,
        );
        None
    }

    fn scratch(&self, s: S, bytes: usize) -> Option<u64> {
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut sc[s as usize];
        if slot.as_ref().is_none_or(|m| m.bytes < bytes) {
            let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            if gs.capturing.is_some() {
                // An allocation cannot go into a graph: the capture is dropped at graph_end and
                // the step runs again eagerly.
                gs.spoiled = true;
                return None;
            }
            // Recordings hold the old pointer.
            gs.graphs.clear();
            gs.names.clear();
            gs.seen.clear();
            drop(gs);
            *slot = None; // free first (stream-ordered) so the new one can reuse the space
            match self.alloc_mem(bytes.next_multiple_of(1 << 16), "scratch") {
                Ok(m) => *slot = Some(m),
                Err(e) => {
                    self.fail(e.to_string());
                    return None;
                }
            }
        }
        slot.as_ref().map(|m| m.ptr)
    }

    /// The first `n` values of the module's `__device__` variable `sym` (after the stream's work).
    fn read_global<T: Copy + Default>(&self, sym: &str, n: usize) -> std::result::Result<Vec<T>, String> {
        let g = self.module.get_global(sym, &self.stream).map_err(|e| format!("{sym}: {e:?}"))?;
        let (ptr, _sync) = g.device_ptr(&self.stream);
        let mut v = vec![T::default(); n];
        unsafe { drv::memcpy_dtoh_sync(&mut v, ptr) }.map_err(|e| format!("{sym}: {e:?}"))?;
        Ok(v)
    }

    /// `TS_CUDA_TRACE`: reads the kernels' records back and writes one CSV line per launch,
    /// `seq,name,grid_id,wait_ns,release_ns` in release order (a kernel's wait returns only after
    /// the previous one ended, so that is launch order; the grid ids say so too), `names` being
    /// the launches in host order. Returns a one-line summary.
    fn write_trace(&self, names: &[String]) -> std::result::Result<String, String> {
        self.synchronize().map_err(|e| e.to_string())?;
        let count = self.read_global::<u32>("ts_trace_n", 1)?[0] as usize;
        const CAP: usize = 1 << 20; // TS_TRACE_CAP in common.cuh
        let n = count.min(CAP);
        let raw = self.read_global::<u64>("ts_trace", 3 * n)?;
        let mut recs: Vec<(u64, u64, u64)> = raw.chunks_exact(3).map(|c| (c[0], c[1], c[2])).collect();
        recs.sort_by_key(|r| (r.2, r.0));
        let in_grid_order = recs.windows(2).all(|w| w[0].0 < w[1].0);
        let path = std::env::var("TS_CUDA_TRACE_OUT").unwrap_or_else(|_| "/tmp/ts-trace.csv".into());
        let mut out = String::from("seq,name,grid_id,wait_ns,release_ns\n");
        for (i, r) in recs.iter().enumerate() {
            let name = names.get(i).map_or("?", String::as_str);
            out.push_str(&format!("{i},{name},{},{},{}\n", r.0, r.1, r.2));
        }
        std::fs::write(&path, out).map_err(|e| format!("{path}: {e}"))?;
        Ok(format!(
            "{n} records ({count} kernels recorded, {} launches named{}), release order {} grid order; {path}",
            names.len(),
            if count > CAP { ", buffer full" } else { "" },
            if in_grid_order { "=" } else { "!=" }
        ))
    }

    fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[A]) {
        let Some(f) = self.funcs.get(name) else {
            self.fail(format!("kernel {name} is not loaded"));
            return;
        };
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || self.skip.iter().any(|p| name.starts_with(p.as_str())) {
            return;
        }
        // The kernel's parameters: pointers to the values in `args`, which outlive the call (the
        // driver copies them at launch). A fixed array: launching allocates nothing.
        const MAX_ARGS: usize = 48;
        if args.len() > MAX_ARGS {
            self.fail(format!("kernel {name}: {} arguments (at most {MAX_ARGS})", args.len()));
            return;
        }
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
        for (p, a) in params.iter_mut().zip(args) {
            *p = match a {
                A::P(v) => v as *const u64 as *mut std::ffi::c_void,
                A::L(v) => v as *const i64 as *mut std::ffi::c_void,
                A::I(v) => v as *const i32 as *mut std::ffi::c_void,
                A::F(v) => v as *const f32 as *mut std::ffi::c_void,
                A::T(m) => *m as *mut std::ffi::c_void,
            };
        }
        // Programmatic dependent launch: the kernel may start while the previous one finishes
        // (each kernel waits with `pdl_wait` before it touches what others write; common.cuh).
        let mut attr: drv_sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = drv_sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        let ev = |s: &CudaStream| s.record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)).ok();
        let e0 = if self.profile.is_some() { ev(&self.stream) } else { None };
        let r = match self.ctx.bind_to_thread() {
            Ok(()) => unsafe { drv_sys::cuLaunchKernelEx(&cfg, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result(),
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            self.fail(format!("launch of kernel {name}: {e:?}"));
        } else if let Some(tr) = &self.trace {
            let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
            if gs.capturing.is_some() {
                gs.capture_names.push(name.to_string());
            } else {
                drop(gs);
                tr.lock().unwrap_or_else(|e| e.into_inner()).push(name.to_string());
            }
        }
        if let (Some(p), Some(e0)) = (&self.profile, e0) {
            if let Some(e1) = ev(&self.stream) {
                if e1.synchronize().is_ok() {
                    if let Ok(ms) = e0.elapsed_ms(&e1) {
                        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                        // The tensor-core products by grid, so that shapes can be told apart.
                        let key =
                            if name.starts_with("mmq") { format!("{name} {}x{}x{}", grid.0, grid.1, grid.2) } else { name.to_string() };
                        let ent = p.entry(key).or_insert((0, 0.0));
                        ent.0 += 1;
                        ent.1 += ms as f64;
                    }
                }
            }
        }
    }

    /// Grid for a grid-stride loop over `total` elements with 256-thread blocks.
    fn grid1(total: usize) -> (u32, u32, u32) {
        (total.div_ceil(256).clamp(1, 1 << 16) as u32, 1, 1)
    }

    /// A dense int8 product's tiles and splits: (tokens a tile, 16 or 64; K splits) for `m` rows
    /// of `ngroups` groups and `n` rows of input, `ng` tokens per matrix over `g` matrices.
    /// Too few tiles to fill the device (small matrices, decode-size batches): split K over
    /// blocks (at least mmq_split.0 groups each) into partial outputs, summed in order after.
    fn dense_plan(&self, m: usize, ngroups: usize, (n, ng, g): (usize, usize, usize)) -> (usize, usize) {
        let bn = if ng <= self.mmq_bn16.load(Ordering::Relaxed).max(self.mmq_rows_dense.load(Ordering::Relaxed)) { 16 } else { 64 };
        let tiles = m.div_ceil(64) * ng.div_ceil(bn) * g;
        // The partial outputs fit the part scratch's fixed size, so that it never grows after
        // the warm-up at open (the decode step there allocates it, see the MLA decode).
        let fit = PART_MIN_BYTES / (4 * n * m).max(1);
        let (smin, socc) = self.mmq_split;
        let nsplit =
            if tiles >= self.sm_count { 1 } else { (socc * self.sm_count).div_ceil(tiles).min(ngroups / smin).min(fit).clamp(1, 16) };
        (bn, nsplit)
    }

    /// `mmq_jobs` in one product launch and at most one sum launch ([`Path::DenseJobs`]:
    /// `mmq_q8_64_jobs`, `mmq_sum_splits_jobs`): each job with the tiles and splits
    /// [`Self::dense_plan`] gives it alone, so the same bits. False (nothing launched) where a
    /// job would not take the 64-token tiles alone or the partials do not fit the part scratch.
    fn mmq_dense_jobs(&self, ngroups: usize, xq: u64, n: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) -> bool {
        if !self.path_on(Path::DenseJobs) || !(2..=3).contains(&jobs.len()) || self.mmq_ws {
            return false;
        }
        let mut plan = [(0usize, 0usize, 0usize); 3]; // (m, splits, part offset in floats)
        let mut part_floats = 0;
        for (p, (w, _, _)) in plan.iter_mut().zip(jobs) {
            let m = w.ne(1);
            let (bn, nsplit) = self.dense_plan(m, ngroups, (n, n, 1));
            if bn != 64 {
                return false;
            }
            *p = (m, nsplit, part_floats);
            if nsplit > 1 {
                part_floats += nsplit * n * m;
            }
        }
        // (The sums' 32-bit indices: every job's rows * m together below 2^31.)
        if 4 * part_floats > PART_MIN_BYTES || plan.iter().map(|p| n * p.0).sum::<usize>() >= 1 << 31 {
            return false;
        }
        let Some(part) = self.scratch(S::Part, PART_MIN_BYTES) else { return true };
        self.took(Path::DenseJobs);
        let mut args = [A::I(0); 31];
        let mut sum = [A::I(0); 22];
        let mut blocks = 0;
        for (j, (&(m, nsplit, poff), &(w, out, o))) in plan.iter().zip(jobs).enumerate() {
            out.check(o);
            let nb = m.div_ceil(64) * n.div_ceil(64) * nsplit;
            blocks += nb;
            let pp = part + 4 * poff as u64;
            let dst = if nsplit > 1 { (pp, 0, m) } else { (out.0.ptr, o.off, o.stride) };
            let job = [A::P(w.mem.ptr), l(w.row_bytes), i(m), A::P(dst.0), l(dst.1), l(dst.2), i(nsplit), l(n * m), i(nb)];
            args[9 * j..9 * j + 9].copy_from_slice(&job);
            let sj = [A::P(pp), i(nsplit), l(n * m), i(if nsplit > 1 { m } else { 0 }), A::P(out.0.ptr), l(o.off), l(o.stride)];
            sum[7 * j..7 * j + 7].copy_from_slice(&sj);
        }
        args[27..].copy_from_slice(&[i(ngroups), A::P(xq), l(ngroups * 144), i(n)]);
        let early = self.path_on(Path::DenseEarly);
        if early {
            self.took(Path::DenseEarly);
        }
        let name = if early { "mmq_q8_64_jobse" } else { "mmq_q8_64_jobs" };
        self.launch(name, (blocks as u32, 1, 1), 128, MMQ_SMEM as u32, &args);
        sum[21] = i(n);
        let total: usize = plan.iter().filter(|p| p.1 > 1).map(|p| n * p.0).sum();
        if total > 0 {
            self.launch("mmq_sum_splits_jobs", Self::grid1(total), 256, 0, &sum);
        }
        true
    }

    /// The int8 tensor-core product of quantised activations `xq` (`n` rows of `ngroups` groups,
    /// `ng` tokens per matrix over `g` matrices of `w`) into `out`/`o`; split K where the tiles
    /// would not fill the device. The caller holds `scratch_op`.
    /// `sum`: what becomes of split K's partial outputs ([`SplitSum`]); the partials (pointer,
    /// splits; split `s` at `s * n * m` floats, rows of `m`) when they are left, else None.
    #[allow(clippy::too_many_arguments)]
    fn mmq_dense(
        &self,
        w: &CudaWeight,
        ngroups: usize,
        xq: u64,
        (n, ng, g): (usize, usize, usize),
        out: &CudaBuf,
        o: Rows,
        sum: SplitSum,
    ) -> Option<(u64, usize)> {
        let q8out = match sum {
            SplitSum::Q8(q) => Some(q),
            _ => None,
        };
        let m = w.ne(1);
        let (bn, nsplit) = self.dense_plan(m, ngroups, (n, ng, g));
        let grid = (m.div_ceil(64) as u32, ng.div_ceil(bn) as u32, (g * nsplit) as u32);
        if nsplit == 1 {
            self.mmq_launch(w, m, ngroups, xq, grid, ng, None, 1, (out.0.ptr, o.off, o.stride), (1, 0), bn);
            if let Some(q) = q8out {
                self.quant_groups(out.0.ptr, 0, o.off, o.stride, n, m, 0, q);
            }
            return None;
        }
        let part = self.scratch(S::Part, (4 * nsplit * n * m).max(PART_MIN_BYTES))?;
        self.mmq_launch(w, m, ngroups, xq, grid, ng, None, 1, (part, 0, m), (nsplit, n * m), bn);
        if let SplitSum::Leave = sum {
            return Some((part, nsplit));
        }
        let sum = [A::P(part), i(nsplit), l(n * m), i(n), i(m), A::P(out.0.ptr), l(o.off), l(o.stride)];
        match q8out {
            Some(q) if m.is_multiple_of(128) => {
                let args: [A; 9] = cat(sum, [A::P(q)]);
                self.launch("mmq_sum_splits_q8", ((n * m / 128).div_ceil(8) as u32, 1, 1), 256, 0, &args);
            }
            _ => {
                self.launch("mmq_sum_splits", Self::grid1(n * m), 256, 0, &sum);
                if let Some(q) = q8out {
                    self.quant_groups(out.0.ptr, 0, o.off, o.stride, n, m, 0, q);
                }
            }
        }
        None
    }

    /// `out = W x` per group: `g` matrices of `w`, row `r` of `xr` uses matrix `r % g`.
    fn matmul_groups(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, g: usize, out: &CudaBuf, o: Rows) {
        let (k, m) = (w.ne(0), w.ne(1));
        assert_eq!(xr.width, k, "matmul: activation width {} != weight input {k}", xr.width);
        assert_eq!(o.width, m, "matmul: output width {} != weight rows {m}", o.width);
        assert_eq!(xr.n, o.n);
        assert_eq!(xr.n % g, 0, "grouped matmul: {} rows is not a multiple of {g} groups", xr.n);
        x.check(xr);
        out.check(o);
        let ng = xr.n / g;
        if ng == 0 || m == 0 {
            return;
        }
        let Some(tn) = tname(w.dtype) else {
            self.fail(format!("matmul: no kernels for {}", w.dtype.name()));
            return;
        };
        if ng <= GEMV_MAX_TOKENS && w.dtype == GgmlType::Q8_0 && !self.exact {
            // dp4a GEMV (kernels/fast.cu): activations quantised to Q8_0 in shared memory.
            let nt = if ng == 1 {
                1
            } else if ng == 2 {
                2
            } else if ng <= 4 {
                4
            } else {
                8
            };
            let smem = nt * k * 9 / 8;
            if smem <= self.smem_max {
                let lpr = (k / 16).next_power_of_two().min(32);
                let tiles = m.div_ceil(8 * (32 / lpr));
                self.launch(
                    KName::of(format_args!("gemv_q8_{nt}")).as_str(),
                    (tiles.min(self.sm_count * 8) as u32, ng.div_ceil(nt) as u32, g as u32),
                    256,
                    smem as u32,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(k),
                        A::P(x.0.ptr),
                        l(xr.off),
                        l(xr.stride * g),
                        l(xr.stride),
                        A::P(out.0.ptr),
                        l(o.off),
                        l(o.stride * g),
                        l(o.stride),
                        i(ng),
                        i(lpr),
                    ],
                );
                return;
            }
        }
        // (Path::RouterSplit: decode batches' routers too, in chunks of 8 tokens.)
        let split_rows = ng <= GEMV_MAX_TOKENS || (ng <= GRAPH_MAX_TOKENS && m <= 512 && self.path_on(Path::RouterSplit));
        if split_rows && g == 1 && w.dtype == GgmlType::F32 && k % 128 == 0 && xr.off % 4 == 0 && (ng == 1 || xr.stride % 4 == 0) {
            // Few-row f32 matrices (the MoE router): split-K GEMV (kernels/fast.cu), 8 tokens a
            // block row.
            if ng > GEMV_MAX_TOKENS {
                self.took(Path::RouterSplit);
            }
            self.launch(
                "gemv_f32_split",
                (m.div_ceil(2) as u32, ng.div_ceil(8) as u32, 1),
                256,
                0,
                &[A::P(w.mem.ptr), i(m), i(k), A::P(x.0.ptr), l(xr.off), l(xr.stride), A::P(out.0.ptr), l(o.off), l(o.stride), i(ng)],
            );
            return;
        }
        if ng <= GEMV_MAX_TOKENS {
            let nn = if ng == 1 {
                1
            } else if ng <= 4 {
                4
            } else {
                8
            };
            let h16 = if h16_vector_ok(w, k, xr.off, xr.stride) { "h16_" } else { "" };
            self.launch(
                KName::of(format_args!("gemv_{h16}{tn}_{nn}")).as_str(),
                (m.div_ceil(4) as u32, ng.div_ceil(nn) as u32, g as u32),
                128,
                0,
                &[
                    A::P(w.mem.ptr),
                    l(w.row_bytes),
                    l(w.mat_bytes()),
                    i(m),
                    i(k),
                    A::P(x.0.ptr),
                    l(xr.off),
                    l(xr.stride * g),
                    l(xr.stride),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(o.stride * g),
                    l(o.stride),
                    i(ng),
                ],
            );
            return;
        }
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(wh) = w.half_rm().filter(|_| ng > GRAPH_MAX_TOKENS && self.dense_blas.load(Ordering::Relaxed)) {
            // Prompts from the row-major f16 copy on cuBLAS, the activation rows in f16.
            let Some(xh) = self.f16_input(x, xr) else { return };
            let c = out.0.ptr + 4 * o.off as u64;
            self.gemm_h16((wh, k, (m * k) as i64), (xh, k * g, k as i64), (c, o.stride * g, o.stride as i64), (m, ng, k), g as i32);
            return;
        }
        if self.tc && w.dtype == GgmlType::Q8_0 && MMQ_SMEM <= self.smem_max {
            // Int8 tensor cores (kernels/mmq.cu): quantise the activation rows once, then one
            // launch for all `g` matrices.
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, xr.n * ngroups * 144) else { return };
            self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, xr.n, k, 0, xq);
            self.mmq_dense(w, ngroups, xq, (xr.n, ng, g), out, o, SplitSum::Plain);
            return;
        }
        // cuBLAS, column-major view: C[m, ng] (ldc = o.stride*g) = op(A)^T[m, k] * B[k, ng],
        // A = weight rows (k contiguous), B = activation rows.
        let (a_ptr, a_type, b_ptr, b_type, ldb, stride_b) = if w.dtype == GgmlType::F32 {
            (
                w.mem.ptr,
                blas_sys::cudaDataType::CUDA_R_32F,
                x.0.ptr + 4 * xr.off as u64,
                blas_sys::cudaDataType::CUDA_R_32F,
                xr.stride * g,
                xr.stride,
            )
        } else {
            let Some(wb) = self.scratch(S::WBf16, 2 * k * m * g) else { return };
            let Some(xb) = self.scratch(S::XBf16, 2 * k * xr.n) else { return };
            let rows = m * g;
            self.launch(
                KName::of(format_args!("dequant_bf16_{tn}")).as_str(),
                Self::grid1(rows * k.div_ceil(32)),
                256,
                0,
                &[A::P(w.mem.ptr), l(w.row_bytes), l(rows), i(k), A::P(wb)],
            );
            self.launch(
                "rows_to_bf16",
                Self::grid1(xr.n * k),
                256,
                0,
                &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(k), l(xr.n * k), A::P(xb)],
            );
            (wb, blas_sys::cudaDataType::CUDA_R_16BF, xb, blas_sys::cudaDataType::CUDA_R_16BF, k * g, k)
        };
        // cuBLAS runs on whichever context is current on this thread.
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("cuda context: {e:?}"));
            return;
        }
        let c = out.0.ptr + 4 * o.off as u64;
        self.gemm_ex(
            (a_ptr, a_type, k, (m * k) as i64),
            (b_ptr, b_type, ldb, stride_b as i64),
            (c, o.stride * g, o.stride as i64),
            (m, ng, k),
            g as i32,
        );
    }

    /// Quantise `n` rows of `k` values (row j at `src + off + j*stride`, f32) into Q8_0 groups at
    /// `dst` (`ceil(k/128)*144` bytes per row). `act` 1/2: the rows are SiLU/GELU(src) * src2.
    #[allow(clippy::too_many_arguments)]
    fn quant_groups(&self, src: u64, src2: u64, off: usize, stride: usize, n: usize, k: usize, act: i32, dst: u64) {
        self.quant_groups_w(src, src2, off, stride, n, k, act, (0, 0, 1), dst);
    }

    /// [`Self::quant_groups`] with router weights `rw = (sel_w, k, slots per token)`: row r is
    /// multiplied by `sel_w[(r / slots) * k + r % slots]` (1 for slots past k) first.
    #[allow(clippy::too_many_arguments)]
    fn quant_groups_w(
        &self,
        src: u64,
        src2: u64,
        off: usize,
        stride: usize,
        n: usize,
        k: usize,
        act: i32,
        rw: (u64, usize, usize),
        dst: u64,
    ) {
        let ngroups = k.div_ceil(128);
        self.launch(
            "quant_q8_groups",
            ((n * ngroups).div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[A::P(src), A::P(src2), l(off), l(stride), i(n), i(k), A::I(act), A::P(rw.0), i(rw.1), i(rw.2), A::P(dst), l(ngroups * 144)],
        );
    }

    /// One `mmq_q8` launch (see kernels/mmq.cu): `experts` the grouped expert product's lists
    /// ([`MmqGroups`]), `None` for the dense one (`grid.2 / nsplit` matrices of `n` tokens);
    /// `out` = (pointer, offset, row stride); `split` = (nsplit, elements between the splits'
    /// partial outputs); `bn` the tokens per tile (64 or 16; `grid.1` counts such tiles).
    #[allow(clippy::too_many_arguments)]
    fn mmq_launch(
        &self,
        w: &CudaWeight,
        m: usize,
        ngroups: usize,
        xq: u64,
        grid: (u32, u32, u32),
        n: usize,
        experts: Option<MmqGroups>,
        in_div: usize,
        (out, ooff, ostride): (u64, usize, usize),
        (nsplit, split_stride): (usize, usize),
        bn: usize,
    ) {
        let MmqGroups { cnt, off, perm, n_exp: ne, sh, pair, pair_tiled, pairs, tokens } = experts.unwrap_or(MmqGroups::NONE);
        let (sh_ptr, sh_row_bytes, sh_stride, e_sh) = sh.unwrap_or((0, 0, 0, i32::MAX as usize));
        let (w2, sh2, out2) = pair.unwrap_or((0, 0, 0));
        // Grouped 16-token tiles: the weights straight into the fragments (`mmq_q8_rows`), the
        // tile's activation rows whole in shared memory.
        // (Rows padded to a stride of 8 words mod 32: at most 124 bytes more.)
        let rows_smem = 16 * (ngroups * 144 + (4 * ((8 + 32 * 4 - 4 * ngroups % 32) % 32)).max(16));
        let rows = bn == 16
            && rows_smem <= self.smem_max
            && if cnt != 0 { self.moe_rows.load(Ordering::Relaxed) } else { n <= self.mmq_rows_dense.load(Ordering::Relaxed) };
        // Grouped rows with R row sets a warp: 64*R rows a block, so fewer blocks along x.
        let rr = match self.rows_r.load(Ordering::Relaxed) {
            _ if !rows || cnt == 0 => 1,
            0 if pairs >= 5 * ne => 2,
            0 => 1,
            r => r,
        };
        let grid = match rr {
            2.. => ((if w2 != 0 { 2 } else { 1 }) * m.div_ceil(64 * rr) as u32, grid.1, grid.2),
            _ => grid,
        };
        let (name, smem) = match (bn, self.mmq16) {
            _ if rows && cnt != 0 => (if rr == 2 { "mmq_q8_rows_r2" } else { "mmq_q8_rows" }, rows_smem),
            _ if rows => ("mmq_q8_rows_d", rows_smem),
            (16, 1) => ("mmq_q8_16g1", mmq_smem(16, 1, 3)),
            (16, _) => ("mmq_q8_16", mmq_smem(16, 2, 2)),
            _ if self.mmq_ws => ("mmq_q8_64ws", MMQ_SMEM),
            _ if cnt == 0 && self.path_on(Path::DenseEarly) => ("mmq_q8_64e", MMQ_SMEM),
            _ => ("mmq_q8_64", MMQ_SMEM),
        };
        if name == "mmq_q8_64e" {
            self.took(Path::DenseEarly);
        }
        // The rows kernels' `early` (see the argument below): 0, 1, or 1 + the shared chunks'
        // tiles when they go first (rows_sh_first).
        let early = match sh {
            _ if cnt == 0 || !self.rows_early.load(Ordering::Relaxed) || pairs < 2 * ne => 0,
            Some((.., e_sh)) if self.rows_sh_first.load(Ordering::Relaxed) && e_sh < ne && tokens > 0 => {
                1 + (ne - e_sh) * tokens.div_ceil(16)
            }
            _ => 1,
        };
        // Tail halves (two row sets only): logical tiles [tail0, tail1), each as two
        // one-row-set blocks, so the grid has tail1 - tail0 more along y. The first tiles'
        // last `rows_tail` only while the routed experts average at most 8 pairs: then the
        // first tiles are nearly all of the work and their end is the launch's end (with more,
        // later tiles follow and those halves would sit mid-launch: 128 sequences -2.1%); and
        // with `rows_tail_later` every later tile's block, which end the launch past that.
        let (routed, re) = match sh {
            Some((.., e_sh)) if e_sh < ne => (pairs.saturating_sub((ne - e_sh) * tokens), e_sh),
            _ => (pairs, ne),
        };
        let (tail0, tail1) = match (rr, early) {
            (2.., 1..) => {
                let end = if early > 1 { early - 1 + e_sh } else { ne }.min(grid.1 as usize);
                let tail = if w2 != 0 { &self.rows_tail } else { &self.rows_tail_dn };
                let t0 = if routed <= 8 * re { end - tail.load(Ordering::Relaxed).min(end) } else { end };
                (t0, if self.rows_tail_later.load(Ordering::Relaxed) { grid.1 as usize } else { end })
            }
            _ => (0, 0),
        };
        let grid = (grid.0, grid.1 + (tail1 - tail0) as u32, grid.2);
        let args = [
            A::P(w.mem.ptr),
            l(w.row_bytes),
            l(w.mat_bytes()),
            i(m),
            i(ngroups),
            A::P(xq),
            l(ngroups * 144),
            i(n),
            A::P(cnt),
            A::P(off),
            A::P(perm),
            i(ne),
            i(in_div),
            A::P(out),
            l(ooff),
            l(ostride),
            i(nsplit),
            l(split_stride),
            A::P(sh_ptr),
            l(sh_row_bytes),
            l(sh_stride),
            i(e_sh),
            A::P(w2),
            A::P(sh2),
            A::P(out2),
            // mmq_q8_rows only: the 16-row tiled copies (or 0), and whether each block y < n_exp
            // takes expert y's first tile and issues its first weight loads before the PDL wait
            // (see mmq_rows_impl): only where few experts go without tokens (an idle expert's
            // blocks load their first groups for nothing).
            A::P(if cnt != 0 { w.tiled_ptr() } else { 0 }),
            A::P(pair_tiled),
            l(w.tiled_mat_bytes()),
            i(early),
            i(tail0),
            i(tail1),
        ];
        // (The mmq_q8 tiles take the common arguments only.)
        let na = if rows { args.len() } else { 25 };
        // (mmq_q8_64ws: the 4 multiplying warps and a producer warp)
        self.launch(name, grid, if name == "mmq_q8_64ws" { 160 } else { 128 }, smem as u32, &args[..na]);
    }

    /// Prompt-size MoE on the int8 tensor cores: route, group the (token, slot) pairs by expert,
    /// then gate, up (one grouped `mmq_q8` each over the experts' token lists), GLU fused into the
    /// quantisation of the down projection's input, down, and the router-weighted sum. With
    /// `shared` (2-D weights whose `ff_s` is a multiple of the experts' `ff`, checked by the
    /// caller), every token also gets `ff_s / ff` shared slots, experts `E ..` whose matrices are
    /// the shared FFN's blocks of `ff` rows (gate, up) or columns (down), summed unweighted: the
    /// shared FFN rides in the same launches. Scratch: `g`, `u` `pairs * ff` floats, `y` `pairs *
    /// hdim`, pairs = tokens x (k + shared slots).
    #[allow(clippy::too_many_arguments)]
    fn moe_mmq(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: &Experts<'_, CudaWeight>,
        shared: Option<&Experts<'_, CudaWeight>>,
        p: &MoeParams,
        warp_route: bool,
        (sel_e, sel_w, g, u, y): (u64, u64, u64, u64, u64),
        out: &CudaBuf,
        o: Rows,
    ) {
        let n = xr.n;
        let (hdim, ff, ne, k) = (xr.width, experts.gate.ne(1), p.n_experts, p.k);
        // The shared FFN on cuBLAS (its row-major copies exist only with moe_blas), added by
        // the combine; the routed experts then as without a shared FFN.
        let mut add = 0;
        let shared = match shared.map(|s| (s, [s.gate.half_rm(), s.up.half_rm(), s.down.half_rm()])) {
            Some((s, [Some(cg), Some(cu), Some(cd)])) if self.moe_blas.load(Ordering::Relaxed) && n > GRAPH_MAX_TOKENS => {
                let act = match p.glu {
                    Glu::SwiGlu => 1,
                    Glu::GeGluTanh => 2,
                };
                match self.shared_blas(x, xr, (cg, cu, cd, s.gate.ne(1)), act) {
                    Some(ys) => {
                        add = ys;
                        None
                    }
                    None => return,
                }
            }
            other => other.map(|(s, _)| s),
        };
        let nsh = shared.map_or(0, |s| s.gate.ne(1) / ff);
        let ks = k + nsh;
        let pairs = n * ks;
        let ne_all = ne + nsh;
        let (Some(cnt), Some(off), Some(perm)) =
            (self.scratch(S::Cnt, 4 * ne_all), self.scratch(S::Off, 4 * ne_all), self.scratch(S::Perm, 4 * pairs))
        else {
            return;
        };
        // Tokens per tile: 16 when the experts see few tokens each (batched decode; the block's
        // work then shrinks with them), else 64. Upper bound of the tiles over all experts: sum
        // of ceil(cnt/bn) <= pairs/bn + experts.
        let bn = self.moe_tile_tokens(pairs, ne_all);
        let (hg, fg) = (hdim.div_ceil(128), ff.div_ceil(128));
        self.route(logits, lr, p, warp_route, sel_e, sel_w);
        self.launch("moe_group", (1, 1, 1), 1024, 0, &[A::P(sel_e), i(n), i(k), i(nsh), i(ne), A::P(cnt), A::P(off), A::P(perm)]);
        if self.moe_counts {
            self.print_moe_counts(cnt, ne_all);
        }
        let tiles = (pairs.div_ceil(bn) + ne_all) as u32;
        let act = match p.glu {
            Glu::SwiGlu => 1,
            Glu::GeGluTanh => 2,
        };
        // Prompt-size MoEs on Hopper's wgmma fed by TMA (`mmh_*`), from the stacks' row-major
        // f16 copies, the shared FFN (if any) already on cuBLAS.
        let mode = self.mmh_mode.load(Ordering::Relaxed);
        if bn == 64 && nsh == 0 && self.mmh && mode != 0 && hdim % 256 == 0 && ff % 128 == 0 {
            let [g8, u8_, d8] = [experts.gate, experts.up, experts.down];
            let w = match [g8.half_rm(), u8_.half_rm(), d8.half_rm()] {
                [Some(wg), Some(wu), Some(wd)] if mode != 2 => Some(MmhWeights::F16(wg, wu, wd)),
                _ if mode >= 2 && [g8, u8_, d8].iter().all(|w| w.dtype == GgmlType::Q8_0) => {
                    Some(MmhWeights::Q8([g8, u8_, d8].map(|w| (w.mem.ptr, w.row_bytes))))
                }
                _ => None,
            };
            if let Some(w) = w {
                if self.moe_mmh(x, xr, add != 0, w, (ne, k, ff), (cnt, off, perm), act, y) {
                    self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, add);
                }
                return;
            }
        }
        // Prompt-size MoEs on the f16 tensor cores: from the f16 copies, or (`mmf_q8`; by
        // default where the copies are absent) straight from the Q8_0 weights, turned into f16
        // in registers (`mmfq8_*`).
        let q8w = |w: &CudaWeight| w.dtype == GgmlType::Q8_0;
        let halves = [experts.gate, experts.up, experts.down].into_iter().all(|w| w.half().is_some())
            && shared.is_none_or(|s| [s.gate, s.up, s.down].into_iter().all(|w| w.half().is_some()));
        let q8 = match self.mmf_q8.load(Ordering::Relaxed) {
            0 => false,
            1 => true,
            _ => !halves,
        } && self.mmfq8.is_some()
            && hdim % 128 == 0
            && ff % 128 == 0
            && [experts.gate, experts.up, experts.down].into_iter().all(q8w)
            && shared.is_none_or(|s| [s.gate, s.up, s.down].into_iter().all(q8w));
        if bn == 64 && self.moe_f16 && (q8 || self.mmf.is_some()) {
            let h = |w: &CudaWeight| if q8 { Some((w.mem.ptr, w.row_bytes, w.mat_bytes())) } else { w.half() };
            if let ([Some(hg), Some(hu), Some(hd)], Some(sh)) = (
                [h(experts.gate), h(experts.up), h(experts.down)],
                match shared {
                    None => Some(None),
                    Some(s) => match [h(s.gate), h(s.up), h(s.down)] {
                        [Some(a), Some(b), Some(c)] => Some(Some([a, b, c])),
                        _ => None,
                    },
                },
            ) {
                let (Some(xh), Some(hh)) = (self.scratch(S::Xh, 2 * n * hdim), self.scratch(S::Hh, 2 * pairs * ff)) else { return };
                // The shared chunks as in the int8 path: gate/up chunk c is rows c*ff.. of the
                // shared matrix (f16 copy: ff/64 tiles, 2*ff*hdim bytes on; Q8_0: ff rows on),
                // down chunk c columns c*ff.. of each of its rows (f16 copy: ff/64 stages of 8 KB
                // on; Q8_0: ff/128 groups of 144 bytes on).
                let chunk = |i: usize, rb: usize| match (q8, i < 2) {
                    (false, true) => 2 * ff * hdim,
                    (false, false) => 128 * ff,
                    (true, true) => ff * rb,
                    (true, false) => ff / 128 * 144,
                };
                let grp = |i: usize| (cnt, off, perm, ne_all, sh.map(|s| (s[i].0, s[i].1, chunk(i, s[i].1), ne)));
                // (shared_blas, when it ran, left these very rows in xh: same slot, same size)
                if add == 0 {
                    self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
                }
                if self.mmf_gu.load(Ordering::Relaxed) && (hg.1, hg.2) == (hu.1, hu.2) {
                    // Gate, up and the GLU in one launch (f16 GLU rows into hh).
                    let glu = Some((hu.0, sh.map_or(0, |s| s[1].0), act));
                    self.mmf_launch(hg, ff, hdim, xh, tiles, grp(0), ks, (hh, 0, ff), glu, q8);
                } else {
                    self.mmf_launch(hg, ff, hdim, xh, tiles, grp(0), ks, (g, 0, ff), None, q8);
                    self.mmf_launch(hu, ff, hdim, xh, tiles, grp(1), ks, (u, 0, ff), None, q8);
                    self.f16_rows(g, u, (0, ff), pairs, ff, act, hh);
                }
                self.mmf_launch(hd, hdim, ff, hh, tiles, grp(2), 1, (y, 0, hdim), None, q8);
                self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, add);
                return;
            }
        }
        // x's groups as the norm's launch before wrote them (Path::NormQ8), else quantised here.
        let ahead = self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()).take();
        let xq = match ahead.filter(|a| a.rows == (x.0.ptr, xr.off, xr.stride, n, hdim)) {
            Some(a) => a.xq,
            None => {
                let Some(xq) = self.scratch(S::Xq, n * hg * 144) else { return };
                self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, n, hdim, 0, xq);
                xq
            }
        };
        let Some(hq) = self.scratch(S::Hq, pairs * fg * 144) else { return };
        // The shared chunks: gate/up chunk c is rows c*ff.. of the shared matrix; down chunk c
        // is groups c*ff/128.. of each of its rows.
        let groups = |sh: Option<(&CudaWeight, usize)>| {
            let sh = sh.map(|(s, stride)| (s.mem.ptr, s.row_bytes, stride, ne));
            Some(MmqGroups { cnt, off, perm, n_exp: ne_all, sh, pair: None, pair_tiled: 0, pairs, tokens: n })
        };
        let sg = shared.map(|s| (s.gate, ff * s.gate.row_bytes));
        let su = shared.map(|s| (s.up, ff * s.up.row_bytes));
        let sd = shared.map(|s| (s.down, ff / 128 * 144));
        let (gate, up) = (experts.gate, experts.up);
        let gx = ff.div_ceil(64) as u32;
        // Gate and up in one launch where their layouts agree, for decode-size batches (16-token
        // tiles; TS_CUDA_MOE_GU=0: two). Measured on the H200: 64 sequences 6,069 vs 6,009 tok/s;
        // prompts (64-token tiles) lost 2% (pp512 15,014 vs 15,347), so they keep two launches.
        if self.moe_gu && bn == 16 && (gate.row_bytes, gate.mat_bytes()) == (up.row_bytes, up.mat_bytes()) {
            let gr = groups(sg).map(|mut m| {
                m.pair = Some((up.mem.ptr, su.map_or(0, |(s, _)| s.mem.ptr), u));
                m.pair_tiled = up.tiled_ptr();
                m
            });
            self.mmq_launch(gate, ff, hg, xq, (2 * gx, tiles, 1), 0, gr, ks, (g, 0, ff), (1, 0), bn);
            self.quant_groups(g, u, 0, ff, pairs, ff, act, hq);
        } else {
            self.mmq_launch(gate, ff, hg, xq, (gx, tiles, 1), 0, groups(sg), ks, (g, 0, ff), (1, 0), bn);
            self.mmq_launch(up, ff, hg, xq, (gx, tiles, 1), 0, groups(su), ks, (u, 0, ff), (1, 0), bn);
            self.quant_groups(g, u, 0, ff, pairs, ff, act, hq);
        }
        self.mmq_launch(experts.down, hdim, fg, hq, (hdim.div_ceil(64) as u32, tiles, 1), 0, groups(sd), 1, (y, 0, hdim), (1, 0), bn);
        self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, add);
    }

    /// `TS_CUDA_MOE_COUNTS=1` (a measurement mode: it waits for the device): one line on stderr
    /// per grouped MoE, how its pairs spread over the experts.
    fn print_moe_counts(&self, cnt: u64, ne: usize) {
        let mut c = vec![0i32; ne];
        let ok = self.stream.synchronize().is_ok() && unsafe { drv::memcpy_dtoh_sync(&mut c[..], cnt) }.is_ok();
        if !ok {
            return;
        }
        let mut s: Vec<i32> = c.iter().copied().filter(|&v| v > 0).collect();
        s.sort_unstable_by(|a, b| b.cmp(a));
        let total: i32 = s.iter().sum();
        let tiles: i32 = s.iter().map(|v| (v + 127) / 128).sum();
        eprintln!("moe counts: {total} pairs over {} of {ne} experts, 128-pair tiles {tiles}, largest {:?}", s.len(), &s[..s.len().min(8)]);
    }

    /// The routed experts of a prompt-size MoE on `mmh_*` (kernels/mmh.cu), after the routing
    /// and grouping (`cnt`, `off`, `perm` over the `ne` experts, `k` slots a token, no shared
    /// slots): x's rows in f16 (already in the `Xh` scratch when `have_xh`: shared_blas made
    /// them), gathered into expert order (`moe_gather_h`), gate, up and the GLU in one launch
    /// (`mmh_gu`, f16 GLU rows in expert order), down (`mmh_dn`, f32 rows of `y` by pair).
    /// `w`: the stacks (gate, up, down) as row-major f16 copies or as Q8_0. False after a
    /// failure (reported).
    #[allow(clippy::too_many_arguments)]
    fn moe_mmh(
        &self,
        x: &CudaBuf,
        xr: Rows,
        have_xh: bool,
        w: MmhWeights,
        (ne, k, ff): (usize, usize, usize),
        (cnt, off, perm): (u64, u64, u64),
        act: i32,
        y: u64,
    ) -> bool {
        let (n, hdim) = (xr.n, xr.width);
        let pairs = n * k;
        let (Some(xh), Some(xs), Some(hs)) =
            (self.scratch(S::Xh, 2 * n * hdim), self.scratch(S::Xs, 2 * pairs * hdim), self.scratch(S::Hh, 2 * pairs * ff))
        else {
            return false;
        };
        if !have_xh {
            self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
        }
        let gather = [A::P(xh), A::P(perm), A::P(cnt), A::P(off), i(ne), i(k), i(hdim / 8), A::P(xs)];
        self.launch("moe_gather_h", Self::grid1(pairs * hdim / 8), 256, 0, &gather);
        let (Some(tx), Some(th)) = (self.tma_f16(xs, hdim, pairs, MMH_BM as u32), self.tma_f16(hs, ff, pairs, MMH_BM as u32)) else {
            return false;
        };
        let tiles = (pairs.div_ceil(MMH_BM) + ne) as u32;
        let (gx, dx) = (((ff / 128) as u32, tiles, 1), ((hdim / 256) as u32, tiles, 1));
        // (each kernel's maps come first, then these)
        let (a_cnt, a_off, a_perm, a_ne) = (A::P(cnt), A::P(off), A::P(perm), i(ne));
        let (a_ff, a_hdim, a_hs, a_act, a_y) = (i(ff), i(hdim), A::P(hs), A::I(act), A::P(y));
        match w {
            MmhWeights::F16(wg, wu, wd) => {
                let (Some(tg), Some(tu), Some(td)) =
                    (self.tma_f16(wg, hdim, ne * ff, 128), self.tma_f16(wu, hdim, ne * ff, 128), self.tma_f16(wd, ff, ne * hdim, 256))
                else {
                    return false;
                };
                let smem = MMH_SMEM as u32;
                self.launch("mmh_gu", gx, 384, smem, &[A::T(&tx), A::T(&tg), A::T(&tu), a_cnt, a_off, a_ne, a_ff, a_hdim, a_hs, a_act]);
                self.launch("mmh_dn", dx, 384, smem, &[A::T(&th), A::T(&td), a_cnt, a_off, a_perm, a_ne, a_hdim, a_ff, a_y]);
            }
            MmhWeights::Q8([(wg, rg), (wu, ru), (wd, rd)]) => {
                // The quants (64-byte boxes) and the group headers (16-byte boxes) of each stack.
                let maps = |p: u64, rb: usize, rows: usize, br: u32| (self.tma_u8(p, rb, rows, 64, br), self.tma_u8(p, rb, rows, 16, br));
                let ((Some(gq), Some(gs)), (Some(uq), Some(us)), (Some(dq), Some(ds))) =
                    (maps(wg, rg, ne * ff, 128), maps(wu, ru, ne * ff, 128), maps(wd, rd, ne * hdim, 256))
                else {
                    return false;
                };
                let smem = MMH8_SMEM as u32;
                let gu = [A::T(&tx), A::T(&gq), A::T(&gs), A::T(&uq), A::T(&us), a_cnt, a_off, a_ne, a_ff, a_hdim, a_hs, a_act];
                self.launch("mmh8_gu", gx, 384, smem, &gu);
                self.launch("mmh8_dn", dx, 384, smem, &[A::T(&th), A::T(&dq), A::T(&ds), a_cnt, a_off, a_perm, a_ne, a_hdim, a_ff, a_y]);
            }
        }
        self.mmh_runs.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// A TMA descriptor (`TmaMap`, kernels/mmh.cu) of `rows` row-major rows of `cols` f16 values
    /// at `ptr`, read in boxes of 64 values (128 bytes, with the 128-byte swizzle) by
    /// `box_rows` rows; rows past the end read as zeros. None after a failure (reported).
    fn tma_f16(&self, ptr: u64, cols: usize, rows: usize, box_rows: u32) -> Option<drv_sys::CUtensorMap> {
        self.tma_2d(ptr, (cols, 2, rows), (64, box_rows), true)
    }

    /// A 2-D TMA descriptor: `rows` rows of `cols` elements of `size` bytes (2: f16, 1: bytes)
    /// at `ptr`, boxes of `box_x` elements by `box_rows` rows, with the 128-byte swizzle or none.
    fn tma_2d(
        &self,
        ptr: u64,
        (cols, size, rows): (usize, usize, usize),
        (box_x, box_rows): (u32, u32),
        swizzle: bool,
    ) -> Option<drv_sys::CUtensorMap> {
        use drv_sys::{
            CUtensorMapDataType_enum as Ty, CUtensorMapFloatOOBfill_enum as Oob, CUtensorMapInterleave_enum as Il,
            CUtensorMapL2promotion_enum as L2, CUtensorMapSwizzle_enum as Sw,
        };
        let mut map = drv_sys::CUtensorMap { opaque: [0; 16] };
        let (dims, strides, boxd, es) = ([cols as u64, rows as u64], [(size * cols) as u64], [box_x, box_rows], [1u32, 1]);
        let ty = if size == 2 { Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 } else { Ty::CU_TENSOR_MAP_DATA_TYPE_UINT8 };
        let sw = if swizzle { Sw::CU_TENSOR_MAP_SWIZZLE_128B } else { Sw::CU_TENSOR_MAP_SWIZZLE_NONE };
        let r = unsafe {
            drv_sys::cuTensorMapEncodeTiled(
                &mut map,
                ty,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxd.as_ptr(),
                es.as_ptr(),
                Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sw,
                L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result();
        match r {
            Ok(()) => Some(map),
            Err(e) => {
                self.fail(format!("cuTensorMapEncodeTiled ({rows} rows of {cols} x {size} bytes, boxes of {box_x} x {box_rows}): {e:?}"));
                None
            }
        }
    }

    /// A TMA descriptor of `rows` rows of `row_bytes` bytes at `ptr`, read in boxes of `box_x`
    /// bytes by `box_rows` rows, unswizzled (the Q8_0 rows of `mmh8_*`). None after a failure
    /// (reported).
    fn tma_u8(&self, ptr: u64, row_bytes: usize, rows: usize, box_x: u32, box_rows: u32) -> Option<drv_sys::CUtensorMap> {
        self.tma_2d(ptr, (row_bytes, 1, rows), (box_x, box_rows), false)
    }

    /// The shared FFN of a prompt-size MoE on cuBLAS, from the row-major f16 copies `(gate, up,
    /// down, sf)` of its `sf` rows: x to f16, gate and up (one batched call where up's copy lies
    /// after gate's), the GLU (`f16_rows`), down; returns its f32 output rows (n x hdim, for
    /// `moe_combine` to add), None after a failure. No copy, no count from the device: the
    /// shapes are known on the host, so this needs no synchronisation. Why: on the H200 one
    /// 512 x 2048 x 5632 GEMM runs at ~700 TFLOP/s where the grouped 64-token tiles reach ~130
    /// (bound by their weight traffic from L2); busy routed experts on cuBLAS were measured too
    /// (gpu-next46/47: their counts must come to the host, and with one sync a layer the eager
    /// prompt's launches fall behind the GPU: pp512 21,529 against 21,652, dropped).
    fn shared_blas(&self, x: &CudaBuf, xr: Rows, (cg, cu, cd, sf): (u64, u64, u64, usize), act: i32) -> Option<u64> {
        let (n, hdim) = (xr.n, xr.width);
        let (Some(xh), Some(gu), Some(hs), Some(ys)) = (
            self.scratch(S::Xh, 2 * n * hdim),
            self.scratch(S::Gu, 8 * n * sf),
            self.scratch(S::Hs, 2 * n * sf),
            self.scratch(S::Ys, 4 * n * hdim),
        ) else {
            return None;
        };
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("cuda context: {e:?}"));
            return None;
        }
        self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
        let up_rows = 4 * (n * sf) as u64;
        if cu > cg {
            self.gemm_h16((cg, hdim, ((cu - cg) / 2) as i64), (xh, hdim, 0), (gu, sf, (n * sf) as i64), (sf, n, hdim), 2);
        } else {
            self.gemm_h16((cg, hdim, 0), (xh, hdim, 0), (gu, sf, 0), (sf, n, hdim), 1);
            self.gemm_h16((cu, hdim, 0), (xh, hdim, 0), (gu + up_rows, sf, 0), (sf, n, hdim), 1);
        }
        self.f16_rows(gu, gu + up_rows, (0, sf), n, sf, act, hs);
        self.gemm_h16((cd, sf, 0), (hs, sf, 0), (ys, hdim, 0), (hdim, n, sf), 1);
        Some(ys)
    }

    /// The activation rows `xr` of `x` in f16 (`f16_rows`, packed rows, the `XBf16` scratch) for
    /// the dense products on cuBLAS, with the context current on this thread; None after a
    /// failure (reported). The caller holds `scratch_op`.
    fn f16_input(&self, x: &CudaBuf, xr: Rows) -> Option<u64> {
        let xh = self.scratch(S::XBf16, 2 * xr.width * xr.n)?;
        self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), xr.n, xr.width, 0, xh);
        if let Err(e) = self.ctx.bind_to_thread() {
            self.fail(format!("cuda context: {e:?}"));
            return None;
        }
        Some(xh)
    }

    /// [`CudaBackend::gemm_ex`] with f16 weights and activations (activation rows `ldx` halves
    /// apart, product b's from `x` + b * `stride_x` halves).
    fn gemm_h16(
        &self,
        (w, lda, stride_w): (u64, usize, i64),
        (x, ldx, stride_x): (u64, usize, i64),
        c: (u64, usize, i64),
        mnk: (usize, usize, usize),
        batch: i32,
    ) {
        let h = blas_sys::cudaDataType::CUDA_R_16F;
        self.gemm_ex((w, h, lda, stride_w), (x, h, ldx, stride_x), c, mnk, batch);
    }

    /// cuBLAS with f32 out and f32 accumulation, `batch` products (column-major view: C_b[m, n]
    /// = W_b^T[m, k] X_b[k, n]): C_b[j][r] = sum_i W_b[r][i] X_b[j][i] for r < m, j < n, i < k,
    /// with W_b at `w` + b * `stride_w` elements (rows of `lda` elements of `wt`), X_b likewise
    /// (rows of `ldx`), C_b at `c` + b * `stride_c` floats (rows of `ldc`). The context must be
    /// current on this thread.
    #[allow(clippy::type_complexity)]
    fn gemm_ex(
        &self,
        (w, wt, lda, stride_w): (u64, blas_sys::cudaDataType, usize, i64),
        (x, xt, ldx, stride_x): (u64, blas_sys::cudaDataType, usize, i64),
        (c, ldc, stride_c): (u64, usize, i64),
        (m, n, k): (usize, usize, usize),
        batch: i32,
    ) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let blas = self.blas.lock().unwrap_or_else(|e| e.into_inner());
        let r = unsafe {
            blas_result::gemm_strided_batched_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                wt,
                lda as i32,
                stride_w,
                x as *const _,
                xt,
                ldx as i32,
                stride_x,
                &beta as *const f32 as *const _,
                c as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                stride_c,
                batch,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if let Err(e) = r {
            self.fail(format!("cublasGemmStridedBatchedEx ({m}x{k} by {n} rows, batch {batch}): {e:?}"));
        }
    }

    /// `n` rows of `k` values (`k % 8 == 0`) from `src` at (offset, row stride) to f16 rows at
    /// `dst`; with `act` (1 SiLU, 2 GELU-tanh) `act(src) * src2` (`f16_rows`).
    #[allow(clippy::too_many_arguments)]
    fn f16_rows(&self, src: u64, src2: u64, (off, stride): (usize, usize), n: usize, k: usize, act: i32, dst: u64) {
        let total = n * k / 8;
        self.launch(
            "f16_rows",
            (total.div_ceil(256).min(65_536) as u32, 1, 1),
            256,
            0,
            &[A::P(src), A::P(src2), l(off), l(stride), i(n), i(k), A::I(act), A::P(dst)],
        );
    }

    /// One grouped f16 product (`mmf16_*`, kernels/mmq.cu; the tile from [`CudaBackend::mmf`]):
    /// the experts' f16 copies `(pointer, row bytes, matrix bytes)` of `m` rows of `k` values
    /// times the f16 rows `xh` gathered by the expert lists `(cnt, off, perm, experts, shared
    /// chunks (pointer, row bytes, chunk stride, first chunk's expert index))` over `tiles` token
    /// tiles, pair p reading row p / in_div and writing row p of `out` = (pointer, offset, row
    /// stride). With `glu` = (the up copy, its shared FFN's, the activation): gate and up in one
    /// launch (`mmf16_gu`, `w` the gate), writing f16 GLU rows to `out`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn mmf_launch(
        &self,
        (w, row_bytes, mat_bytes): (u64, usize, usize),
        m: usize,
        k: usize,
        xh: u64,
        tiles: u32,
        (cnt, off, perm, ne, sh): (u64, u64, u64, usize, Option<(u64, usize, usize, usize)>),
        in_div: usize,
        (out, ooff, ostride): (u64, usize, usize),
        glu: Option<(u64, u64, i32)>,
        q8: bool,
    ) {
        let (sp, srb, sst, e_sh) = sh.unwrap_or((0, 0, 0, i32::MAX as usize));
        // mmf16_gu* / mmfq8_gu: the plain tile, 128 ff rows each of gate and up a block. The
        // mmfq8 kernels take every argument; the plain mmf16 ones the first 20.
        let ((plain, gu, smem), threads) = match (q8, self.mmf, self.mmfq8) {
            (true, _, Some(t)) => (t, 256),
            (false, Some(t), _) => (t, 256),
            _ => return,
        };
        let (name, rows) = if glu.is_some() { (gu, 128) } else { (plain, 256) };
        let (w2, ws2, act) = glu.unwrap_or((0, 0, 0));
        let args = [
            A::P(w),
            l(row_bytes),
            l(mat_bytes),
            i(m),
            i(k),
            A::P(xh),
            l(2 * k),
            i(0),
            A::P(cnt),
            A::P(off),
            A::P(perm),
            i(ne),
            i(in_div),
            A::P(out),
            l(ooff),
            l(ostride),
            A::P(sp),
            l(srb),
            l(sst),
            i(e_sh),
            A::P(w2),
            A::P(ws2),
            A::I(act),
        ];
        self.launch(name, (m.div_ceil(rows) as u32, tiles, 1), threads, smem as u32, if glu.is_some() || q8 { &args } else { &args[..20] });
    }

    /// out rows = the router-weighted sum of each token's `k` routed rows of `y` (slots with
    /// `sel_e < 0` left out) plus its `ks - k` shared rows unweighted (`moe_combine`; a
    /// four-columns-a-thread variant measured +0.3% on prompts and ±0 at 64 sequences, dropped).
    #[allow(clippy::too_many_arguments)]
    /// `add` (0: none): `n` rows of `hdim` f32 added too (the shared FFN's, [`CudaBackend::shared_blas`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_combine(
        &self,
        y: u64,
        (k, ks): (usize, usize),
        hdim: usize,
        n: usize,
        (sel_e, sel_w): (u64, u64),
        out: &CudaBuf,
        o: Rows,
        add: u64,
    ) {
        self.launch(
            "moe_combine",
            Self::grid1(n * hdim),
            256,
            0,
            &[A::P(y), i(k), i(ks), l(hdim), l(n), A::P(sel_e), A::P(sel_w), A::P(out.0.ptr), l(o.off), l(o.stride), A::P(add)],
        );
    }

    /// [`Backend::moe_shared`] for f16/bf16 experts (checked by the caller), after the routing:
    /// the gate/up products of every slot with the GLU and the router weight (`moe_gateup_sh_<t>`), then
    /// the down products summed over the slots (`moe_down_sh_<t>`). Activations stay f32.
    #[allow(clippy::too_many_arguments)]
    fn moe_shared_h16(
        &self,
        x: &CudaBuf,
        xr: Rows,
        p: &MoeParams,
        experts: &Experts<'_, CudaWeight>,
        shared: &Experts<'_, CudaWeight>,
        (n, ks, nsh): (usize, usize, usize),
        (sel_e, sel_w, g): (u64, u64, u64),
        out: &CudaBuf,
        o: Rows,
    ) {
        let (hdim, ff, k) = (xr.width, experts.gate.ne(1), p.k);
        let tn = if experts.gate.dtype == GgmlType::F16 { "f16" } else { "bf16" };
        let act = match p.glu {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        self.launch(
            KName::of(format_args!("moe_gateup_sh_{tn}")).as_str(),
            (ff.div_ceil(8) as u32, (n * ks) as u32, 1),
            256,
            0,
            &moe_gateup_args::<6, 18>(
                experts,
                shared,
                (ff, hdim, k, nsh),
                (sel_e, sel_w),
                [A::P(x.0.ptr), l(xr.off), l(xr.stride), A::I(act), A::P(g), l(ff)],
            ),
        );
        // Staging the activations in shared memory with every weight piece of a lane in flight
        // (moe_down_sh_<t>_s) measured slower on the H200: bf16 tg128 492.4 against 515.5
        // (docs/PERF.md, session 26); dropped.
        let (name, rows) = if self.down_w4.1 {
            (KName::of(format_args!("moe_down_sh_{tn}_w4")), 2)
        } else {
            (KName::of(format_args!("moe_down_sh_{tn}")), 8)
        };
        self.launch(
            name.as_str(),
            (hdim.div_ceil(rows) as u32, n as u32, 1),
            256,
            0,
            &moe_down_args(experts.down, shared.down, (hdim, ff, k, nsh), sel_e, (g, ff), out, o),
        );
    }

    /// The router: expert ids and weights of every (token, slot) pair into `sel_e`/`sel_w`:
    /// `moe_route_warp` (a warp per token; plain top-k) or `moe_route` (a thread per token; expert
    /// groups too). Both take the same leading arguments; the group counts only go to the latter.
    fn route(&self, logits: &CudaBuf, lr: Rows, p: &MoeParams, warp_route: bool, sel_e: u64, sel_w: u64) {
        let n = lr.n;
        let mut args = [A::I(0); 13];
        args[..9].copy_from_slice(&Self::route_lead(logits, lr, p));
        if warp_route {
            args[9..11].copy_from_slice(&[A::P(sel_e), A::P(sel_w)]);
            self.launch("moe_route_warp", (n.div_ceil(4) as u32, 1, 1), 128, 0, &args[..11]);
        } else {
            args[9..13].copy_from_slice(&[i(p.n_group), i(p.topk_group), A::P(sel_e), A::P(sel_w)]);
            self.launch("moe_route", (n.div_ceil(128) as u32, 1, 1), 128, 0, &args);
        }
    }

    /// The routing kernels' leading arguments (`moe_route*`, `route_warp_body`): the logits rows,
    /// tokens, experts, k, gating (1 = sigmoid), whether the top k are renormalised, the scale.
    fn route_lead(logits: &CudaBuf, lr: Rows, p: &MoeParams) -> [A; 9] {
        let gating = A::I(matches!(p.gating, Gating::Sigmoid) as i32);
        [A::P(logits.0.ptr), l(lr.off), l(lr.stride), i(lr.n), i(p.n_experts), i(p.k), gating, A::I(p.norm_topk as i32), A::F(p.scale)]
    }

    /// Host-side check that every token's cache rows `[slot*slot_len, slot*slot_len + pos]` lie in
    /// a cache of `rows` rows.
    fn check_cache_rows(&self, batch: &CudaBatch, rows: usize, what: &str) -> bool {
        let sl = batch.slot_len as usize;
        for tm in &batch.tokens {
            if tm.pos as usize >= sl || (tm.slot as usize * sl + tm.pos as usize) >= rows {
                self.fail(format!("{what}: position {} of slot {} is outside the cache ({rows} rows, {sl} per slot)", tm.pos, tm.slot));
                return false;
            }
        }
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn attention_launch(
        &self,
        q: (&CudaBuf, usize, usize, usize),
        k: (u64, usize, usize),
        v: (u64, usize, usize),
        out: (&CudaBuf, usize, usize, usize),
        batch: &CudaBatch,
        nh: usize,
        group: usize,
        hd: usize,
        vd: usize,
        scale: f32,
        window: u32,
        softcap: f32,
    ) {
        let vpl = if vd <= 128 {
            4
        } else if vd <= 256 {
            8
        } else if vd <= 512 {
            16
        } else {
            self.fail(format!("attention: value width {vd} > 512 is not supported"));
            return;
        };
        let smem = ((hd + 4 * vd + 8) * 4) as u32;
        if smem > 48 * 1024 {
            self.fail(format!("attention: head width {hd} needs {smem} bytes of shared memory"));
            return;
        }
        let n = batch.tokens.len();
        self.launch(
            KName::of(format_args!("attention_{vpl}")).as_str(),
            ((n * nh) as u32, 1, 1),
            128,
            smem,
            &[
                A::P(q.0 .0.ptr),
                l(q.1),
                l(q.2),
                l(q.3),
                A::P(k.0),
                l(k.1),
                l(k.2),
                A::P(v.0),
                l(v.1),
                l(v.2),
                A::P(out.0 .0.ptr),
                l(out.1),
                l(out.2),
                l(out.3),
                A::P(batch.pos_ptr()),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
                i(nh),
                i(group),
                i(hd),
                i(vd),
                A::F(scale),
                A::I(window as i32),
                A::F(softcap),
            ],
        );
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Cache = CudaCache;
    type Weight = CudaWeight;
    type Batch = CudaBatch;
    type Rope = CudaRope;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("buffer of {len} floats overflows") })?;
        Ok(CudaBuf(Arc::new(self.alloc_mem(bytes, &format!("buffer of {len} floats"))?)))
    }

    fn alloc_cache(&self, rows: usize, width: usize) -> Result<CudaCache> {
        let bytes = rows
            .checked_mul(width)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("cache of {rows} x {width} overflows") })?;
        Ok(CudaCache { mem: self.alloc_mem(bytes, &format!("KV cache of {rows} rows x {width}"))?, rows, width, half: false })
    }

    fn cache_value_bytes(&self, cache: &CudaCache) -> usize {
        if cache.half {
            2
        } else {
            4
        }
    }

    fn alloc_latent_cache(&self, rows: usize, width: usize, kv_lora: usize, heads: usize) -> Result<CudaCache> {
        // f16 where every MLA kernel that can meet this cache has an f16 twin: V2's shapes
        // (576 = 512 + 64) on the tensor cores (mla_prefill_h, mla_split_tc_h; the 16-head SIMT
        // split mla_split_18_16_h), written by norm_rope_cache_h / mla_rope_absorb_1_h /
        // cache_write_h.
        let half = self.mla_f16
            && self.tc
            && (width, kv_lora) == (576, 512)
            && heads > 0
            && heads % 16 == 0
            && ms_smem_h(self.ms_nb).max(MP_SMEM) <= self.smem_max;
        if !half {
            return self.alloc_cache(rows, width);
        }
        let bytes = rows
            .checked_mul(width)
            .and_then(|v| v.checked_mul(2))
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("cache of {rows} x {width} overflows") })?;
        Ok(CudaCache { mem: self.alloc_mem(bytes, &format!("MLA cache of {rows} rows x {width} (f16)"))?, rows, width, half: true })
    }

    fn load_remaining(&self, src_bytes: u64) {
        self.load_left.store(src_bytes, Ordering::Relaxed);
    }

    fn upload_weight(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<CudaWeight> {
        let err = |what: String| BackendError::Weight { name: t.name.to_string(), what };
        if !t.dtype.is_supported_weight() || tname(t.dtype).is_none() {
            return Err(err(format!("type {} is not supported", t.dtype.name())));
        }
        let ne0 = t.shape.first().copied().unwrap_or(1);
        let file_row = t.dtype.row_bytes(ne0).ok_or_else(|| err(format!("row of {ne0} is not whole {} blocks", t.dtype.name())))?;
        let rows: usize = t.shape.iter().skip(1).product();
        if file_row.checked_mul(rows) != Some(t.data.len()) {
            return Err(err(format!("{} bytes of data for shape {:?} of {}", t.data.len(), t.shape, t.dtype.name())));
        }
        if usage == WeightUse::Vector {
            let mut v = vec![0f32; t.numel()];
            quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| err(e.to_string()))?;
            let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
            let mem = self.alloc_mem(bytes.len(), &format!("tensor '{}'", t.name))?;
            self.upload_bytes(&mem, 0, &bytes)?;
            return Ok(CudaWeight {
                dtype: GgmlType::F32,
                shape: t.shape.to_vec(),
                mem,
                row_bytes: ne0 * 4,
                tiled: None,
                half: None,
                half_rm: false,
            });
        }
        let data = repack(t.dtype, t.data, ne0);
        let row_bytes = dev_row_bytes(t.dtype, ne0);
        let mem = self.alloc_mem(data.len(), &format!("tensor '{}'", t.name))?;
        self.upload_bytes(&mem, 0, &data)?;
        let stack = t.dtype == GgmlType::Q8_0 && t.shape.len() == 3 && t.shape[2] > 1;
        let tile = stack
            && match self.moe_tiled.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(tile16_mat_bytes(row_bytes, t.shape[1]) * t.shape[2]),
            };
        let tiled = if tile {
            let (rows, rows16, mats) = (t.shape[1], t.shape[1].next_multiple_of(16), t.shape[2]);
            // Out of memory for the copy: an error only when asked for (TS_CUDA_MOE_TILED=1);
            // by default the stack stays row-major (the same bits, only slower).
            match self.alloc_mem(mats * tile16_mat_bytes(row_bytes, rows), &format!("tensor '{}' (16-row tiles)", t.name)) {
                Ok(tl) => {
                    let ng = row_bytes / 144;
                    let total = mats * rows16 / 16 * ng * (TILE_GROUP / 16);
                    let blocks = total.div_ceil(256).min(65_536) as u32;
                    self.launch("tile16_q8", (blocks, 1, 1), 256, 0, &[A::P(mem.ptr), A::P(tl.ptr), l(rows), l(rows16), l(ng), l(total)]);
                    Some(tl)
                }
                Err(BackendError::OutOfMemory { .. }) if self.moe_tiled.load(Ordering::Relaxed) == 2 => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        // The f16 copy for prompt MoEs: Q8_0 expert matrices (and shared FFNs) of whole groups.
        let half_bytes = 2 * ne0 * rows;
        let half = usage == WeightUse::Expert
            && self.tc
            && self.mmf.is_some()
            && t.dtype == GgmlType::Q8_0
            && t.shape.len() >= 2
            && ne0 % 128 == 0
            && t.shape[1] % 64 == 0
            && match self.f16_copy.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(half_bytes),
            };
        // Dense matrices for cuBLAS (dense_blas): a row-major copy.
        let dense = usage == WeightUse::Matmul
            && self.tc
            && self.dense_blas.load(Ordering::Relaxed)
            && t.dtype == GgmlType::Q8_0
            && t.shape.len() >= 2
            && ne0 % 128 == 0
            && match self.f16_copy.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(half_bytes),
            };
        let half = half || dense;
        // With the shared FFN on cuBLAS (moe_blas): a row-major copy of the shared FFN's matrices
        // (2-D); the routed experts' stacks get one only for mmh_* (otherwise they run from
        // Q8_0 on mmfq8, which needs no copy).
        let half_rm = dense || (self.moe_blas.load(Ordering::Relaxed) && (self.mmfq8.is_some() || self.mmh_copies()));
        let unused_stack = !dense && half_rm && t.shape.len() > 2 && !self.mmh_copies();
        let half = if half && !unused_stack {
            match self.alloc_mem(half_bytes, &format!("tensor '{}' (f16 copy)", t.name)) {
                Ok(h) => {
                    let total = half_bytes / 16;
                    let blocks = total.div_ceil(256).min(65_536) as u32;
                    let args = [A::P(mem.ptr), A::P(h.ptr), l(total), i(row_bytes / 144), i(!half_rm as usize)];
                    self.launch("q8_to_f16", (blocks, 1, 1), 256, 0, &args);
                    Some(h)
                }
                Err(BackendError::OutOfMemory { .. }) if self.f16_copy.load(Ordering::Relaxed) == 2 => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        Ok(CudaWeight { dtype: t.dtype, shape: t.shape.to_vec(), mem, row_bytes, tiled, half, half_rm })
    }

    fn upload_rope(&self, spec: &RopeSpec) -> Result<CudaRope> {
        if spec.dim % 2 != 0 || spec.freqs.len() != spec.dim / 2 {
            return Err(BackendError::Unsupported(format!("rope: {} frequencies for {} dimensions", spec.freqs.len(), spec.dim)));
        }
        let bytes: Vec<u8> = spec.freqs.iter().flat_map(|f| f.to_le_bytes()).collect();
        let freqs = self.alloc_mem(bytes.len(), "rope table")?;
        self.upload_bytes(&freqs, 0, &bytes)?;
        Ok(CudaRope { freqs, dim: spec.dim, mode: spec.mode, mscale: spec.mscale })
    }

    fn alloc_batch(&self, max_tokens: usize) -> Result<CudaBatch> {
        let mt = max_tokens.max(1);
        let mem = self.alloc_mem(16 * mt, "batch")?;
        let pinned = HostPinned::new(&self.ctx, 16 * mt).zip(HostPinned::new(&self.ctx, 16 * mt)).map(|(a, b)| [a, b]);
        Ok(CudaBatch {
            mem,
            max_tokens: mt,
            tokens: Vec::with_capacity(mt),
            n_outputs: 0,
            slot_len: 0,
            host: vec![0; 16 * mt],
            pinned,
            sent: [None, None],
            flip: 0,
        })
    }

    fn upload_batch(&self, meta: &BatchMeta, batch: &mut CudaBatch) -> Result<()> {
        let n = meta.len();
        if n > batch.max_tokens {
            return Err(BackendError::Unsupported(format!("batch of {n} tokens exceeds the {} it was sized for", batch.max_tokens)));
        }
        if meta.outputs.len() > batch.max_tokens {
            return Err(BackendError::Unsupported(format!(
                "{} output rows exceed the {} the batch was sized for",
                meta.outputs.len(),
                batch.max_tokens
            )));
        }
        let mt = batch.max_tokens;
        let mut put = |field: usize, i: usize, v: u32| {
            let at = 4 * (field * mt + i);
            batch.host[at..at + 4].copy_from_slice(&v.to_le_bytes());
        };
        // Tokens that are a previous step's pick (TOKEN_FROM_ARGMAX + row) are copied on the
        // device from the last arg-max's ids after the upload (FedRuns); their rows checked here.
        let last_rows = self.argq.lock().unwrap_or_else(|e| e.into_inner()).rows;
        for (t, tm) in meta.tokens.iter().enumerate() {
            let fed = tm.token >= TOKEN_FROM_ARGMAX;
            put(0, t, if fed { 0 } else { tm.token });
            put(1, t, tm.pos);
            put(2, t, tm.slot);
            let r = tm.token.wrapping_sub(TOKEN_FROM_ARGMAX) as usize;
            if fed && r >= last_rows {
                return Err(BackendError::Unsupported(format!("token {t} takes row {r} of the last arg-max, which had {last_rows} rows")));
            }
        }
        for (i, &o) in meta.outputs.iter().enumerate() {
            put(3, i, o);
        }
        if self.batch_fill.load(Ordering::Relaxed) && n == 1 && meta.outputs.len() <= 1 {
            // One token: written by a kernel from its arguments (batch_fill_1), its pick taken on
            // the device where it is one.
            let tm = meta.tokens[0];
            let (ids, row) = match FedRuns::of(&meta.tokens).next() {
                Some((_, r, _)) => {
                    let ids = self.scratch_ptr(S::Ids).ok_or_else(|| BackendError::Unsupported("no arg-max to take tokens from".into()))?;
                    (ids, r)
                }
                None => (0, 0),
            };
            let args = [
                A::P(batch.mem.ptr),
                l(mt),
                A::I(tm.token as i32),
                A::I(tm.pos as i32),
                A::I(tm.slot as i32),
                i(meta.outputs.len()),
                A::I(meta.outputs.first().map_or(0, |&o| o as i32)),
                A::P(ids),
                i(row),
            ];
            self.launch("batch_fill_1", (1, 1, 1), 32, 0, &args);
            self.take_error()?;
            batch.set_meta(meta);
            return Ok(());
        }
        match batch.pinned.as_mut() {
            Some(pin) => {
                // This copy's last upload must have been done before it is rewritten.
                let k = batch.flip;
                if let Some(ev) = &batch.sent[k] {
                    ev.synchronize().map_err(|e| dev_err("batch upload event", e))?;
                }
                let stage = pin[k].bytes();
                stage.copy_from_slice(&batch.host);
                self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
                unsafe { drv::memcpy_htod_async(batch.mem.ptr, &*stage, self.stream.cu_stream()) }
                    .map_err(|e| dev_err("host-to-device copy", e))?;
                match &batch.sent[k] {
                    Some(ev) => ev.record(&self.stream).map_err(|e| dev_err("batch upload event", e))?,
                    None => batch.sent[k] = Some(self.stream.record_event(None).map_err(|e| dev_err("batch upload event", e))?),
                }
                batch.flip ^= 1;
            }
            None => self.upload_bytes(&batch.mem, 0, &batch.host)?,
        }
        for (t, r, c) in FedRuns::of(&meta.tokens) {
            let ids = self.scratch_ptr(S::Ids).ok_or_else(|| BackendError::Unsupported("no arg-max to take tokens from".into()))?;
            unsafe { drv::memcpy_dtod_async(batch.tok_ptr() + 4 * t as u64, ids + 4 * r as u64, 4 * c, self.stream.cu_stream()) }
                .map_err(|e| dev_err("device-to-device copy", e))?;
        }
        batch.set_meta(meta);
        Ok(())
    }

    fn write(&self, dst: &CudaBuf, off: usize, src: &[f32]) -> Result<()> {
        if off + src.len() > dst.len() {
            return Err(BackendError::Unsupported(format!("write of {} floats at {off} outside a buffer of {}", src.len(), dst.len())));
        }
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, src.len() * 4) };
        self.upload_bytes(&dst.0, off * 4, bytes)
    }

    fn read(&self, buf: &CudaBuf, rows: Rows, dst: &mut [f32]) -> Result<()> {
        buf.check(rows);
        assert_eq!(dst.len(), rows.n * rows.width);
        self.synchronize()?;
        let contiguous = rows.n <= 1 || rows.stride == rows.width;
        if contiguous && 4 * dst.len() >= PINNED_MIN_BYTES {
            let mut pin = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
            if pin.as_ref().is_none_or(|p| p.len < dst.len()) {
                *pin = None;
                self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
                let ptr = unsafe { drv::malloc_host(4 * dst.len(), 0) }.map_err(|e| dev_err("pinned host allocation", e))?;
                *pin = Some(Pinned { ptr: ptr as *mut f32, len: dst.len() });
            }
            if let Some(p) = pin.as_ref() {
                // Safety: `p` holds at least dst.len() f32s and nothing else uses it (mutex).
                let stage = unsafe { std::slice::from_raw_parts_mut(p.ptr, dst.len()) };
                unsafe { drv::memcpy_dtoh_async(stage, buf.0.ptr + 4 * rows.off as u64, self.stream.cu_stream()) }
                    .map_err(|e| dev_err("device-to-host copy", e))?;
                self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))?;
                dst.copy_from_slice(stage);
                return Ok(());
            }
        }
        let r = if contiguous {
            unsafe { drv::memcpy_dtoh_async(dst, buf.0.ptr + 4 * rows.off as u64, self.stream.cu_stream()) }
        } else {
            let mut r = Ok(());
            for (j, chunk) in dst.chunks_mut(rows.width.max(1)).enumerate() {
                r = unsafe { drv::memcpy_dtoh_async(chunk, buf.0.ptr + 4 * (rows.off + j * rows.stride) as u64, self.stream.cu_stream()) };
                if r.is_err() {
                    break;
                }
            }
            r
        };
        r.map_err(|e| dev_err("device-to-host copy", e))?;
        self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))
    }

    fn argmax_rows(&self, x: &CudaBuf, xr: Rows, out: &mut [u32]) -> Result<()> {
        x.check(xr);
        assert_eq!(out.len(), xr.n);
        if xr.n == 0 {
            return Ok(());
        }
        if xr.width > i32::MAX as usize {
            return Err(BackendError::Unsupported(format!("arg-max over rows of {} values", xr.width)));
        }
        let Some(ids) = self.enqueue_argmax(x, xr, 0) else { return self.synchronize() };
        self.argq.lock().unwrap_or_else(|e| e.into_inner()).rows = xr.n;
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        unsafe { drv::memcpy_dtoh_async(out, ids, self.stream.cu_stream()) }.map_err(|e| dev_err("device-to-host copy", e))?;
        self.synchronize()
    }

    fn chains_argmax(&self) -> bool {
        true
    }

    fn argmax_rows_queued(&self, x: &CudaBuf, xr: Rows) -> Result<()> {
        x.check(xr);
        if xr.n == 0 || xr.width > i32::MAX as usize {
            return Err(BackendError::Unsupported(format!("queued arg-max over {} rows of {} values", xr.n, xr.width)));
        }
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        if q.pending.len() >= 2 {
            return Err(BackendError::Unsupported("a third queued arg-max before the first was collected".into()));
        }
        let k = q.next;
        // The slot is free (at most one other is pending); grown where too small.
        if q.slots[k].as_ref().is_none_or(|(p, _, _)| p.len < 4 * xr.n) {
            let len = 4 * xr.n.next_power_of_two();
            // Mapped memory: argmax_final writes the ids there itself (with batch_fill; else a copy).
            let mapped = if self.batch_fill.load(Ordering::Relaxed) { HostPinned::mapped(&self.ctx, len) } else { None };
            let (pin, dev) = match mapped {
                Some(m) => m,
                None => (
                    HostPinned::new(&self.ctx, len).ok_or_else(|| BackendError::Device("pinned host allocation for arg-max ids".into()))?,
                    0,
                ),
            };
            let ev = self.ctx.new_event(None).map_err(|e| dev_err("arg-max event", e))?;
            q.slots[k] = Some((pin, dev, ev));
        }
        let Some((pin, dev, ev)) = q.slots[k].as_mut() else { return Err(BackendError::Device("arg-max slot missing".into())) };
        let Some(ids) = self.enqueue_argmax(x, xr, *dev) else { return self.synchronize() };
        if *dev == 0 {
            // Safety: the slot holds at least 4 * n bytes, and nothing reads them before its event.
            let dst = unsafe { std::slice::from_raw_parts_mut(pin.ptr as *mut u32, xr.n) };
            self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
            unsafe { drv::memcpy_dtoh_async(dst, ids, self.stream.cu_stream()) }.map_err(|e| dev_err("device-to-host copy", e))?;
        }
        ev.record(&self.stream).map_err(|e| dev_err("arg-max event", e))?;
        q.rows = xr.n;
        q.pending.push_back((k, xr.n));
        q.next ^= 1;
        Ok(())
    }

    fn argmax_collect(&self, out: &mut [u32]) -> Result<()> {
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        let Some((k, n)) = q.pending.pop_front() else {
            return Err(BackendError::Unsupported("no queued arg-max to collect".into()));
        };
        if out.len() != n {
            return Err(BackendError::Unsupported(format!("the queued arg-max has {n} rows, not {}", out.len())));
        }
        let Some((pin, _, ev)) = q.slots[k].as_ref() else { return Err(BackendError::Device("arg-max slot missing".into())) };
        ev.synchronize().map_err(|e| dev_err("arg-max event", e))?;
        self.take_error()?;
        // Safety: the slot's copy of n ids is done (its event has passed).
        out.copy_from_slice(unsafe { std::slice::from_raw_parts(pin.ptr as *const u32, n) });
        Ok(())
    }

    fn gather_outputs(&self, x: &CudaBuf, xr: Rows, batch: &CudaBatch, out: &CudaBuf, o: Rows) {
        assert_eq!((xr.n, o.n, xr.width), (batch.tokens.len(), batch.n_outputs, o.width));
        x.check(xr);
        out.check(o);
        self.launch(
            "gather_rows",
            (o.n as u32, 1, 1),
            256,
            0,
            &[A::P(x.0.ptr), l(xr.off), l(xr.stride), A::P(batch.out_ptr()), A::P(out.0.ptr), l(o.off), l(o.stride), i(o.width)],
        );
    }

    fn embed(&self, table: &CudaWeight, batch: &CudaBatch, scale: f32, out: &CudaBuf, o: Rows) {
        let dim = table.ne(0);
        assert_eq!(o.width, dim);
        assert_eq!(o.n, batch.tokens.len());
        out.check(o);
        if let Some(tm) = batch.tokens.iter().find(|tm| tm.token as usize >= table.ne(1) && tm.token < TOKEN_FROM_ARGMAX) {
            self.fail(format!("token id {} outside the vocabulary of {}", tm.token, table.ne(1)));
            return;
        }
        let Some(tn) = tname(table.dtype) else { return };
        self.launch(
            KName::of(format_args!("embed_{tn}")).as_str(),
            (o.n as u32, 1, 1),
            128,
            0,
            &[A::P(table.mem.ptr), l(table.row_bytes), A::P(batch.tok_ptr()), A::F(scale), A::P(out.0.ptr), l(o.off), l(o.stride), i(dim)],
        );
    }

    fn rms_norm(&self, x: &CudaBuf, xr: Rows, w: Option<&CudaWeight>, eps: f32, out: &CudaBuf, o: Rows) {
        assert_eq!((xr.n, xr.width), (o.n, o.width));
        x.check(xr);
        out.check(o);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), xr.width, "norm weight length != row width {}", xr.width);
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        let block = xr.width.next_power_of_two().clamp(32, 256) as u32;
        self.launch(
            "rms_norm",
            (xr.n as u32, 1, 1),
            block,
            0,
            &[
                A::P(x.0.ptr),
                l(xr.off),
                l(xr.stride),
                A::P(w.map_or(0, |w| w.mem.ptr)),
                A::I(w.is_some() as i32),
                A::F(eps),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                i(xr.width),
            ],
        );
    }

    fn matmul(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, out: &CudaBuf, o: Rows) {
        assert!(w.ne(2) == 1, "matmul with a 3-D weight {:?}: use matmul_grouped", w.shape);
        self.matmul_groups(x, xr, w, 1, out, o);
    }

    fn matmul_grouped(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, out: &CudaBuf, o: Rows) {
        self.matmul_groups(x, xr, w, w.ne(2), out, o);
    }

    fn add(&self, a: &CudaBuf, ar: Rows, b: &CudaBuf, br: Rows, out: &CudaBuf, o: Rows) {
        assert!(ar.n == br.n && ar.n == o.n && ar.width == br.width && ar.width == o.width);
        a.check(ar);
        b.check(br);
        out.check(o);
        let total = o.n * o.width;
        self.launch(
            "add_rows",
            Self::grid1(total),
            256,
            0,
            &[
                A::P(a.0.ptr),
                l(ar.off),
                l(ar.stride),
                A::P(b.0.ptr),
                l(br.off),
                l(br.stride),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                l(o.width),
                l(total),
            ],
        );
    }

    fn scale(&self, x: &CudaBuf, xr: Rows, s: f32) {
        x.check(xr);
        let total = xr.n * xr.width;
        self.launch("scale_rows", Self::grid1(total), 256, 0, &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(xr.width), l(total), A::F(s)]);
    }

    fn glu(&self, kind: Glu, gate: &CudaBuf, gr: Rows, up: &CudaBuf, ur: Rows, out: &CudaBuf, o: Rows) {
        assert!(gr.n == ur.n && gr.n == o.n && gr.width == ur.width && gr.width == o.width);
        gate.check(gr);
        up.check(ur);
        out.check(o);
        let total = o.n * o.width;
        let k = match kind {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        self.launch(
            "glu_rows",
            Self::grid1(total),
            256,
            0,
            &[
                A::I(k),
                A::P(gate.0.ptr),
                l(gr.off),
                l(gr.stride),
                A::P(up.0.ptr),
                l(ur.off),
                l(ur.stride),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                l(o.width),
                l(total),
            ],
        );
    }

    fn softcap(&self, x: &CudaBuf, xr: Rows, cap: f32) {
        x.check(xr);
        let total = xr.n * xr.width;
        self.launch(
            "softcap_rows",
            Self::grid1(total),
            256,
            0,
            &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(xr.width), l(total), A::F(cap)],
        );
    }

    fn copy(&self, src: &CudaBuf, sr: Rows, dst: &CudaBuf, dr: Rows) {
        assert!(sr.n == dr.n && sr.width == dr.width);
        src.check(sr);
        dst.check(dr);
        let total = sr.n * sr.width;
        self.launch(
            "copy_rows",
            Self::grid1(total),
            256,
            0,
            &[A::P(src.0.ptr), l(sr.off), l(sr.stride), A::P(dst.0.ptr), l(dr.off), l(dr.stride), l(sr.width), l(total)],
        );
    }

    fn rope(&self, x: &CudaBuf, xr: Rows, heads_per_token: usize, batch: &CudaBatch, rope: &CudaRope) {
        assert!(rope.dim <= xr.width && rope.dim % 2 == 0);
        assert_eq!(xr.n, batch.tokens.len() * heads_per_token, "rope: rows != tokens * heads");
        x.check(xr);
        let half = rope.dim / 2;
        let mode = match rope.mode {
            RopeMode::Normal => 0,
            RopeMode::Neox => 1,
        };
        self.launch(
            "rope_rows",
            Self::grid1(xr.n * half),
            256,
            0,
            &[
                A::P(x.0.ptr),
                l(xr.off),
                l(xr.stride),
                l(xr.n),
                i(heads_per_token),
                A::P(batch.pos_ptr()),
                A::P(rope.freqs.ptr),
                i(half),
                A::I(mode),
                A::F(rope.mscale),
            ],
        );
    }

    fn cache_write(&self, cache: &CudaCache, src: &CudaBuf, sr: Rows, batch: &CudaBatch) {
        assert_eq!(sr.n, batch.tokens.len());
        assert_eq!(sr.width, cache.width, "cache_write: row width {} != cache width {}", sr.width, cache.width);
        src.check(sr);
        if !self.check_cache_rows(batch, cache.rows, "cache_write") {
            return;
        }
        let total = sr.n * sr.width;
        self.launch(
            cache.kernel("cache_write").as_str(),
            Self::grid1(total),
            256,
            0,
            &[
                A::P(cache.mem.ptr),
                A::P(src.0.ptr),
                l(sr.off),
                l(sr.stride),
                l(sr.width),
                l(sr.n),
                A::P(batch.pos_ptr()),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
            ],
        );
    }

    fn attention(&self, q: &CudaBuf, qr: Rows, k: &CudaCache, v: &CudaCache, batch: &CudaBatch, p: &AttnParams, out: &CudaBuf, o: Rows) {
        assert!(!k.half && !v.half, "attention: K/V caches are f32 (an f16 cache is an MLA latent cache)");
        let (nh, nkv, hd, vd) = (p.n_heads, p.n_kv_heads, p.head_dim, p.v_dim);
        assert_eq!(qr.width, nh * hd);
        assert_eq!(o.width, nh * vd);
        assert_eq!(qr.n, batch.tokens.len());
        assert_eq!(nh % nkv, 0);
        assert_eq!(k.width, nkv * hd, "attention: K cache width");
        assert_eq!(v.width, nkv * vd, "attention: V cache width");
        q.check(qr);
        out.check(o);
        if !self.check_cache_rows(batch, k.rows.min(v.rows), "attention") {
            return;
        }
        self.attention_launch(
            (q, qr.off, qr.stride, hd),
            (k.mem.ptr, k.width, hd),
            (v.mem.ptr, v.width, vd),
            (out, o.off, o.stride, vd),
            batch,
            nh,
            nh / nkv,
            hd,
            vd,
            p.scale,
            p.window.unwrap_or(0),
            p.softcap.unwrap_or(0.0),
        );
    }

    fn mla_attention(&self, q: &CudaBuf, qr: Rows, cache: &CudaCache, batch: &CudaBatch, p: &MlaParams, out: &CudaBuf, o: Rows) {
        self.mla_attention_run(q, qr, cache, batch, p, out, o, false);
    }

    fn moe(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        p: &MoeParams,
        out: &CudaBuf,
        o: Rows,
    ) {
        // A routing made ahead (pre_route) is for moe_shared only; this op routes itself.
        self.routed.lock().unwrap_or_else(|e| e.into_inner()).take();
        let n = xr.n;
        assert!(lr.n == n && o.n == n && lr.width == p.n_experts && o.width == xr.width);
        x.check(xr);
        logits.check(lr);
        out.check(o);
        let (hdim, ff, ne) = (experts.gate.ne(0), experts.gate.ne(1), p.n_experts);
        assert_eq!(hdim, xr.width);
        assert_eq!(experts.gate.ne(2), ne);
        assert_eq!((experts.up.ne(0), experts.up.ne(1), experts.up.ne(2)), (hdim, ff, ne), "moe: up shape");
        assert_eq!((experts.down.ne(0), experts.down.ne(1), experts.down.ne(2)), (ff, hdim, ne), "moe: down shape");
        if n == 0 {
            return;
        }
        if ne > 512 || p.n_group > 64 || p.n_group == 0 || ne % p.n_group != 0 || p.k == 0 || p.k > ne {
            self.fail(format!("moe: {ne} experts in {} groups, top {} is not supported (at most 512 experts, 64 groups)", p.n_group, p.k));
            return;
        }
        let (Some(gt), Some(ut), Some(dt)) = (tname(experts.gate.dtype), tname(experts.up.dtype), tname(experts.down.dtype)) else {
            self.fail("moe: expert weight type without kernels".into());
            return;
        };
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let k = p.k;
        let pairs = n * k;
        let Some(sel_e) = self.scratch(S::SelE, 4 * pairs) else { return };
        let Some(sel_w) = self.scratch(S::SelW, 4 * pairs) else { return };
        let Some(g) = self.scratch(S::G, 4 * pairs * ff) else { return };
        let Some(u) = self.scratch(S::U, 4 * pairs * ff) else { return };
        let Some(y) = self.scratch(S::Y, 4 * pairs * hdim) else { return };
        let warp_route = warp_route(p);
        let fast = n <= GEMV_MAX_TOKENS
            && !self.exact
            && [experts.gate.dtype, experts.up.dtype, experts.down.dtype].iter().all(|&t| t == GgmlType::Q8_0)
            && hdim * 9 / 8 <= self.smem_max
            && k * ff * 9 / 8 <= self.smem_max;
        if fast && warp_route {
            // Decode: route (one warp per token), gate+up+GLU of all pairs in one launch, down and
            // the weighted sum in one launch (kernels/fast.cu).
            self.route(logits, lr, p, true, sel_e, sel_w);
            let act = match p.glu {
                Glu::SwiGlu => 0,
                Glu::GeGluTanh => 1,
            };
            let (gw, uw, dw) = (experts.gate, experts.up, experts.down);
            self.launch(
                "moe_gateup_q8",
                (ff.div_ceil(8) as u32, pairs as u32, 1),
                256,
                (hdim * 9 / 8) as u32,
                &[
                    A::P(gw.mem.ptr),
                    A::P(uw.mem.ptr),
                    l(gw.row_bytes),
                    l(gw.mat_bytes()),
                    i(ff),
                    i(hdim),
                    A::P(sel_e),
                    A::P(x.0.ptr),
                    l(xr.off),
                    l(xr.stride),
                    i(k),
                    A::I(act),
                    A::P(g),
                    l(ff),
                ],
            );
            self.launch(
                "moe_down_q8",
                (hdim.div_ceil(8) as u32, n as u32, 1),
                256,
                (k * ff * 9 / 8) as u32,
                &[
                    A::P(dw.mem.ptr),
                    l(dw.row_bytes),
                    l(dw.mat_bytes()),
                    i(hdim),
                    i(ff),
                    i(k),
                    A::P(sel_e),
                    A::P(sel_w),
                    A::P(g),
                    l(ff),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(o.stride),
                ],
            );
            return;
        }
        let all_q8 = [experts.gate.dtype, experts.up.dtype, experts.down.dtype].iter().all(|&t| t == GgmlType::Q8_0);
        if self.tc && all_q8 && n > GEMV_MAX_TOKENS && MMQ_SMEM <= self.smem_max {
            self.moe_mmq(x, xr, logits, lr, &experts, None, p, warp_route, (sel_e, sel_w, g, u, y), out, o);
            return;
        }
        self.route(logits, lr, p, false, sel_e, sel_w);
        // (weight, m, kdim, input ptr, input off, input stride, in_div, output ptr, output stride)
        type Prod<'a> = (&'a CudaWeight, &'a str, usize, usize, u64, usize, usize, usize, u64, usize);
        let prods: [Prod; 3] = [
            (experts.gate, gt, ff, hdim, x.0.ptr, xr.off, xr.stride, k, g, ff),
            (experts.up, ut, ff, hdim, x.0.ptr, xr.off, xr.stride, k, u, ff),
            (experts.down, dt, hdim, ff, g, 0, ff, 1, y, hdim),
        ];
        let grouped = n > GEMV_MAX_TOKENS;
        let (cnt, off, perm) = if grouped {
            let (Some(c), Some(of), Some(pm)) =
                (self.scratch(S::Cnt, 4 * ne), self.scratch(S::Off, 4 * ne), self.scratch(S::Perm, 4 * pairs))
            else {
                return;
            };
            self.launch("moe_group", (1, 1, 1), 1024, 0, &[A::P(sel_e), i(n), i(k), i(0), i(ne), A::P(c), A::P(of), A::P(pm)]);
            (c, of, pm)
        } else {
            (0, 0, 0)
        };
        for (idx, &(w, tn, m, kd, ip, ioff, istr, div, op, ostr)) in prods.iter().enumerate() {
            if idx == 2 {
                // g = act(g) * u before the down projection.
                let total = pairs * ff;
                let kind = match p.glu {
                    Glu::SwiGlu => 0,
                    Glu::GeGluTanh => 1,
                };
                self.launch(
                    "glu_rows",
                    Self::grid1(total),
                    256,
                    0,
                    &[A::I(kind), A::P(g), l(0), l(ff), A::P(u), l(0), l(ff), A::P(g), l(0), l(ff), l(ff), l(total)],
                );
            }
            if grouped {
                self.launch(
                    KName::of(format_args!("moe_gemm_{tn}")).as_str(),
                    (m.div_ceil(64) as u32, n.div_ceil(64) as u32, ne as u32),
                    256,
                    0,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(kd),
                        A::P(cnt),
                        A::P(off),
                        A::P(perm),
                        A::P(ip),
                        l(ioff),
                        l(istr),
                        i(div),
                        A::P(op),
                        l(ostr),
                    ],
                );
            } else {
                let h16 = if h16_vector_ok(w, kd, ioff, istr) { "h16_" } else { "" };
                self.launch(
                    KName::of(format_args!("moe_gemv_{h16}{tn}")).as_str(),
                    (m.div_ceil(4) as u32, pairs as u32, 1),
                    128,
                    0,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(kd),
                        A::P(sel_e),
                        A::P(ip),
                        l(ioff),
                        l(istr),
                        i(div),
                        A::P(op),
                        l(ostr),
                    ],
                );
            }
        }
        self.moe_combine(y, (k, k), hdim, n, (sel_e, sel_w), out, o, 0);
    }

    /// What picks the MLA decode's kernels for the batch: long-context (`TS_CUDA_MLA_LONG`), one
    /// token at a short context (`mo_att`: the attention inside `mla_out_q8`), a batch's splits.
    fn graph_class(&self, batch: &BatchMeta) -> u64 {
        let pos = || batch.tokens.iter().map(|t| t.pos);
        let n = batch.tokens.len();
        let splits = if n > 1 { self.batch_mla_splits(n, pos()) as u64 } else { 0 };
        let tc_splits = if n > 1 { self.tc_batch_splits(n, pos()) as u64 } else { 0 };
        let short = n == 1 && pos().all(|p| p < self.mo_att.load(Ordering::Relaxed));
        self.long_context(n, pos()) as u64 | (short as u64) << 1 | splits << 2 | tc_splits << 12
    }

    /// CUDA graphs for steps of up to [`GRAPH_MAX_TOKENS`] tokens (decode, batched decode): a key runs eagerly the
    /// first time (scratch reaches its size), is captured the second time and replayed after
    /// that, one launch instead of hundreds. Any scratch reallocation drops every recording (they
    /// hold scratch pointers); an allocation during capture spoils it (the step runs eagerly).
    /// `TS_CUDA_GRAPHS=0` turns recording off.
    fn graph_begin(&self, key: u64, n_tokens: usize) -> bool {
        if n_tokens == 0 || n_tokens > self.graph_max || !self.graphs_on {
            return false;
        }
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if gs.capturing.is_some() {
            return false;
        }
        if let Some(g) = gs.graphs.get(&key) {
            if let Err(e) = g.0.launch() {
                self.fail(format!("CUDA graph launch: {e:?}"));
            } else if let (Some(tr), Some(names)) = (&self.trace, gs.names.get(&key)) {
                tr.lock().unwrap_or_else(|e| e.into_inner()).extend(names.iter().cloned());
            }
            gs.counts.replayed += 1;
            return true;
        }
        if gs.failed.contains(&key) {
            return false;
        }
        if gs.graphs.len() >= GRAPH_MAX_COUNT {
            return false;
        }
        if gs.seen.len() >= 16 * GRAPH_MAX_COUNT {
            // Keys seen once (a server's mixed batches) are forgotten now and then.
            gs.seen.clear();
        }
        if !gs.seen.insert(key) {
            if self.ctx.bind_to_thread().is_ok()
                && self.stream.begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).is_ok()
            {
                gs.capturing = Some(key);
                gs.spoiled = false;
            }
        }
        false
    }

    /// Scratch (dequantised weights, MoE intermediates) and step recordings are sized on first
    /// use, so the loader runs the widest forward and one decode step at open.
    fn warm_up_at_open(&self) -> bool {
        true
    }

    fn graph_end(&self) -> bool {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(key) = gs.capturing.take() else {
            gs.counts.eager += 1;
            return true;
        };
        let spoiled = std::mem::take(&mut gs.spoiled);
        match self.stream.end_capture(drv_sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(graph)) if !spoiled => {
                let names = std::mem::take(&mut gs.capture_names);
                if let Err(e) = graph.launch() {
                    self.fail(format!("CUDA graph launch: {e:?}"));
                } else if let Some(tr) = &self.trace {
                    tr.lock().unwrap_or_else(|e| e.into_inner()).extend(names.iter().cloned());
                }
                gs.names.insert(key, names);
                gs.graphs.insert(key, Graph(graph));
                gs.counts.recorded += 1;
                true
            }
            _ => {
                gs.capture_names.clear();
                gs.failed.insert(key);
                gs.counts.eager += 1;
                false
            }
        }
    }

    fn step_counts(&self) -> StepCounts {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).counts
    }

    fn matmul_many(&self, x: &CudaBuf, xr: Rows, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) {
        let n = xr.n;
        let k = xr.width;
        let nt = if n == 1 {
            1
        } else if n == 2 {
            2
        } else if n <= 4 {
            4
        } else {
            8
        };
        let fast = self.fused
            && jobs.len() >= 2
            && (1..=GEMV_MAX_TOKENS).contains(&n)
            && nt * k * 9 / 8 <= self.smem_max
            && jobs.iter().all(|(w, _, o)| {
                w.dtype == GgmlType::Q8_0
                    && w.shape.len() <= 3
                    && w.ne(2) == 1
                    && w.ne(0) == k
                    && o.n == n
                    && o.width == w.ne(1)
                    && w.ne(1) > 0
            });
        // Prompts with every matrix's f16 copy (dense_blas): the input in f16 once, one cuBLAS
        // product a job (the same bits as each `matmul` alone).
        let blas = n > GRAPH_MAX_TOKENS
            && self.dense_blas.load(Ordering::Relaxed)
            && jobs.len() >= 2
            && jobs.iter().all(|(w, _, o)| w.half_rm().is_some() && w.ne(2) == 1 && w.ne(0) == k && o.n == n && o.width == w.ne(1));
        if blas {
            x.check(xr);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(xh) = self.f16_input(x, xr) else { return };
            for &(w, out, o) in jobs {
                out.check(o);
                let (Some(wh), m) = (w.half_rm(), w.ne(1)) else { continue };
                self.gemm_h16((wh, k, 0), (xh, k, 0), (out.0.ptr + 4 * o.off as u64, o.stride, 0), (m, n, k), 1);
            }
            return;
        }
        // Above the GEMV sizes, on the int8 tensor cores: the input quantised once for all jobs
        // (each `matmul` would quantise it again; the same bits).
        if self.mmq_many(n, k, jobs) {
            x.check(xr);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, n * ngroups * 144) else { return };
            self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, n, k, 0, xq);
            self.mmq_jobs(ngroups, xq, n, jobs);
            return;
        }
        if !fast {
            for &(w, out, o) in jobs {
                self.matmul(x, xr, w, out, o);
            }
            return;
        }
        x.check(xr);
        // One launch per 3 jobs (a lone last job goes through the plain GEMV).
        for chunk in jobs.chunks(3) {
            if chunk.len() == 1 {
                let (w, out, o) = chunk[0];
                self.matmul(x, xr, w, out, o);
                continue;
            }
            let (table, lpr, total) = multi_jobs(chunk, k);
            // The job table (a fixed array: launching allocates nothing), then the shared input.
            let args: [A; 27] = cat(table, [i(k), A::P(x.0.ptr), l(xr.off), l(xr.stride), i(n), i(lpr)]);
            self.launch(
                KName::of(format_args!("gemv_q8_multi_{nt}")).as_str(),
                (total.min(self.sm_count * 8) as u32, n.div_ceil(nt) as u32, 1),
                256,
                (nt * k * 9 / 8) as u32,
                &args,
            );
        }
    }

    fn add_rms_norm_matmul_many(
        &self,
        x: (&CudaBuf, Rows),
        delta: (&CudaBuf, Rows),
        w: Option<&CudaWeight>,
        eps: f32,
        out: (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        self.norm_matmul_many(x, Some(delta), w, eps, out, jobs);
    }

    fn rms_norm_matmul_many(
        &self,
        x: (&CudaBuf, Rows),
        w: Option<&CudaWeight>,
        eps: f32,
        out: (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        self.norm_matmul_many(x, None, w, eps, out, jobs);
    }

    fn prefetch_hint(&self, weights: &[&CudaWeight]) {
        let mut h = [(0u64, 0usize); 4];
        if self.l2pf > 0 {
            for (slot, w) in h.iter_mut().zip(weights) {
                *slot = (w.mem.ptr, w.mem.bytes / 16 * 16);
            }
        }
        *self.l2_hint.lock().unwrap_or_else(|e| e.into_inner()) = h;
    }

    fn mla_attention_out(
        &self,
        (q, qr): (&CudaBuf, Rows),
        cache: &CudaCache,
        batch: &CudaBatch,
        p: &MlaParams,
        (w_uv, wo): (&CudaWeight, &CudaWeight),
        (lat, lr, av, avr, avo): (&CudaBuf, Rows, &CudaBuf, Rows, Rows),
        (x, xr, y): (&CudaBuf, Rows, &CudaBuf),
        w: Option<&CudaWeight>,
        eps: f32,
        out: &CudaBuf,
        o: Rows,
        next: Option<MoeNext<'_, CudaWeight, CudaBuf>>,
    ) {
        let (nh, kl, hd) = (p.n_heads, p.kv_lora, xr.width);
        *self.routed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let rows = self.mla_out.load(Ordering::Relaxed);
        // One token (a decode step) of V2's shapes with Q8_0 value and output weights:
        // mla_out_q8's preconditions (kernels/fused.cu), else the plain chain.
        let one = self.fused
            && rows > 0
            && batch.tokens.len() == 1
            && xr.n == 1
            && o.n == 1
            && o.width == hd
            && lr.n == nh
            && lr.width == kl
            && lr.off % 2 == 0
            && lr.stride % 2 == 0
            && w_uv.dtype == GgmlType::Q8_0
            && wo.dtype == GgmlType::Q8_0
            && (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2)) == (kl, MO_VD, nh)
            && w_uv.row_bytes == kl / 128 * 144
            && kl % 128 == 0
            && kl <= 512
            && nh <= MO_MAX_PARTS
            && (wo.ne(0), wo.ne(1)) == (nh * MO_VD, hd)
            && wo.row_bytes == nh * 144
            && hd <= 2 * 1024
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == hd)
            && mla_out_smem(kl, w_uv.row_bytes, rows) <= self.smem_max;
        // The same for f16 / bf16 value and output weights (mla_out_<t>, clusters of 8 blocks a
        // head).
        let h16 = !one
            && self.fused
            && self.path_on(Path::Out16)
            && self.clusters()
            && batch.tokens.len() == 1
            && xr.n == 1
            && o.n == 1
            && o.width == hd
            && lr.n == nh
            && lr.width == kl
            && lr.off % 2 == 0
            && lr.stride % 2 == 0
            && matches!(w_uv.dtype, GgmlType::F16 | GgmlType::BF16)
            && wo.dtype == w_uv.dtype
            && (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2)) == (kl, MO_VD, nh)
            && w_uv.row_bytes == 2 * kl
            && kl % 8 == 0
            && kl <= 512
            && nh <= MO_MAX_PARTS
            && (wo.ne(0), wo.ne(1)) == (nh * MO_VD, hd)
            && wo.row_bytes == 2 * nh * MO_VD
            && hd % MH_CLUSTER == 0
            && hd <= 2 * 1024
            && [w_uv, wo].iter().all(|w| w.mem.ptr % 16 == 0 && w.mat_bytes() % 16 == 0)
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == hd)
            && mla_out_h16_smem(kl, hd) <= self.smem_max;
        if !one && !h16 {
            self.mla_attention(q, qr, cache, batch, p, lat, lr);
            // A decode batch on the int8 products: W_uv's split sum quantises the values for
            // W_o (Path::SumQ8), else the two products as they come.
            // (W_o's partial outputs left for the norm's launch to sum when it takes NormQ8)
            let n = xr.n;
            let nq8 = next.is_some() && self.norm_q8_ok(n, hd, (o.n, o.width), w);
            let mut y_parts = None;
            let sq = self.path_on(Path::SumQ8)
                && self.tc
                && MMQ_SMEM <= self.smem_max
                && (GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS).contains(&xr.n)
                && [w_uv, wo].iter().all(|w| w.dtype == GgmlType::Q8_0)
                && (w_uv.ne(0), w_uv.ne(2)) == (lr.width, nh)
                && lr.n == xr.n * nh
                && (avr.n, avr.width) == (lr.n, w_uv.ne(1))
                && (avo.n, avo.width) == (xr.n, nh * w_uv.ne(1))
                // (the value rows per head and per token are one packed block of memory)
                && (avr.off, avr.stride, avo.stride) == (avo.off, avr.width, avo.width)
                && w_uv.ne(1).is_multiple_of(128)
                && (wo.ne(0), wo.ne(1), wo.ne(2)) == (avo.width, hd, 1);
            // (Held through the norm's launch, which may read W_o's partials from the Part
            // scratch; dropped before the router's product, which takes it itself.)
            let op = sq.then(|| self.scratch_op.lock().unwrap_or_else(|e| e.into_inner()));
            if sq {
                self.took(Path::SumQ8);
                lat.check(lr);
                av.check(avr);
                y.check(xr);
                let (gl, gv) = (lr.width.div_ceil(128), avo.width / 128);
                let Some(xq) = self.scratch(S::Xq, lr.n * gl * 144) else { return };
                let Some(vq) = self.scratch(S::SumXq, xr.n * gv * 144) else { return };
                self.quant_groups(lat.0.ptr, 0, lr.off, lr.stride, lr.n, lr.width, 0, xq);
                self.mmq_dense(w_uv, gl, xq, (lr.n, xr.n, nh), av, avr, SplitSum::Q8(vq));
                // (the norm sums partials on its register path only: rows of <= 8 x 256 values)
                let ys = if nq8 && hd <= 8 * 256 { SplitSum::Leave } else { SplitSum::Plain };
                y_parts = self.mmq_dense(wo, gv, vq, (xr.n, xr.n, 1), y, xr, ys);
            } else {
                self.matmul_grouped(lat, lr, w_uv, av, avr);
                self.matmul(av, avo, wo, y, xr);
            }
            // A decode batch before a MoE: the norm's launch also quantises its rows for the
            // MoE's int8 products (Path::NormQ8), and sums W_o's partials if they were left.
            if nq8 {
                let Some(xq) = self.scratch(S::NormXq, n * hd.div_ceil(128) * 144) else { return };
                self.took(Path::NormQ8);
                let delta = match y_parts {
                    Some((part, nsplit)) => (part, Rows::packed(n, hd), nsplit),
                    None => {
                        y.check(xr);
                        (y.0.ptr, xr, 0)
                    }
                };
                self.add_rms_norm_q8((x, xr), Some(delta), w, eps, (out, o), xq);
                *self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()) = Some(NormXq { rows: (out.0.ptr, o.off, o.stride, n, hd), xq });
            } else {
                self.add_rms_norm(x, xr, y, xr, w, eps, out, o);
            }
            drop(op);
            if let Some(m) = next {
                self.matmul(out, o, m.router, m.logits.0, m.logits.1);
            }
            return;
        }
        x.check(xr);
        out.check(o);
        lat.check(lr);
        // A short context: the attention in mla_out_q8's blocks (mo_attend's shapes), else the
        // split kernel's partial rows, merged by mla_out_q8; or lat, written merged.
        let short = cache.half
            && (qr.width, kl, cache.width, p.rope_dim) == (576, 512, 576, 64)
            && qr.n == nh
            && qr.off % 2 == 0
            && qr.stride % 2 == 0
            && batch.tokens[0].pos < self.mo_att.load(Ordering::Relaxed);
        let (part, nsp) = if short {
            q.check(qr);
            self.take_hint(false);
            if !self.check_cache_rows(batch, cache.rows, "mla_attention_out") {
                return;
            }
            self.mo_att_done.fetch_add(1, Ordering::Relaxed);
            (0, 0)
        } else {
            self.mla_attention_run(q, qr, cache, batch, p, lat, lr, true).unwrap_or((0, 0))
        };
        let att = if short {
            [
                A::P(q.0.ptr),
                l(qr.off),
                l(qr.stride),
                A::P(cache.mem.ptr),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
                A::F(p.scale),
            ]
        } else {
            [A::P(0), l(0), l(0), A::P(0), A::P(0), A::I(0), A::F(0.0)]
        };
        // Held from here to the routing's record (`routed`), so that no other op's launches come
        // between this one's on the stream.
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ho) = self.scratch(S::Ho, 4 * nh * hd) else { return };
        if h16 {
            self.took(Path::Out16);
            let name = if w_uv.dtype == GgmlType::BF16 { "mla_out_bf16" } else { "mla_out_f16" };
            self.launch(
                name,
                (MH_CLUSTER as u32, nh as u32, 1),
                256,
                mla_out_h16_smem(kl, hd) as u32,
                &cat::<15, 7, 22>(
                    [
                        A::P(part),
                        i(nsp),
                        A::P(lat.0.ptr),
                        l(lr.off),
                        l(lr.stride),
                        A::P(batch.pos_ptr()),
                        i(nh),
                        i(kl),
                        A::P(w_uv.mem.ptr),
                        l(w_uv.row_bytes),
                        l(w_uv.mat_bytes()),
                        A::P(wo.mem.ptr),
                        l(wo.row_bytes),
                        i(hd),
                        A::P(ho),
                    ],
                    att,
                ),
            );
        } else {
            self.launch(
                "mla_out_q8",
                (hd.div_ceil(rows) as u32, nh as u32, 1),
                256,
                mla_out_smem(kl, w_uv.row_bytes, rows) as u32,
                &cat::<16, 7, 23>(
                    [
                        A::P(part),
                        i(nsp),
                        A::P(lat.0.ptr),
                        l(lr.off),
                        l(lr.stride),
                        A::P(batch.pos_ptr()),
                        i(nh),
                        i(kl),
                        A::P(w_uv.mem.ptr),
                        l(w_uv.row_bytes),
                        l(w_uv.mat_bytes()),
                        A::P(wo.mem.ptr),
                        l(wo.row_bytes),
                        i(hd),
                        i(rows),
                        A::P(ho),
                    ],
                    att,
                ),
            );
        }
        // With `next` a few-row f32 matrix of the row's width (the MoE router): the norm and
        // that product in one launch (add_rms_norm_parts_router, the same bits as the two).
        let fused_next = next.as_ref().filter(|m| {
            self.norm_router.load(Ordering::Relaxed)
                && m.router.dtype == GgmlType::F32
                && m.router.ne(0) == hd
                && hd % 128 == 0
                && m.logits.1.n == 1
                && m.logits.1.width == m.router.ne(1)
        });
        // add_rms_norm_parts' arguments, which the router's kernel extends.
        let norm = [
            A::P(x.0.ptr),
            l(xr.off),
            A::P(ho),
            l(hd),
            i(nh),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(out.0.ptr),
            l(o.off),
            i(hd),
        ];
        if let Some(&MoeNext { router: nw, logits: (nb, nr), params: mp }) = fused_next {
            nb.check(nr);
            // The MoE's routing too (pre_route): plain top-k, the router's
            // rows being the experts.
            // rows being the experts, at most 64 of them (one cluster of 8 blocks, sm_90 on).
            let pre = self.pre_route.load(Ordering::Relaxed)
                && self.clusters()
                && warp_route(mp)
                && mp.n_experts == nw.ne(1)
                && mp.n_experts <= 64
                && mp.k > 0;
            let router = [A::P(nw.mem.ptr), i(nw.ne(1)), A::P(nb.0.ptr), l(nr.off)];
            if pre {
                let (Some(se), Some(sw)) = (self.scratch(S::PreE, 4 * mp.k), self.scratch(S::PreW, 4 * mp.k)) else { return };
                let Some(xq) = self.scratch(S::PreXq, hd / 128 * 144) else { return };
                let gating = A::I(matches!(mp.gating, Gating::Sigmoid) as i32);
                let route = [i(mp.k), gating, A::I(mp.norm_topk as i32), A::F(mp.scale), A::P(se), A::P(sw), A::P(xq)];
                let args: [A; 22] = cat(cat::<11, 4, 15>(norm, router), route);
                // (By column slices of the row, add_rms_norm_parts_router_route_s, measured
                // slower on the H200: tg128 675.3 against 709.9; docs/PERF.md, session 27.)
                // (At 512 threads a block with the router's rows in shared memory, so that its
                // cluster fits beside mla_out_q8's blocks: tg128 623.5 against 709.1 on the H200,
                // docs/PERF.md, session 30; dropped.)
                self.launch("add_rms_norm_parts_router_route", (8, 1, 1), 1024, 0, &args);
                *self.routed.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Routed { logits: (nb.0.ptr, nr.off), input: (out.0.ptr, o.off), p: *mp });
                return;
            }
            let Some(done) = self.scratch(S::NormSync, 16) else { return };
            let args: [A; 16] = cat(cat::<11, 4, 15>(norm, router), [A::P(done)]);
            self.launch("add_rms_norm_parts_router", (nw.ne(1).div_ceil(8) as u32, 1, 1), 1024, 0, &args);
            return;
        }
        self.launch("add_rms_norm_parts", (1, 1, 1), 1024, 0, &norm);
        drop(_op);
        if let Some(m) = next {
            self.matmul(out, o, m.router, m.logits.0, m.logits.1);
        }
    }

    fn add_rms_norm(&self, x: &CudaBuf, xr: Rows, delta: &CudaBuf, dr: Rows, w: Option<&CudaWeight>, eps: f32, out: &CudaBuf, o: Rows) {
        if !self.fused {
            self.add(x, xr, delta, dr, x, xr);
            self.rms_norm(x, xr, w, eps, out, o);
            return;
        }
        assert!(xr.n == dr.n && xr.n == o.n && xr.width == dr.width && xr.width == o.width, "add_rms_norm: shapes {xr:?} {dr:?} {o:?}");
        x.check(xr);
        delta.check(dr);
        out.check(o);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), xr.width, "norm weight length != row width {}", xr.width);
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        let block = xr.width.next_power_of_two().clamp(32, 256) as u32;
        // Backend::prefetch_hint's regions go with a one-row norm (a decode layer's start) under
        // TS_CUDA_L2PF=2 (taken either way): one block's bulk prefetches, a measurement.
        let hint = self.take_hint(xr.n == 1 && self.l2pf >= 2);
        let args: [A; 21] = cat(add_norm_args((x, xr), (delta.0.ptr, dr), w, eps, (out, o)), hint);
        self.launch("add_rms_norm", (xr.n as u32, 1, 1), block, 0, &args);
    }

    fn rope_copy(&self, src: &CudaBuf, sr: Rows, dst: &CudaBuf, dr: Rows, heads_per_token: usize, batch: &CudaBatch, rope: &CudaRope) {
        if !self.fused {
            self.copy(src, sr, dst, dr);
            self.rope(dst, dr, heads_per_token, batch, rope);
            return;
        }
        assert!(sr.n == dr.n && sr.width == dr.width, "rope_copy: shapes {sr:?} {dr:?}");
        assert!(rope.dim <= sr.width && rope.dim % 2 == 0);
        assert_eq!(sr.n, batch.tokens.len() * heads_per_token, "rope_copy: rows != tokens * heads");
        src.check(sr);
        dst.check(dr);
        let half = rope.dim / 2;
        let mode = match rope.mode {
            RopeMode::Normal => 0,
            RopeMode::Neox => 1,
        };
        self.launch(
            "rope_copy_rows",
            Self::grid1(sr.n * (sr.width - half)),
            256,
            0,
            &[
                A::P(src.0.ptr),
                l(sr.off),
                l(sr.stride),
                A::P(dst.0.ptr),
                l(dr.off),
                l(dr.stride),
                l(sr.n),
                i(sr.width),
                i(heads_per_token),
                A::P(batch.pos_ptr()),
                A::P(rope.freqs.ptr),
                i(half),
                A::I(mode),
                A::F(rope.mscale),
            ],
        );
    }

    fn norm_rope_cache_write(
        &self,
        x: &CudaBuf,
        xr: Rows,
        norm_width: usize,
        w: Option<&CudaWeight>,
        eps: f32,
        batch: &CudaBatch,
        rope: &CudaRope,
        cache: &CudaCache,
    ) {
        self.norm_rope_cache(&Nrc { x, xr, norm_width, w, eps, q: None, batch, rope, cache });
    }

    fn mla_rope_cache_write(
        &self,
        x: &CudaBuf,
        xr: Rows,
        norm_width: usize,
        w: Option<&CudaWeight>,
        eps: f32,
        q: (&CudaBuf, Rows, &CudaBuf, Rows, usize),
        absorb: Option<(&CudaWeight, Rows, Rows)>,
        batch: &CudaBatch,
        rope: &CudaRope,
        cache: &CudaCache,
    ) {
        let (qs, qr, qd, qdr, heads) = q;
        assert!(qr.n == qdr.n && qr.width == qdr.width, "mla_rope_cache_write: q shapes {qr:?} {qdr:?}");
        assert!(rope.dim <= qr.width, "mla_rope_cache_write: rope {} over q width {}", rope.dim, qr.width);
        assert_eq!(qr.n, batch.tokens.len() * heads, "mla_rope_cache_write: q rows != tokens * heads");
        qs.check(qr);
        qd.check(qdr);
        let op = Nrc { x, xr, norm_width, w, eps, q: Some(q), batch, rope, cache };
        let Some((wk, src, dst)) = absorb else {
            self.norm_rope_cache(&op);
            return;
        };
        // One decode token: the absorbed query's product (gemv_q8_1's body, one matrix per head)
        // in the same launch as norm_rope_cache (mla_rope_absorb_1), whose blocks must then be
        // GQ_THREADS wide. Otherwise the two ops one after the other.
        let (k, m) = (wk.ne(0), wk.ne(1));
        // 16-bit W_uk (mla_rope_absorb_<t>_1): rows of at most 128 values, half a warp each.
        let h16 = matches!(wk.dtype, GgmlType::F16 | GgmlType::BF16)
            && self.path_on(Path::Absorb16)
            && k % 8 == 0
            && k <= 128
            && wk.mem.ptr % 16 == 0
            && wk.row_bytes % 16 == 0
            && wk.mat_bytes() % 16 == 0
            && src.off % 4 == 0
            && src.stride % 4 == 0;
        let smem = if h16 { 0 } else { k * 9 / 8 };
        let merged = self.fused
            && self.rope_absorb
            && !self.exact
            && xr.n == 1
            && (wk.dtype == GgmlType::Q8_0 || h16)
            && wk.shape.len() == 3
            && wk.ne(2) == heads
            && (src.n, src.width, dst.n, dst.width) == (heads, k, heads, m)
            && norm_width.next_power_of_two().clamp(32, 256) == 256
            && norm_width > 0
            && norm_width + rope.dim <= xr.width
            && rope.dim % 2 == 0
            && xr.width == cache.width
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == norm_width)
            && smem <= self.smem_max;
        if !merged {
            self.norm_rope_cache(&op);
            self.matmul_grouped(qs, src, wk, qd, dst);
            return;
        }
        x.check(xr);
        qs.check(src);
        qd.check(dst);
        if !self.check_cache_rows(batch, cache.rows, "mla_rope_cache_write") {
            return;
        }
        let (_, qblocks, nrc) = op.args();
        let lpr = (k / 16).next_power_of_two().min(32);
        // Blocks a head: Q8_0 as gemv_q8_1's tiles; 16-bit weights RA_ROWS rows a half-warp.
        let gtiles = if h16 { m.div_ceil(8 * 2 * 4) } else { m.div_ceil(8 * (32 / lpr)).min(self.sm_count * 8) };
        let args: [A; 36] = cat(
            nrc,
            [
                i(qblocks),
                A::P(wk.mem.ptr),
                l(wk.row_bytes),
                l(wk.mat_bytes()),
                i(m),
                i(k),
                l(src.off),
                l(src.stride),
                l(dst.off),
                l(dst.stride),
                i(gtiles),
                i(lpr),
            ],
        );
        if h16 {
            self.took(Path::Absorb16);
        }
        let name = match wk.dtype {
            GgmlType::BF16 => "mla_rope_absorb_bf16_1",
            GgmlType::F16 => "mla_rope_absorb_f16_1",
            _ => "mla_rope_absorb_1",
        };
        self.launch(cache.kernel(name).as_str(), ((1 + qblocks + gtiles * heads) as u32, 1, 1), 256, smem as u32, &args);
    }

    fn moe_shared(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        shared: Experts<'_, CudaWeight>,
        p: &MoeParams,
        out: &CudaBuf,
        o: Rows,
    ) -> bool {
        self.moe_shared_to(x, xr, logits, lr, experts, shared, p, out, o, false)
    }

    fn moe_shared_residual(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        shared: Experts<'_, CudaWeight>,
        p: &MoeParams,
        res: &CudaBuf,
        rr: Rows,
    ) -> bool {
        self.moe_residual.load(Ordering::Relaxed) && self.moe_shared_to(x, xr, logits, lr, experts, shared, p, res, rr, true)
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        let r = self.stream.synchronize().map_err(|e| dev_err("cuda stream", e));
        self.take_error()?;
        r
    }
}

impl CudaBackend {
    /// `moe_shared` into `out` (radd false), or added into the residual rows `out` (radd: only
    /// on the one-token Q8_0 path of three launches, whose down kernel adds; else it declines
    /// with nothing taken or enqueued).
    #[allow(clippy::too_many_arguments)]
    fn moe_shared_to(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        shared: Experts<'_, CudaWeight>,
        p: &MoeParams,
        out: &CudaBuf,
        o: Rows,
        radd: bool,
    ) -> bool {
        let n = xr.n;
        let (hdim, ff, ne, k) = (experts.gate.ne(0), experts.gate.ne(1), p.n_experts, p.k);
        let sf = shared.gate.ne(1);
        let all = [experts.gate, experts.up, experts.down, shared.gate, shared.up, shared.down];
        let ty = experts.gate.dtype;
        let same = all.iter().all(|w| w.dtype == ty);
        // Q8_0 experts (activations quantised once, dp4a), or f16/bf16 experts with 16-byte
        // aligned rows and an input view the float4 loads can read.
        let q8 = same && ty == GgmlType::Q8_0 && ff % 128 == 0 && self.smem_max > 0;
        let h16 = same
            && matches!(ty, GgmlType::F16 | GgmlType::BF16)
            && hdim % 8 == 0
            && ff % 8 == 0
            && all.iter().all(|w| w.mem.ptr % 16 == 0 && w.row_bytes % 16 == 0 && w.mat_bytes() % 16 == 0)
            && xr.off % 4 == 0
            && xr.stride % 4 == 0;
        let shapes = xr.width == hdim
            && lr.n == n
            && o.n == n
            && lr.width == ne
            && o.width == hdim
            && (experts.gate.ne(2), experts.up.ne(0), experts.up.ne(1), experts.up.ne(2)) == (ne, hdim, ff, ne)
            && (experts.down.ne(0), experts.down.ne(1), experts.down.ne(2)) == (ff, hdim, ne)
            && [shared.gate, shared.up, shared.down].iter().all(|w| w.shape.len() <= 3 && w.ne(2) == 1)
            && (shared.gate.ne(0), shared.up.ne(0), shared.up.ne(1)) == (hdim, hdim, sf)
            && (shared.down.ne(0), shared.down.ne(1)) == (sf, hdim)
            && ff > 0
            && sf % ff == 0
            && (1..=32).contains(&(sf / ff))
            && (1..=32).contains(&k)
            && k <= ne;
        // Into the residual: the path of three launches only (one token, Q8_0, not the one-launch
        // MoE), decided before anything is taken or enqueued.
        if radd && !(n == 1 && self.fused && q8 && shapes && warp_route(p) && self.moe_one.load(Ordering::Relaxed) == 0) {
            return false;
        }
        // A routing made ahead for this op (pre_route) serves it or none: taken on every path
        // (but radd's decline above).
        let routed = self.routed.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Batches above the decode size (the server's steps, prompts): the shared FFN's blocks of
        // ff rows ride in the grouped tensor-core expert products as experts E.. (moe_mmq): one
        // chain of launches instead of the routed one plus the dense FFN's (TS_CUDA_MOE_SH=0:
        // the caller's two chains, to compare).
        let batched = !radd
            && self.fused
            && self.moe_sh
            && n > GEMV_MAX_TOKENS
            && q8
            && self.tc
            && !self.exact
            && MMQ_SMEM <= self.smem_max
            && shapes
            && ne + sf / ff <= 512
            && (1..=64).contains(&p.n_group)
            && ne % p.n_group == 0;
        if batched {
            x.check(xr);
            logits.check(lr);
            out.check(o);
            let (k, ks) = (p.k, p.k + sf / ff);
            let pairs = n * ks;
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(sel_e) = self.scratch(S::SelE, 4 * n * k) else { return true };
            let Some(sel_w) = self.scratch(S::SelW, 4 * n * k) else { return true };
            let Some(g) = self.scratch(S::G, 4 * pairs * ff) else { return true };
            let Some(u) = self.scratch(S::U, 4 * pairs * ff) else { return true };
            let Some(y) = self.scratch(S::Y, 4 * pairs * hdim) else { return true };
            self.moe_mmq(x, xr, logits, lr, &experts, Some(&shared), p, warp_route(p), (sel_e, sel_w, g, u, y), out, o);
            return true;
        }
        let ok = self.fused && (1..=GEMV_MAX_TOKENS).contains(&n) && (q8 || h16) && shapes && warp_route(p);
        if !ok {
            return false;
        }
        x.check(xr);
        logits.check(lr);
        out.check(o);
        let nsh = sf / ff;
        let ks = k + nsh;
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        // Routed already, in the launch that made the logits (pre_route)?
        let pre = n == 1 && routed.is_some_and(|r| r.serves((logits.0.ptr, lr.off), (x.0.ptr, xr.off), p));
        if pre {
            self.pre_routed.fetch_add(1, Ordering::Relaxed);
        }
        // A scratch that cannot be had (an allocation during a capture, or a failed one) has been
        // recorded: the op counts as enqueued (the step is redone or the error reported).
        let (se, sw) = if pre { (S::PreE, S::PreW) } else { (S::SelE, S::SelW) };
        let Some(sel_e) = self.scratch(se, 4 * n * k) else { return true };
        let Some(sel_w) = self.scratch(sw, 4 * n * k) else { return true };
        let Some(g) = self.scratch(S::G, 4 * n * ks * ff) else { return true };
        if h16 {
            if !pre {
                self.route(logits, lr, p, true, sel_e, sel_w);
            }
            self.moe_shared_h16(x, xr, p, &experts, &shared, (n, ks, nsh), (sel_e, sel_w, g), out, o);
            return true;
        }
        // Activations quantised once (the input per token, the GLU output per slot, times its
        // router weight), in the weights' group layout.
        let (xrow, hrow) = (hdim.div_ceil(128) * 144, ff.div_ceil(128) * 144);
        let Some(xq) = self.scratch(if pre { S::PreXq } else { S::Xq }, n * xrow) else { return true };
        let Some(hq) = self.scratch(S::Hq, n * ks * hrow) else { return true };
        let dw = experts.down;
        let act = match p.glu {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        // One token: gate/up and down in one launch whose down warps start on their slots as
        // those finish (moe_sh_q8_one; two warps a down row, as moe_down_sh_q8), with the routing
        // and the input's quantisation in its block 0 (TS_CUDA_MOE_ONE_ROUTE=0: moe_route_quant).
        let cap = self.moe_one.load(Ordering::Relaxed);
        let one = n == 1 && cap > 0 && !pre && !self.down_w4.0 && ks + 2 <= MOE_SH_MAX_SLOTS;
        let inline_route = one && self.moe_one_route;
        // moe_gateup_sh_q8q's arguments, which its one-token variants extend.
        let gu: [A; 17] =
            moe_gateup_args(&experts, &shared, (ff, hdim, k, nsh), (sel_e, sel_w), [A::P(xq), l(xrow), A::I(act), A::P(hq), l(hrow)]);
        if !inline_route && !pre {
            // The routing and the input's quantisation in one launch (moe_route_quant).
            let ngroups = hdim.div_ceil(128);
            let args: [A; 17] = cat(
                Self::route_lead(logits, lr, p),
                [A::P(sel_e), A::P(sel_w), A::P(x.0.ptr), l(xr.off), l(xr.stride), i(hdim), A::P(xq), l(xrow)],
            );
            self.launch("moe_route_quant", ((n.div_ceil(8) + (n * ngroups).div_ceil(8)) as u32, 1, 1), 256, 0, &args);
        }
        if one {
            let Some(cnt) = self.scratch(S::Sync, 4 * (ks + 2)) else { return true };
            let items = ks * ff / 32 + hdim.div_ceil(4);
            let gating = A::I(matches!(p.gating, Gating::Sigmoid) as i32);
            let args: [A; 34] = cat(
                gu,
                [
                    A::P(dw.mem.ptr),
                    l(dw.row_bytes),
                    l(dw.mat_bytes()),
                    i(hdim),
                    A::P(shared.down.mem.ptr),
                    l(shared.down.row_bytes),
                    A::P(out.0.ptr),
                    l(o.off),
                    A::P(cnt),
                    A::P(if inline_route { logits.0.ptr } else { 0 }),
                    l(lr.off),
                    i(p.n_experts),
                    gating,
                    A::I(p.norm_topk as i32),
                    A::F(p.scale),
                    A::P(x.0.ptr),
                    l(xr.off),
                ],
            );
            self.launch("moe_sh_q8_one", (items.min(cap) as u32, 1, 1), 256, 0, &args);
            return true;
        }
        // Gate/up with the GLU output quantised in the kernel (32 rows per block).
        // (Each warp's rows 2 and 3 staged in shared memory by cp.async with row 0's loads,
        // three blocks an SM: tg128 650.9 against 709.1 on the H200, docs/PERF.md, session 30;
        // dropped.)
        self.launch("moe_gateup_sh_q8q", (ff.div_ceil(32) as u32, (n * ks) as u32, 1), 256, 0, &gu);
        // Two rounds of weights before the wait with the activations staged in shared memory
        // (moe_down_sh_q8s) measured slower on the H200: tg128 671.9 against 709.5 (docs/PERF.md,
        // session 26); dropped.
        self.launch(
            if self.down_w4.0 { "moe_down_sh_q8_w4" } else { "moe_down_sh_q8" },
            (hdim.div_ceil(if self.down_w4.0 { 2 } else { 4 }) as u32, n as u32, 1),
            256,
            0,
            &cat::<15, 1, 16>(moe_down_args(dw, shared.down, (hdim, ff, k, nsh), sel_e, (hq, hrow), out, o), [A::I(radd as i32)]),
        );
        true
    }

    /// `add_rms_norm_matmul_many` (`delta` Some) and `rms_norm_matmul_many` (None).
    /// Whether `matmul_many` of `n` rows of width `k` runs `jobs` as int8 tensor-core products
    /// of one quantised input (above the GEMV sizes; Q8_0 matrices of `k` columns).
    fn mmq_many(&self, n: usize, k: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) -> bool {
        self.tc
            && jobs.len() >= 2
            && n > GEMV_MAX_TOKENS
            && MMQ_SMEM <= self.smem_max
            && jobs.iter().all(|(w, _, o)| {
                w.dtype == GgmlType::Q8_0 && w.shape.len() <= 3 && w.ne(2) == 1 && w.ne(0) == k && o.n == n && o.width == w.ne(1)
            })
    }

    /// Whether a batch of `n` rows of width `k` (output rows `o`, norm weights `w`) takes the
    /// norm-and-quantise launch ([`Path::NormQ8`]): decode batches on the int8 products.
    fn norm_q8_ok(&self, n: usize, k: usize, o: (usize, usize), w: Option<&CudaWeight>) -> bool {
        self.fused
            && self.tc
            && self.path_on(Path::NormQ8)
            && n > GEMV_MAX_TOKENS
            && n <= GRAPH_MAX_TOKENS
            && o == (n, k)
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == k)
    }

    /// `add_rms_norm_q8`: rows `x` (+= the delta), normed into `out`, and `out`'s Q8_0 groups
    /// into `xq` (kernels/fused.cu; the same bits as add_rms_norm then quant_q8_groups). The
    /// delta (pointer, rows, splits): rows of a buffer (splits 0, checked by the caller), or a
    /// product's split-K partials left by `mmq_dense` (splits > 0, split `s` at `s * n * width`
    /// floats; rows of at most 8 * 256 values), summed in split order as `mmq_sum_splits` would.
    fn add_rms_norm_q8(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(u64, Rows, usize)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        xq: u64,
    ) {
        x.check(xr);
        out.check(o);
        let (n, k) = (xr.n, xr.width);
        let (dp, dr, nsplit) = delta.unwrap_or((0, Rows::packed(0, 0), 0));
        let q = [i(n), A::P(xq), l(k.div_ceil(128) * 144), i(nsplit), l(dr.n * dr.width)];
        let args: [A; 18] = cat(add_norm_args((x, xr), (dp, dr), w, eps, (out, o)), q);
        self.launch("add_rms_norm_q8", (n as u32, 1, 1), k.next_power_of_two().clamp(32, 256) as u32, 0, &args);
    }

    /// `mmq_many`'s products from the quantised input `xq` (`ngroups` groups a row).
    fn mmq_jobs(&self, ngroups: usize, xq: u64, n: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) {
        if self.mmq_dense_jobs(ngroups, xq, n, jobs) {
            return;
        }
        for &(w, out, o) in jobs {
            out.check(o);
            self.mmq_dense(w, ngroups, xq, (n, n, 1), out, o, SplitSum::Plain);
        }
    }

    fn norm_matmul_many(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(&CudaBuf, Rows)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        let k = xr.width;
        // One token, 2 or 3 products of the row, the norm in the product kernels' blocks
        // (kernels/fused.cu: add_rms_norm's block of 256 threads, its register path), else the
        // two ops. The preconditions both kernels share, with each job's shape:
        let common = self.fused
            && xr.n == 1
            && delta.is_none_or(|(d, dr)| dr.n == 1 && dr.width == k && out.0.ptr != d.0.ptr)
            && o.n == 1
            && o.width == k
            && k > 128
            && k <= 8 * 256
            && k % 128 == 0
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == k)
            && (2..=3).contains(&jobs.len())
            && jobs.iter().all(|(jw, _, jo)| {
                jw.shape.len() <= 3 && jw.ne(2) == 1 && jw.ne(0) == k && jo.n == 1 && jo.width == jw.ne(1) && jw.ne(1) > 0
            });
        // Q8_0 jobs: gemv_q8_multi_norm_1; without a delta only while `moe_residual` is on (it
        // was measured with it).
        let one = common
            && self.norm_mm.load(Ordering::Relaxed)
            && (delta.is_some() || self.moe_residual.load(Ordering::Relaxed))
            && k * 9 / 8 + 4 * k <= self.smem_max
            && jobs.iter().all(|(jw, _, _)| jw.dtype == GgmlType::Q8_0);
        // All f16 or all bf16 jobs, rows of whole 16-byte pieces: gemv_h16_multi_norm_<t>_1,
        // while `norm_mm16` is on.
        let t16 = jobs.first().map(|(jw, _, _)| jw.dtype).filter(|t| matches!(t, GgmlType::F16 | GgmlType::BF16));
        let one16 = common
            && !one
            && self.norm_mm16.load(Ordering::Relaxed)
            && 4 * k <= self.smem_max
            && t16.is_some()
            && jobs.iter().all(|(jw, _, _)| Some(jw.dtype) == t16 && jw.mem.ptr % 16 == 0 && jw.row_bytes % 16 == 0);
        // A decode batch on the int8 products (matmul_many's mmq_many, below its cuBLAS sizes):
        // the norm and the input's quantisation in one launch (Path::NormQ8).
        let n = xr.n;
        let q8 = !one
            && !one16
            && self.norm_q8_ok(n, k, (o.n, o.width), w)
            && self.mmq_many(n, k, jobs)
            && delta.is_none_or(|(_, dr)| (dr.n, dr.width) == (n, k));
        if q8 {
            self.took(Path::NormQ8);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, n * ngroups * 144) else { return };
            let delta = delta.map(|(d, dr)| {
                d.check(dr);
                (d.0.ptr, dr, 0)
            });
            self.add_rms_norm_q8((x, xr), delta, w, eps, (out, o), xq);
            self.mmq_jobs(ngroups, xq, n, jobs);
            return;
        }
        if !one && !one16 {
            match delta {
                Some((d, dr)) => self.add_rms_norm(x, xr, d, dr, w, eps, out, o),
                None => self.rms_norm(x, xr, w, eps, out, o),
            }
            self.matmul_many(out, o, jobs);
            return;
        }
        x.check(xr);
        if let Some((d, dr)) = delta {
            d.check(dr);
        }
        out.check(o);
        let Some(done) = self.scratch(S::NormSync, 16) else { return };
        // x, delta, the norm's weights and eps, h, the counter (gemv_*_multi_norm_1's tail).
        let norm = [
            A::P(x.0.ptr),
            l(xr.off),
            A::P(delta.map_or(0, |(d, _)| d.0.ptr)),
            l(delta.map_or(0, |(_, dr)| dr.off)),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(out.0.ptr),
            l(o.off),
            // Word 1 of NormSync (word 0 is add_rms_norm_parts_router's).
            A::P(done + 4),
        ];
        if one16 {
            let (table, total) = multi_job_table(jobs, 8);
            let args: [A; 32] = cat(cat::<21, 1, 22>(table, [i(k)]), norm);
            let name = if t16 == Some(GgmlType::BF16) { "gemv_h16_multi_norm_bf16_1" } else { "gemv_h16_multi_norm_f16_1" };
            self.launch(name, (total.min(self.sm_count * 8) as u32, 1, 1), 256, (4 * k) as u32, &args);
            return;
        }
        let (table, lpr, total) = multi_jobs(jobs, k);
        let args: [A; 33] = cat(cat::<21, 2, 23>(table, [i(k), i(lpr)]), norm);
        self.launch("gemv_q8_multi_norm_1", (total.min(self.sm_count * 8) as u32, 1, 1), 256, (k * 9 / 8 + 4 * k) as u32, &args);
    }

    /// Splits a token of a batch of `n` (> 1) gets on the tensor-core MLA decode: one block an
    /// SM over the batch (`sm_count / n`) while those splits take at most
    /// [`CudaBackend::mla_kps_b`] keys of the longest context each, else two (`2 * sm_count /
    /// n`); part of the step's graph key. Fewer, longer splits write and merge fewer partial
    /// rows. H200, 64 sequences (gpu-next117, tok/s): `-d 96` 2 splits 8,414 against 4's 8,377
    /// (1: 8,266, 3: 8,370); `-d 200` 2 splits 8,262 against 8,242 (3: 8,211); `-d 400` 4
    /// splits 8,082 against 2's 8,049.
    fn tc_batch_splits(&self, n: usize, pos: impl Iterator<Item = u32>) -> usize {
        tc_batch_splits(self.sm_count, n, self.mla_kps_b, pos.max())
    }

    /// Splits a token of a batch of `n` (> 1) gets on the 16-head SIMT MLA decode: one wave
    /// (`sm_count / n`, the kernel holds an SM alone), and no more than the runs of
    /// [`CudaBackend::mla_keys`] keys in the longest context; part of the step's graph key.
    fn batch_mla_splits(&self, n: usize, pos: impl Iterator<Item = u32>) -> usize {
        let wave = (self.sm_count / n).max(1);
        match (self.mla_keys, pos.max()) {
            (0, _) | (_, None) => wave,
            (k, Some(p)) => wave.min((p as usize + 1).div_ceil(k)),
        }
    }

    /// Whether a step of `n` tokens at these positions counts as long-context (`mla_long`, or
    /// `mla_long_batch` for several tokens), part of the step's graph key
    /// ([`Backend::graph_class`]).
    fn long_context(&self, n: usize, pos: impl Iterator<Item = u32>) -> bool {
        let from = if n > 1 { self.mla_long_batch } else { self.mla_long };
        from > 0 && pos.max().is_some_and(|p| p >= from)
    }

    /// `norm_rope_cache_write`, and with `q` also `rope_copy` of the query's rope part, in one
    /// `norm_rope_cache` launch (kernels/fused.cu).
    fn norm_rope_cache(&self, op: &Nrc<'_>) {
        let &Nrc { x, xr, norm_width, w, eps, q, batch, rope, cache } = op;
        if !self.fused {
            let nr = xr.cols(0, norm_width);
            self.rms_norm(x, nr, w, eps, x, nr);
            self.rope(x, xr.cols(norm_width, xr.width - norm_width), 1, batch, rope);
            self.cache_write(cache, x, xr, batch);
            if let Some((qs, qr, qd, qdr, heads)) = q {
                self.rope_copy(qs, qr, qd, qdr, heads, batch, rope);
            }
            return;
        }
        assert!(
            norm_width > 0 && norm_width + rope.dim <= xr.width && rope.dim % 2 == 0,
            "norm_rope_cache_write: {norm_width} + rope {} > width {}",
            rope.dim,
            xr.width
        );
        assert_eq!(xr.n, batch.tokens.len());
        assert_eq!(xr.width, cache.width, "norm_rope_cache_write: row width {} != cache width {}", xr.width, cache.width);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), norm_width, "norm weight length != norm width {norm_width}");
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        x.check(xr);
        if !self.check_cache_rows(batch, cache.rows, "norm_rope_cache_write") {
            return;
        }
        let (block, qblocks, args) = op.args();
        self.launch(cache.kernel("norm_rope_cache").as_str(), (xr.n as u32, 1 + qblocks as u32, 1), block, 0, &args);
    }
}

/// One `norm_rope_cache_write` / `mla_rope_cache_write` as the backend's ops receive it: the
/// latent rows `x` (`xr`; the first `norm_width` values normalised by `w`, then `rope.dim` roped),
/// the query's rope part `q` when there is one (rows in, rows out, heads per token), the batch
/// and the cache the rows go to.
#[derive(Clone, Copy)]
struct Nrc<'a> {
    x: &'a CudaBuf,
    xr: Rows,
    norm_width: usize,
    w: Option<&'a CudaWeight>,
    eps: f32,
    q: Option<(&'a CudaBuf, Rows, &'a CudaBuf, Rows, usize)>,
    batch: &'a CudaBatch,
    rope: &'a CudaRope,
    cache: &'a CudaCache,
}

impl Nrc<'_> {
    /// The launch's block size, query-rope block count and arguments (kernels/fused.cu).
    fn args(&self) -> (u32, usize, [A; 24]) {
        let &Nrc { x, xr, norm_width, w, eps, q, batch, rope, cache } = self;
        let mode = match rope.mode {
            RopeMode::Normal => 0,
            RopeMode::Neox => 1,
        };
        let block = norm_width.next_power_of_two().clamp(32, 256) as u32;
        // The query's rope items (heads x (width - half) per token) in blocks of about two per
        // thread, beside the latent row's block.
        let qblocks = q.map_or(0, |q| (q.4 * (q.1.width - rope.dim / 2)).div_ceil(2 * block as usize).clamp(1, 64));
        let args = [
            A::P(x.0.ptr),
            l(xr.off),
            l(xr.stride),
            i(xr.width),
            i(norm_width),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(batch.pos_ptr()),
            A::P(batch.slot_ptr()),
            A::I(batch.slot_len as i32),
            A::P(rope.freqs.ptr),
            i(rope.dim / 2),
            A::I(mode),
            A::F(rope.mscale),
            A::P(cache.mem.ptr),
            A::P(q.map_or(0, |q| q.0 .0.ptr)),
            l(q.map_or(0, |q| q.1.off)),
            l(q.map_or(0, |q| q.1.stride)),
            A::P(q.map_or(0, |q| q.2 .0.ptr)),
            l(q.map_or(0, |q| q.3.off)),
            l(q.map_or(0, |q| q.3.stride)),
            i(q.map_or(0, |q| q.1.width)),
            i(q.map_or(0, |q| q.4)),
        ];
        (block, qblocks, args)
    }
}

#[cfg(test)]
mod tests {
    /// The tiled copy: what each lane of `mmq_q8_rows` loads from it (one 16-byte load for
    /// the scales of rows g and g+8, one a block for its 8 bytes of both, word-interleaved) is what it loads from
    /// the row-major layout; padding rows are zeros; the size is `tile16_mat_bytes`.
    #[test]
    fn tile16_places_every_group() {
        let (rb, rows, mats) = (3 * 144, 21, 2);
        let data: Vec<u8> = (0..mats * rows * rb).map(|i| (i * 7 % 251) as u8 | 1).collect();
        let t = super::tile16(&data, rb, rows);
        assert_eq!(t.len(), mats * super::tile16_mat_bytes(rb, rows));
        let at = |e: usize, r: usize, o: usize| -> &[u8] {
            if r < rows {
                &data[(e * rows + r) * rb + o..][..8]
            } else {
                &[0u8; 8]
            }
        };
        for e in 0..mats {
            for tile in 0..2 {
                for gi in 0..3 {
                    let p = ((e * 2 + tile) * 3 + gi) * super::TILE_GROUP;
                    for lane in 0..32 {
                        let (g, tt) = (lane / 4, lane % 4);
                        let (ra, rb2) = (tile * 16 + g, tile * 16 + g + 8);
                        let h = &t[p + 16 * g..][..16];
                        assert_eq!(&h[..8], at(e, ra, gi * 144), "scales e {e} tile {tile} group {gi} row {ra}");
                        assert_eq!(&h[8..], at(e, rb2, gi * 144), "scales e {e} tile {tile} group {gi} row {rb2}");
                        for bl in 0..4 {
                            // Words: row g's bytes 8t.., row g+8's, row g's 8t+4.., row g+8's.
                            let q = &t[p + 128 + 512 * bl + 16 * lane..][..16];
                            let o = gi * 144 + 16 + 32 * bl + 8 * tt;
                            let (a, b) = (at(e, ra, o), at(e, rb2, o));
                            assert_eq!([&q[..4], &q[8..12]].concat(), a, "quants e {e} row {ra} group {gi} block {bl}");
                            assert_eq!([&q[4..8], &q[12..]].concat(), b, "quants e {e} row {rb2} group {gi} block {bl}");
                        }
                    }
                }
            }
        }
    }

    /// Tokens taken from the last arg-max are copied in runs of consecutive rows.
    #[test]
    fn fed_runs_coalesce_consecutive_rows() {
        use ts_core::{TokenMeta, TOKEN_FROM_ARGMAX as F};
        let toks: Vec<TokenMeta> =
            [F + 5, F + 4, F, F + 1, F + 2, 17, F + 3, F + 4].iter().map(|&token| TokenMeta { token, pos: 0, slot: 0 }).collect();
        let runs: Vec<_> = super::FedRuns::of(&toks).collect();
        assert_eq!(runs, [(0, 5, 1), (1, 4, 1), (2, 0, 3), (6, 3, 2)]);
        let plain = [TokenMeta { token: 3, pos: 0, slot: 0 }];
        assert_eq!(super::FedRuns::of(&plain).count(), 0);
    }

    /// Kernel names built on the stack equal the format! strings; an over-long one is cut, never
    /// a panic.
    #[test]
    fn kernel_names_on_the_stack() {
        let (nt, tn, h16) = (8, "bf16", "h16_");
        assert_eq!(super::KName::of(format_args!("gemv_q8_{nt}")).as_str(), "gemv_q8_8");
        assert_eq!(super::KName::of(format_args!("moe_gemv_{h16}{tn}")).as_str(), "moe_gemv_h16_bf16");
        let long = "x".repeat(100);
        assert!(super::KName::of(format_args!("{long}")).as_str().len() <= 48);
    }

    /// The batch split rule: one block an SM while a split holds at most `kps` keys of the
    /// longest context, else two; 0 keeps two always.
    #[test]
    fn tc_batch_split_rule() {
        // 132 SMs, 64 sequences: 2 splits up to 256 keys, then 4.
        assert_eq!(super::tc_batch_splits(132, 64, 128, Some(127)), 2);
        assert_eq!(super::tc_batch_splits(132, 64, 128, Some(255)), 2);
        assert_eq!(super::tc_batch_splits(132, 64, 128, Some(256)), 4);
        assert_eq!(super::tc_batch_splits(132, 64, 0, Some(95)), 4);
        assert_eq!(super::tc_batch_splits(132, 64, 128, None), 4);
        // More tokens than SMs: one split either way.
        assert_eq!(super::tc_batch_splits(132, 200, 128, Some(1000)), 1);
        // 32 sequences: 4 splits up to 512 keys, then 8.
        assert_eq!(super::tc_batch_splits(132, 32, 128, Some(511)), 4);
        assert_eq!(super::tc_batch_splits(132, 32, 128, Some(512)), 8);
    }

    /// Every kernel given more shared memory at start, or asked its occupancy, is one the
    /// backend loads (`funcs[name]` would otherwise panic in `CudaBackend::new`, found only on a
    /// GPU).
    #[test]
    fn big_smem_kernels_are_loaded() {
        let names = super::kernel_names();
        for k in super::BIG_SMEM_KERNELS.iter().chain(&["moe_sh_q8_one", "mmh_gu", "mmh_dn", "mmh8_gu", "mmh8_dn"]) {
            assert!(names.iter().any(|n| n == k), "{k} is not in kernel_names()");
        }
    }

    /// Every kernel the backend loads at start is in the module NVRTC builds (a missing one is
    /// otherwise found only on a GPU, as an error at `CudaBackend::new`): each name must stand
    /// in the CUBIN's string table as a whole, NUL-delimited symbol. Needs libnvrtc (CI installs
    /// it; without it the test says SKIP and passes).
    #[test]
    fn every_loaded_kernel_is_in_the_module() {
        if !crate::kernels::nvrtc_available() {
            eprintln!("\n*** SKIP: libnvrtc could not be loaded; the kernel list was NOT checked ***\n");
            return;
        }
        let cubin = crate::kernels::compile_cubin("sm_90").expect("kernels compile");
        let missing: Vec<String> = super::kernel_names()
            .into_iter()
            .filter(|n| {
                let mut pat = vec![0u8];
                pat.extend_from_slice(n.as_bytes());
                pat.push(0);
                !cubin.windows(pat.len()).any(|w| w == pat.as_slice())
            })
            .collect();
        assert!(missing.is_empty(), "kernels listed but not built: {missing:?}");
    }
}
