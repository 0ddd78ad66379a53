//! [`CudaBackend`]: every [`Backend`] op on one NVIDIA GPU, enqueued on one stream.
//!
//! * Buffers, caches, weights and batches are plain device allocations addressed by raw device
//!   pointers; kernels take `(pointer, offset, stride)` triples, so `Rows` views and in-place ops
//!   cost nothing. Event tracking is off (one stream orders everything; the one exception,
//!   [`Path::SharedFork`]'s side stream, is ordered with the main one by its fork and join
//!   events within the op that uses it).
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
//!
//! Here: the device types, the kernel list, the backend's state, its switches and its launch,
//! scratch, trace and graph machinery. The ops ([`Backend`] for [`CudaBackend`]) are in `ops`;
//! the work they enqueue in `products` (dense and grouped quantised products), `moe` (routing
//! and the expert ops), `attention` (MLA) and `layout` (the weights' device layouts).

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

mod attention;
mod layout;
mod lt;
mod moe;
mod ops;
mod products;

use attention::{JointRows, Nrc};
pub use layout::tile16;
use layout::*;

/// One device allocation; freed (stream-ordered) on drop.
struct DevMem {
    /// The allocation (shared by views of it: weights stored side by side,
    /// `Backend::join_products`).
    _slice: Arc<CudaSlice<u8>>,
    ptr: u64,
    bytes: usize,
}

