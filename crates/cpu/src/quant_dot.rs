//! Quantised dot-product kernels: the inner loop of every CPU matmul.
//!
//! Like llama.cpp, a matmul `out = W · x` with quantised weight rows does not dequantise the
//! weights. Each activation row is quantised once (per matmul) to the weight type's *vec_dot
//! type* ([`act_type`]) and the dot products run on integers, block by block:
//!
//! | weights            | activations | per-block term (llama.cpp semantics)                    |
//! |--------------------|-------------|---------------------------------------------------------|
//! | Q4_0, Q5_0, Q8_0   | Q8_0        | d_w·d_a·Σ q_w q_a  (q_w centred: −8 / −16 / none)        |
//! | Q4_1, Q5_1         | Q8_1        | d_w·d_a·Σ q_w q_a + m_w·s_a  (s_a = d_a·Σ q_a, as f16)   |
//! | Q4_K, Q5_K         | Q8_K        | d_a·(d_w·Σ_j sc_j Σ q_w q_a − dmin_w·Σ_j m_j·bsum_j)    |
//! | Q6_K               | Q8_K        | d_a·d_w·Σ_j sc_j Σ (q_w − 32) q_a                        |
//! | F32, F16, BF16     | F32 (LE)    | plain f32 multiply-add                                  |
//!
//! ## Why hand-written SIMD
//! This is the hot kernel of CPU inference: decoding is bound by streaming weight bytes through
//! it and prompt processing by its integer throughput. The compiler does not vectorise the
//! nibble unpacking + int8 multiply-add chains well, so on x86-64 the kernels use AVX2/FMA/F16C
//! intrinsics (`_mm256_maddubs_epi16` / `_mm256_madd_epi16`, as in ggml's x86 paths), chosen at
//! run time (detection cached in a static). Every other CPU uses the portable scalar path
//! ([`vec_dot_scalar`], [`gemm_scalar`]), which is also the referee in the tests.
//!
//! ## Tiles
//! [`gemm`] computes a tile of dot products. Each weight row is decoded once per group of up to
//! four activation rows (the group's partial sums live in registers), and weight rows are taken
//! in L2-sized chunks so that for many activation rows the weights come from memory only once.
//! On the SIMD path the f16 scales of Q8_0/Q8_1 activation blocks are converted to f32 once per
//! call rather than once per weight row. For one activation row (decode) the legacy types use a
//! four-weight-row kernel whose rows lie a quarter of the matrix apart: one activation load per
//! four rows, and four long sequential streams for the hardware prefetchers (1.3-1.8x the
//! row-by-row rate from DRAM on the dev machine). Results of [`gemm`] and [`vec_dot`] agree to
//! float rounding (summation order differs), not bit for bit.
//!
//! For prompts (n ≥ `TILED_MIN_ROWS` activation rows) the quantised types (Q4_0, Q5_0, Q4_1,
//! Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) take a tiled GEMM instead: each tile of four weight rows is
//! unpacked once into canonical blocks (32 unsigned quants, f32 scale, f32 offset coefficients
//! standing in for −8/−16/−32 centring or the min), the activation rows are repacked per group
//! of four with their 8-byte chunks interleaved, and an int8 micro-kernel multiplies a
//! broadcast weight chunk against four activation rows per `maddubs`. The offset terms use the
//! activations' d·Σq, so results equal the other paths up to float rounding (1.5-1.8x the rate
//! of the earlier 8-row prompt kernels on the dev machine, 128 activation rows). Q8_0's signed
//! quants do not fit that scheme (see `avx2::tile_kernel`): its blocks hold |q| and q, and the
//! kernel moves q's sign onto the activations (1.37x the 8-row kernel: 32 → 44 GMAC/s).
//!
//! Where the CPU has AVX-VNNI ([`vnni_available`]), the tiled and small-batch kernels run a
//! copy of themselves that forms each four-byte i32 sum with one `vpdpbusd` instead of
//! `maddubs` + `madd` (+ adds): the same exact integers and the same float steps, so the same
//! bits (test `vnni_kernels_match_avx2_bit_for_bit`). Q8_0's tiled kernel there drops the sign
//! trick too: the activations are packed as y + 128 (unsigned) against the signed quants, and
//! each lane starts from −128·Σq, unpacked with the weights. On the dev machine (Sapphire
//! Rapids, shared): Q8_0's tiled rate 44-47 → 73-77 GMAC/s (single thread, 64 × 128, best
//! runs), the other types within the benchmark's noise; `TS_CPU_VNNI=0` turns it off.
//!
//! Products of one to three activation rows with Q4_0, Q5_0, Q4_1, Q5_1 or Q8_0 weights
//! (decode) take `avx2::gemm_invariant`: the tiled kernel's per-row arithmetic (per block two
//! exact integer half-sums, the same FMA chains, the same final add) on raw weight rows, four a
//! quarter of the matrix apart. A row then gives the same bits alone as in any batch of four or
//! more, and decode is no slower than the earlier four-row kernels (Q4_1 +7%, Q8_0 +9%, Q5_1
//! +18%, Q4_0 and Q5_0 the same, in cache). The K-quants keep their own n < 4 kernels (equal to
//! the tiled results up to float rounding), except under [`gemm_mode`]'s `invariant` (the
//! server's backend), where their small batches take the tiled kernel too.
//!
//! Not done: a NEON path — aarch64 currently runs the scalar kernels.
//!
//! ## Invariants (checked with `assert!` in the public functions)
//! * `k` is a multiple of the weight type's block size (32 for Q4_0..Q8_0, 256 for K-quants);
//! * a weight row is `w.row_bytes(k)` bytes, an activation row `act_type(w).row_bytes(k)` bytes;
//! * activation rows are produced by [`quantize_act`] (for Q8_0/Q8_1/Q8_K: |q| ≤ 127, which the
//!   sign trick of the AVX2 int8 dot relies on — ggml's own quantisers never produce −128).

// Block kernels index several parallel arrays by position; iterator chains would obscure the layouts.
#![allow(clippy::needless_range_loop)]

use std::sync::OnceLock;
use ts_formats::quant::{self, GgmlType};

/// Activation format that weights of type `w` dot against: Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for
/// Q4_1/Q5_1, Q8K for Q4K/Q5K/Q6K, F32 for F32/F16/BF16 (f32 bytes, little-endian).
///
/// Panics for weight types without a dot kernel (see [`GgmlType::is_supported_weight`]).
pub fn act_type(w: GgmlType) -> GgmlType {
    use GgmlType::*;
    match w {
        Q4_0 | Q5_0 | Q8_0 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q4K | Q5K | Q6K => Q8K,
        F32 | F16 | BF16 => F32,
        other => panic!("quant_dot: no dot kernel for weight type {}", other.name()),
    }
}

fn check_k(w: GgmlType, k: usize) -> (usize, usize) {
    let wrb = w.row_bytes(k);
    let arb = act_type(w).row_bytes(k);
    match (wrb, arb) {
        (Some(a), Some(b)) => (a, b),
        _ => panic!("quant_dot: k = {k} is not a multiple of the {} block size {}", w.name(), w.block_size()),
    }
}

/// Quantise one activation row `x` (len k, multiple of the block size) into `out` (exactly
/// `act_type(w).row_bytes(k)` bytes), with ggml's reference quantiser (`quantize_row_q8_*_ref`).
pub fn quantize_act(w: GgmlType, x: &[f32], out: &mut [u8]) {
    check_k(w, x.len());
    quantize_act_as(act_type(w), x, out);
}

/// [`quantize_act`] given the activation format itself (Q8_0, Q8_1, Q8K or F32).
///
/// On the SIMD path Q8_0/Q8_1/Q8K are quantised eight lanes at a time with the reference's
/// exact arithmetic (same scale, same division, same rounding: half away from zero for
/// Q8_0/Q8_1, to nearest even for Q8K), so the bytes are identical to the scalar reference.
pub fn quantize_act_as(at: GgmlType, x: &[f32], out: &mut [u8]) {
    let arb =
        at.row_bytes(x.len()).unwrap_or_else(|| panic!("quant_dot: k = {} is not a multiple of the {} block size", x.len(), at.name()));
    assert_eq!(out.len(), arb, "quantize_act: output is {} bytes, need {arb}", out.len());
    match at {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        #[cfg(target_arch = "x86_64")]
        GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8K if simd_available() => {
            // SAFETY: features detected; out holds exactly the row's blocks (checked above).
            unsafe {
                match at {
                    GgmlType::Q8_0 => avx2::quant_q8_legacy::<false>(x.as_ptr(), x.len() / 32, out.as_mut_ptr()),
                    GgmlType::Q8_1 => avx2::quant_q8_legacy::<true>(x.as_ptr(), x.len() / 32, out.as_mut_ptr()),
                    _ => avx2::quant_q8_k(x.as_ptr(), x.len() / 256, out.as_mut_ptr()),
                }
            }
        }
        _ => quant::quantize(at, x, out).expect("sizes checked above"),
    }
}

/// The scalar reference of [`quantize_act_as`] (for tests and benchmarks).
pub fn quantize_act_scalar(at: GgmlType, x: &[f32], out: &mut [u8]) {
    if at == GgmlType::F32 {
        for (o, v) in out.chunks_exact_mut(4).zip(x) {
            o.copy_from_slice(&v.to_le_bytes());
        }
    } else {
        quant::quantize(at, x, out).expect("quantize_act_scalar: sizes");
    }
}

/// True when the AVX2+FMA+F16C kernels can run on this CPU (detected once).
pub fn simd_available() -> bool {
    static SIMD: OnceLock<bool> = OnceLock::new();
    *SIMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Dot product of one weight row (k elements, type w) with one quantised activation row.
pub fn vec_dot(w: GgmlType, w_row: &[u8], act: &[u8], k: usize) -> f32 {
    let (wrb, arb) = check_k(w, k);
    assert!(w_row.len() >= wrb && act.len() >= arb, "vec_dot: rows shorter than k = {k} needs");
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        // SAFETY: features detected; lengths checked above.
        return unsafe { avx2::dot::<1>(w, w_row.as_ptr(), [act.as_ptr()], None, k)[0] };
    }
    scalar::vec_dot(w, &w_row[..wrb], &act[..arb], k)
}

/// The portable path of [`vec_dot`] (same numerics up to float summation order).
pub fn vec_dot_scalar(w: GgmlType, w_row: &[u8], act: &[u8], k: usize) -> f32 {
    let (wrb, arb) = check_k(w, k);
    scalar::vec_dot(w, &w_row[..wrb], &act[..arb], k)
}

/// Tile kernel: for weight rows i in 0..m (row i at `wdata[i*wrb..]`, wrb = `w.row_bytes(k)`)
/// and activation rows j in 0..n (row j at `acts[j*arb..]`, arb = `act_type(w).row_bytes(k)`),
/// `out[j*out_stride + i] = dot(w_i, a_j)`. Other elements of `out` are not touched.
///
/// Reads each weight row once per group of up to 4 activation rows, so prompt matmuls are not
/// bound by re-reading weights; weight rows are processed in L2-sized chunks.
#[allow(clippy::too_many_arguments)]
pub fn gemm(w: GgmlType, wdata: &[u8], m: usize, k: usize, acts: &[u8], n: usize, out: &mut [f32], out_stride: usize) {
    gemm_mode(w, wdata, m, k, acts, n, out, out_stride, false)
}

/// [`gemm`], with `invariant`: products of one to three activation rows whose weight type has
/// the tiled prompt kernel but no [`batch_invariant`] small-batch kernel (Q4_K, Q5_K, Q6_K) run
/// the tiled kernel too (its short activation group repeats the last row), so that every row
/// gets the same bits in any batch. The server asks for it (no padding of its forwards); it
/// costs those types' decode about half their n = 1 speed, so the other commands do not.
#[allow(clippy::too_many_arguments)]
pub fn gemm_mode(
    w: GgmlType,
    wdata: &[u8],
    m: usize,
    k: usize,
    acts: &[u8],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    invariant: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        let path = if vnni_available() { Path::Vnni } else { Path::Avx2 };
        return gemm_impl(w, wdata, m, k, acts, n, out, out_stride, path, invariant);
    }
    let _ = invariant;
    gemm_impl(w, wdata, m, k, acts, n, out, out_stride, Path::Scalar, false)
}