impl DevMem {
    /// `bytes` bytes from byte `off` of the same allocation.
    fn view(&self, off: usize, bytes: usize) -> DevMem {
        assert!(off + bytes <= self.bytes, "view {off}+{bytes} of {} bytes", self.bytes);
        DevMem { _slice: self._slice.clone(), ptr: self.ptr + off as u64, bytes }
    }
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

/// The kernels' rope `mode` argument: 0 rotates consecutive pairs (2i, 2i + 1), 1 NeoX's
/// halves (i, i + dim / 2).
fn rope_mode(rope: &CudaRope) -> i32 {
    match rope.mode {
        RopeMode::Normal => 0,
        RopeMode::Neox => 1,
    }
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
    /// `gemv_q8_multi_norm_1`'s; word 2 `moe_gateup_sh_q8d`'s unit claims ([`Path::GuDyn`],
    /// reset by the block that makes the last claim).
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
    /// A decode batch's attention values (`[n, heads * v]`) in f16, written by the W_uv product
    /// on cuBLAS for the W_o product (`values_out_blas`, [`Path::DenseBlasBatch`]).
    AvH,
    /// A decode batch's attention output (`[n * heads, kv_lora]`) in f16, written by the merge
    /// (`mla_combine_few`) beside its f32 rows for the W_uv product on cuBLAS
    /// (`values_out_blas`).
    LatH,
    /// A decode batch's q and kv_a rows from one product of their side-by-side f16 copies
    /// (`[n, q + kv_a]` f32, [`Path::QkvJoint`]), read by `norm_rope_cache` in place of the
    /// model's `q` and `kv` buffers.
    Qkv,
}
const N_SCRATCH: usize = 31;

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
    "moe_gateup_sh_q8d",
    "moe_gateup_sh_q8t",
    "moe_down_sh_q8",
    "moe_down_sh_q8_w4",
    "mla_prefill",
    "mla_prefill_h",
    "mla_prefill_ha",
    "mla_split_tc",
    "mla_split_tc_h",
    "mla_split_tc_he",
    "mla_split_tc_hep",
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
    "mla_out_q8p",
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
/// The Hopper MoE and output-head kernels (kernels/mmh.cu) with the dynamic shared memory each
/// is given at start; `CudaBackend::mmh` is whether all got it.
const MMH_KERNELS: [(&str, usize); 5] =
    [("mmh_gu", MMH_SMEM), ("mmh_dn", MMH_SMEM), ("mmh8_gu", MMH8_SMEM), ("mmh8_dn", MMH8_SMEM), ("mmh8_dn200", MMH8_SMEM)];
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
/// (A float4 form in 8,192-value chunks, one wave of 832 blocks at 64 rows, `Path::ArgmaxVec`,
/// read the same on an H100 in the fifty-sixth session: 7,888 / 7,885 tok/s at 64 sequences
/// against 7,883 / 7,891 without. Removed; git history has it, commit b75e77b.)
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

/// A decode batch's product of more rows than this (and one matrix) is taken for the output
/// head: the head paths ([`Path::HeadBlas`], [`Path::HeadMmh`]).
const HEAD_ROWS: usize = 8192;

/// Weight rows a tile of [`Path::HeadMmh`]'s launch for a head of `m` rows on `sm` SMs at one
/// block an SM: `forced` (200 or 256) where it divides `m`, else (`forced` 0) whichever of 256 and
/// 200 dividing `m` spends fewer tile-rows of time over its whole waves (256 on a tie: the
/// kernel the prompt MoE runs); 0 where neither divides `m` (the path declines). The kernels'
/// time a tile grows with its rows (each stage's rows are copied and turned into f16 by the
/// same warps), so a ragged last wave of 256-row tiles costs a whole wave.
fn head_tile(m: usize, sm: usize, forced: usize) -> usize {
    let cost = |bn: usize| m.div_ceil(bn).div_ceil(sm.max(1)) * bn;
    match forced {
        0 => [256, 200].into_iter().filter(|&bn| m.is_multiple_of(bn)).min_by_key(|&bn| cost(bn)).unwrap_or(0),
        bn if m.is_multiple_of(bn) => bn,
        _ => 0,
    }
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
        && k.is_multiple_of(8)
        && w.row_bytes.is_multiple_of(16)
        && w.mat_bytes().is_multiple_of(16)
        && w.mem.ptr.is_multiple_of(16)
        && xoff.is_multiple_of(4)
        && xstride.is_multiple_of(4)
}

/// Bytes of one 16-row tile's group in the tiled copy (`MMQ_TG` in kernels/mmq.cu).
const TILE_GROUP: usize = 2176;

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
        "mla_split_tc_hep",
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
        "add_rms_norm_h",
        "add_rms_norm_parts",
        "add_rms_norm_parts_router",
        "mla_out_q8",
        "mla_out_q8p",
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
        "moe_gateup_sh_q8d",
        "moe_gateup_sh_q8t",
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
        "mmh8_dn200",
        "head_list",
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

/// The default of `TS_CUDA_MLA_LONG` (`CudaBackend::mla_long`): the position from which one
/// token's 16-head MLA decode takes the tensor-core split instead of the SIMT one. The same as
/// `TS_CUDA_MO_ATT`'s default, below which `mla_out_q8` / `mla_out_<t>` attend themselves.
pub const MLA_LONG_DEFAULT: u32 = 192;

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
    /// With [`Path::SplitEarly`], one token's split kernel before `mla_out_q8`: the partial rows
    /// divided by their softmax sums and stored as f16 (`mla_split_tc_hep`, half the bytes),
    /// merged by `mla_out_q8p`, whose 8 blocks a head each read all of the head's splits (at
    /// 16k, 34.7 MB of L2 reads a layer in f32). The rows rounded to f16: other bits. On;
    /// `TS_CUDA_HALF_PARTS=0` turns it off (H100, tg64: 16k 498.6 / 499.4 against 489.3 /
    /// 489.2, 8k 533.0 against 520.9, 4k 544.1 against 532.0; 1,024 teacher-forced steps sit
    /// as far from the CPU's logits as the f32 rows do, KL 1.243e-3 against 1.245e-3 nats;
    /// sixtieth session).
    HalfParts,
    /// `add_rms_norm_matmul_many` / `rms_norm_matmul_many` of a decode batch whose products run
    /// on the int8 tensor cores: the norm and the input's quantisation in one launch
    /// (`add_rms_norm_q8`, the same bits as `add_rms_norm` then `quant_q8_groups`). Off
    /// (`TS_CUDA_NORM_Q8=1` turns it on): measured slower on the H200 (thirty-first session:
    /// 64 sequences 8,127 against 8,143; fortieth: 9,345 against 9,368).
    NormQ8,
    /// `mla_attention_out` of a decode batch with Q8_0 W_uv and W_o on the int8 products: the
    /// W_uv product's split sum also writes the W_o product's quantised input
    /// (`mmq_sum_splits_q8`, the same bits as `mmq_sum_splits` then `quant_q8_groups`), and with
    /// [`Path::NormQ8`] the norm's launch sums W_o's partial outputs itself (no
    /// `mmq_sum_splits` for it; the same sums in the same order). Off (`TS_CUDA_SUM_Q8=1` turns
    /// it on): measured slower on the H200 (thirty-first session: 64 sequences 8,197 against
    /// 8,244 alone, 8,007 with NormQ8).
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
    /// The dense products of decode batches (9-128 rows: q / kv_a, W_uk, W_uv, W_o, a dense
    /// FFN, the output head) on cuBLAS in f16 from the copies [`CudaBackend::dense_blas`] made
    /// for prompts (`f16_rows` input, f32 accumulation), instead of the 64-token int8 tiles
    /// (the input quantised to 8 bits, split K, a split-sum launch). Other bits (no 8-bit
    /// rounding of the activations). On; `TS_CUDA_DENSE_BLAS_BATCH=0` turns it off (H200,
    /// gpu-next128/129: 64 sequences 8,547 -> 9,183, 128 14,203 -> 15,551, 32 4,789 -> 4,975,
    /// 9 1,666 -> 1,708, the server 8,055 -> 8,517).
    DenseBlasBatch,
    /// With [`Path::DenseBlasBatch`]: the norm before q / kv_a writes their f16 input in its
    /// launch (`add_rms_norm_h`), and W_uv's product writes W_o's input in f16 (no `f16_rows`
    /// launch before either). On; `TS_CUDA_DENSE_BLAS_FUSED=0` turns it off.
    DenseBlasFused,
    /// With [`Path::DenseBlasFused`]: the attention's merge (`mla_combine_few`) writes its rows
    /// in f16 too (scratch `LatH`, f16_rows' bits) for W_uv's product on cuBLAS, so no
    /// `f16_rows` launch between them. On; `TS_CUDA_LAT_H=0` turns it off.
    LatH,
    /// With [`Path::DenseBlasFused`]: a decode batch's `norm_rope_cache` launch writes q_nope's
    /// f16 rows too, for the absorbed query's product (W_uk) on cuBLAS, so no `f16_rows` launch
    /// between them. On; `TS_CUDA_QNOPE_H=0` turns it off.
    QnopeH,
    /// With [`Path::DenseBlasBatch`]: a decode batch's output head (a product of more than
    /// 8,192 rows) on cuBLAS from its f16 copy, like the layers' products. On;
    /// `TS_CUDA_HEAD_BLAS=0` keeps the head on the int8 tiles, which read its Q8_0 bytes (223 MB
    /// for V2-Lite against the copy's 419 MB) but are slower all the same (H200, gpu-next139:
    /// 64 sequences 9,325 / 9,330 against 9,394 / 9,388, 128 sequences 15,404 against 15,719,
    /// the server 8,593 against 8,647).
    HeadBlas,
    /// A decode batch's output head (a Q8_0 product of more than 8,192 rows, a multiple of
    /// 256 or 200: `head_tile`) on the prompt MoE's Hopper kernel (`mmh8_dn`, or `mmh8_dn200`
    /// in tiles of 200 rows: TMA, the Q8_0 rows turned into f16 in shared memory, wgmma) as one
    /// expert's token list (`head_list`), where [`Path::HeadBlas`] runs cuBLAS on the f16 copy:
    /// 223 MB read for V2-Lite against 419. The same f16 operands, another summation order.
    /// Off; `TS_CUDA_HEAD_MMH=1` turns it on. H100, fifty-fifth session: 64 sequences −0.2%
    /// (400 tiles of 256 rows at one block an SM, 3.03 waves). Sixty-ninth (gpu-next222, 223):
    /// 512 tiles of 200 rows and seven converting warps (`MMH_HELP`), the launch 182 → 160 µs
    /// (Nsight; 237 MB, ~1.5 TB/s: held by the TMA copies of narrow boxes), 64 sequences
    /// 8,081 / 8,071 and 8,089 / 8,081 against 8,066 / 8,067 (+0.1-0.2%, the same picks). Kept
    /// off until measured on an H200, where cuBLAS's f16 copy reads at the card's higher rate.
    HeadMmh,
    /// With [`Path::DenseBlasFused`]: a decode batch's q and kv_a products as one cuBLAS product
    /// (their f16 copies side by side, `Backend::join_products`) into scratch `Qkv`, which
    /// `norm_rope_cache` reads (`Backend::norm_qkv_rope_cache`): one launch a layer fewer, and
    /// kv_a's 576 rows ride along q's 3,072 (torch's f16 products on the H200: 7.1 µs for the
    /// two against 12.7). On; `TS_CUDA_QKV_JOINT=0` turns it off.
    QkvJoint,
    /// A decode batch's MoE with the shared FFN on a second stream, forked right after the FFN
    /// norm and joined before the combine: the shared FFN runs beside the router, routing,
    /// grouping and quantisation launches on the main one, which leave the memory bus nearly
    /// idle for ~12 µs a layer, and the grouped rows launches carry the routed experts only.
    /// On cuBLAS from the shared FFN's row-major f16 copies, as prompts run it (`shared_blas`;
    /// other bits than the shared chunks in the int8 launches: f16 activations). On;
    /// `TS_CUDA_SHARED_FORK=0` turns it off. H200 (forty-third session, gpu-next145/146): 64
    /// sequences 9,807 / 9,791 against 9,628 / 9,624 (+1.8%), the server 9,503 against 9,349
    /// (+1.6%). (A rows form, the shared chunks alone on the int8 rows kernels, kept the bits
    /// but lost: 9,249, the server 8,915; removed, git history has it at 901d341.)
    SharedFork,
    /// A decode batch's cuBLAS products (9-128 rows on the main stream) with each shape's
    /// algorithm chosen by timing at its first eager sight: cuBLASLt's candidates for the
    /// shape and cuBLAS's own call, run on the step's own operands (`lt.rs`). Other bits where
    /// a candidate wins (another summation order); which wins may differ between processes.
    /// Each new shape pays its timing once, in an eager step (up to 17 candidates x 6 runs:
    /// a few ms; the output head's ~10 ms), so a server's first steps at each batch size are
    /// slower. Off (`TS_CUDA_BLAS_TUNE=1` turns it on, with its handle and 32 MiB of workspace
    /// made at start): no gain on the H200 (forty-third session, gpu-next145: 64 sequences
    /// 9,612 against 9,628, the same hash, so cuBLAS's own call won every shape; the server
    /// 9,330 against 9,349). Kept off, as a knob for other cards and shapes.
    BlasTune,
    /// The one-token Q8_0 MoE's gate/up with its routed 32-row units claimed from a counter by
    /// `TS_CUDA_GU_DYN_PER_SM` blocks an SM (default 2; `moe_gateup_sh_q8d`) instead of a block
    /// a unit (`moe_gateup_sh_q8q`): the units go to whichever blocks are free, however the
    /// blocks were placed (Nsight, sixty-second session: 88 SMs ran 3 of the 352 blocks and 44
    /// ran 2). The same bits. Off (`TS_CUDA_GU_DYN=1` turns it on) until measured.
    GuDyn,
    /// The one-token Q8_0 MoE's gate/up reading its routed slots' rows from the experts' 16-row
    /// tiled copies ([`CudaWeight::tiled`], no pad bytes: 5.6% fewer bytes than the row-major
    /// 144-byte groups; `moe_gateup_sh_q8t`) where both stacks have one; the shared slots as
    /// before. Another summation order: close to the path off, not the same bits. Off
    /// (`TS_CUDA_GU_TILE=1` turns it on) until measured.
    GuTile,
}

impl Path {
    const ALL: [Path; 22] = [
        Path::Absorb16,
        Path::Out16,
        Path::SplitEarly,
        Path::HalfParts,
        Path::NormQ8,
        Path::SumQ8,
        Path::DenseJobs,
        Path::DenseEarly,
        Path::RouterSplit,
        Path::CombineFew,
        Path::SplitBatch,
        Path::DenseBlasBatch,
        Path::DenseBlasFused,
        Path::LatH,
        Path::QnopeH,
        Path::HeadBlas,
        Path::HeadMmh,
        Path::QkvJoint,
        Path::SharedFork,
        Path::BlasTune,
        Path::GuDyn,
        Path::GuTile,
    ];

    /// Its environment variable and its default.
    fn env(self) -> (&'static str, bool) {
        match self {
            Path::Absorb16 => ("TS_CUDA_ABSORB16", true),
            Path::Out16 => ("TS_CUDA_OUT16", true),
            Path::SplitEarly => ("TS_CUDA_MS_EARLY", true),
            Path::HalfParts => ("TS_CUDA_HALF_PARTS", true),
            Path::NormQ8 => ("TS_CUDA_NORM_Q8", false),
            Path::SumQ8 => ("TS_CUDA_SUM_Q8", false),
            Path::DenseJobs => ("TS_CUDA_DENSE_JOBS", true),
            Path::DenseEarly => ("TS_CUDA_DENSE_EARLY", true),
            Path::RouterSplit => ("TS_CUDA_ROUTER_SPLIT", true),
            Path::CombineFew => ("TS_CUDA_COMBINE_FEW", true),
            Path::SplitBatch => ("TS_CUDA_MS_BATCH", true),
            Path::DenseBlasBatch => ("TS_CUDA_DENSE_BLAS_BATCH", true),
            Path::DenseBlasFused => ("TS_CUDA_DENSE_BLAS_FUSED", true),
            Path::LatH => ("TS_CUDA_LAT_H", true),
            Path::QnopeH => ("TS_CUDA_QNOPE_H", true),
            Path::HeadBlas => ("TS_CUDA_HEAD_BLAS", true),
            Path::HeadMmh => ("TS_CUDA_HEAD_MMH", false),
            Path::QkvJoint => ("TS_CUDA_QKV_JOINT", true),
            Path::SharedFork => ("TS_CUDA_SHARED_FORK", true),
            Path::BlasTune => ("TS_CUDA_BLAS_TUNE", false),
            Path::GuDyn => ("TS_CUDA_GU_DYN", false),
            Path::GuTile => ("TS_CUDA_GU_TILE", false),
        }
    }