/// The portable path of [`gemm`].
#[allow(clippy::too_many_arguments)]
pub fn gemm_scalar(w: GgmlType, wdata: &[u8], m: usize, k: usize, acts: &[u8], n: usize, out: &mut [f32], out_stride: usize) {
    gemm_impl(w, wdata, m, k, acts, n, out, out_stride, Path::Scalar, false)
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Path {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// [`Path::Avx2`] with the tiled kernels' AVX-VNNI copies ([`vnni_available`]): the same bits.
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Path {
    /// The x86 SIMD kernels (AVX2, with or without VNNI).
    fn simd(self) -> bool {
        self != Path::Scalar
    }
}

/// True when the tiled kernels may use AVX-VNNI (`vpdpbusd`; Intel from Alder Lake and
/// Sapphire Rapids, AMD from Zen 5): detected once, and off with `TS_CPU_VNNI=0` (for
/// comparisons). The results are the same bits either way.
pub fn vnni_available() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            simd_available() && is_x86_feature_detected!("avxvnni") && std::env::var("TS_CPU_VNNI").map_or(true, |v| v != "0")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Bytes of weight rows processed against all activation groups before moving on (fits L2).
const WEIGHT_CHUNK_BYTES: usize = 128 * 1024;

thread_local! {
    /// Per-thread scratch of [`gemm_impl`]: the activation rows' converted scales and the
    /// interleaved per-group scales of the prompt kernels (grown once, reused: the matmul path
    /// allocates nothing after the first calls).
    static GEMM_SCRATCH: std::cell::RefCell<GemmScratch> = const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
}

/// [`GEMM_SCRATCH`]: activation scales, prompt-kernel group scales, the tiled GEMM's unpacked
/// weight tile and its packed activation groups.
type GemmScratch = (Vec<f32>, Vec<f32>, Vec<V32>, Vec<V32>);

/// 32 bytes aligned to 32: the word of the tiled prompt GEMM's unpacked-weight scratch.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct V32([u8; 32]);

/// Whether [`gemm`] gives each activation row of weights `w` the same bits for any row count:
/// on AVX2, the types with the tiled kernel's arithmetic at every n (`avx2::gemm_invariant`
/// below four rows). Elsewhere not claimed.
pub fn batch_invariant(w: GgmlType) -> bool {
    batch_invariant_mode(w, false)
}

/// [`batch_invariant`] for [`gemm_mode`]: with `invariant`, every type with the tiled kernel.
/// The float types (F32, F16, BF16) are invariant either way: their kernel (`float_rows`) runs
/// each activation row's lanes with the same arithmetic for one row as for a group of four.
pub fn batch_invariant_mode(w: GgmlType, invariant: bool) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_available() {
        return matches!(w, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
            || avx2::tiled_supported(w) && (invariant || avx2::invariant_supported(w));
    }
    let _ = (w, invariant);
    false
}

/// Activation rows from which [`gemm`] uses the tiled prompt kernel (weights unpacked once per
/// tile of rows, then reused for every activation row) where the weight type has one. Four, the
/// server's row multiple: the tiled kernel computes each activation row in lanes of its own with
/// the same arithmetic wherever the row sits, so every batch of four or more rows gives each row
/// the same result; with a threshold of 8 a sequence padded to 4 rows and the same sequence among
/// 7 others took different kernels and sampled texts diverged (crates/server, batch invariance).
const TILED_MIN_ROWS: usize = 4;

/// `call(rows, cnt)` over weight rows 0..m four at a time, the four a quarter of the matrix apart
/// (each one long sequential stream that the hardware prefetchers follow; four adjacent rows were
/// four short streams restarting every call: 2-4x slower from DRAM), then a tail of 1-3 rows
/// padded by repeating its last row (`cnt` rows of the four are real).
fn quarter_rows(m: usize, mut call: impl FnMut([usize; 4], usize)) {
    let q = m / 4;
    for i in 0..q {
        call([i, i + q, i + 2 * q, i + 3 * q], 4);
    }
    let mut i = 4 * q;
    while i < m {
        call(std::array::from_fn(|t| (i + t).min(m - 1)), (m - i).min(4));
        i += 4;
    }
}

#[allow(clippy::too_many_arguments)]
fn gemm_impl(
    w: GgmlType,
    wdata: &[u8],
    m: usize,
    k: usize,
    acts: &[u8],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    path: Path,
    invariant: bool,
) {
    GEMM_SCRATCH.with(|c| match c.try_borrow_mut() {
        Ok(mut c) => {
            let (scales, sc4, tile, packed) = &mut *c;
            gemm_with(w, wdata, m, k, acts, n, out, out_stride, path, invariant, scales, sc4, tile, packed)
        }
        // (Not reached: gemm does not call itself. Fresh buffers keep it correct if it did.)
        Err(_) => {
            let (scales, sc4, tile, packed) = &mut GemmScratch::default();
            gemm_with(w, wdata, m, k, acts, n, out, out_stride, path, invariant, scales, sc4, tile, packed)
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn gemm_with(
    w: GgmlType,
    wdata: &[u8],
    m: usize,
    k: usize,
    acts: &[u8],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    path: Path,
    invariant: bool,
    act_scales: &mut Vec<f32>,
    sc4: &mut Vec<f32>,
    tile: &mut Vec<V32>,
    packed: &mut Vec<V32>,
) {
    let (wrb, arb) = check_k(w, k);
    if m == 0 || n == 0 {
        return;
    }
    assert!(wdata.len() >= m * wrb, "gemm: weights are {} bytes, need {}", wdata.len(), m * wrb);
    assert!(acts.len() >= n * arb, "gemm: activations are {} bytes, need {}", acts.len(), n * arb);
    assert!(out_stride >= m && out.len() >= (n - 1) * out_stride + m, "gemm: output too small for n = {n}, stride {out_stride}, m = {m}");
    // Fewer rows than the tiled kernel takes, for the types that have it: the tiled kernel's
    // per-row arithmetic without its unpacking (a row gives the same bits in any batch).
    #[cfg(target_arch = "x86_64")]
    if path.simd() && n < TILED_MIN_ROWS && avx2::invariant_supported(w) {
        // SAFETY: Avx2 (Vnni) only after detection; sizes checked above and inside.
        unsafe {
            if path == Path::Vnni {
                avx2::gemm_invariant_vnni(w, wdata, m, k, acts, n, out, out_stride)
            } else {
                avx2::gemm_invariant(w, wdata, m, k, acts, n, out, out_stride)
            }
        };
        return;
    }
    // (`invariant`: small batches of the types without that kernel take the tiled one below.)
    #[cfg(target_arch = "x86_64")]
    if path.simd() && (n >= TILED_MIN_ROWS || invariant) && avx2::tiled_supported(w) {
        let (nb, ng, at) = (k / 32, n.div_ceil(4), act_type(w));
        packed.clear();
        packed.resize(ng * nb * avx2::ACT_WORDS, V32::default());
        tile.resize(nb * avx2::TILE_ROWS * avx2::entry_words(w), V32::default());
        for g in 0..ng {
            // A short last group repeats its last row (its results are not stored).
            let rows: [*const u8; 4] = std::array::from_fn(|r| acts[(4 * g + r).min(n - 1) * arb..][..arb].as_ptr());
            let dst = packed[g * nb * avx2::ACT_WORDS..(g + 1) * nb * avx2::ACT_WORDS].as_mut_ptr();
            // SAFETY: Avx2 only after detection; whole activation rows (bounds checked by the
            // slicing); the group's nb·ACT_WORDS words lie inside `packed` (sized above).
            unsafe { avx2::act_pack(at, rows, nb, dst as *mut std::arch::x86_64::__m256i, path == Path::Vnni && w == GgmlType::Q8_0) };
        }
        // SAFETY: Avx2 only after detection; sizes checked above and inside.
        unsafe {
            if path == Path::Vnni {
                avx2::gemm_tiled_vnni(w, wdata, m, k, n, packed, out, out_stride, tile)
            } else {
                avx2::gemm_tiled(w, wdata, m, k, n, packed, out, out_stride, tile)
            }
        };
        return;
    }
    let chunk = (WEIGHT_CHUNK_BYTES / wrb.max(1)).clamp(1, m);
    // Legacy activation blocks carry f16 scales that every weight row would convert again; the
    // SIMD path converts them once here (Q8_0: d per block; Q8_1: d, s per block).
    act_scales.clear();
    match path {
        // SAFETY: Avx2 is only chosen after detection; acts holds n whole rows (checked above).
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 | Path::Vnni => unsafe { avx2::act_scales_into(act_type(w), &acts[..n * arb], act_scales) },
        _ => {}
    }
    let act_scales: &[f32] = act_scales;
    let sc_per_row = act_scales.len() / n;
    #[cfg(target_arch = "x86_64")]
    if path.simd() && n == 1 {
        if let Some(kern) = avx2::x4_kernel(w) {
            let row = |i: usize| wdata[i * wrb..(i + 1) * wrb].as_ptr();
            // The four rows of a call are a quarter of the matrix apart ([`quarter_rows`]).
            let call = |rows: [usize; 4], cnt: usize| {
                // SAFETY: Avx2 is only chosen after detection; every row pointer is a whole
                // weight row (bounds checked by the slicing), acts a whole activation row and
                // act_scales holds its pre-converted scales.
                let r = unsafe { kern(rows.map(row), acts.as_ptr(), act_scales.as_ptr(), k / 32) };
                for t in 0..cnt {
                    out[rows[t]] = r[t];
                }
            };
            quarter_rows(m, call);
            return;
        }
    }
    // Prompt kernel for Q4_0/Q5_0/Q4_1/Q5_1: groups of four activation rows with their scales
    // (and, for Q8_0, quant sums) interleaved per block (see `min_2x4`, `signed_2x4`).
    #[cfg(target_arch = "x86_64")]
    let k2x4 = if path.simd() && n >= 4 { avx2::k2x4_kernel(w) } else { None };
    #[cfg(target_arch = "x86_64")]
    let kx8 = if path.simd() && n >= 8 { avx2::kx8_kernel(w) } else { None };
    #[cfg(not(target_arch = "x86_64"))]
    let k2x4: Option<fn()> = None;
    let nb = k / 32;
    // Per block and group of four rows, `per` floats: Q8_1 (min types): the four (d, s) pairs;
    // Q8_0 (Q4_0/Q5_0): the four d twice, then the four quant sums twice as i32 (see `signed_2x4`).
    let q80 = sc_per_row == nb;
    let per = if q80 { 16 } else { 8 };
    sc4.clear();
    if k2x4.is_some() {
        sc4.resize((n / 4) * nb * per, 0.0);
        let v = &mut *sc4;
        for g in 0..n / 4 {
            for b in 0..nb {
                let o = (g * nb + b) * per;
                for r in 0..4 {
                    let row = 4 * g + r;
                    if q80 {
                        let d = act_scales[row * sc_per_row + b];
                        let qs = &acts[row * arb + b * 34 + 2..row * arb + b * 34 + 34];
                        let sum = qs.iter().map(|&q| q as i8 as i32).sum::<i32>();
                        v[o + r] = d;
                        v[o + 4 + r] = d;
                        v[o + 8 + r] = f32::from_bits(sum as u32);
                        v[o + 12 + r] = f32::from_bits(sum as u32);
                    } else {
                        v[o + 2 * r] = act_scales[row * sc_per_row + 2 * b];
                        v[o + 2 * r + 1] = act_scales[row * sc_per_row + 2 * b + 1];
                    }
                }
            }
        }
    }
    let sc4: &[f32] = sc4;
    let mut i0 = 0;
    while i0 < m {
        let i1 = (i0 + chunk).min(m);
        let mut j = 0;
        while j < n {
            let g = match n - j {
                1 => 1,
                2 | 3 => 2,
                _ => 4,
            };
            #[cfg(target_arch = "x86_64")]
            if let (4, true, Some(kern)) = (g, n - j >= 8, kx8) {
                const W: usize = avx2::W8_ROWS;
                let a: [*const u8; 8] = std::array::from_fn(|t| acts[(j + t) * arb..(j + t + 1) * arb].as_ptr());
                let sc = [0, 1].map(|h| sc4[(j / 4 + h) * nb * per..(j / 4 + h + 1) * nb * per].as_ptr());
                let mut i = i0;
                while i < i1 {
                    // A short last set of rows repeats its last row (per-row arithmetic is independent).
                    let rows: [usize; W] = std::array::from_fn(|t| (i + t).min(i1 - 1));
                    // SAFETY: Avx2 only after detection; whole weight rows and activation rows
                    // (bounds checked by the slicing); each sc slice holds 16 words per block.
                    let r = unsafe { kern(rows.map(|ii| wdata[ii * wrb..(ii + 1) * wrb].as_ptr()), a, sc, nb) };
                    for t in 0..W.min(i1 - i) {
                        for (q, v) in r[t].into_iter().enumerate() {
                            out[(j + q) * out_stride + rows[t]] = v;
                        }
                    }
                    i += W;
                }
                j += 8;
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if let (4, Some(kern)) = (g, k2x4) {
                let a: [*const u8; 4] = std::array::from_fn(|t| acts[(j + t) * arb..(j + t + 1) * arb].as_ptr());
                let sc = sc4[(j / 4) * nb * per..(j / 4 + 1) * nb * per].as_ptr();
                let mut i = i0;
                while i < i1 {
                    // An odd last row is paired with itself (per-row arithmetic is independent).
                    let i2 = (i + 1).min(i1 - 1);
                    let wr = [wdata[i * wrb..(i + 1) * wrb].as_ptr(), wdata[i2 * wrb..(i2 + 1) * wrb].as_ptr()];
                    // SAFETY: Avx2 only after detection; whole weight rows and activation rows
                    // (bounds checked by the slicing); sc holds 8 floats per block of this group.
                    let r = unsafe { kern(wr, a, sc, nb) };
                    for (t, &ii) in [i, i2].iter().enumerate().take(if i2 > i { 2 } else { 1 }) {
                        for (q, v) in r[t].into_iter().enumerate() {
                            out[(j + q) * out_stride + ii] = v;
                        }
                    }
                    i += 2;
                }
                j += 4;
                continue;
            }
            for i in i0..i1 {
                let wr = &wdata[i * wrb..(i + 1) * wrb];
                match g {
                    1 => {
                        let r = dot_group::<1>(path, w, wr, acts, arb, act_scales, sc_per_row, j, k);
                        out[j * out_stride + i] = r[0];
                    }
                    2 => {
                        let r = dot_group::<2>(path, w, wr, acts, arb, act_scales, sc_per_row, j, k);
                        for (t, v) in r.into_iter().enumerate() {
                            out[(j + t) * out_stride + i] = v;
                        }
                    }
                    _ => {
                        let r = dot_group::<4>(path, w, wr, acts, arb, act_scales, sc_per_row, j, k);
                        for (t, v) in r.into_iter().enumerate() {
                            out[(j + t) * out_stride + i] = v;
                        }
                    }
                }
            }
            j += g;
        }
        i0 = i1;
    }
}

/// Dots of one weight row with activation rows j0..j0+R (all bounds checked by the caller).
/// `scales` (empty, or `spr` pre-converted activation scales per row) feeds the legacy kernels.
#[inline]
#[allow(clippy::too_many_arguments)]
fn dot_group<const R: usize>(
    path: Path,
    w: GgmlType,
    wr: &[u8],
    acts: &[u8],
    arb: usize,
    scales: &[f32],
    spr: usize,
    j0: usize,
    k: usize,
) -> [f32; R] {
    match path {
        Path::Scalar => {
            let _ = (scales, spr); // only the SIMD kernels use pre-converted scales
            std::array::from_fn(|t| scalar::vec_dot(w, wr, &acts[(j0 + t) * arb..(j0 + t + 1) * arb], k))
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 | Path::Vnni => {
            let a: [*const u8; R] = std::array::from_fn(|t| acts[(j0 + t) * arb..(j0 + t + 1) * arb].as_ptr());
            let sc = if spr > 0 { Some(std::array::from_fn(|t| scales[(j0 + t) * spr..(j0 + t + 1) * spr].as_ptr())) } else { None };
            // SAFETY: Avx2 is only chosen after detection; every row slice was bounds-checked,
            // and the scale rows hold one (Q8_0) or two (Q8_1) floats per block.
            unsafe { avx2::dot::<R>(w, wr.as_ptr(), a, sc, k) }
        }
    }
}

/// Unpack the 12 packed scale bytes of a Q4_K/Q5_K block into 8 scales and 8 mins (ggml's
/// `utmp` / kmask trick: the result is bytes 0..8 = scales, 8..16 = mins; equals
/// [`quant::get_scale_min_k4`] for j in 0..8).
#[inline(always)]
fn unpack_k4(s: &[u8]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let mut u = [
        u32::from_le_bytes([s[0], s[1], s[2], s[3]]),
        u32::from_le_bytes([s[4], s[5], s[6], s[7]]),
        u32::from_le_bytes([s[8], s[9], s[10], s[11]]),
        0,
    ];
    u[3] = ((u[2] >> 4) & KMASK2) | (((u[1] >> 6) & KMASK3) << 4);
    let aux = u[1] & KMASK1;
    u[1] = (u[2] & KMASK2) | (((u[0] >> 6) & KMASK3) << 4);
    u[2] = aux;
    u[0] &= KMASK1;
    u
}

/// Portable kernels: straightforward translations of ggml's generic `ggml_vec_dot_*` (integer
/// sums per block, then one float multiply-add per block).
mod scalar {
    use super::*;
    use quant::read_f16;

    #[inline(always)]
    fn f32_at(b: &[u8], off: usize) -> f32 {
        f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
    }

    /// Eight partial sums so the compiler can vectorise the float paths.
    #[inline(always)]
    fn float_dot(k: usize, wv: impl Fn(usize) -> f32, a: &[u8]) -> f32 {
        let mut s = [0f32; 8];
        let mut i = 0;
        while i + 8 <= k {
            for t in 0..8 {
                s[t] += wv(i + t) * f32_at(a, 4 * (i + t));
            }
            i += 8;
        }
        let mut tail = 0f32;
        for t in i..k {
            tail += wv(t) * f32_at(a, 4 * t);
        }
        s.iter().sum::<f32>() + tail
    }

    pub fn vec_dot(w: GgmlType, wr: &[u8], a: &[u8], k: usize) -> f32 {
        use GgmlType::*;
        match w {
            F32 => float_dot(k, |i| f32_at(wr, 4 * i), a),
            F16 => float_dot(k, |i| read_f16(wr, 2 * i), a),
            BF16 => float_dot(k, |i| half::bf16::from_le_bytes([wr[2 * i], wr[2 * i + 1]]).to_f32(), a),
            Q4_0 => legacy(wr, a, 18, 34, |wb, ab| {
                let mut s = 0i32;
                for j in 0..16 {
                    s += ((wb[2 + j] & 0xF) as i32 - 8) * ab[2 + j] as i8 as i32;
                    s += ((wb[2 + j] >> 4) as i32 - 8) * ab[18 + j] as i8 as i32;
                }
                (s as f32 * read_f16(wb, 0) * read_f16(ab, 0), 0.0)
            }),
            Q4_1 => legacy(wr, a, 20, 36, |wb, ab| {
                let mut s = 0i32;
                for j in 0..16 {
                    s += (wb[4 + j] & 0xF) as i32 * ab[4 + j] as i8 as i32;
                    s += (wb[4 + j] >> 4) as i32 * ab[20 + j] as i8 as i32;
                }
                (s as f32 * read_f16(wb, 0) * read_f16(ab, 0), read_f16(wb, 2) * read_f16(ab, 2))
            }),
            Q5_0 => legacy(wr, a, 22, 34, |wb, ab| {
                let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
                let mut s = 0i32;
                for j in 0..16 {
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    s += (((wb[6 + j] & 0xF) as u32 | h0) as i32 - 16) * ab[2 + j] as i8 as i32;
                    s += (((wb[6 + j] >> 4) as u32 | h1) as i32 - 16) * ab[18 + j] as i8 as i32;
                }
                (s as f32 * read_f16(wb, 0) * read_f16(ab, 0), 0.0)
            }),
            Q5_1 => legacy(wr, a, 24, 36, |wb, ab| {
                let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
                let mut s = 0i32;
                for j in 0..16 {
                    let h0 = ((qh >> j) << 4) & 0x10;
                    let h1 = (qh >> (j + 12)) & 0x10;
                    s += ((wb[8 + j] & 0xF) as u32 | h0) as i32 * ab[4 + j] as i8 as i32;
                    s += ((wb[8 + j] >> 4) as u32 | h1) as i32 * ab[20 + j] as i8 as i32;
                }
                (s as f32 * read_f16(wb, 0) * read_f16(ab, 0), read_f16(wb, 2) * read_f16(ab, 2))
            }),
            Q8_0 => legacy(wr, a, 34, 34, |wb, ab| {
                let mut s = 0i32;
                for j in 0..32 {
                    s += wb[2 + j] as i8 as i32 * ab[2 + j] as i8 as i32;
                }
                (s as f32 * read_f16(wb, 0) * read_f16(ab, 0), 0.0)
            }),
            Q4K => {
                let mut sumf = 0f32;
                for (wb, ab) in wr.chunks_exact(144).zip(a.chunks_exact(292)) {
                    let u = unpack_k4(&wb[4..16]);
                    let sm: [u8; 16] = bytemuck_u32x4(u);
                    let (sc, mn) = (&sm[..8], &sm[8..]);
                    let bsum = |t: usize| i16::from_le_bytes([ab[260 + 2 * t], ab[261 + 2 * t]]) as i32;
                    let mut summ = 0i32;
                    for j in 0..8 {
                        summ += mn[j] as i32 * (bsum(2 * j) + bsum(2 * j + 1));
                    }
                    let mut isum = 0i32;
                    for c in 0..4 {
                        let q = &wb[16 + 32 * c..48 + 32 * c];
                        let (mut lo, mut hi) = (0i32, 0i32);
                        for l in 0..32 {
                            lo += (q[l] & 0xF) as i32 * ab[4 + 64 * c + l] as i8 as i32;
                            hi += (q[l] >> 4) as i32 * ab[36 + 64 * c + l] as i8 as i32;
                        }
                        isum += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
                    }
                    let da = f32_at(ab, 0);
                    sumf += da * read_f16(wb, 0) * isum as f32 - da * read_f16(wb, 2) * summ as f32;
                }
                sumf
            }
            Q5K => {
                let mut sumf = 0f32;
                for (wb, ab) in wr.chunks_exact(176).zip(a.chunks_exact(292)) {
                    let u = unpack_k4(&wb[4..16]);
                    let sm: [u8; 16] = bytemuck_u32x4(u);
                    let (sc, mn) = (&sm[..8], &sm[8..]);
                    let bsum = |t: usize| i16::from_le_bytes([ab[260 + 2 * t], ab[261 + 2 * t]]) as i32;
                    let mut summ = 0i32;
                    for j in 0..8 {
                        summ += mn[j] as i32 * (bsum(2 * j) + bsum(2 * j + 1));
                    }
                    let qh = &wb[16..48];
                    let mut isum = 0i32;
                    for c in 0..4 {
                        let q = &wb[48 + 32 * c..80 + 32 * c];
                        let (mut lo, mut hi) = (0i32, 0i32);
                        for l in 0..32 {
                            let h_lo = ((qh[l] >> (2 * c)) & 1) as i32 * 16;
                            let h_hi = ((qh[l] >> (2 * c + 1)) & 1) as i32 * 16;
                            lo += ((q[l] & 0xF) as i32 + h_lo) * ab[4 + 64 * c + l] as i8 as i32;
                            hi += ((q[l] >> 4) as i32 + h_hi) * ab[36 + 64 * c + l] as i8 as i32;
                        }
                        isum += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
                    }
                    let da = f32_at(ab, 0);
                    sumf += da * read_f16(wb, 0) * isum as f32 - da * read_f16(wb, 2) * summ as f32;
                }
                sumf
            }
            Q6K => {
                let mut sumf = 0f32;
                for (wb, ab) in wr.chunks_exact(210).zip(a.chunks_exact(292)) {
                    let mut isum = 0i32;
                    for h in 0..2 {
                        let ql = &wb[64 * h..64 * h + 64];
                        let qh = &wb[128 + 32 * h..160 + 32 * h];
                        let q8 = &ab[4 + 128 * h..132 + 128 * h];
                        let mut sub = [0i32; 8];
                        for l in 0..32 {
                            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                            let is = l / 16;
                            sub[is] += q1 * q8[l] as i8 as i32;
                            sub[is + 2] += q2 * q8[l + 32] as i8 as i32;
                            sub[is + 4] += q3 * q8[l + 64] as i8 as i32;
                            sub[is + 6] += q4 * q8[l + 96] as i8 as i32;
                        }
                        for (s, &v) in sub.iter().enumerate() {
                            isum += wb[192 + 8 * h + s] as i8 as i32 * v;
                        }
                    }
                    sumf += f32_at(ab, 0) * read_f16(wb, 208) * isum as f32;
                }
                sumf
            }
            other => panic!("quant_dot: no dot kernel for weight type {}", other.name()),
        }
    }

    /// Legacy 32-element blocks: `f` returns (d_w·d_a·Σq_w q_a, m_w·s_a) for one block pair.
    #[inline(always)]
    fn legacy(wr: &[u8], a: &[u8], wts: usize, ats: usize, f: impl Fn(&[u8], &[u8]) -> (f32, f32)) -> f32 {
        let (mut sumf, mut summ) = (0f32, 0f32);
        for (wb, ab) in wr.chunks_exact(wts).zip(a.chunks_exact(ats)) {
            let (x, m) = f(wb, ab);
            sumf += x;
            summ += m;
        }
        sumf + summ
    }

    fn bytemuck_u32x4(u: [u32; 4]) -> [u8; 16] {
        let mut o = [0u8; 16];
        for (c, v) in o.chunks_exact_mut(4).zip(u) {
            c.copy_from_slice(&v.to_le_bytes());
        }
        o
    }
}

/// AVX2 + FMA + F16C kernels (x86-64). Each takes one weight row and R activation rows (raw
/// pointers, bounds already checked) and returns R dot products. The weight block is loaded and
/// decoded once; the R activation blocks are multiplied against it with independent
/// accumulators. Int8 products use ggml's tricks: `maddubs(|x|, sign(y, x))` for signed×signed,
/// `maddubs(x, y)` when the weight quant is unsigned, then `madd(…, 1)` to widen to i32.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Run `$body` for every block index `$ib` in 0..nb with two accumulator arrays
    /// `$acc, $ms: &mut [__m256; R]` (the second is for the m·s term of Q4_1/Q5_1; unused ones
    /// are optimised away). For R ≤ 2 two accumulator sets alternate between even and odd
    /// blocks, so the float latency chain does not limit a single-row dot. Returns (acc, ms).
    macro_rules! drive {
        ($R:ident, $nb:expr, |$ib:ident, $acc:ident, $ms:ident| $body:block) => {{
            let nb = $nb;
            let mut acc0 = [_mm256_setzero_ps(); $R];
            let mut ms0 = [_mm256_setzero_ps(); $R];
            if $R <= 2 {
                let mut acc1 = [_mm256_setzero_ps(); $R];
                let mut ms1 = [_mm256_setzero_ps(); $R];
                let mut i = 0;
                while i + 1 < nb {
                    {
                        let $ib = i;
                        let $acc = &mut acc0;
                        let $ms = &mut ms0;
                        $body
                    }
                    {
                        let $ib = i + 1;
                        let $acc = &mut acc1;
                        let $ms = &mut ms1;
                        $body
                    }
                    i += 2;
                }
                if i < nb {
                    let $ib = i;
                    let $acc = &mut acc0;
                    let $ms = &mut ms0;
                    $body
                }
                for r in 0..$R {
                    acc0[r] = _mm256_add_ps(acc0[r], acc1[r]);
                    ms0[r] = _mm256_add_ps(ms0[r], ms1[r]);
                }
            } else {
                for i in 0..nb {
                    let $ib = i;
                    let $acc = &mut acc0;
                    let $ms = &mut ms0;
                    $body
                }
            }
            (acc0, ms0)
        }};
    }

    /// Dispatch on the weight type. Safety: CPU has avx2/fma/f16c; `w` points at a whole weight
    /// row of `k` elements and every `a[r]` at a whole activation row of [`act_type`]`(w)`;
    /// `sc`, if given (legacy types only), points at each row's activation scales as f32
    /// (Q8_0: d per block; Q8_1: d, s per block), used instead of converting the f16 ones.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<const R: usize>(w: GgmlType, wp: *const u8, a: [*const u8; R], sc: Option<[*const f32; R]>, k: usize) -> [f32; R] {
        use GgmlType::*;
        let nb = k / 32;
        macro_rules! legacy {
            ($f:ident) => {
                match sc {
                    Some(sc) => $f::<R, true>(wp, a, sc, nb),
                    None => $f::<R, false>(wp, a, [std::ptr::null(); R], nb),
                }
            };
        }
        match w {
            F32 => f32_rows::<R>(wp, a, k),
            F16 => f16_rows::<R>(wp, a, k),
            BF16 => bf16_rows::<R>(wp, a, k),
            Q4_0 => legacy!(q4_0),
            Q4_1 => legacy!(q4_1),
            Q5_0 => legacy!(q5_0),
            Q5_1 => legacy!(q5_1),
            Q8_0 => legacy!(q8_0),
            Q4K => q4_k::<R>(wp, a, k / 256),
            Q5K => q5_k::<R>(wp, a, k / 256),
            Q6K => q6_k::<R>(wp, a, k / 256),
            other => panic!("quant_dot: no dot kernel for weight type {}", other.name()),
        }
    }

    /// f32 copies of the f16 scales of a run of activation blocks: Q8_0 → d per block, Q8_1 →
    /// d, s per block; empty for other types. Eight f16 per `vcvtph2ps`.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn act_scales(at: GgmlType, acts: &[u8]) -> Vec<f32> {
        let mut out = Vec::new();
        act_scales_into(at, acts, &mut out);
        out
    }

    /// [`act_scales`] into `out` (cleared and resized; no allocation once it is large enough).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn act_scales_into(at: GgmlType, acts: &[u8], out: &mut Vec<f32>) {
        out.clear();
        let (bsz, per) = match at {
            GgmlType::Q8_0 => (34, 1),
            GgmlType::Q8_1 => (36, 2),
            _ => return,
        };
        let nb = acts.len() / bsz;
        out.resize(nb * per, 0.0);
        let p = acts.as_ptr();
        let h = |i: usize, o: usize| (p.add(i * bsz + o) as *const u16).read_unaligned() as i16;
        let mut i = 0;
        // 8 halves per step: 8 blocks' d (Q8_0) or 4 blocks' (d, s) (Q8_1).
        let step = 8 / per;
        while i + step <= nb {
            let v = if per == 1 {
                _mm_set_epi16(h(i + 7, 0), h(i + 6, 0), h(i + 5, 0), h(i + 4, 0), h(i + 3, 0), h(i + 2, 0), h(i + 1, 0), h(i, 0))
            } else {
                _mm_set_epi16(h(i + 3, 2), h(i + 3, 0), h(i + 2, 2), h(i + 2, 0), h(i + 1, 2), h(i + 1, 0), h(i, 2), h(i, 0))
            };
            _mm256_storeu_ps(out.as_mut_ptr().add(i * per), _mm256_cvtph_ps(v));
            i += step;
        }
        for b in i..nb {
            for t in 0..per {
                out[b * per + t] = quant::read_f16(&acts[b * bsz..], 2 * t);
            }
        }
    }

    /// The f16 at p in all 8 lanes.
    ///
    /// Scales are always converted as whole vectors: a scalar `_mm_cvtsi32_si128` + `cvtph`
    /// demands only lane 0, and LLVM then compiles it to `vpinsrw $0, mem, %xmmN` with N any
    /// live register — in practice the FMA accumulator, a false dependency that serialised
    /// the block loop (measured 4-5x slower).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16x8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi16((p as *const u16).read_unaligned() as i16))
    }

    /// The two f16 at p, p+2 as [a, b, a, b, a, b, a, b].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16pair(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_set1_epi32((p as *const u32).read_unaligned() as i32))
    }

    /// The f32 at p in all 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f32x8(p: *const u8) -> __m256 {
        _mm256_set1_ps((p as *const f32).read_unaligned())
    }

    /// Scalar f16 load; only for the element tails of the float kernels (see [`f16x8`]).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let h = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    #[inline(always)]
    unsafe fn u32_at(p: *const u8) -> i32 {
        (p as *const i32).read_unaligned()
    }

    #[inline(always)]
    unsafe fn f32_at(p: *const u8) -> f32 {
        (p as *const f32).read_unaligned()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_ps(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn ld256(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    #[inline(always)]
    unsafe fn ld128(p: *const u8) -> __m128i {
        _mm_loadu_si128(p as *const __m128i)
    }

    /// 16 packed bytes → 32 nibbles: low nibbles in bytes 0..16, high nibbles in bytes 16..32
    /// (ggml's `bytes_from_nibbles_32`; matches the element order of the legacy blocks).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        let t = ld128(p);
        _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(t), t), _mm256_set1_epi8(0x0F))
    }

    /// 32 bits (little-endian u32 at p) → 32 bytes, 0xFF where the bit is set (ggml's
    /// `bytes_from_bits_32`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
        let x = (p as *const u32).read_unaligned() as i32;
        let shuf = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
        let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
        _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
    }

    /// Σ over 32 signed bytes of x·y as 8 i32 lanes, given ax = |x|: maddubs needs an unsigned
    /// first operand, so the sign of x moves onto y (y never holds −128, see module docs).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_i8(ax: __m256i, x: __m256i, y: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, x)), _mm256_set1_epi16(1))
    }

    /// Σ over 32 bytes of x·y (x unsigned ≤ 127, y signed) as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_u8i8(x: __m256i, y: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish<const R: usize>(acc: [__m256; R]) -> [f32; R] {
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum_ps(acc[r]);
        }
        out
    }

    /// Signed-weight legacy blocks against Q8_0 (34-byte blocks: f16 d, i8 qs[32]).
    /// `decode(wb)` returns (d_w in all lanes, weight quants as signed bytes).
    macro_rules! legacy_signed {
        ($name:ident, $wts:expr, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $name<const R: usize, const PRE: bool>(w: *const u8, a: [*const u8; R], sc: [*const f32; R], nb: usize) -> [f32; R] {
                let (acc, _) = drive!(R, nb, |ib, acc, _ms| {
                    let $wb = w.add(ib * $wts);
                    let (dw, qx): (__m256, __m256i) = $decode;
                    let ax = _mm256_sign_epi8(qx, qx);
                    for r in 0..R {
                        let ab = a[r].add(ib * 34);
                        let da = if PRE { _mm256_set1_ps(sc[r].add(ib).read()) } else { f16x8(ab) };
                        let d = _mm256_mul_ps(dw, da);
                        let p = dot_i8(ax, qx, ld256(ab.add(2)));
                        acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
                    }
                });
                finish(acc)
            }
        };
    }

    legacy_signed!(q4_0, 18, |wb| (f16x8(wb), _mm256_sub_epi8(nibbles(wb.add(2)), _mm256_set1_epi8(8))));
    // Q5_0: nibble | 0xF0 where the 5th bit is clear, i.e. the byte is already q − 16.
    legacy_signed!(q5_0, 22, |wb| (
        f16x8(wb),
        _mm256_or_si256(nibbles(wb.add(6)), _mm256_andnot_si256(bits_to_bytes(wb.add(2)), _mm256_set1_epi8(0xF0u8 as i8)))
    ));
    legacy_signed!(q8_0, 34, |wb| (f16x8(wb), ld256(wb.add(2))));

    /// Unsigned-weight legacy blocks with a min against Q8_1 (36-byte blocks: f16 d, f16 s,
    /// i8 qs[32]). Both blocks start with an f16 pair ({d, m} / {d, s}); one multiply of the
    /// two pair vectors gives [d_w·d_a, m_w·s_a, …]: `moveldup` broadcasts the first, and the
    /// second accumulates in the odd lanes of `ms`. `decode(wb)` returns ({d_w, m_w} pair
    /// vector, weight quants 0..31).
    macro_rules! legacy_min {
        ($name:ident, $wts:expr, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $name<const R: usize, const PRE: bool>(w: *const u8, a: [*const u8; R], sc: [*const f32; R], nb: usize) -> [f32; R] {
                let (acc, ms) = drive!(R, nb, |ib, acc, ms| {
                    let $wb = w.add(ib * $wts);
                    let (wpair, qx): (__m256, __m256i) = $decode;
                    for r in 0..R {
                        let ab = a[r].add(ib * 36);
                        let apair = if PRE {
                            _mm256_castpd_ps(_mm256_set1_pd((sc[r].add(2 * ib) as *const f64).read_unaligned()))
                        } else {
                            f16pair(ab)
                        };
                        let ds = _mm256_mul_ps(wpair, apair);
                        let p = dot_u8i8(qx, ld256(ab.add(4)));
                        acc[r] = _mm256_fmadd_ps(_mm256_moveldup_ps(ds), _mm256_cvtepi32_ps(p), acc[r]);
                        ms[r] = _mm256_add_ps(ms[r], ds);
                    }
                });
                let mut out = finish(acc);
                for r in 0..R {
                    // lane 1 holds Σ m_w·s_a (lanes 3, 5, 7 hold the same sum).
                    out[r] += _mm_cvtss_f32(_mm_movehdup_ps(_mm256_castps256_ps128(ms[r])));
                }
                out
            }
        };
    }

    legacy_min!(q4_1, 20, |wb| (f16pair(wb), nibbles(wb.add(4))));
    legacy_min!(q5_1, 24, |wb| (
        f16pair(wb),
        _mm256_or_si256(nibbles(wb.add(8)), _mm256_and_si256(bits_to_bytes(wb.add(4)), _mm256_set1_epi8(0x10)))
    ));

    /// Four weight rows against one activation row (the decode shape, n = 1): the activation
    /// block and its scale are loaded once for all four rows, each row keeps one accumulator
    /// chain, and the four horizontal sums share one reduction. Per row the arithmetic does not
    /// depend on which rows share the call, so [`gemm`] can cover a tail of fewer than four
    /// rows by repeating a row pointer and still give identical bits. `Some(wts)` = signed
    /// types against Q8_0 (34-byte blocks), the min types against Q8_1 (36-byte blocks).
    macro_rules! legacy_x4 {
        (signed $name:ident, $wts:expr, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(w: [*const u8; 4], a: *const u8, sc: *const f32, nb: usize) -> [f32; 4] {
                let mut acc = [_mm256_setzero_ps(); 4];
                for ib in 0..nb {
                    let ab = a.add(ib * 34);
                    let ya = ld256(ab.add(2));
                    let da = _mm256_set1_ps(sc.add(ib).read());
                    for r in 0..4 {
                        let $wb = w[r].add(ib * $wts);
                        let (dw, qx): (__m256, __m256i) = $decode;
                        let ax = _mm256_sign_epi8(qx, qx);
                        let p = dot_i8(ax, qx, ya);
                        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc[r]);
                    }
                }
                hsum4(acc, [_mm256_setzero_ps(); 4])
            }
        };
        (min $name:ident, $wts:expr, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(w: [*const u8; 4], a: *const u8, sc: *const f32, nb: usize) -> [f32; 4] {
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut ms = [_mm256_setzero_ps(); 4];
                for ib in 0..nb {
                    let ab = a.add(ib * 36);
                    let ya = ld256(ab.add(4));
                    let apair = _mm256_castpd_ps(_mm256_set1_pd((sc.add(2 * ib) as *const f64).read_unaligned()));
                    for r in 0..4 {
                        let $wb = w[r].add(ib * $wts);
                        let (wpair, qx): (__m256, __m256i) = $decode;
                        let ds = _mm256_mul_ps(wpair, apair);
                        let p = dot_u8i8(qx, ya);
                        acc[r] = _mm256_fmadd_ps(_mm256_moveldup_ps(ds), _mm256_cvtepi32_ps(p), acc[r]);
                        ms[r] = _mm256_add_ps(ms[r], ds);
                    }
                }
                hsum4(acc, ms)
            }
        };
    }

    /// Σ of the 8 lanes of each `acc[r]`, plus lane 1 of `ms[r]` (the m·s term of the min types;
    /// zero vectors for the others).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum4(acc: [__m256; 4], ms: [__m256; 4]) -> [f32; 4] {
        let h01 = _mm256_hadd_ps(acc[0], acc[1]);
        let h23 = _mm256_hadd_ps(acc[2], acc[3]);
        let h = _mm256_hadd_ps(h01, h23);
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        // Lane 1 of each ms[r]: [a0 b0 a1 b1], [c0 d0 c1 d1] → [a1 b1 c1 d1].
        let m01 = _mm_unpacklo_ps(_mm256_castps256_ps128(ms[0]), _mm256_castps256_ps128(ms[1]));
        let m23 = _mm_unpacklo_ps(_mm256_castps256_ps128(ms[2]), _mm256_castps256_ps128(ms[3]));
        let m = _mm_movehl_ps(m23, m01);
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm_add_ps(s, m));
        out
    }

    legacy_x4!(signed q4_0_x4, 18, |wb| (f16x8(wb), _mm256_sub_epi8(nibbles(wb.add(2)), _mm256_set1_epi8(8))));
    legacy_x4!(signed q5_0_x4, 22, |wb| (
        f16x8(wb),
        _mm256_or_si256(nibbles(wb.add(6)), _mm256_andnot_si256(bits_to_bytes(wb.add(2)), _mm256_set1_epi8(0xF0u8 as i8)))
    ));
    legacy_x4!(signed q8_0_x4, 34, |wb| (f16x8(wb), ld256(wb.add(2))));
    legacy_x4!(min q4_1_x4, 20, |wb| (f16pair(wb), nibbles(wb.add(4))));
    legacy_x4!(min q5_1_x4, 24, |wb| (
        f16pair(wb),
        _mm256_or_si256(nibbles(wb.add(8)), _mm256_and_si256(bits_to_bytes(wb.add(4)), _mm256_set1_epi8(0x10)))
    ));

    /// Four weight rows, one activation row, its f32 scales, blocks per row.
    pub type X4Kernel = unsafe fn([*const u8; 4], *const u8, *const f32, usize) -> [f32; 4];

    /// Two weight rows against four activation rows of a min type (Q4_1 / Q5_1 against Q8_1):
    /// the prompt shape. Each weight block is decoded once for four activation rows and each
    /// activation block loaded once for two weight rows (the R = 4 kernel decodes per weight row
    /// and reloads activations per weight row), about 1.5x fewer instructions per MAC.
    /// `sc4` holds, per block, the four activation rows' (d, s) pairs as 8 f32. Per (weight
    /// row, activation row) the arithmetic is one FMA chain over blocks, then [`hsum4`]-style
    /// reduction plus the m·s sum, independent of the other rows of the call.
    macro_rules! min_2x4 {
        ($name:ident, $wts:expr, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(w: [*const u8; 2], a: [*const u8; 4], sc4: *const f32, nb: usize) -> [[f32; 4]; 2] {
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                let mut ms = [_mm256_setzero_ps(); 2];
                for ib in 0..nb {
                    let ap = _mm256_loadu_ps(sc4.add(8 * ib));
                    for t in 0..2 {
                        let $wb = w[t].add(ib * $wts);
                        let (wpair, qx): (__m256, __m256i) = $decode;
                        // [dw·da0, mw·sa0, dw·da1, mw·sa1, …]: the odd lanes are the m·s terms.
                        ms[t] = _mm256_add_ps(ms[t], _mm256_mul_ps(wpair, ap));
                        let dw = _mm256_moveldup_ps(wpair);
                        for r in 0..4 {
                            let p = dot_u8i8(qx, ld256(a[r].add(ib * 36 + 4)));
                            let d = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*sc4.add(8 * ib + 2 * r)));
                            acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[t][r]);
                        }
                    }
                }
                let odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
                let mut out = [[0f32; 4]; 2];
                for t in 0..2 {
                    let h01 = _mm256_hadd_ps(acc[t][0], acc[t][1]);
                    let h23 = _mm256_hadd_ps(acc[t][2], acc[t][3]);
                    let h = _mm256_hadd_ps(h01, h23);
                    let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
                    let m = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(ms[t], odd));
                    _mm_storeu_ps(out[t].as_mut_ptr(), _mm_add_ps(sums, m));
                }
                out
            }
        };
    }

    min_2x4!(q4_1_2x4, 20, |wb| (f16pair(wb), nibbles(wb.add(4))));
    min_2x4!(q5_1_2x4, 24, |wb| (
        f16pair(wb),
        _mm256_or_si256(nibbles(wb.add(8)), _mm256_and_si256(bits_to_bytes(wb.add(4)), _mm256_set1_epi8(0x10)))
    ));

    /// [`min_2x4`] for Q4_0 / Q5_0 against Q8_0. The weight quants are decoded unsigned
    /// (q + OFF, OFF = 8 / 16, so `maddubs` needs no sign trick) and the offset is taken off in
    /// integers per block: Σ (q_u − OFF)·y = Σ q_u·y − OFF·Σ y, exactly the signed block sum.
    /// The four activation rows' 16-bit pair sums are folded into one vector with `hadd`
    /// (|values| ≤ 4·2·31·127 < 2^15), so one convert + multiply + FMA serves four rows.
    /// `sc4` holds, per block, 16 words: [d_0..d_3, d_0..d_3] as f32, then [Σy_0..Σy_3,
    /// Σy_0..Σy_3] as i32 (each row's quant sum of the block). Per (weight row, activation row)
    /// one FMA chain over blocks in each 128-bit half, then the two halves added.
    macro_rules! signed_2x4 {
        ($name:ident, $wts:expr, $sh:literal, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name(w: [*const u8; 2], a: [*const u8; 4], sc4: *const f32, nb: usize) -> [[f32; 4]; 2] {
                // Two chains per weight row (even / odd blocks): more partial sums per row.
                let mut acc = [[_mm256_setzero_ps(); 2]; 2];
                let ones = _mm256_set1_epi16(1);
                for ib in 0..nb {
                    let da = _mm256_loadu_ps(sc4.add(16 * ib));
                    // OFF/2 · Σy in each half: the two halves of the i32 lanes add up to OFF · Σy.
                    let cc = _mm256_slli_epi32::<$sh>(_mm256_loadu_si256(sc4.add(16 * ib + 8) as *const __m256i));
                    let y: [__m256i; 4] = std::array::from_fn(|r| ld256(a[r].add(ib * 34 + 2)));
                    for t in 0..2 {
                        let $wb = w[t].add(ib * $wts);
                        let (dw, qu): (__m256, __m256i) = $decode;
                        let m01 = _mm256_hadd_epi16(_mm256_maddubs_epi16(qu, y[0]), _mm256_maddubs_epi16(qu, y[1]));
                        let m23 = _mm256_hadd_epi16(_mm256_maddubs_epi16(qu, y[2]), _mm256_maddubs_epi16(qu, y[3]));
                        let p = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(m01, m23), ones), cc);
                        acc[t][ib & 1] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc[t][ib & 1]);
                    }
                }
                let mut out = [[0f32; 4]; 2];
                for t in 0..2 {
                    let a = _mm256_add_ps(acc[t][0], acc[t][1]);
                    let sums = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                    _mm_storeu_ps(out[t].as_mut_ptr(), sums);
                }
                out
            }
        };
    }

    /// [`signed_2x4`] over W weight rows and eight activation rows (two groups of four, each
    /// with its own `sc4` slice): the weight block is decoded once for eight rows. Per group the
    /// arithmetic is exactly that of [`signed_2x4`] (same FMA chains, same order), so results
    /// are bit-identical to it.
    macro_rules! signed_wx8 {
        ($name:ident, $wts:expr, $sh:literal, |$wb:ident| $decode:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn $name<const W: usize>(w: [*const u8; W], a: [*const u8; 8], sc: [*const f32; 2], nb: usize) -> [[f32; 8]; W] {
                let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; W];
                let ones = _mm256_set1_epi16(1);
                for ib in 0..nb {
                    for t in 0..W {
                        let $wb = w[t].add(ib * $wts);
                        let (dw, qu): (__m256, __m256i) = $decode;
                        for g in 0..2 {
                            let da = _mm256_loadu_ps(sc[g].add(16 * ib));
                            let cc = _mm256_slli_epi32::<$sh>(_mm256_loadu_si256(sc[g].add(16 * ib + 8) as *const __m256i));
                            let y = |r: usize| ld256(a[4 * g + r].add(ib * 34 + 2));
                            let m01 = _mm256_hadd_epi16(_mm256_maddubs_epi16(qu, y(0)), _mm256_maddubs_epi16(qu, y(1)));
                            let m23 = _mm256_hadd_epi16(_mm256_maddubs_epi16(qu, y(2)), _mm256_maddubs_epi16(qu, y(3)));
                            let p = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(m01, m23), ones), cc);
                            acc[t][g][ib & 1] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc[t][g][ib & 1]);
                        }
                    }
                }
                let mut out = [[0f32; 8]; W];
                for t in 0..W {
                    for g in 0..2 {
                        let a = _mm256_add_ps(acc[t][g][0], acc[t][g][1]);
                        let sums = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
                        _mm_storeu_ps(out[t][4 * g..].as_mut_ptr(), sums);
                    }
                }
                out
            }
        };
    }

    signed_wx8!(q4_0_wx8, 18, 2, |wb| (f16x8(wb), nibbles(wb.add(2))));
    signed_wx8!(q5_0_wx8, 22, 3, |wb| (
        f16x8(wb),
        _mm256_or_si256(nibbles(wb.add(6)), _mm256_and_si256(bits_to_bytes(wb.add(2)), _mm256_set1_epi8(0x10)))
    ));

    /// W8_ROWS weight rows, eight activation rows, their two groups' `sc4` slices, blocks per row.
    pub const W8_ROWS: usize = 1;
    pub type Kx8 = unsafe fn([*const u8; W8_ROWS], [*const u8; 8], [*const f32; 2], usize) -> [[f32; 8]; W8_ROWS];

    /// The eight-activation-row prompt kernel of Q4_0 / Q5_0 (see [`signed_wx8`]).
    pub fn kx8_kernel(w: GgmlType) -> Option<Kx8> {
        match w {
            GgmlType::Q4_0 => Some(q4_0_wx8::<W8_ROWS>),
            GgmlType::Q5_0 => Some(q5_0_wx8::<W8_ROWS>),
            _ => None,
        }
    }

    signed_2x4!(q4_0_2x4, 18, 2, |wb| (f16x8(wb), nibbles(wb.add(2))));
    signed_2x4!(q5_0_2x4, 22, 3, |wb| (
        f16x8(wb),
        _mm256_or_si256(nibbles(wb.add(6)), _mm256_and_si256(bits_to_bytes(wb.add(2)), _mm256_set1_epi8(0x10)))
    ));

    /// Two weight rows, four activation rows, their interleaved (d, s) scales, blocks per row.
    pub type K2x4 = unsafe fn([*const u8; 2], [*const u8; 4], *const f32, usize) -> [[f32; 4]; 2];

    /// The prompt kernel of a min type, if it has one (see [`min_2x4`]).
    pub fn k2x4_kernel(w: GgmlType) -> Option<K2x4> {
        match w {
            GgmlType::Q4_1 => Some(q4_1_2x4),
            GgmlType::Q5_1 => Some(q5_1_2x4),
            GgmlType::Q4_0 => Some(q4_0_2x4),
            GgmlType::Q5_0 => Some(q5_0_2x4),
            _ => None,
        }
    }

    /// The n = 1 kernel of a legacy type, if it has one (see [`legacy_x4`]).
    pub fn x4_kernel(w: GgmlType) -> Option<X4Kernel> {
        use GgmlType::*;
        Some(match w {
            Q4_0 => q4_0_x4,
            Q5_0 => q5_0_x4,
            Q8_0 => q8_0_x4,
            Q4_1 => q4_1_x4,
            Q5_1 => q5_1_x4,
            _ => return None,
        })
    }

    /// Quants of 32-byte chunk `c` (0..4) of a Q4_K / Q5_K super-block at `wb` (quants at
    /// `qs_off`): 32 low-nibble and 32 high-nibble values as bytes (sub-blocks 2c and 2c+1), with
    /// Q5_K's fifth bits taken from `hb` (the block's qh, two bits per chunk, shifted on here).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k45_chunk(wb: *const u8, qs_off: usize, c: usize, q5: bool, hb: &mut __m256i) -> (__m256i, __m256i) {
        let m4 = _mm256_set1_epi8(0x0F);
        let bits = ld256(wb.add(qs_off + 32 * c));
        let mut ql = _mm256_and_si256(bits, m4);
        let mut qh = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
        if q5 {
            // bit 2c of qh[l] → +16 for the low half, bit 2c+1 → the high half.
            ql = _mm256_or_si256(ql, _mm256_slli_epi16::<4>(_mm256_and_si256(*hb, _mm256_set1_epi8(1))));
            qh = _mm256_or_si256(qh, _mm256_slli_epi16::<3>(_mm256_and_si256(*hb, _mm256_set1_epi8(2))));
            *hb = _mm256_srli_epi16::<2>(*hb);
        }
        (ql, qh)
    }

    /// Q4_K / Q5_K against Q8_K (292-byte blocks: f32 d @0, i8 qs[256] @4, i16 bsums[16] @260).
    /// `hi_bits` selects Q5_K (qh at +16, qs at +48) over Q4_K (qs at +16).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn k_asym<const R: usize, const Q5: bool>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
        let wts = if Q5 { 176 } else { 144 };
        let qs_off = if Q5 { 48 } else { 16 };
        let mut acc = [_mm256_setzero_ps(); R];
        for ib in 0..nb {
            let wb = w.add(ib * wts);
            let dw = f16x8(wb);
            let dmw = f16x8(wb.add(2));
            let u = unpack_k4(std::slice::from_raw_parts(wb.add(4), 12));
            let mins16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, u[3] as i32, u[2] as i32));
            let mut ab = [std::ptr::null::<u8>(); R];
            let mut sumi = [_mm256_setzero_si256(); R];
            for r in 0..R {
                ab[r] = a[r].add(ib * 292);
                // bsums of 16 → sums per 32-element sub-block (≤ 4064, no i16 overflow); the
                // mins term −d_a·dmin·Σ m_j·bsum_j goes into the same accumulator (4 lanes).
                let q8s = _mm_hadd_epi16(ld128(ab[r].add(260)), ld128(ab[r].add(276)));
                let pm = _mm256_set_m128i(_mm_setzero_si128(), _mm_madd_epi16(mins16, q8s));
                let dm = _mm256_mul_ps(dmw, f32x8(ab[r]));
                acc[r] = _mm256_fnmadd_ps(dm, _mm256_cvtepi32_ps(pm), acc[r]);
            }
            let mut hb = if Q5 { ld256(wb.add(16)) } else { _mm256_setzero_si256() };
            for c in 0..4 {
                let (ql, qh) = k45_chunk(wb, qs_off, c, Q5, &mut hb);
                let scl = _mm256_set1_epi16(((u[c / 2] >> (16 * (c % 2))) & 0xFF) as i16);
                let sch = _mm256_set1_epi16(((u[c / 2] >> (16 * (c % 2) + 8)) & 0xFF) as i16);
                for r in 0..R {
                    let pl = _mm256_madd_epi16(scl, _mm256_maddubs_epi16(ql, ld256(ab[r].add(4 + 64 * c))));
                    let ph = _mm256_madd_epi16(sch, _mm256_maddubs_epi16(qh, ld256(ab[r].add(36 + 64 * c))));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                }
            }
            for r in 0..R {
                let d = _mm256_mul_ps(dw, f32x8(ab[r]));
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        finish(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k<const R: usize>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
        k_asym::<R, false>(w, a, nb)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_k<const R: usize>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
        k_asym::<R, true>(w, a, nb)
    }

    /// Q6_K against Q8_K. Quants are used unsigned (0..63) and the −32 offset is applied once
    /// per block through the activation block sums: Σ sc·(q−32)·y = Σ sc·q·y − 32·Σ sc·bsum.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k<const R: usize>(w: *const u8, a: [*const u8; R], nb: usize) -> [f32; R] {
        let m4 = _mm256_set1_epi8(0x0F);
        let m3 = _mm256_set1_epi8(0x03);
        let mut acc = [_mm256_setzero_ps(); R];
        for ib in 0..nb {
            let wb = w.add(ib * 210);
            let dw = f16x8(wb.add(208));
            let sc8 = ld128(wb.add(192));
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let mut ab = [std::ptr::null::<u8>(); R];
            let mut sumi = [_mm256_setzero_si256(); R];
            for r in 0..R {
                ab[r] = a[r].add(ib * 292);
                let corr = _mm256_madd_epi16(sc16, ld256(ab[r].add(260)));
                sumi[r] = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(corr));
            }
            for h in 0..2 {
                let b1 = ld256(wb.add(64 * h));
                let b2 = ld256(wb.add(64 * h + 32));
                let hb = ld256(wb.add(128 + 32 * h));
                for i in 0..4 {
                    let q = match i {
                        0 => _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(hb, m3))),
                        1 => _mm256_or_si256(
                            _mm256_and_si256(b2, m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(hb), m3)),
                        ),
                        2 => _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(b1), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(hb), m3)),
                        ),
                        _ => _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(b2), m4),
                            _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(hb), m3)),
                        ),
                    };
                    // Sub-blocks s (elements 0..16 of this run) and s+1 (16..32).
                    let s = (8 * h + 2 * i) as i64;
                    let shuf = _mm_set_epi64x((s + 1) * 0x0101_0101_0101_0101, s * 0x0101_0101_0101_0101);
                    let scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, shuf));
                    for r in 0..R {
                        let p = _mm256_maddubs_epi16(q, ld256(ab[r].add(4 + 128 * h + 32 * i)));
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(scale, p));
                    }
                }
            }
            for r in 0..R {
                let d = _mm256_mul_ps(dw, f32x8(ab[r]));
                acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        finish(acc)
    }

    /// 32 i32 lanes (four vectors, each of values in −128..=127) → 32 bytes in element order.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pack_i32x32(q: [__m256i; 4]) -> __m256i {
        // packs works within 128-bit lanes; the permute restores element order.
        let a = _mm256_packs_epi32(q[0], q[1]);
        let b = _mm256_packs_epi32(q[2], q[3]);
        let c = _mm256_packs_epi16(a, b);
        _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hmax_ps(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// `quantize_row_q8_0_ref` / `quantize_row_q8_1_ref` (Q81: also s = d·Σq): d = amax/127,
    /// q = round(x·(1/d)) rounding half away from zero, exactly like `f32::round`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quant_q8_legacy<const Q81: bool>(x: *const f32, nb: usize, out: *mut u8) {
        let (bsz, qoff) = if Q81 { (36, 4) } else { (34, 2) };
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        for b in 0..nb {
            let xp = x.add(32 * b);
            let v: [__m256; 4] = std::array::from_fn(|t| _mm256_loadu_ps(xp.add(8 * t)));
            let m01 = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
            let m23 = _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]));
            let amax = hmax_ps(_mm256_max_ps(m01, m23));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let q: [__m256i; 4] = std::array::from_fn(|t| {
                let y = _mm256_mul_ps(v[t], idv);
                let a = _mm256_andnot_ps(sign, y);
                let tr = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(a);
                // a − trunc(a) is exact; round up when it is ≥ 0.5 (ties away from zero).
                let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(a, tr), half), one);
                let r = _mm256_or_ps(_mm256_add_ps(tr, up), _mm256_and_ps(sign, y));
                _mm256_cvttps_epi32(r)
            });
            let ob = out.add(b * bsz);
            _mm256_storeu_si256(ob.add(qoff) as *mut __m256i, pack_i32x32(q));
            (ob as *mut u16).write_unaligned(quant::f32_to_f16(d));
            if Q81 {
                let sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
                (ob.add(2) as *mut u16).write_unaligned(quant::f32_to_f16(sum as f32 * d));
            }
        }
    }

    /// `quantize_row_q8_K_ref`: iscale = −127/max where max is the first element of largest
    /// magnitude; q = nearest_int(iscale·x) (to nearest even, the `cvtps` default) capped at
    /// 127; per-16 sums; d = 1/iscale.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quant_q8_k(x: *const f32, nb: usize, out: *mut u8) {
        let sign = _mm256_set1_ps(-0.0);
        for b in 0..nb {
            let xp = x.add(256 * b);
            let ob = out.add(292 * b);
            let mut m = _mm256_setzero_ps();
            for t in 0..32 {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xp.add(8 * t))));
            }
            let amax = hmax_ps(m);
            if amax == 0.0 {
                std::ptr::write_bytes(ob, 0, 292);
                continue;
            }
            let av = _mm256_set1_ps(amax);
            let mut max = amax;
            for t in 0..32 {
                let mask = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, _mm256_loadu_ps(xp.add(8 * t))), av));
                if mask != 0 {
                    max = *xp.add(8 * t + mask.trailing_zeros() as usize);
                    break;
                }
            }
            let iscale = -127.0 / max;
            let isv = _mm256_set1_ps(iscale);
            let cap = _mm256_set1_epi32(127);
            for c in 0..8 {
                let q: [__m256i; 4] = std::array::from_fn(|t| {
                    _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(isv, _mm256_loadu_ps(xp.add(32 * c + 8 * t)))), cap)
                });
                _mm256_storeu_si256(ob.add(4 + 32 * c) as *mut __m256i, pack_i32x32(q));
                for h in 0..2 {
                    let s = hsum_epi32(_mm256_add_epi32(q[2 * h], q[2 * h + 1]));
                    (ob.add(260 + 2 * (2 * c + h)) as *mut i16).write_unaligned(s as i16);
                }
            }
            (ob as *mut f32).write_unaligned(1.0 / iscale);
        }
    }

    /// Float weights against f32 activations; `$load(p)` loads 8 weights at p as f32 lanes and
    /// `$one(p)` a single weight.
    macro_rules! float_rows {
        ($name:ident, $esz:expr, |$p:ident| $load:expr, |$q:ident| $one:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn $name<const R: usize>(w: *const u8, a: [*const u8; R], k: usize) -> [f32; R] {
                let mut acc0 = [_mm256_setzero_ps(); R];
                let mut acc1 = [_mm256_setzero_ps(); R];
                let mut i = 0;
                while i + 16 <= k {
                    let w0 = {
                        let $p = w.add(i * $esz);
                        $load
                    };
                    let w1 = {
                        let $p = w.add((i + 8) * $esz);
                        $load
                    };
                    for r in 0..R {
                        acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[r].add(4 * i) as *const f32), acc0[r]);
                        acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a[r].add(4 * i + 32) as *const f32), acc1[r]);
                    }
                    i += 16;
                }
                if i + 8 <= k {
                    let w0 = {
                        let $p = w.add(i * $esz);
                        $load
                    };
                    for r in 0..R {
                        acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a[r].add(4 * i) as *const f32), acc0[r]);
                    }
                    i += 8;
                }
                let mut out = [0f32; R];
                for r in 0..R {
                    let mut s = hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
                    for t in i..k {
                        let wv = {
                            let $q = w.add(t * $esz);
                            $one
                        };
                        s += wv * f32_at(a[r].add(4 * t));
                    }
                    out[r] = s;
                }
                out
            }
        };
    }

    float_rows!(f32_rows, 4, |p| _mm256_loadu_ps(p as *const f32), |q| f32_at(q));
    float_rows!(f16_rows, 2, |p| _mm256_cvtph_ps(ld128(p)), |q| f16_at(q));
    float_rows!(bf16_rows, 2, |p| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(p)))), |q| f32::from_bits(
        ((q as *const u16).read_unaligned() as u32) << 16
    ));

    // ---------------------------------------------------------------------------------------
    // Prompt GEMM: unpack a tile of weight rows once, then sweep every activation row.
    // ---------------------------------------------------------------------------------------

    /// Weight rows per unpacked tile (the micro-kernel's register rows).
    pub const TILE_ROWS: usize = 4;
    /// `__m256i` words per packed (group of four activation rows, block): four interleaved
    /// quant vectors, the scale pairs, the offset partners (see [`act_pack`]).
    pub const ACT_WORDS: usize = 6;

    /// True for the weight types the tiled prompt GEMM handles: those whose quants unpack to
    /// unsigned bytes ≤ 63, and Q8_0 (signed quants, its own variant of [`tile_kernel`]).
    pub fn tiled_supported(w: GgmlType) -> bool {
        use GgmlType::*;
        matches!(w, Q4_0 | Q5_0 | Q4_1 | Q5_1 | Q8_0 | Q4K | Q5K | Q6K)
    }

    /// `__m256i` words per unpacked (block, weight row) entry: quants, scale, offset, and for
    /// Q6_K the two 16-element sub-block scales as i16 vectors.
    pub fn entry_words(w: GgmlType) -> usize {
        if w == GgmlType::Q6K {
            5
        } else {
            3
        }
    }

    /// Decode weight row `row` (nb 32-element blocks of type `w`) into canonical entries, block
    /// b at `out + b·stride` (`stride` in `__m256i` words, ≥ [`entry_words`]):
    /// * word 0: the 32 quants as unsigned bytes in element order (0..=15 for Q4_0/Q4_1/Q4_K,
    ///   0..=31 for the 5-bit types, 0..=63 for Q6_K);
    /// * word 1: the f32 block scale in all lanes;
    /// * word 2: f32 offset coefficients [c_lo, c_hi] repeated (lo: elements 0..16, hi: 16..32);
    /// * Q6_K only, words 3 and 4: the i16 sub-block scales of elements 0..16 and 16..32.
    ///
    /// Q8_0 differs: word 0 holds |q| (unsigned, ≤ 128: −128 becomes the byte 0x80), word 1 the
    /// scale d, word 2 the signed quants q themselves (no offset: the quants are not centred).
    /// With `vnni` (the AVX-VNNI kernels, whose activations come biased by 128, see
    /// [`act_pack`]): word 0 the signed quants q, word 2 the i32 correction −128·Σq over the
    /// bytes each `vpdpbusd` lane meets, [e, o] repeated (e: the quants 8c..8c+4 of every
    /// 8-byte chunk c, o: 8c+4..8c+8), so that Σ (y + 128)·q − 128·Σq = Σ y·q exactly.
    ///
    /// so that the block's dot with an activation block is scale·d_a·Σ q·y (Q6_K: Σ sc·q·y per
    /// half) + c_lo·S_lo + c_hi·S_hi, S = the activation's d_a·Σ y over the half (Q8_1: the
    /// stored s on the first half, 0 on the second). Per type (llama.cpp semantics, see the
    /// module table): Q4_0/Q5_0: scale d, offsets −8d / −16d; Q4_1/Q5_1: scale d, offset m;
    /// Q4_K/Q5_K: scale d·sc_j, offset −dmin·m_j; Q6_K: scale d, offsets −32·d·sc per half.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn unpack_row(w: GgmlType, row: *const u8, nb: usize, out: *mut __m256i, stride: usize, vnni: bool) {
        use GgmlType::*;
        let put = |b: usize, q: __m256i, sc: __m256, off: __m256| {
            let e = out.add(b * stride);
            _mm256_store_si256(e, q);
            _mm256_store_si256(e.add(1), _mm256_castps_si256(sc));
            _mm256_store_si256(e.add(2), _mm256_castps_si256(off));
        };
        let x10 = _mm256_set1_epi8(0x10);
        match w {
            Q8_0 if vnni => {
                let ones8 = _mm256_set1_epi8(1);
                let ones16 = _mm256_set1_epi16(1);
                for b in 0..nb {
                    let wb = row.add(b * 34);
                    let q = ld256(wb.add(2));
                    let e = out.add(b * stride);
                    // Lane j: Σ q[4j..4j+4]; then the even lanes' sum and the odd lanes' sum in
                    // every lane pair (j even is the first half of chunk j / 2).
                    let v = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, q), ones16);
                    let v = _mm256_add_epi32(v, _mm256_shuffle_epi32::<0b01_00_11_10>(v));
                    let v = _mm256_add_epi32(v, _mm256_permute2x128_si256::<1>(v, v));
                    _mm256_store_si256(e, q);
                    _mm256_store_si256(e.add(1), _mm256_castps_si256(f16x8(wb)));
                    _mm256_store_si256(e.add(2), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<7>(v)));
                }
            }
            Q8_0 => {
                for b in 0..nb {
                    let wb = row.add(b * 34);
                    let q = ld256(wb.add(2));
                    let e = out.add(b * stride);
                    // |q| (−128 → 0x80 = 128 unsigned), the scale, the signed quants.
                    _mm256_store_si256(e, _mm256_sign_epi8(q, q));
                    _mm256_store_si256(e.add(1), _mm256_castps_si256(f16x8(wb)));
                    _mm256_store_si256(e.add(2), q);
                }
            }
            Q4_0 | Q5_0 => {
                let (wts, c) = if w == Q4_0 { (18, -8.0) } else { (22, -16.0) };
                for b in 0..nb {
                    let wb = row.add(b * wts);
                    let d = f16x8(wb);
                    let q = if w == Q4_0 {
                        nibbles(wb.add(2))
                    } else {
                        _mm256_or_si256(nibbles(wb.add(6)), _mm256_and_si256(bits_to_bytes(wb.add(2)), x10))
                    };
                    put(b, q, d, _mm256_mul_ps(d, _mm256_set1_ps(c)));
                }
            }
            Q4_1 | Q5_1 => {
                let wts = if w == Q4_1 { 20 } else { 24 };
                for b in 0..nb {
                    let wb = row.add(b * wts);
                    let q = if w == Q4_1 {
                        nibbles(wb.add(4))
                    } else {
                        _mm256_or_si256(nibbles(wb.add(8)), _mm256_and_si256(bits_to_bytes(wb.add(4)), x10))
                    };
                    put(b, q, f16x8(wb), f16x8(wb.add(2)));
                }
            }
            Q4K | Q5K => {
                let q5 = w == Q5K;
                let (wts, qs_off) = if q5 { (176, 48) } else { (144, 16) };
                for sb in 0..nb / 8 {
                    let wb = row.add(sb * wts);
                    let d = f16_at(wb);
                    let dmin = f16_at(wb.add(2));
                    let u = unpack_k4(std::slice::from_raw_parts(wb.add(4), 12));
                    let byte = |j: usize| ((u[j / 4] >> (8 * (j % 4))) & 0xFF) as f32;
                    let mut hb = if q5 { ld256(wb.add(16)) } else { _mm256_setzero_si256() };
                    for c in 0..4 {
                        let (ql, qh) = k45_chunk(wb, qs_off, c, q5, &mut hb);
                        for (t, q) in [(0, ql), (1, qh)] {
                            let j = 2 * c + t;
                            put(sb * 8 + j, q, _mm256_set1_ps(d * byte(j)), _mm256_set1_ps(-dmin * byte(8 + j)));
                        }
                    }
                }
            }
            Q6K => {
                let m4 = _mm256_set1_epi8(0x0F);
                let m3 = _mm256_set1_epi8(0x03);
                for sb in 0..nb / 8 {
                    let wb = row.add(sb * 210);
                    let d = f16_at(wb.add(208));
                    let scs = std::slice::from_raw_parts(wb.add(192) as *const i8, 16);
                    for h in 0..2 {
                        let b1 = ld256(wb.add(64 * h));
                        let b2 = ld256(wb.add(64 * h + 32));
                        let hb = ld256(wb.add(128 + 32 * h));
                        let qs = [
                            _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(hb, m3))),
                            _mm256_or_si256(
                                _mm256_and_si256(b2, m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(hb), m3)),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(b1), m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(hb), m3)),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(b2), m4),
                                _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(hb), m3)),
                            ),
                        ];
                        for (i, q) in qs.into_iter().enumerate() {
                            let s = 8 * h + 2 * i;
                            let (lo, hi) = (scs[s], scs[s + 1]);
                            let (cl, ch) = (-32.0 * d * lo as f32, -32.0 * d * hi as f32);
                            let b = sb * 8 + 4 * h + i;
                            put(b, q, _mm256_set1_ps(d), _mm256_setr_ps(cl, ch, cl, ch, cl, ch, cl, ch));
                            let e = out.add(b * stride);
                            _mm256_store_si256(e.add(3), _mm256_set1_epi16(lo as i16));
                            _mm256_store_si256(e.add(4), _mm256_set1_epi16(hi as i16));
                        }
                    }
                }
            }
            other => panic!("quant_dot: no tiled kernel for weight type {}", other.name()),
        }
    }

    /// Pack four activation rows (`rows`, format `at`, repeated rows allowed) for the
    /// micro-kernel: per 32-block b, [`ACT_WORDS`] words at `out + b·ACT_WORDS`:
    /// * words 0..4: word c holds bytes 8c..8c+8 of the four rows' quants, row r in bytes
    ///   8r..8r+8 (so one `maddubs` against the weight's 8 bytes broadcast serves four rows);
    /// * word 4: f32 [d_0, d_0, d_1, d_1, d_2, d_2, d_3, d_3] (row scale; Q8K: the super-block's);
    /// * word 5: f32 [S_lo 0, S_hi 0, S_lo 1, S_hi 1, …], the offset partners of [`unpack_row`]:
    ///   d·Σy per 16-element half (Q8_0; Q8K from the stored bsums) or the stored s and 0 (Q8_1).
    ///
    /// With `bias` (Q8_0 weights on the AVX-VNNI kernels) words 0..4 hold y + 128 as unsigned
    /// bytes (y ^ 0x80), the operand `vpdpbusd` takes unsigned ([`unpack_row`]'s correction).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn act_pack(at: GgmlType, rows: [*const u8; 4], nb: usize, out: *mut __m256i, bias: bool) {
        let flip = _mm256_set1_epi8(if bias { -128 } else { 0 });
        let ones8 = _mm256_set1_epi8(1);
        let ones16 = _mm256_set1_epi16(1);
        for b in 0..nb {
            let o = out.add(b * ACT_WORDS);
            let off = match at {
                GgmlType::Q8_0 => b * 34 + 2,
                GgmlType::Q8_1 => b * 36 + 4,
                _ => (b / 8) * 292 + 4 + (b % 8) * 32,
            };
            let y: [__m256i; 4] = std::array::from_fn(|r| ld256(rows[r].add(off)));
            // 64-bit chunks: t01 = [r0c0 r1c0 r0c2 r1c2 | … ] etc.; regroup into chunk vectors.
            let lo01 = _mm256_unpacklo_epi64(y[0], y[1]); // r0c0 r1c0 | r0c2 r1c2
            let hi01 = _mm256_unpackhi_epi64(y[0], y[1]); // r0c1 r1c1 | r0c3 r1c3
            let lo23 = _mm256_unpacklo_epi64(y[2], y[3]);
            let hi23 = _mm256_unpackhi_epi64(y[2], y[3]);
            _mm256_store_si256(o, _mm256_xor_si256(_mm256_permute2x128_si256::<0x20>(lo01, lo23), flip));
            _mm256_store_si256(o.add(1), _mm256_xor_si256(_mm256_permute2x128_si256::<0x20>(hi01, hi23), flip));
            _mm256_store_si256(o.add(2), _mm256_xor_si256(_mm256_permute2x128_si256::<0x31>(lo01, lo23), flip));
            _mm256_store_si256(o.add(3), _mm256_xor_si256(_mm256_permute2x128_si256::<0x31>(hi01, hi23), flip));
            let mut ds = [0f32; 8];
            let mut ss = [0f32; 8];
            for r in 0..4 {
                let a = rows[r];
                let (d, lo, hi) = match at {
                    GgmlType::Q8_0 => {
                        let d = f16_at(a.add(b * 34));
                        // Σ over each 16-byte half: pairs (maddubs with 1s), quads, then 4 lanes.
                        let v = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, y[r]), ones16);
                        let s = _mm256_hadd_epi32(v, v);
                        let s = _mm256_hadd_epi32(s, s);
                        (d, d * _mm256_extract_epi32::<0>(s) as f32, d * _mm256_extract_epi32::<4>(s) as f32)
                    }
                    GgmlType::Q8_1 => {
                        let ab = a.add(b * 36);
                        (f16_at(ab), f16_at(ab.add(2)), 0.0)
                    }
                    _ => {
                        let ab = a.add((b / 8) * 292);
                        let d = f32_at(ab);
                        let bs = ab.add(260 + 4 * (b % 8)) as *const i16;
                        (d, d * bs.read_unaligned() as f32, d * bs.add(1).read_unaligned() as f32)
                    }
                };
                ds[2 * r] = d;
                ds[2 * r + 1] = d;
                ss[2 * r] = lo;
                ss[2 * r + 1] = hi;
            }
            _mm256_store_si256(o.add(4), _mm256_castps_si256(_mm256_loadu_ps(ds.as_ptr())));
            _mm256_store_si256(o.add(5), _mm256_castps_si256(_mm256_loadu_ps(ss.as_ptr())));
        }
    }

    /// [`tile_kernel`] variants: unsigned quants ≤ 31 with an offset term; Q6_K; Q8_0.
    pub const KIND_GENERIC: u8 = 0;
    pub const KIND_Q6: u8 = 1;
    pub const KIND_Q8: u8 = 2;

    /// Lanes 2r and 2r + 1 of `v` added, for r in 0..4.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn pair_sums(v: __m256) -> [f32; 4] {
        let h = _mm256_hadd_ps(v, v); // [p0 p1 p0 p1 | p2 p3 p2 p3]
        let h = _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5));
        let mut o = [0f32; 4];
        _mm_storeu_ps(o.as_mut_ptr(), _mm256_castps256_ps128(h));
        o
    }

    /// Weight types whose products of fewer than four activation rows [`gemm_invariant`] computes
    /// with [`gemm_tiled`]'s per-row arithmetic (the others keep their own kernels there).
    pub fn invariant_supported(w: GgmlType) -> bool {
        use GgmlType::*;
        matches!(w, Q4_0 | Q5_0 | Q4_1 | Q5_1 | Q8_0)
    }

    /// The tiled kernels, stamped out twice by [`tiled_kernels!`]: for AVX2 (`maddubs` + `madd`,
    /// [`tile_kernel`], [`gemm_tiled`], [`gemm_invariant`]) and for AVX-VNNI (`vpdpbusd`: the
    /// same four-byte i32 sums in one instruction; [`tile_kernel_vnni`], [`gemm_tiled_vnni`],
    /// [`gemm_invariant_vnni`]). Every integer lane is an exact sum either way (no 16-bit
    /// saturation on the AVX2 side: see [`tile_kernel`]), and the float steps are the same, so
    /// the two give the same bits (test `vnni_kernels_match_avx2_bit_for_bit`). Two copies,
    /// not one generic function, because a function's target features are fixed: a VNNI
    /// instruction may run only where it was detected, and the AVX2 copy must not let the
    /// compiler use VNNI forms on its own.
    macro_rules! tiled_kernels {
        ($feat:literal, $vnni:literal, $tile_kernel:ident, $invariant_x4:ident, $gemm_invariant:ident, $gemm_tiled:ident) => {
            /// The micro-kernel: [`TILE_ROWS`] unpacked weight rows (`wt`: entry (b, i) at
            /// `wt + (b·TILE_ROWS + i)·E`, E = [`entry_words`]) against G packed groups of four
            /// activation rows (`a[g]`: [`act_pack`] words), over nb blocks. Returns per (weight row,
            /// group) an accumulator whose lanes 2r and 2r + 1 hold the dot with the group's row r
            /// (the caller adds them).
            ///
            /// Per weight row and block, each 8-byte chunk of the weight quants is broadcast and
            /// multiplied (`maddubs`: unsigned weight × signed activation → i16 pair sums) against the
            /// chunk vector of four activation rows; the four chunk products add up in 16 bits (sums of
            /// 8 products ≤ 8·31·127 < 2^15) and one `madd` widens them, so one convert, one multiply
            /// and two FMAs serve four activation rows. Q6_K (quants ≤ 63) adds only the two chunks of
            /// each 16-element half in 16 bits and widens each half with `madd` by its sub-block scale.
            /// Per (weight row, activation row) the arithmetic is one FMA chain over the blocks,
            /// independent of the other rows in the call, so callers may repeat rows to fill a tile.
            ///
            /// Q8_0 ([`KIND_Q8`]): the signed quants (−128..127) fit no unsigned `maddubs` operand, and
            /// the usual fix of the unsigned types, q + 128 with an offset term, would give pair sums up
            /// to 2·255·127 = 64770 (saturated). So, as in ggml's `mul_sum_i8_pairs`, the weight enters
            /// as |q| (≤ 128) and its sign moves onto the activation chunk (`sign(y, q)`: byte-wise, and
            /// q's broadcast chunk lines up with every activation row's chunk, so this fits the
            /// broadcast design at one `sign` per `maddubs`). A pair sum is then ≤ 2·128·127 = 32512 <
            /// 2^15 but two of them may not be added in 16 bits, so each `maddubs` result is widened by
            /// its own `madd` and the four are added in 32 bits: 4 sign + 4 maddubs + 4 madd + 3 add
            /// against 4 maddubs + 3 add + 1 madd (and no offset FMA) for the other types. Measured on
            /// the dev machine (single thread, 64 weight x 128 activation rows): 44 GMAC/s, against
            /// 32 for the earlier 8-row kernel; computing |q| from the broadcast q with `sign` instead
            /// of loading it (37) and two groups per call (41) were slower. The alternatives all need
            /// more multiplies: sign-extended i16 with `madd` only (8 madds and 7 adds, twice the
            /// activation loads) or q + 128 split into two 4-bit halves (8 maddubs, 2 madds, offset).
            #[inline]
            #[target_feature(enable = $feat)]
            pub unsafe fn $tile_kernel<const G: usize, const KIND: u8>(
                wt: *const __m256i,
                a: [*const __m256i; G],
                nb: usize,
            ) -> [[__m256; G]; TILE_ROWS] {
                let ew = if KIND == KIND_Q6 { 5 } else { 3 };
                let mut acc = [[_mm256_setzero_ps(); G]; TILE_ROWS];
                let ones = _mm256_set1_epi16(1);
                for b in 0..nb {
                    for i in 0..TILE_ROWS {
                        let e = wt.add((b * TILE_ROWS + i) * ew);
                        let wq = e as *const i64;
                        let wc: [__m256i; 4] = std::array::from_fn(|c| _mm256_set1_epi64x(wq.add(c).read()));
                        let dw = _mm256_castsi256_ps(_mm256_load_si256(e.add(1)));
                        if KIND == KIND_Q8 {
                            // The signs' chunks (AVX2 only: the VNNI copy's word 2 is its correction).
                            let ws = e.add(2) as *const i64;
                            let sc: [__m256i; 4] = if $vnni {
                                [_mm256_setzero_si256(); 4]
                            } else {
                                std::array::from_fn(|c| _mm256_set1_epi64x(ws.add(c).read()))
                            };
                            for g in 0..G {
                                let y = a[g].add(b * ACT_WORDS);
                                let p = if $vnni {
                                    // The same i32 lanes, each an exact sum: the biased activations
                                    // (y + 128, unsigned) times the signed quants, from the
                                    // correction −128·Σq (unpack_row with `vnni`, act_pack with `bias`).
                                    let z = _mm256_setzero_si256();
                                    let corr = _mm256_load_si256(e.add(2));
                                    let y0 = _mm256_load_si256(y);
                                    let y1 = _mm256_load_si256(y.add(1));
                                    let y2 = _mm256_load_si256(y.add(2));
                                    let y3 = _mm256_load_si256(y.add(3));
                                    _mm256_add_epi32(
                                        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(corr, y0, wc[0]), y1, wc[1]),
                                        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, y2, wc[2]), y3, wc[3]),
                                    )
                                } else {
                                    let p: [__m256i; 4] = std::array::from_fn(|c| {
                                        let ys = _mm256_sign_epi8(_mm256_load_si256(y.add(c)), sc[c]);
                                        _mm256_madd_epi16(_mm256_maddubs_epi16(wc[c], ys), ones)
                                    });
                                    _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]))
                                };
                                let da = _mm256_castsi256_ps(_mm256_load_si256(y.add(4)));
                                acc[i][g] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc[i][g]);
                            }
                            continue;
                        }
                        let cw = _mm256_castsi256_ps(_mm256_load_si256(e.add(2)));
                        for g in 0..G {
                            let y = a[g].add(b * ACT_WORDS);
                            let lo = _mm256_add_epi16(
                                _mm256_maddubs_epi16(wc[0], _mm256_load_si256(y)),
                                _mm256_maddubs_epi16(wc[1], _mm256_load_si256(y.add(1))),
                            );
                            let hi = _mm256_add_epi16(
                                _mm256_maddubs_epi16(wc[2], _mm256_load_si256(y.add(2))),
                                _mm256_maddubs_epi16(wc[3], _mm256_load_si256(y.add(3))),
                            );
                            let p = if $vnni && KIND != KIND_Q6 {
                                let z = _mm256_setzero_si256();
                                _mm256_add_epi32(
                                    _mm256_dpbusd_avx_epi32(
                                        _mm256_dpbusd_avx_epi32(z, wc[0], _mm256_load_si256(y)),
                                        wc[1],
                                        _mm256_load_si256(y.add(1)),
                                    ),
                                    _mm256_dpbusd_avx_epi32(
                                        _mm256_dpbusd_avx_epi32(z, wc[2], _mm256_load_si256(y.add(2))),
                                        wc[3],
                                        _mm256_load_si256(y.add(3)),
                                    ),
                                )
                            } else if KIND == KIND_Q6 {
                                _mm256_add_epi32(
                                    _mm256_madd_epi16(lo, _mm256_load_si256(e.add(3))),
                                    _mm256_madd_epi16(hi, _mm256_load_si256(e.add(4))),
                                )
                            } else {
                                _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones)
                            };
                            let da = _mm256_castsi256_ps(_mm256_load_si256(y.add(4)));
                            let s = _mm256_castsi256_ps(_mm256_load_si256(y.add(5)));
                            acc[i][g] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc[i][g]);
                            acc[i][g] = _mm256_fmadd_ps(cw, s, acc[i][g]);
                        }
                    }
                }
                acc
            }

            /// One activation row (`a`: raw quantised blocks, [`act_type`]) against four weight rows,
            /// nb blocks: lanes [e0, o0, e2, o2 | e1, o1, e3, o3], e_t + o_t being weight row t's dot.
            ///
            /// The same arithmetic as [`tile_kernel`] gives the pair (weight row, activation row): per
            /// block, the exact integer sums over the elements {0-3, 8-11, 16-19, 24-27} (e) and the
            /// others (o) (there the lanes 2r and 2r + 1 of the chunk-broadcast `maddubs`; here a whole
            /// row's `maddubs` + `madd` and two lane folds: integers, so the grouping does not matter),
            /// then per lane one `fma(d_w·d_a, sum, acc)` and, but for Q8_0, `fma(c, S, acc)` with
            /// [`unpack_row`]'s offset c and [`act_pack`]'s S (Q4_1/Q5_1: c = m, S = the Q8_1 block's s
            /// on e and 0 on o; Q4_0/Q5_0: c = −8d / −16d, S = d_a·Σy over elements 0..16 on e and
            /// 16..32 on o), blocks in order. So a row's result is the same bits alone (1-3 rows) as among
            /// four or more (the tiled kernel): the server's batch invariance without padding.
            #[inline]
            #[target_feature(enable = $feat)]
            unsafe fn $invariant_x4<const W: u8>(rows: [*const u8; 4], a: *const u8, nb: usize) -> __m256 {
                use GgmlType::*;
                let w = match W {
                    0 => Q4_0,
                    1 => Q5_0,
                    2 => Q4_1,
                    3 => Q5_1,
                    _ => Q8_0,
                };
                let ones = _mm256_set1_epi16(1);
                let ones8 = _mm256_set1_epi8(1);
                let x10 = _mm256_set1_epi8(0x10);
                let mut acc = _mm256_setzero_ps();
                let min = matches!(w, Q4_1 | Q5_1);
                let (wbs, abs) = match w {
                    Q4_0 => (18, 34),
                    Q5_0 => (22, 34),
                    Q4_1 => (20, 36),
                    Q5_1 => (24, 36),
                    _ => (34, 34),
                };
                let centre = match w {
                    Q4_0 => -8.0,
                    Q5_0 => -16.0,
                    _ => 0.0,
                };
                for b in 0..nb {
                    let ab = a.add(b * abs);
                    // The activation block's f16 d (and Q8_1's s) as f32, [d, s] repeated.
                    let ds = _mm256_cvtph_ps(_mm_set1_epi32(u32_at(ab)));
                    let y = ld256(ab.add(if min { 4 } else { 2 }));
                    let wb = [rows[0].add(b * wbs), rows[1].add(b * wbs), rows[2].add(b * wbs), rows[3].add(b * wbs)];
                    // Per weight row: 8 i32 lanes, lane L = the products of elements 4L..4L+3; folded to
                    // [L0+L4, L1+L5, L2+L6, L3+L7]. (Plain loops, not closures: a closure is not compiled
                    // with this function's target features, and its intrinsics then become calls.)
                    let mut h = [_mm_setzero_si128(); 4];
                    for t in 0..4 {
                        let q = match w {
                            Q4_0 => nibbles(wb[t].add(2)),
                            Q5_0 => _mm256_or_si256(nibbles(wb[t].add(6)), _mm256_and_si256(bits_to_bytes(wb[t].add(2)), x10)),
                            Q4_1 => nibbles(wb[t].add(4)),
                            Q5_1 => _mm256_or_si256(nibbles(wb[t].add(8)), _mm256_and_si256(bits_to_bytes(wb[t].add(4)), x10)),
                            _ => ld256(wb[t].add(2)),
                        };
                        let v = if $vnni {
                            let z = _mm256_setzero_si256();
                            if w == Q8_0 {
                                _mm256_dpbusd_avx_epi32(z, _mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q))
                            } else {
                                _mm256_dpbusd_avx_epi32(z, q, y)
                            }
                        } else if w == Q8_0 {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q)), ones)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones)
                        };
                        h[t] = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
                    }
                    let x = _mm256_set_m128i(h[1], h[0]);
                    let z = _mm256_set_m128i(h[3], h[2]);
                    // [e, o, e, o] per 128-bit half, then rows (0, 2 | 1, 3) side by side.
                    let x = _mm256_add_epi32(x, _mm256_shuffle_epi32::<0b01_00_11_10>(x));
                    let z = _mm256_add_epi32(z, _mm256_shuffle_epi32::<0b01_00_11_10>(z));
                    let p = _mm256_unpacklo_epi64(x, z);
                    // The weight rows' f16 d (and the min types' m) in the lane order of p:
                    // [d0 m0 d2 m2 d1 m1 d3 m3] (other types: the u16 after d is not read as a value).
                    let dm = _mm256_cvtph_ps(_mm_setr_epi32(u32_at(wb[0]), u32_at(wb[2]), u32_at(wb[1]), u32_at(wb[3])));
                    let dw = _mm256_moveldup_ps(dm);
                    let da = _mm256_moveldup_ps(ds);
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(p), acc);
                    if min {
                        let sa = _mm256_blend_ps::<0b1010_1010>(_mm256_movehdup_ps(ds), _mm256_setzero_ps());
                        acc = _mm256_fmadd_ps(_mm256_movehdup_ps(dm), sa, acc);
                    } else if w != Q8_0 {
                        // act_pack's S: d_a times the quant sums of elements 0..16 and 16..32 (lanes 0, 4).
                        let v = if $vnni {
                            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ones8, y)
                        } else {
                            _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, y), ones)
                        };
                        let v = _mm256_hadd_epi32(v, v);
                        let v = _mm256_hadd_epi32(v, v);
                        let sv = _mm256_mul_ps(da, _mm256_cvtepi32_ps(v));
                        let sa = _mm256_permutevar8x32_ps(sv, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
                        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(centre)), sa, acc);
                    }
                }
                acc
            }

            /// Weight rows 0..m of `w` ([`invariant_supported`]) against `n` activation rows (raw
            /// quantised rows, [`act_type`]), out[r·out_stride + i]: each pair with the arithmetic
            /// [`gemm_tiled`] gives it, bit for bit ([`invariant_x4`]). Four weight rows a call, a
            /// quarter of the matrix apart (four long streams for the prefetchers, as the n = 1 kernels).
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub unsafe fn $gemm_invariant(
                w: GgmlType,
                wdata: &[u8],
                m: usize,
                k: usize,
                acts: &[u8],
                n: usize,
                out: &mut [f32],
                out_stride: usize,
            ) {
                let wrb = w.row_bytes(k).expect("whole blocks");
                let arb = act_type(w).row_bytes(k).expect("whole blocks");
                let nb = k / 32;
                assert!(invariant_supported(w) && wdata.len() >= m * wrb && acts.len() >= n * arb);
                let call = |rows: [usize; 4], cnt: usize| {
                    let ptrs = rows.map(|i| wdata[i * wrb..(i + 1) * wrb].as_ptr());
                    for r in 0..n {
                        let a = acts[r * arb..(r + 1) * arb].as_ptr();
                        let v: [f32; 8] = std::mem::transmute(match w {
                            GgmlType::Q4_0 => $invariant_x4::<0>(ptrs, a, nb),
                            GgmlType::Q5_0 => $invariant_x4::<1>(ptrs, a, nb),
                            GgmlType::Q4_1 => $invariant_x4::<2>(ptrs, a, nb),
                            GgmlType::Q5_1 => $invariant_x4::<3>(ptrs, a, nb),
                            _ => $invariant_x4::<4>(ptrs, a, nb),
                        });
                        // Weight row t's two lanes added, as pair_sums does.
                        let dots = [v[0] + v[1], v[4] + v[5], v[2] + v[3], v[6] + v[7]];
                        for t in 0..cnt {
                            out[r * out_stride + rows[t]] = dots[t];
                        }
                    }
                };
                super::quarter_rows(m, call);
            }

            /// The tiled prompt GEMM over weight rows 0..m and activation rows 0..n (see
            /// [`super::gemm`] for the layout), given the activation rows packed by [`act_pack`] per
            /// group of four (group g at word g·nb·ACT_WORDS of `packed`) and `tile` scratch of at least
            /// nb·TILE_ROWS·[`entry_words`] words.
            #[allow(clippy::too_many_arguments)]
            #[target_feature(enable = $feat)]
            pub unsafe fn $gemm_tiled(
                w: GgmlType,
                wdata: &[u8],
                m: usize,
                k: usize,
                n: usize,
                packed: &[V32],
                out: &mut [f32],
                out_stride: usize,
                tile: &mut [V32],
            ) {
                let wrb = w.row_bytes(k).expect("whole blocks");
                let nb = k / 32;
                let ng = n.div_ceil(4);
                let ew = entry_words(w);
                assert!(packed.len() >= ng * nb * ACT_WORDS && tile.len() >= nb * TILE_ROWS * ew && wdata.len() >= m * wrb);
                let tp = tile.as_mut_ptr() as *mut __m256i;
                let pp = packed.as_ptr() as *const __m256i;
                let mut i0 = 0;
                while i0 < m {
                    // A short last tile repeats its last row (per-row arithmetic is independent).
                    for t in 0..TILE_ROWS {
                        let i = (i0 + t).min(m - 1);
                        unpack_row(w, wdata[i * wrb..(i + 1) * wrb].as_ptr(), nb, tp.add(t * ew), TILE_ROWS * ew, $vnni);
                    }
                    let rows = TILE_ROWS.min(m - i0);
                    let mut store = |g: usize, acc: &[__m256]| {
                        for t in 0..rows {
                            let v = pair_sums(acc[t]);
                            for r in 0..4.min(n - 4 * g) {
                                out[(4 * g + r) * out_stride + i0 + t] = v[r];
                            }
                        }
                    };
                    let grp = |g: usize| pp.add(g * nb * ACT_WORDS);
                    let mut g = 0;
                    // One group per call: two groups' accumulators spilled to the stack (~10% slower).
                    while g < ng {
                        let acc = match w {
                            GgmlType::Q6K => $tile_kernel::<1, KIND_Q6>(tp, [grp(g)], nb),
                            GgmlType::Q8_0 => $tile_kernel::<1, KIND_Q8>(tp, [grp(g)], nb),
                            _ => $tile_kernel::<1, KIND_GENERIC>(tp, [grp(g)], nb),
                        };
                        let col: [__m256; TILE_ROWS] = std::array::from_fn(|t| acc[t][0]);
                        store(g, &col);
                        g += 1;
                    }
                    i0 += TILE_ROWS;
                }
            }
        };
    }
    tiled_kernels!("avx2,fma,f16c", false, tile_kernel, invariant_x4, gemm_invariant, gemm_tiled);
    tiled_kernels!("avx2,fma,f16c,avxvnni", true, tile_kernel_vnni, invariant_x4_vnni, gemm_invariant_vnni, gemm_tiled_vnni);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use GgmlType::*;

    const TYPES: &[GgmlType] = &[F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4K, Q5K, Q6K];

    /// splitmix64; no extra dev-dependency needed.
    struct Rng(u64);
    impl Rng {
        fn u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            (self.u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    fn ks(w: GgmlType) -> &'static [usize] {
        match w.block_size() {
            1 => &[1, 7, 8, 16, 61, 256, 1037],
            32 => &[32, 64, 96, 512, 1536],
            _ => &[256, 512, 1280, 4096],
        }
    }

    /// Random values with per-32 magnitudes from 0.05 to ~3 and (sometimes) an offset, so the
    /// min/offset terms of the asymmetric formats are exercised.
    fn random_vals(rng: &mut Rng, len: usize, offset: bool) -> Vec<f32> {
        let mut v = Vec::with_capacity(len);
        let mut scale = 1.0;
        let mut off = 0.0;
        for i in 0..len {
            if i % 32 == 0 {
                scale = 0.05 + 3.0 * (rng.f() + 1.0) / 2.0;
                off = if offset { 0.7 * scale * rng.f() } else { 0.0 };
            }
            v.push(rng.f() * scale + off);
        }
        v
    }

    fn quantize_rows(w: GgmlType, vals: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; w.row_bytes(vals.len()).unwrap()];
        quant::quantize(w, vals, &mut out).unwrap();
        out
    }

    fn deq(ty: GgmlType, b: &[u8], k: usize) -> Vec<f32> {
        let mut y = vec![0f32; k];
        quant::dequantize(ty, b, &mut y).unwrap();
        y
    }

    /// Exact (f64) reference of the integer dot and the tolerance the kernels must meet:
    /// 1e-4·Σ|terms| of float rounding, plus for Q4_1/Q5_1 the f16 rounding of the activation
    /// block sum s = d·Σq that llama.cpp's m·s term carries too.
    fn reference(w: GgmlType, wr: &[u8], act: &[u8], k: usize) -> (f64, f64) {
        let wd = deq(w, wr, k);
        let ad = deq(act_type(w), act, k);
        let (mut s, mut abs) = (0f64, 0f64);
        for (a, b) in wd.iter().zip(&ad) {
            s += *a as f64 * *b as f64;
            abs += (*a as f64 * *b as f64).abs();
        }
        let mut extra = 0f64;
        if matches!(w, Q4_1 | Q5_1) {
            let wts = w.type_size();
            for (wb, ab) in wr.chunks_exact(wts).zip(act.chunks_exact(36)) {
                extra += (quant::read_f16(wb, 2) as f64 * quant::read_f16(ab, 2) as f64).abs() / 1024.0;
            }
        }
        (s, 1e-4 * abs + extra + 1e-30)
    }

    /// Bound on |Σ w·x − Σ w·deq(act(x))|: each activation is within ~0.5 of its block step
    /// (amax/127) of x (0.6 allows for the f16 rounding of the step).
    fn act_quant_bound(w: GgmlType, wd: &[f32], x: &[f32]) -> f64 {
        let at = act_type(w);
        if at == F32 {
            return 0.0;
        }
        let bs = at.block_size();
        let mut b = 0f64;
        for (wb, xb) in wd.chunks(bs).zip(x.chunks(bs)) {
            let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs())) as f64;
            let wsum: f64 = wb.iter().map(|&v| (v as f64).abs()).sum();
            b += 0.6 * amax / 127.0 * wsum;
        }
        b
    }

    #[test]
    fn simd_detection_is_cached_and_sane() {
        let a = simd_available();
        assert_eq!(a, simd_available());
        #[cfg(target_arch = "x86_64")]
        eprintln!("quant_dot: AVX2 path {}", if a { "enabled" } else { "NOT available (scalar only)" });
    }

    #[test]
    fn quant_dot_unpack_k4_matches_reference() {
        let mut rng = Rng(7);
        for _ in 0..200 {
            let s: Vec<u8> = (0..12).map(|_| rng.u64() as u8).collect();
            let u = unpack_k4(&s);
            let bytes: Vec<u8> = u.iter().flat_map(|v| v.to_le_bytes()).collect();
            for j in 0..8 {
                assert_eq!((bytes[j], bytes[8 + j]), quant::get_scale_min_k4(j, &s));
            }
        }
    }

    #[test]
    fn quant_dot_vec_dot_matches_reference_all_types() {
        let mut rng = Rng(1);
        for &w in TYPES {
            for &k in ks(w) {
                for trial in 0..4 {
                    let wv = random_vals(&mut rng, k, trial % 2 == 1);
                    let x = random_vals(&mut rng, k, trial >= 2);
                    let wr = quantize_rows(w, &wv);
                    let mut act = vec![0u8; act_type(w).row_bytes(k).unwrap()];
                    quantize_act(w, &x, &mut act);
                    let (r, tol) = reference(w, &wr, &act, k);
                    let fast = vec_dot(w, &wr, &act, k) as f64;
                    let slow = vec_dot_scalar(w, &wr, &act, k) as f64;
                    assert!((fast - r).abs() <= tol, "{} k={k} trial {trial}: simd {fast} vs ref {r} (tol {tol})", w.name());
                    assert!((slow - r).abs() <= tol, "{} k={k} trial {trial}: scalar {slow} vs ref {r} (tol {tol})", w.name());
                    // Against the un-quantised activations: only the activation rounding differs.
                    let wd = deq(w, &wr, k);
                    let exact: f64 = wd.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let tol2 = tol + act_quant_bound(w, &wd, &x);
                    assert!((fast - exact).abs() <= tol2, "{} k={k}: simd {fast} vs f32 dot {exact} (tol {tol2})", w.name());
                }
            }
        }
    }

    #[test]
    fn quant_dot_extreme_values() {
        // Saturated blocks: weights at both ends of their range, activations ±amax (q = ±127),
        // all-zero activation rows, and large k, so no int16/int32 overflow goes unnoticed.
        let mut rng = Rng(3);
        for &w in TYPES {
            let k = if w.block_size() == 256 { 2048 } else { 1024 };
            let wv: Vec<f32> = (0..k).map(|i| if (i * 7 + i / 3) % 2 == 0 { 1.0 } else { -1.0 } * (1.0 + (i % 5) as f32 * 1e-3)).collect();
            for pattern in 0..3 {
                let x: Vec<f32> = (0..k)
                    .map(|i| match pattern {
                        0 => wv[i].signum(),
                        1 => -wv[i].signum() * 3.0,
                        _ => 0.0,
                    })
                    .collect();
                let wr = quantize_rows(w, &wv);
                let mut act = vec![0u8; act_type(w).row_bytes(k).unwrap()];
                quantize_act(w, &x, &mut act);
                let (r, tol) = reference(w, &wr, &act, k);
                for v in [vec_dot(w, &wr, &act, k), vec_dot_scalar(w, &wr, &act, k)] {
                    assert!((v as f64 - r).abs() <= tol, "{} pattern {pattern}: {v} vs {r}", w.name());
                }
                if pattern == 2 {
                    assert_eq!(vec_dot(w, &wr, &act, k), 0.0);
                }
            }
            let _ = rng.u64();
        }
    }

    #[test]
    fn quant_dot_gemm_matches_vec_dot() {
        let mut rng = Rng(2);
        for &w in TYPES {
            // Large F32/F16 rows with m = 20 cross several L2 chunks of the tile loop.
            let (k, m) = match w.block_size() {
                1 => (4096 + 3, 20),
                32 => (320, 9),
                _ => (512, 9),
            };
            let wv = random_vals(&mut rng, m * k, true);
            let wdata = quantize_rows(w, &wv);
            let wrb = w.row_bytes(k).unwrap();
            let arb = act_type(w).row_bytes(k).unwrap();
            for &n in &[1usize, 2, 3, 4, 5, 7, 8, 11, 16, 21] {
                let x = random_vals(&mut rng, n * k, false);
                let mut acts = vec![0u8; n * arb];
                for j in 0..n {
                    quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
                }
                let stride = m + 3;
                for scalar in [false, true] {
                    let mut out = vec![f32::NAN; (n - 1) * stride + m + 2];
                    if scalar {
                        gemm_scalar(w, &wdata, m, k, &acts, n, &mut out, stride);
                    } else {
                        gemm(w, &wdata, m, k, &acts, n, &mut out, stride);
                    }
                    for j in 0..n {
                        for i in 0..m {
                            let (wr, ar) = (&wdata[i * wrb..(i + 1) * wrb], &acts[j * arb..(j + 1) * arb]);
                            let (r, tol) = reference(w, wr, ar, k);
                            let got = out[j * stride + i];
                            assert!((got as f64 - r).abs() <= tol, "{} n={n} scalar={scalar} ({j},{i}): {got} vs {r}", w.name());
                            if scalar {
                                assert_eq!(got, vec_dot_scalar(w, wr, ar, k));
                            }
                        }
                        for i in m..stride {
                            let idx = j * stride + i;
                            if idx < out.len() {
                                assert!(out[idx].is_nan(), "{} gemm wrote outside the tile at {idx}", w.name());
                            }
                        }
                    }
                }
            }
        }
    }

    /// Batch invariance: for the types with `avx2::gemm_invariant`, a row's result from 1-3
    /// activation rows equals, bit for bit, the same row's among 4-9 rows (the tiled kernel),
    /// wherever it sits; Q8_0 with ±127 and −128 weight quants, every row's length a tail case.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn quant_dot_small_batches_match_the_tiled_kernel_bit_for_bit() {
        if !simd_available() {
            return;
        }
        let mut rng = Rng(23);
        for w in [Q4_0, Q5_0, Q4_1, Q5_1, Q8_0] {
            for &(m, k) in &[(1usize, 32usize), (3, 64), (4, 96), (7, 576), (13, 1536), (64, 576)] {
                let mut wdata = quantize_rows(w, &random_vals(&mut rng, m * k, true));
                let wrb = w.row_bytes(k).unwrap();
                if w == Q8_0 && m > 3 {
                    for blk in wdata[2 * wrb..3 * wrb].chunks_exact_mut(34) {
                        blk[2..].iter_mut().enumerate().for_each(|(t, q)| *q = if t % 3 == 0 { 127 } else { 0x80 });
                    }
                }
                let arb = act_type(w).row_bytes(k).unwrap();
                let big = 9;
                let mut x = random_vals(&mut rng, big * k, true);
                for (t, v) in x[k..2 * k].iter_mut().enumerate() {
                    *v = if t % 3 == 0 { -1.0 } else { 1.0 };
                }
                let mut acts = vec![0u8; big * arb];
                for j in 0..big {
                    quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
                }
                for nbig in 4..=big {
                    let mut all = vec![f32::NAN; nbig * m];
                    gemm(w, &wdata, m, k, &acts, nbig, &mut all, m);
                    for n in 1..=3usize {
                        for j0 in 0..=nbig - n {
                            let mut few = vec![f32::NAN; n * m];
                            gemm(w, &wdata, m, k, &acts[j0 * arb..(j0 + n) * arb], n, &mut few, m);
                            for r in 0..n {
                                for i in 0..m {
                                    let (a, b) = (few[r * m + i], all[(j0 + r) * m + i]);
                                    assert_eq!(
                                        a.to_bits(),
                                        b.to_bits(),
                                        "{} m={m} k={k}: row {} of {n} vs of {nbig}: {a} vs {b}",
                                        w.name(),
                                        j0 + r
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The tiled kernels' AVX-VNNI copies give the AVX2 kernels' bits: every tiled type, 1 to
    /// 13 activation rows (the invariant kernel below four, the tiled one from four, and with
    /// `invariant` the tiled one at every n), random rows and saturated ones (weights at both
    /// ends of their range, activations at ±127). Skips (passes) where the CPU has no VNNI.
    #[test]
    fn vnni_kernels_match_avx2_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            if !(simd_available() && is_x86_feature_detected!("avxvnni")) {
                eprintln!("vnni_kernels_match_avx2_bit_for_bit: no AVX-VNNI on this CPU, skipped");
                return;
            }
            let mut rng = Rng(41);
            for w in [Q4_0, Q5_0, Q4_1, Q5_1, Q8_0, Q4K, Q5K, Q6K] {
                let k = if w.block_size() == 256 { 512 } else { 192 };
                let m = 11;
                let mut wv = random_vals(&mut rng, m * k, true);
                // Two saturated rows: ±1 patterns (the quants at their ends), and a sign pattern.
                for i in 0..k {
                    wv[i] = if (i * 7 + i / 3) % 2 == 0 { 1.0 } else { -1.0 };
                    wv[k + i] = if i % 3 == 0 { -2.5 } else { 2.5 };
                }
                let mut wdata = quantize_rows(w, &wv);
                if w == Q8_0 {
                    // −128, which ggml's quantiser never writes but a file may hold.
                    for i in [2, 5, 34 + 2, 34 * 7 + 20] {
                        wdata[i] = 0x80;
                    }
                }
                let arb = act_type(w).row_bytes(k).unwrap();
                let nmax = 13;
                let mut x = random_vals(&mut rng, nmax * k, true);
                for i in 0..k {
                    x[i] = wv[i].signum();
                    x[k + i] = -3.0 * wv[i].signum();
                }
                let mut acts = vec![0u8; nmax * arb];
                for j in 0..nmax {
                    quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
                }
                for n in 1..=nmax {
                    for invariant in [false, true] {
                        let mut a = vec![f32::NAN; n * m];
                        let mut b = vec![f32::NAN; n * m];
                        gemm_impl(w, &wdata, m, k, &acts[..n * arb], n, &mut a, m, Path::Avx2, invariant);
                        gemm_impl(w, &wdata, m, k, &acts[..n * arb], n, &mut b, m, Path::Vnni, invariant);
                        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                            assert_eq!(x.to_bits(), y.to_bits(), "{} n={n} invariant={invariant}: element {i}: {x} vs {y}", w.name());
                        }
                    }
                }
            }
        }
    }

    /// The float types' products are batch-invariant as they are (no mode): each row of a
    /// 1-3 row batch equals that row in batches of 4-9, bit for bit, with k tails of 8 and 1.
    #[test]
    fn quant_dot_float_types_are_batch_invariant() {
        if !simd_available() {
            return;
        }
        let mut rng = Rng(31);
        for w in [F32, F16, BF16] {
            assert!(batch_invariant(w), "{}", w.name());
            for &(m, k) in &[(3usize, 64usize), (7, 200), (5, 33)] {
                let vals = random_vals(&mut rng, m * k, true);
                let wdata: Vec<u8> = match w {
                    F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    F16 => vals.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                    _ => vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
                };
                let arb = 4 * k;
                let big = 9;
                let acts: Vec<u8> = random_vals(&mut rng, big * k, true).iter().flat_map(|v| v.to_le_bytes()).collect();
                for nbig in 4..=big {
                    let mut all = vec![f32::NAN; nbig * m];
                    gemm(w, &wdata, m, k, &acts, nbig, &mut all, m);
                    for n in 1..=3usize {
                        for j0 in 0..=nbig - n {
                            let mut few = vec![f32::NAN; n * m];
                            gemm(w, &wdata, m, k, &acts[j0 * arb..(j0 + n) * arb], n, &mut few, m);
                            for r in 0..n {
                                for i in 0..m {
                                    let (a, b) = (few[r * m + i], all[(j0 + r) * m + i]);
                                    assert_eq!(a.to_bits(), b.to_bits(), "{} m={m} k={k}: row {} of {n} vs of {nbig}", w.name(), j0 + r);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `gemm_mode(.., invariant)`: the K-quants' products of 1-3 rows take the tiled kernel, so
    /// every row of any batch gets the same bits ([`batch_invariant_mode`] says so); without
    /// the mode they keep their own kernels (and the claim is not made).
    #[test]
    fn quant_dot_invariant_mode_makes_k_quants_batch_invariant() {
        if !simd_available() {
            return;
        }
        let mut rng = Rng(29);
        for w in [Q4K, Q5K, Q6K] {
            assert!(!batch_invariant(w) && batch_invariant_mode(w, true), "{}", w.name());
            let mut differs = false;
            for &(m, k) in &[(1usize, 256usize), (5, 512), (13, 768), (64, 512)] {
                let wdata = quantize_rows(w, &random_vals(&mut rng, m * k, true));
                let arb = act_type(w).row_bytes(k).unwrap();
                let big = 7;
                let x = random_vals(&mut rng, big * k, true);
                let mut acts = vec![0u8; big * arb];
                for j in 0..big {
                    quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
                }
                for nbig in 4..=big {
                    let mut all = vec![f32::NAN; nbig * m];
                    gemm_mode(w, &wdata, m, k, &acts, nbig, &mut all, m, true);
                    for n in 1..=3usize {
                        for j0 in 0..=nbig - n {
                            let mut few = vec![f32::NAN; n * m];
                            gemm_mode(w, &wdata, m, k, &acts[j0 * arb..(j0 + n) * arb], n, &mut few, m, true);
                            for r in 0..n {
                                for i in 0..m {
                                    let (a, b) = (few[r * m + i], all[(j0 + r) * m + i]);
                                    assert_eq!(
                                        a.to_bits(),
                                        b.to_bits(),
                                        "{} m={m} k={k}: row {} of {n} vs of {nbig}: {a} vs {b}",
                                        w.name(),
                                        j0 + r
                                    );
                                }
                            }
                        }
                    }
                }
                // The mode's small batches agree with the K-quants' own kernels to rounding.
                let mut own = vec![0f32; m];
                let mut tiled = vec![0f32; m];
                gemm(w, &wdata, m, k, &acts[..arb], 1, &mut own, m);
                gemm_mode(w, &wdata, m, k, &acts[..arb], 1, &mut tiled, m, true);
                for i in 0..m {
                    assert!((own[i] - tiled[i]).abs() <= 1e-4 * (1.0 + own[i].abs()), "{} row {i}: {} vs {}", w.name(), own[i], tiled[i]);
                }
                differs |= own.iter().zip(&tiled).any(|(a, b)| a.to_bits() != b.to_bits());
            }
            // (Else the mode would change nothing: the own kernels would already be invariant.)
            assert!(differs, "{}: the own single-row kernel gave the tiled kernel's bits everywhere", w.name());
        }
    }

    /// The tiled prompt GEMM (n ≥ TILED_MIN_ROWS) against the scalar reference `gemm_scalar`,
    /// for every weight type, with tails in m (tile of 4 rows), n (groups of 4 / pairs of
    /// groups) and k; extreme activations (|q| = 127 in every lane) and extreme weights (every
    /// quant at its range's ends; Q8_0 also −128) included.
    #[test]
    fn quant_dot_tiled_gemm_matches_scalar() {
        let mut rng = Rng(11);
        for &w in TYPES {
            let bs = w.block_size().max(32);
            for &(m, kb) in &[(1usize, 1usize), (3, 2), (4, 3), (7, 1), (13, 5)] {
                let k = kb * if bs == 256 { 256 } else { 32 };
                let mut wv = random_vals(&mut rng, m * k, true);
                // One weight row of constant magnitude: every quant at the end of its range
                // (Q8_0: ±127, the largest maddubs pair sums).
                if m > 2 {
                    for (t, v) in wv[k..2 * k].iter_mut().enumerate() {
                        *v = if t % 5 < 2 { -1.0 } else { 1.0 };
                    }
                }
                let mut wdata = quantize_rows(w, &wv);
                let wrb = w.row_bytes(k).unwrap();
                // Q8_0: a row of −128 quants too (ggml never writes them, other quantisers do).
                if w == Q8_0 && m > 3 {
                    for blk in wdata[2 * wrb..3 * wrb].chunks_exact_mut(34) {
                        blk[2..].iter_mut().enumerate().for_each(|(t, q)| *q = if t % 3 == 0 { 127 } else { 0x80 });
                    }
                }
                let arb = act_type(w).row_bytes(k).unwrap();
                for &n in &[4usize, 5, 8, 9, 12, 13, 19, 33] {
                    let mut x = random_vals(&mut rng, n * k, false);
                    // One row of constant magnitude: every activation quant is ±127.
                    for (t, v) in x[k..2 * k].iter_mut().enumerate() {
                        *v = if t % 3 == 0 { -1.0 } else { 1.0 };
                    }
                    let mut acts = vec![0u8; n * arb];
                    for j in 0..n {
                        quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
                    }
                    let stride = m + 2;
                    let mut got = vec![f32::NAN; n * stride];
                    let mut want = vec![f32::NAN; n * stride];
                    gemm(w, &wdata, m, k, &acts, n, &mut got, stride);
                    gemm_scalar(w, &wdata, m, k, &acts, n, &mut want, stride);
                    for j in 0..n {
                        for i in 0..stride {
                            let (g, r) = (got[j * stride + i], want[j * stride + i]);
                            if i >= m {
                                assert!(g.is_nan(), "{} wrote outside the tile", w.name());
                                continue;
                            }
                            let (_, tol) = reference(w, &wdata[i * wrb..(i + 1) * wrb], &acts[j * arb..(j + 1) * arb], k);
                            assert!(((g - r) as f64).abs() <= tol, "{} m={m} k={k} n={n} ({j},{i}): {g} vs {r}", w.name());
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quant_dot_known_values() {
        // One Q4_0 block, d = 0.5, nibbles j (low) and 15 − j (high): weights (j − 8)/2 and (7 − j)/2.
        let mut wr = vec![0x00u8, 0x38];
        wr.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        // Q8_0 activation block by hand: d = 0.25, q = 1 for elements 0..16, −2 for 16..32.
        let mut act = vec![0x00u8, 0x34];
        act.extend((0..32).map(|i| if i < 16 { 1u8 } else { (-2i8) as u8 }));
        // Σ_j (j−8)·1 + (7−j)·(−2) over j = 0..16 = −8 − 2·(−8) = 8; × 0.5 × 0.25 = 1.
        assert_eq!(vec_dot(Q4_0, &wr, &act, 32), 1.0);
        assert_eq!(vec_dot_scalar(Q4_0, &wr, &act, 32), 1.0);
        let mut out = [0f32; 1];
        gemm(Q4_0, &wr, 1, 32, &act, 1, &mut out, 1);
        assert_eq!(out[0], 1.0);

        // Q8_0 weights may hold −128 (other quantisers than ggml's produce it): the sign trick
        // must still be exact. Weights all −128 with d = 1, activations q = 127 with d = 1.
        let mut wr = vec![0x00u8, 0x3C];
        wr.extend([0x80u8; 32]);
        let mut act = vec![0x00u8, 0x3C];
        act.extend([127u8; 32]);
        let want = -128.0 * 127.0 * 32.0;
        assert_eq!(vec_dot(Q8_0, &wr, &act, 32), want);
        assert_eq!(vec_dot_scalar(Q8_0, &wr, &act, 32), want);
        let mut act4 = Vec::new();
        for _ in 0..4 {
            act4.extend_from_slice(&act);
        }
        let mut out = [0f32; 4];
        gemm(Q8_0, &wr, 1, 32, &act4, 4, &mut out, 1);
        assert_eq!(out, [want; 4]);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn quant_dot_act_scale_conversion() {
        if !simd_available() {
            return;
        }
        let mut rng = Rng(5);
        for (at, bsz, per) in [(Q8_0, 34, 1), (Q8_1, 36, 2)] {
            for nb in 1..20 {
                let x = random_vals(&mut rng, nb * 32, true);
                let acts = quantize_rows(at, &x);
                let got = unsafe { avx2::act_scales(at, &acts) };
                let want: Vec<f32> = acts.chunks_exact(bsz).flat_map(|b| (0..per).map(move |t| quant::read_f16(b, 2 * t))).collect();
                assert_eq!(got, want, "{} nb={nb}", at.name());
            }
        }
    }

    #[test]
    fn quant_dot_simd_act_quantisers_are_bit_exact() {
        let mut rng = Rng(11);
        for at in [Q8_0, Q8_1, Q8K] {
            for &k in &[256usize, 512, 1536] {
                for trial in 0..20 {
                    let mut x = random_vals(&mut rng, k, trial % 2 == 1);
                    match trial % 5 {
                        // Ties: integers and half-integers times a power of two step.
                        2 => x.iter_mut().enumerate().for_each(|(i, v)| *v = ((i % 255) as f32 - 127.0) * 0.5),
                        // A zero block and a block whose largest magnitude appears with both signs.
                        3 if k > 256 => {
                            x[..256].iter_mut().for_each(|v| *v = 0.0);
                            x[300] = -4.0;
                            x[310] = 4.0;
                        }
                        4 => x.iter_mut().for_each(|v| *v *= 1e-30),
                        _ => {}
                    }
                    let arb = at.row_bytes(k).unwrap();
                    let (mut a, mut b) = (vec![0u8; arb], vec![1u8; arb]);
                    quantize_act_as(at, &x, &mut a);
                    quantize_act_scalar(at, &x, &mut b);
                    assert!(a == b, "{} k={k} trial {trial}: SIMD bytes differ from the reference", at.name());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "not a multiple")]
    fn quant_dot_rejects_partial_blocks() {
        let wr = vec![0u8; 18];
        let act = vec![0u8; 34];
        vec_dot(Q4_0, &wr, &act, 31);
    }

    /// Single-thread gemm n=1 throughput from DRAM (weights far larger than the caches), the
    /// regime of a decode step. Run: `cargo test --release -p ts-cpu quant_dot_bench_dram --
    /// --ignored --nocapture`.
    #[test]
    #[ignore = "benchmark: `cargo test --release -p ts-cpu quant_dot_bench_dram -- --ignored --nocapture`"]
    fn quant_dot_bench_dram() {
        for &(w, k) in &[(Q4_1, 576usize), (Q4_1, 1536), (Q8_0, 576), (Q4K, 2048), (Q6K, 2048)] {
            let bytes_target = 96usize << 20;
            let wrb = w.row_bytes(k).unwrap();
            let m = bytes_target / wrb;
            let mut rng = Rng(9);
            let row = quantize_rows(w, &random_vals(&mut rng, k, true));
            let mut wdata = Vec::with_capacity(m * wrb);
            for _ in 0..m {
                wdata.extend_from_slice(&row);
            }
            let arb = act_type(w).row_bytes(k).unwrap();
            let mut acts = vec![0u8; arb];
            quantize_act(w, &random_vals(&mut rng, k, false), &mut acts);
            let mut out = vec![0f32; m];
            let (mut best, mut best_row) = (f64::MAX, f64::MAX);
            for _ in 0..7 {
                let t = Instant::now();
                gemm(w, &wdata, m, k, &acts, 1, &mut out, m);
                best = best.min(t.elapsed().as_secs_f64());
                std::hint::black_box(&out);
                let t = Instant::now();
                for i in 0..m {
                    out[i] = vec_dot(w, &wdata[i * wrb..(i + 1) * wrb], &acts, k);
                }
                best_row = best_row.min(t.elapsed().as_secs_f64());
                std::hint::black_box(&out);
            }
            let mb = (m * wrb) as f64;
            eprintln!(
                "{:>5} k={k:<5} {:.0} MB from DRAM: gemm n=1 {:6.2} GB/s | row by row (vec_dot) {:6.2} GB/s",
                w.name(),
                mb / 1e6,
                mb / best / 1e9,
                mb / best_row / 1e9
            );
        }
    }

    /// Single-thread throughput in GB/s of weight bytes streamed (the number that bounds decode).
    /// Run: `cargo test --release -p ts-cpu quant_dot_bench -- --ignored --nocapture`.
    #[test]
    #[ignore = "benchmark: `cargo test --release -p ts-cpu quant_dot_bench -- --ignored --nocapture`"]
    fn quant_dot_bench() {
        for &(w, m, k) in &[
            (Q4_1, 576usize, 1536usize),
            (Q8_0, 2048, 1408),
            (Q4_0, 2048, 2048),
            (Q5_0, 2048, 640),
            (Q5_1, 2048, 640),
            (Q4K, 2048, 2048),
            (Q6K, 2048, 2048),
            (F16, 1024, 2048),
        ] {
            let mut rng = Rng(9);
            let wv = random_vals(&mut rng, m * k, true);
            let wdata = quantize_rows(w, &wv);
            let wrb = w.row_bytes(k).unwrap();
            let arb = act_type(w).row_bytes(k).unwrap();
            let nmax = 8;
            // The prompt shape: 128 activation rows against a 64-row task slice of the weights.
            let (np, mp) = (128usize, 64usize.min(m));
            let x = random_vals(&mut rng, np * k, false);
            let mut acts = vec![0u8; np * arb];
            for j in 0..np {
                quantize_act(w, &x[j * k..(j + 1) * k], &mut acts[j * arb..(j + 1) * arb]);
            }
            let mut out = vec![0f32; np * m];
            let bytes = (m * wrb) as f64;
            // Best of many calls: the machine is shared, and the minimum is the figure least
            // disturbed by other processes being scheduled onto our core.
            let time = |f: &mut dyn FnMut()| {
                f();
                let t = Instant::now();
                let mut best = f64::MAX;
                while t.elapsed().as_secs_f64() < 0.5 {
                    let t1 = Instant::now();
                    f();
                    best = best.min(t1.elapsed().as_secs_f64());
                }
                best
            };
            let gemv = time(&mut || {
                for i in 0..m {
                    out[i] = vec_dot(w, &wdata[i * wrb..(i + 1) * wrb], &acts[..arb], k);
                }
                std::hint::black_box(&out);
            });
            let gemv_s = time(&mut || {
                for i in 0..m {
                    out[i] = vec_dot_scalar(w, &wdata[i * wrb..(i + 1) * wrb], &acts[..arb], k);
                }
                std::hint::black_box(&out);
            });
            let g1 = time(&mut || {
                gemm(w, &wdata, m, k, &acts[..arb], 1, &mut out, m);
                std::hint::black_box(&out);
            });
            let g8 = time(&mut || {
                gemm(w, &wdata, m, k, &acts[..nmax * arb], nmax, &mut out, m);
                std::hint::black_box(&out);
            });
            let gp = time(&mut || {
                gemm(w, &wdata[..mp * wrb], mp, k, &acts, np, &mut out, mp);
                std::hint::black_box(&out);
            });
            eprintln!(
                "{:>5} {m:>4}x{k:<4} ({:>5.2} MB): vec_dot {:6.2} GB/s ({:6.1} us) | gemm n=1 {:6.2} GB/s | scalar {:5.2} GB/s | gemm n=8 {:6.2} GB/s-equiv ({:5.1} GMAC/s) | {mp}x{np} {:5.1} GMAC/s",
                w.name(),
                bytes / 1e6,
                bytes / gemv / 1e9,
                gemv * 1e6,
                bytes / g1 / 1e9,
                bytes / gemv_s / 1e9,
                bytes * nmax as f64 / g8 / 1e9,
                (m * k * nmax) as f64 / g8 / 1e9,
                (mp * k * np) as f64 / gp / 1e9
            );
        }
    }
}