    /// Whether it starts on: its variable's setting, else its default.
    fn env_on(self) -> bool {
        let (var, default) = self.env();
        std::env::var(var).map_or(default, |v| v != "0")
    }
}

/// A second stream for work that may run beside the main one's ([`Path::SharedFork`]): work
/// on `side` starts after `fork_ev` (recorded on the main stream) and the main stream goes on
/// after `join_ev` (recorded on `side`), in eager steps and in recorded graphs alike (a fork
/// and a join edge in the step's graph).
pub(super) struct Fork {
    pub(super) side: Arc<CudaStream>,
    pub(super) blas: Mutex<CudaBlas>,
    fork_ev: cudarc::driver::CudaEvent,
    join_ev: cudarc::driver::CudaEvent,
    /// A fork point recorded ahead ([`CudaBackend::fork_ahead`]): the address of the rows
    /// whose write it follows (0: none), for the fork that reads them.
    early: AtomicU64,
}

impl Fork {
    fn new(ctx: &Arc<CudaContext>) -> Result<Fork> {
        let side = ctx.new_stream().map_err(|e| dev_err("cannot create a second CUDA stream", e))?;
        let blas = CudaBlas::new(side.clone()).map_err(|e| dev_err("cannot create the second cuBLAS handle", e))?;
        let ev = || ctx.new_event(None).map_err(|e| dev_err("cannot create a CUDA event", e));
        Ok(Fork { side, blas: Mutex::new(blas), fork_ev: ev()?, join_ev: ev()?, early: AtomicU64::new(0) })
    }
}

/// An open fork ([`CudaBackend::fork_open`]): the main stream waits for the side's work at
/// [`Joiner::join`], or when the value is dropped (an op that returns early still joins, so a
/// capture never ends with its side stream unjoined).
pub(super) struct Joiner<'a> {
    be: &'a CudaBackend,
    fk: &'a Fork,
    open: bool,
}

impl Joiner<'_> {
    /// The main stream waits for everything enqueued on the side stream so far (once).
    pub(super) fn join(&mut self) {
        if std::mem::take(&mut self.open) {
            if let Err(e) = self.fk.join_ev.record(&self.fk.side).and_then(|_| self.be.stream.wait(&self.fk.join_ev)) {
                self.be.fail(format!("cuda stream join: {e:?}"));
            }
        }
    }
}

impl Drop for Joiner<'_> {
    fn drop(&mut self) {
        self.join();
    }
}

thread_local! {
    /// The backend (its address) whose side section this thread is in, else 0: per thread, so
    /// that another thread's launches on the same backend (the tests share one) stay on the
    /// main stream.
    static SIDE_SECTION: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// A side section ([`CudaBackend::side_section`]): this thread's launches on the backend go to
/// the side stream until it drops.
pub(super) struct SideGuard<'a> {
    _be: &'a CudaBackend,
}

impl Drop for SideGuard<'_> {
    fn drop(&mut self) {
        SIDE_SECTION.with(|c| c.set(0));
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
    /// graph key ([`Backend::graph_class`]). Default 192 (as [`MLA_LONG_DEFAULT`]);
    /// measured again once the tensor-core split had become cheaper (H100, sixty-first
    /// session): 128 (with `MLA_LONG=128`) the same as 192 from position 128, 256 −2.7% from
    /// 192, and 0 with the split from position 1 −3.7% at tg128 (one launch more a layer).
    mo_att: AtomicU32,
    /// One-token attentions done that way (for the tests: [`CudaBackend::short_attentions`]).
    mo_att_done: AtomicU64,
    /// MLA latent caches in f16 where the kernels allow (`alloc_latent_cache`);
    /// `TS_CUDA_MLA_F16=0` keeps them f32, to compare.
    mla_f16: bool,
    /// The 16-head MLA decode of one token takes the tensor-core split kernel once its position
    /// reaches this (below it, the SIMT split); 0: never. `TS_CUDA_MLA_LONG`; the step's graph
    /// key holds the choice ([`Backend::graph_class`]). Default [`MLA_LONG_DEFAULT`], 192.
    /// From the seventh session to the sixtieth it was 2560 (the H200's tg64 at 2048 then: SIMT
    /// 527 against tensor cores 492). Since the early split, its shared-space ldmatrix and its
    /// f16 partial rows ([`Path::HalfParts`]), the tensor cores win from the first position past
    /// the attention inside `mla_out_q8`: H100, tg64 Q8_0 from 192 590.9 against 583.3, 512
    /// 581.5 / 573.4, 1024 565.8 / 538.7, 2048 550.9 / 521.4; bf16 from 192 422.8 / 419.9,
    /// 1024 397.1 / 389.2.
    mla_long: u32,
    /// The same for batches of several tokens (the server's steps), whose one-split SIMT blocks
    /// (one token's 16 heads each, 64 blocks for 64 sequences on 132 SMs) walk every key alone.
    /// `TS_CUDA_MLA_LONG_BATCH`, 0: never. Default 32: on the H200 at 64 clients (server
    /// contexts of 32-160 tokens) the SIMT attention took 51-56 us a layer, 1.4 ms of an 8.8 ms
    /// step (trace, gpu-next106), and the tensor cores gave 6,819 -> 7,240 tok/s (gpu-next107)
    /// with 64. Since the tensor-core path's f16 fusions (its merge and `norm_rope_cache` write
    /// the f16 rows of the products after them; the SIMT path needs an `f16_rows` launch a
    /// layer), it wins from 32 keys too (H100, gpu-next171: 64 sequences at contexts 32-64
    /// 7,961 against 7,714 with 64, the server 7,668 against 7,628); below 32 keys
    /// (`bench --parallel 64 -n 32`) SIMT still wins, 8,075 against 7,956.
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
    /// Weight rows a tile of [`Path::HeadMmh`]'s launch: 0 (the default) picks 256 (`mmh8_dn`)
    /// or 200 (`mmh8_dn200`), whichever spends fewer tile-rows of time over whole waves of one
    /// block an SM (V2-Lite's 102,400 rows on 132 SMs: 400 tiles of 256 are 4 waves of 256 rows,
    /// 512 of 200 are 4 of 200); `TS_CUDA_HEAD_BN=256|200` forces one where the rows divide.
    head_bn: usize,
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
    /// of weights uploaded after it). Decode batches too, with [`Path::DenseBlasBatch`].
    dense_blas: AtomicBool,
    /// `TS_CUDA_MOE_COUNTS=1`: each grouped MoE prints how its pairs spread over the experts
    /// ([`CudaBackend::print_moe_counts`]; a measurement mode that waits for the device).
    moe_counts: bool,
    /// Source bytes of the load's tensors still to come ([`Backend::load_remaining`]).
    load_left: AtomicU64,
    /// The decode MoE's down products with four warps a row, (Q8_0, f16/bf16): by default for
    /// f16/bf16 only (one warp a row before; bf16 tg128 413 -> 435 tok/s on the H200), not for
    /// Q8_0 (two warps; four measured 583 -> 568, and again in the fifty-fifth session on an
    /// H100: 610.1 / 609.8 against 629.8 / 631.2). `TS_CUDA_DOWN_WPR=4` for both, `=1` for
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
    /// [`Path::GuDyn`]'s blocks an SM (`TS_CUDA_GU_DYN_PER_SM`, default 2, at most 3: the
    /// kernel's occupancy).
    gu_dyn_per_sm: usize,
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
    /// [`Path::SharedFork`]'s second stream, its cuBLAS handle and the fork / join events; made
    /// when the path is on at start (the default; `TS_CUDA_SHARED_FORK=0` turns it off) or
    /// turned on by `set_path`.
    fork: std::sync::OnceLock<Fork>,
    /// [`Path::BlasTune`]'s cuBLASLt handle, workspace and chosen algorithms; made when the
    /// path is turned on (at start with `TS_CUDA_BLAS_TUNE=1`, or by `set_path`).
    lt: std::sync::OnceLock<lt::Lt>,
    /// With [`Path::SharedFork`]: the fork point recorded right after a decode batch's FFN
    /// norm ([`CudaBackend::fork_ahead`]), before the router's product, so that the side does
    /// not wait for it. On; `TS_CUDA_FORK_AHEAD=0`: the fork point at the MoE op's start.
    fork_ahead_on: bool,
    /// Forks that started from a point recorded ahead ([`CudaBackend::forks_ahead`]).
    took_fork_ahead: AtomicU64,
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
    /// Bytes of a decode batch's routed gate and up stacks (half each, their tiled copies'
    /// first experts: the gate/up launch's first blocks) asked into L2 by an earlier launch of
    /// the layer, while the bus is idle: `TS_CUDA_XPF` (MB, default 24; 0 off). `TS_CUDA_XPF_AT`
    /// (default 2): 0 the layer's first norm (`add_rms_norm_h`), 1 the FFN norm
    /// (`add_rms_norm`), 2 the attention's merge (`mla_combine_few`); several digits (in launch
    /// order: 0, 2, 1) share the bytes, in order. `TS_CUDA_DEFINES=L2PF_LAST=1` asks with
    /// L2::evict_last. Why the merge and 24 MB: at 64 sequences 7,752 against 7,656 tok/s with
    /// 32 MB from the FFN norm (+1.25%, the same hash; 16 and 32 MB from the merge the same
    /// within 0.15%) and the server 7,496 against 7,419 (+1.0%) on an H100, forty-ninth session;
    /// 9,946 against 9,871 on an H200 (gpu-next153). One sequence is not touched (tg128 the same).
    xpf: usize,
    /// The largest decode batch (rows) that `xpf` serves: `TS_CUDA_XPF_ROWS` (default 32).
    /// Larger batches get the same first experts into L2 from the gate/up launch's own first
    /// blocks (`MMQ_GU_PF` in kernels/mmq.cu), so the merge's ask only adds work there. H100,
    /// fifty-seventh session, `-d 96`, prefetch off against on: 16 rows -0.8% / -0.75%, 24
    /// -0.15%, 32 -0.5%; 48 +0.3%, 64 +0.44% / +0.58% / +0.44%, 128 +0.8%; the server (64
    /// clients) 8,037 against 7,978 tok/s (+0.74%); this default against 128 on another H100,
    /// 64 rows: 8,016 / 8,019 against 7,969 / 7,978. The same hashes.
    xpf_rows: usize,
    /// Bytes into each of the gate and up stacks' tiled copies where `xpf`'s regions start:
    /// `TS_CUDA_XPF_SKIP` (MB, default 0). A measurement knob: the gate/up launch's own first
    /// 128 blocks (`MMQ_GU_PF`) ask for about the first 18 MB of each (V2-Lite's first ~6
    /// experts), so the merge may ask for the experts after them instead.
    xpf_skip: usize,
    /// The same for the down stack's first experts (`TS_CUDA_XPF_DN`, MB, default 0).
    xpf_dn: usize,
    xpf_at: Vec<u8>,
    /// Bytes of a decode batch's routed down stack (its tiled copy's first experts: the down
    /// launch's first blocks) asked into L2 by the GLU's quantisation launch before it, while
    /// the gate/up launch's last blocks leave the bus part idle: `TS_CUDA_XPF_GLU` (MB, default
    /// 0). `xpf_glu_hint`: the region for the next `quant_q8_groups` launch (taken by it).
    xpf_glu: usize,
    xpf_glu_hint: Mutex<Option<(u64, usize)>>,
    /// The regions [`Backend::prefetch_hint`] named for `xpf` (taken by the launches `xpf_at` names).
    xpf_hint: Mutex<[(u64, usize); 4]>,
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
    /// bits. Measured slower on the H200 (thirty-first session: 64 sequences 8,035 against
    /// 8,233), so off.
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
    /// bits. Default 8; on the H200 (gpu-next123, 64 sequences at -d 96, same hash) 0 / 8 /
    /// 16 / 32 / 48 / 72 (all) tiles gave 8,372 / 8,420 / 8,550 / 8,510 / 8,453 / 8,295 tok/s,
    /// 128 sequences with 32 (before the pairs rule) 13,737 against 14,032. Since the shared
    /// FFN left these launches (Path::SharedFork) fewer do better (gpu-next148/149, same hash):
    /// 0 / 4 / 6 / 8 / 10 / 12 / 16 / 32 gave 9,457 / 9,866 / 9,885 / 9,888-9,898 / 9,881 /
    /// 9,848 / 9,803-9,816 / 9,726; the down's count decides (gate/up 8 with the down's 16:
    /// 9,808; 16 with 8: 9,894); 128 sequences the same (16,784 / 16,786). `TS_CUDA_ROWS_TAIL=N`
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
            && MMH_KERNELS.iter().all(|(n, b)| {
                funcs[*n].set_attribute(drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *b as i32).is_ok()
            });
        // Blocks of the one-launch decode MoE the card holds at once (it needs them all resident).
        let moe_one_cap =
            funcs["moe_sh_q8_one"].occupancy_max_active_blocks_per_multiprocessor(256, 0, None).map_or(0, |b| b as usize * sm_count);
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(BackendError::Device("libcublas.so.13 could not be loaded (needed for prefill matmuls)".into()));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| dev_err("cannot create the cuBLAS handle", e))?;
        let fork = std::sync::OnceLock::new();
        if Path::SharedFork.env_on() {
            let _ = fork.set(Fork::new(&ctx)?);
        }
        let exact = std::env::var("TS_CUDA_EXACT").is_ok_and(|v| v == "1");
        let be = CudaBackend {
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
            head_bn: env_usize("TS_CUDA_HEAD_BN").filter(|b| [200, 256].contains(b)).unwrap_or(0),
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
            gu_dyn_per_sm: std::env::var("TS_CUDA_GU_DYN_PER_SM").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(2).clamp(1, 3),
            moe_one_route: std::env::var("TS_CUDA_MOE_ONE_ROUTE").map_or(true, |v| v != "0"),
            l2_hint: Mutex::new([(0, 0); 4]),
            norm_router: AtomicBool::new(std::env::var("TS_CUDA_NORM_ROUTER").map_or(true, |v| v != "0")),
            norm_mm: AtomicBool::new(std::env::var("TS_CUDA_NORM_MM").map_or(true, |v| v != "0")),
            pre_route: AtomicBool::new(std::env::var("TS_CUDA_PRE_ROUTE").map_or(true, |v| v != "0")),
            routed: Mutex::new(None),
            norm_xq: Mutex::new(None),
            fork,
            lt: std::sync::OnceLock::new(),
            fork_ahead_on: std::env::var("TS_CUDA_FORK_AHEAD").map_or(true, |v| v != "0"),
            took_fork_ahead: AtomicU64::new(0),
            pre_routed: AtomicU64::new(0),
            moe_residual: AtomicBool::new(std::env::var("TS_CUDA_MOE_RESIDUAL").map_or(true, |v| v != "0")),
            norm_mm16: AtomicBool::new(std::env::var("TS_CUDA_NORM_MM16").map_or(true, |v| v != "0")),
            // Off unless asked: measured slower (tg128 600 against 631 without it, gpu-next59).
            l2pf: std::env::var("TS_CUDA_L2PF").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            xpf: env_usize("TS_CUDA_XPF").unwrap_or(24) << 20,
            xpf_rows: env_usize("TS_CUDA_XPF_ROWS").unwrap_or(32),
            xpf_skip: env_usize("TS_CUDA_XPF_SKIP").unwrap_or(0) << 20,
            xpf_dn: env_usize("TS_CUDA_XPF_DN").unwrap_or(0) << 20,
            xpf_glu: env_usize("TS_CUDA_XPF_GLU").unwrap_or(0) << 20,
            xpf_glu_hint: Mutex::new(None),
            xpf_at: std::env::var("TS_CUDA_XPF_AT")
                .ok()
                .map(|v| v.bytes().filter(|b| (b'0'..=b'2').contains(b)).map(|b| b - b'0').collect())
                .unwrap_or_else(|| vec![2]),
            xpf_hint: Mutex::new([(0, 0); 4]),
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
            rows_tail: AtomicUsize::new(env_usize("TS_CUDA_ROWS_TAIL").unwrap_or(8)),
            rows_tail_dn: AtomicUsize::new(env_usize("TS_CUDA_ROWS_TAIL_DN").or(env_usize("TS_CUDA_ROWS_TAIL")).unwrap_or(8)),
            rows_tail_later: AtomicBool::new(std::env::var("TS_CUDA_ROWS_TAIL_LATER").map_or(true, |v| v != "0")),
            mla_long: std::env::var("TS_CUDA_MLA_LONG").ok().and_then(|v| v.parse().ok()).unwrap_or(MLA_LONG_DEFAULT),
            mla_long_batch: std::env::var("TS_CUDA_MLA_LONG_BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(32),
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
        };
        // (Path::BlasTune's handle and workspace, where its variable turned it on)
        if Path::BlasTune.env_on() {
            let _ = be.lt.set(lt::Lt::new(&be).ok_or_else(|| {
                BackendError::Device("TS_CUDA_BLAS_TUNE=1: cuBLASLt could not be loaded or its workspace allocated".into())
            })?);
        }
        Ok(be)
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

    /// Whether the Hopper kernels (`mmh_*`: wgmma fed by TMA, sm_90a) loaded and fit this
    /// card's shared memory: the prompt MoE's `mmh` paths and [`Path::HeadMmh`] need them.
    pub fn hopper_kernels(&self) -> bool {
        self.mmh
    }

    /// Weight rows a tile of [`Path::HeadMmh`]'s launch for a head of `m` rows on this card
    /// (`head_tile`: 256 or 200; 0 where neither divides `m`).
    fn head_tile_rows(&self, m: usize) -> usize {
        head_tile(m, self.sm_count, self.head_bn)
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
    pub fn clusters(&self) -> bool {
        let digits: String = self.arch.trim_start_matches("sm_").chars().take_while(|c| c.is_ascii_digit()).collect();
        digits.parse::<u32>().is_ok_and(|v| v >= 90)
    }

    /// Turn a decode path on or off (its environment variable's setting until then); for steps
    /// recorded after this call.
    pub fn set_path(&self, p: Path, on: bool) {
        if p == Path::SharedFork && on && self.fork.get().is_none() {
            // (its stream and handle first: a failure leaves the path off, reported)
            match Fork::new(&self.ctx) {
                Ok(f) => {
                    let _ = self.fork.set(f);
                }
                Err(e) => {
                    self.fail(format!("Path::SharedFork: {e}"));
                    return;
                }
            }
        }
        if p == Path::BlasTune && on && self.lt.get().is_none() {
            match lt::Lt::new(self) {
                Some(l) => {
                    let _ = self.lt.set(l);
                }
                None => {
                    self.fail("Path::BlasTune: cuBLASLt could not be loaded or its workspace allocated".into());
                    return;
                }
            }
        }
        self.paths[p as usize].0.store(on, Ordering::Relaxed);
    }

    /// How many ops have taken the path (for the tests: that a switch did something).
    pub fn path_launches(&self, p: Path) -> u64 {
        self.paths[p as usize].1.load(Ordering::Relaxed)
    }

    /// Makes the context current on this thread (cuBLAS calls need it); false after a failure,
    /// which is recorded.
    fn bind_ctx(&self) -> bool {
        match self.ctx.bind_to_thread() {
            Ok(()) => true,
            Err(e) => {
                self.fail(format!("cuda context: {e:?}"));
                false
            }
        }
    }

    fn path_on(&self, p: Path) -> bool {
        self.paths[p as usize].0.load(Ordering::Relaxed)
    }

    /// [`Path::SharedFork`]'s side stream, forked from the main one here (it starts on what is
    /// enqueued after everything enqueued on the main stream so far), with its joiner; None
    /// when the path is off or has no stream, or after a failure (recorded).
    ///
    /// `ahead`: the address of the side's input rows, where the fork point recorded ahead for
    /// them ([`CudaBackend::fork_ahead`]) may serve (the caller's scratch did not grow since:
    /// a slot that grows is zeroed on the main stream after that point). The side then starts
    /// right after those rows were written, not after everything enqueued since.
    pub(super) fn fork_open(&self, ahead: Option<u64>) -> Option<(&Fork, Joiner<'_>)> {
        let fk = self.fork.get().filter(|_| self.path_on(Path::SharedFork))?;
        let early = fk.early.swap(0, Ordering::Relaxed);
        let r = if ahead.is_some_and(|a| a != 0 && a == early) {
            self.took_fork_ahead.fetch_add(1, Ordering::Relaxed);
            fk.side.wait(&fk.fork_ev)
        } else {
            fk.fork_ev.record(&self.stream).and_then(|_| fk.side.wait(&fk.fork_ev))
        };
        if let Err(e) = r {
            self.fail(format!("cuda stream fork: {e:?}"));
            return None;
        }
        Some((fk, Joiner { be: self, fk, open: true }))
    }

    /// Records [`Path::SharedFork`]'s fork point now, for the fork of the op that will read the
    /// rows at address `rows` (just written by the last launch: a decode batch's FFN norm,
    /// before the router's product), so that the side need not wait for the launches between.
    /// Any later fork point replaces it; [`CudaBackend::fork_open`] takes it.
    pub(super) fn fork_ahead(&self, rows: u64) {
        let Some(fk) = self.fork.get().filter(|_| self.path_on(Path::SharedFork) && self.fork_ahead_on) else { return };
        match fk.fork_ev.record(&self.stream) {
            Ok(()) => fk.early.store(rows, Ordering::Relaxed),
            Err(e) => self.fail(format!("cuda stream fork point: {e:?}")),
        }
    }

    /// Forgets a fork point recorded ahead (an op that does not take it).
    pub(super) fn fork_ahead_clear(&self) {
        if let Some(fk) = self.fork.get() {
            fk.early.store(0, Ordering::Relaxed);
        }
    }

    /// How many forks started from a point recorded ahead (for the tests).
    pub fn forks_ahead(&self) -> u64 {
        self.took_fork_ahead.load(Ordering::Relaxed)
    }

    /// Whether every slot `(slot, bytes)` already holds its bytes (no growth on asking).
    fn scratch_holds(&self, slots: &[(S, usize)]) -> bool {
        let sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        slots.iter().all(|&(s, b)| sc[s as usize].as_ref().is_some_and(|m| m.bytes >= b))
    }

    /// Until the returned guard drops, this thread's launches ([`CudaBackend::launch`]) and
    /// cuBLAS products on this backend go to the side stream (forked by
    /// [`CudaBackend::fork_open`]); other threads' stay on the main one. Copies, allocations
    /// and synchronisations stay on the main stream: a side section enqueues kernels only, on
    /// scratch sized before the fork.
    pub(super) fn side_section(&self) -> SideGuard<'_> {
        SIDE_SECTION.with(|c| c.set(self as *const CudaBackend as usize));
        SideGuard { _be: self }
    }

    /// The fork whose side stream takes this thread's launches now (inside a side section of
    /// this backend), if any.
    fn side_now(&self) -> Option<&Fork> {
        if SIDE_SECTION.with(|c| c.get()) == self as *const CudaBackend as usize {
            self.fork.get()
        } else {
            None
        }
    }

    /// Counts one op on the path.
    fn took(&self, p: Path) {
        self.paths[p as usize].1.fetch_add(1, Ordering::Relaxed);
    }

    /// How many `moe_shared` ops have used a routing made ahead (`pre_route`).
    pub fn pre_routes(&self) -> u64 {
        self.pre_routed.load(Ordering::Relaxed)
    }

    /// Whether a dense product of `n` rows runs on cuBLAS in f16 where its weight has the
    /// row-major f16 copy ([`CudaBackend::dense_blas`]; decode batches with
    /// [`Path::DenseBlasBatch`]).
    pub fn dense_blas_rows(&self, n: usize) -> bool {
        self.dense_blas.load(Ordering::Relaxed) && (n > GRAPH_MAX_TOKENS || (n > GEMV_MAX_TOKENS && self.path_on(Path::DenseBlasBatch)))
    }

    /// [`CudaBackend::dense_blas_rows`], counting a decode batch's product on
    /// [`Path::DenseBlasBatch`].
    fn dense_blas_take(&self, n: usize) -> bool {
        let on = self.dense_blas_rows(n);
        if on && n <= GRAPH_MAX_TOKENS {
            self.took(Path::DenseBlasBatch);
        }
        on
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
            && hdim.is_multiple_of(128)
            && ff.is_multiple_of(128)
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
                Ok(DevMem { _slice: Arc::new(s), ptr, bytes })
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

    /// The [`Backend::prefetch_hint`] regions as a kernel's 8 trailing arguments (pointer, bytes)
    /// x 4, taken either way; zeros unless `use_them`.
    fn take_hint(&self, use_them: bool) -> [A; 8] {
        let h = std::mem::take(&mut *self.l2_hint.lock().unwrap_or_else(|e| e.into_inner()));
        let h = if use_them { h } else { [(0, 0); 4] };
        [A::P(h[0].0), l(h[0].1), A::P(h[1].0), l(h[1].1), A::P(h[2].0), l(h[2].1), A::P(h[3].0), l(h[3].1)]
    }

    /// `xpf_glu`'s region of the routed down stack `down` for the next `quant_q8_groups`
    /// launch, if this is a decode batch of `n` rows and the stack has a tiled copy.
    pub(super) fn xpf_glu_set(&self, down: &CudaWeight, n: usize) {
        let r = match &down.tiled {
            Some(t) if self.xpf_glu > 0 && (GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS).contains(&n) => {
                Some((t.ptr, self.xpf_glu.min(t.bytes) / 16 * 16))
            }
            _ => None,
        };
        *self.xpf_glu_hint.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }

    /// The L2 prefetch regions of launch `at` (0 the layer's first norm, 1 the FFN norm, 2 the
    /// attention's merge) of a batch of `n` rows as a kernel's 8 trailing arguments (pointer,
    /// bytes) x 4: its share of `xpf`'s (zeros: none).
    fn take_xpf(&self, at: u8, n: usize) -> [A; 8] {
        let h = self.xpf_regions(at, n);
        [A::P(h[0].0), l(h[0].1), A::P(h[1].0), l(h[1].1), A::P(h[2].0), l(h[2].1), A::P(h[3].0), l(h[3].1)]
    }

    /// The `xpf` regions of launch `at`: its share of them if `xpf_at` names it (the last one
    /// named takes them away), else none. Only decode batches (`n` rows: the grouped int8 rows
    /// kernels read the tiled copies) of up to `xpf_rows` rows.
    fn xpf_regions(&self, at: u8, n: usize) -> [(u64, usize); 4] {
        let mut g = self.xpf_hint.lock().unwrap_or_else(|e| e.into_inner());
        let none = [(0, 0); 4];
        let Some(p) = self.xpf_at.iter().position(|&a| a == at) else { return none };
        if !(GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS.min(self.xpf_rows)).contains(&n) {
            *g = [(0, 0); 4];
            return none;
        }
        let parts = self.xpf_at.len();
        let mut h = *g;
        if p + 1 == parts {
            *g = [(0, 0); 4];
        }
        drop(g);
        for r in h.iter_mut() {
            // share p of `parts`, in 64 KB pieces (the prefetch's chunk)
            let chunks = r.1.div_ceil(1 << 16);
            let (c0, c1) = (chunks * p / parts, chunks * (p + 1) / parts);
            let (b0, b1) = ((c0 << 16).min(r.1), (c1 << 16).min(r.1));
            *r = if b1 > b0 && r.0 != 0 { (r.0 + b0 as u64, b1 - b0) } else { (0, 0) };
        }
        h
    }

    /// Device pointer of scratch slot `s`, grown to at least `bytes` (zeroed when it grows,
    /// else as the last user left it). Growing drops every recorded step (they hold the old
    /// pointer); inside a capture it cannot grow: None, and the capture is spoiled.
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

    /// Launches on the main stream, or inside a side section ([`CudaBackend::side_section`]) on
    /// [`Path::SharedFork`]'s side stream.
    fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[A]) {
        match self.side_now() {
            Some(fk) => self.launch_on(&fk.side, name, grid, block, smem, args),
            None => self.launch_on(&self.stream, name, grid, block, smem, args),
        }
    }

    /// [`CudaBackend::launch`] on `stream`.
    fn launch_on(&self, stream: &CudaStream, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[A]) {
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
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.pdl),
        };
        let ev = |s: &CudaStream| s.record_event(Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT)).ok();
        let e0 = if self.profile.is_some() { ev(stream) } else { None };
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
            if let Some(e1) = ev(stream) {
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

    /// The output head's tiles: V2-Lite's 102,400 rows on 132 SMs take 200 (4 waves of 200 rows,
    /// not 4 of 256); a head that fills whole waves of 256 keeps 256; a forced size that does not
    /// divide the rows, or rows that neither divides, decline.
    #[test]
    fn head_tiles() {
        use super::head_tile;
        assert_eq!(head_tile(102_400, 132, 0), 200);
        assert_eq!(head_tile(102_400, 132, 256), 256);
        assert_eq!(head_tile(256 * 132, 132, 0), 256);
        assert_eq!(head_tile(8_448, 132, 0), 256);
        assert_eq!(head_tile(6_400, 132, 0), 200);
        assert_eq!(head_tile(6_400, 132, 256), 256);
        assert_eq!(head_tile(8_448, 132, 200), 0);
        assert_eq!(head_tile(1_000, 132, 0), 200);
        assert_eq!(head_tile(1_032, 132, 0), 0);
    }

    /// Every kernel given more shared memory at start, or asked its occupancy, is one the
    /// backend loads (`funcs[name]` would otherwise panic in `CudaBackend::new`, found only on a
    /// GPU).
    #[test]
    fn big_smem_kernels_are_loaded() {
        let names = super::kernel_names();
        for k in super::BIG_SMEM_KERNELS.iter().chain(&["moe_sh_q8_one"]).chain(super::MMH_KERNELS.iter().map(|(n, _)| n)) {
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
