// Fused decode-step kernels: each replaces a short chain of the plain kernels (see the trait's
// fused ops in ts-core's ops.rs) to cut launches per decode step. Every one of them can be turned
// off at run time with TS_CUDA_FUSED=0, which makes the backend enqueue the plain kernels instead.
// Where the plain chain's float operations can be reproduced exactly (norms, rope, copies) they are:
// same block sizes, same reduction order, same formulas.

// x += delta; out = x / sqrt(mean(x^2) + eps) * w. One block per row, block size as rms_norm's
// (so the sum of squares is reduced in the same order). `out` may be `x` or `delta` (same view):
// every thread reads and writes only its own elements, and (rows up to NORM_PER * blockDim, as
// rms_norm) reads all of them, into registers, before it writes any.
// pf0..pf3: up to four weight regions asked into L2 (Backend::prefetch_hint, l2_prefetch4) before
// the PDL wait: a decode layer's attention weights, while the layer's first kernel runs.
extern "C" __global__ void add_rms_norm(float* x, i64 xoff, i64 xstride, const float* d, i64 doff, i64 dstride,
                                        const float* w, int has_w, float eps, float* out, i64 ooff, i64 ostride,
                                        int width, const u8* pf0, i64 pb0, const u8* pf1, i64 pb1, const u8* pf2,
                                        i64 pb2, const u8* pf3, i64 pb3) {
    l2_prefetch4(pf0, pb0, pf1, pb1, pf2, pb2, pf3, pb3);
    float* xr = x + xoff + blockIdx.x * xstride;
    norm_block_row<true>(xr, xr, d + doff + blockIdx.x * dstride, w, has_w, eps, out + ooff + blockIdx.x * ostride, width);
}

// A batch's norm and the quantisation of its rows for the int8 products that read them, in one
// launch (CudaBackend::norm_q8): block r is add_rms_norm's row r (with d; rms_norm's without),
// then, from the row it has just written (out, seen by the whole block after the barrier), its
// Q8_0 groups into xq exactly as quant_q8_groups writes them (the same body). The same bits as
// the two launches, one dependent step fewer. (quant_group_body: kernels/mmq.cu, which follows.)
__device__ __forceinline__ void quant_group_body(i64 gid, const float* src, const float* src2, i64 off, i64 stride, int n,
                                                 int k, int act, const float* rw, int rk, int rks, u8* dst, i64 drow);
// nsplit > 0 (Path::SumQ8 with NormQ8; rows of width <= NORM_PER * blockDim): d holds the delta
// as the split-K partial outputs of the product before (split s at d + s * split_stride), summed
// here in split order as mmq_sum_splits sums them, so that launch goes too.
extern "C" __global__ void add_rms_norm_q8(float* x, i64 xoff, i64 xstride, const float* d, i64 doff, i64 dstride,
                                           const float* w, int has_w, float eps, float* out, i64 ooff, i64 ostride,
                                           int width, int n, u8* xq, i64 xqrow, int nsplit, i64 split_stride) {
    float* xr = x + xoff + blockIdx.x * xstride;
    float* orow = out + ooff + blockIdx.x * ostride;
    if (nsplit > 0) {
        // norm_block_row's register path, the delta summed from the partials.
        __shared__ float part[32];
        float wv[NORM_PER], v[NORM_PER];
        norm_load_w(w, has_w, width, wv);
        PDL_ENTRY();
        const float* dr = d + doff + blockIdx.x * dstride;
#pragma unroll
        for (int k = 0; k < NORM_PER; k++) {
            const int i = threadIdx.x + k * blockDim.x;
            v[k] = 0.f;
            if (i < width) {
                float ds = 0.f;
                for (int s = 0; s < nsplit; s++) ds += dr[s * split_stride + i];
                v[k] = xr[i] + ds;
                xr[i] = v[k];
            }
        }
        norm_store(v, wv, has_w, block_rms_inv(norm_ss(v, width), part, width, eps), width, orow);
    } else if (d) {
        norm_block_row<true>(xr, xr, d + doff + blockIdx.x * dstride, w, has_w, eps, orow, width);
    } else {
        norm_block_row<false>(xr, nullptr, nullptr, w, has_w, eps, orow, width);
    }
    __syncthreads();
    const int ng = (width + 127) >> 7, nw = blockDim.x >> 5;
    for (int g = threadIdx.x >> 5; g < ng; g += nw)
        quant_group_body((i64)blockIdx.x * ng + g, out, nullptr, ooff, ostride, n, width, 0, nullptr, 0, 1, xq, xqrow);
}

// A batch's norm and its rows in f16 for the cuBLAS products that read them
// (Path::DenseBlasBatch), in one launch: block r is add_rms_norm's row r (rms_norm's without d),
// then each thread converts the values of the row it has itself written (norm_block_row's
// i = tid + k * blockDim.x) as f16_rows converts them, into row r of xh (width halves). The same
// bits as add_rms_norm (or rms_norm) then f16_rows, one dependent step fewer.
extern "C" __global__ void add_rms_norm_h(float* x, i64 xoff, i64 xstride, const float* d, i64 doff, i64 dstride,
                                          const float* w, int has_w, float eps, float* out, i64 ooff, i64 ostride,
                                          int width, u16* xh, const u8* pf0, i64 pb0, const u8* pf1, i64 pb1,
                                          const u8* pf2, i64 pb2, const u8* pf3, i64 pb3) {
    l2_prefetch4(pf0, pb0, pf1, pb1, pf2, pb2, pf3, pb3);  // CudaBackend::xpf (TS_CUDA_XPF_AT=0)
    float* xr = x + xoff + blockIdx.x * xstride;
    float* orow = out + ooff + blockIdx.x * ostride;
    if (d) {
        norm_block_row<true>(xr, xr, d + doff + blockIdx.x * dstride, w, has_w, eps, orow, width);
    } else {
        norm_block_row<false>(xr, nullptr, nullptr, w, has_w, eps, orow, width);
    }
    u16* hr = xh + (i64)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) hr[i] = f2h_sat(orow[i]);
}

// dst = rope(src): per row, pairs of the first 2*half values rotated (as rope_rows), the rest of
// the row (width - 2*half values) copied. One thread per (row, pair or copied column).
extern "C" __global__ void rope_copy_rows(const float* src, i64 soff, i64 sstride, float* dst, i64 doff, i64 dstride,
                                          i64 nrows, int width, int heads_per_token, const int* pos,
                                          const float* freqs, int half, int mode, float mscale) { PDL_ENTRY();
    const int per = width - half;  // half pairs + (width - 2*half) copied columns
    const i64 total = nrows * per;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / per;
        const int j = (int)(idx % per);
        const float* srow = src + soff + r * sstride;
        float* drow = dst + doff + r * dstride;
        if (j < half) {
            float p = (float)pos[r / heads_per_token];
            float sn, cs;
            sincosf(p * freqs[j], &sn, &cs);
            sn *= mscale;
            cs *= mscale;
            int a = mode == 0 ? 2 * j : j, b = mode == 0 ? 2 * j + 1 : j + half;
            float x0 = srow[a], x1 = srow[b];
            drow[a] = x0 * cs - x1 * sn;
            drow[b] = x0 * sn + x1 * cs;
        } else {
            const int col = 2 * half + (j - half);
            drow[col] = srow[col];
        }
    }
}

// The MLA cache write of token t (block (t, 0)): rms_norm of the first nw values of row t (in
// place, weight w), rope of the 2*half values from column nw (in place, position pos[t]), then the
// whole row (width values) to cache row slot[t] * slot_len + pos[t]. Block size as rms_norm's for
// nw. With q (non-null), blocks (t, 1..gridDim.y) do the query's rope part of token t, an equal
// share each: its qh rows (qsrc row r -> qdst row r, qw values each) get rope_copy_rows' exact
// arithmetic (Backend::mla_rope_cache_write); q and qd must not overlap x. Token t's rows of q
// start qtstride apart (qh * qstride for packed head rows; the row of q and kv_a's joint product,
// Path::QkvJoint, where q's rows of a token are followed by its kv_a row).
// Latency: the latent row (nw <= NORM_PER * blockDim) and its rope pairs (half <= blockDim) are
// loaded into registers before any is used, and the query items (QROPE_U per round) likewise,
// spread over several blocks, so a token costs a few L2 round trips instead of one per strided
// loop step; the arithmetic is the loops'.
#define QROPE_U 8
// The body for token t and block qb of its 1 + nqb (0: the latent row, 1..nqb: query rope items);
// the kernel passes its block indices, mla_rope_absorb_1 its own numbering.
template <typename C>
__device__ __forceinline__ void norm_rope_cache_body(int t, int qb, int nqb, float* x, i64 xoff, i64 xstride, int width,
                                                     int nw, const float* w, int has_w, float eps, const int* pos,
                                                     const int* slot, int slot_len, const float* freqs, int half,
                                                     int mode, float mscale, C* cache, const float* q, i64 qoff,
                                                     i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw, int qh,
                                                     i64 qtstride) {
    __shared__ float part[32];
    const int bd = blockDim.x, tid = threadIdx.x;
    if (qb > 0) {
        PDL_ENTRY();
        const int per = qw - half, all = qh * per;
        const int span = (all + nqb - 1) / nqb, lo = (qb - 1) * span, total = min(all, lo + span);
        const float p = (float)pos[t];
        for (int base = lo + tid; base < total; base += QROPE_U * bd) {
            float a0[QROPE_U], a1[QROPE_U];
#pragma unroll
            for (int u = 0; u < QROPE_U; u++) {
                const int idx = base + u * bd;
                a0[u] = a1[u] = 0.f;
                if (idx < total) {
                    const int j = idx % per;
                    const float* srow = q + qoff + (i64)t * qtstride + (i64)(idx / per) * qstride;
                    if (j < half) {
                        a0[u] = srow[mode == 0 ? 2 * j : j];
                        a1[u] = srow[mode == 0 ? 2 * j + 1 : j + half];
                    } else {
                        a0[u] = srow[2 * half + (j - half)];
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < QROPE_U; u++) {
                const int idx = base + u * bd;
                if (idx < total) {
                    const int j = idx % per;
                    float* drow = qd + qdoff + ((i64)t * qh + idx / per) * qdstride;
                    if (j < half) {
                        float sn, cs;
                        sincosf(p * freqs[j], &sn, &cs);
                        sn *= mscale;
                        cs *= mscale;
                        const float x0 = a0[u], x1 = a1[u];
                        drow[mode == 0 ? 2 * j : j] = x0 * cs - x1 * sn;
                        drow[mode == 0 ? 2 * j + 1 : j + half] = x0 * sn + x1 * cs;
                    } else {
                        drow[2 * half + (j - half)] = a0[u];
                    }
                }
            }
        }
        return;
    }
    const bool regs = nw <= NORM_PER * bd, rpre = half <= bd;
    float wv[NORM_PER], v[NORM_PER];
    if (regs) norm_load_w(w, has_w, nw, wv);
    PDL_ENTRY();
    float* xr = x + xoff + (i64)t * xstride;
    float* rr = xr + nw;
    const float p = (float)pos[t];
    if (regs) {
#pragma unroll
        for (int k = 0; k < NORM_PER; k++) v[k] = tid + k * bd < nw ? xr[tid + k * bd] : 0.f;
    }
    const int ra = mode == 0 ? 2 * tid : tid, rb = mode == 0 ? 2 * tid + 1 : tid + half;
    float r0 = 0.f, r1 = 0.f;
    if (rpre && tid < half) {
        r0 = rr[ra];
        r1 = rr[rb];
    }
    C* crow = cache + ((i64)slot[t] * slot_len + pos[t]) * (i64)width;
    float ss = 0.f;
    if (regs) {
        ss = norm_ss(v, nw);
    } else {
        for (int i = tid; i < nw; i += bd) { float e = xr[i]; ss += e * e; }
    }
    const float inv = block_rms_inv(ss, part, nw, eps);
    if (regs) {
#pragma unroll
        for (int k = 0; k < NORM_PER; k++)
            if (tid + k * bd < nw) {
                float e = v[k] * inv;
                e = has_w ? e * wv[k] : e;
                xr[tid + k * bd] = e;
                cache_st(crow + tid + k * bd, e);
            }
    } else {
        for (int i = tid; i < nw; i += bd) {
            float e = xr[i] * inv;
            e = has_w ? e * w[i] : e;
            xr[i] = e;
            cache_st(crow + i, e);
        }
    }
    C* cr = crow + nw;
    for (int i = tid; i < half; i += bd) {
        float sn, cs;
        sincosf(p * freqs[i], &sn, &cs);
        sn *= mscale;
        cs *= mscale;
        int a = mode == 0 ? 2 * i : i, b = mode == 0 ? 2 * i + 1 : i + half;
        float x0 = rpre ? r0 : rr[a], x1 = rpre ? r1 : rr[b];
        float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
        rr[a] = y0;
        rr[b] = y1;
        cache_st(cr + a, y0);
        cache_st(cr + b, y1);
    }
    for (int i = nw + 2 * half + tid; i < width; i += bd) cache_st(crow + i, xr[i]);
}
// With nh (non-null): the grid's last block row converts token t's qh rows of nw_h values at
// qn + qnoff (rows qnstride apart, a token's qntstride; the query's no-rope part) to f16 as f16_rows does, into the
// packed rows t * qh .. of nh (the input of the absorbed query's product on cuBLAS, so no
// f16_rows launch between the two; nw_h % 8 == 0).
__device__ __forceinline__ void nope_h_rows(int t, const float* qn, i64 qnoff, i64 qnstride, i64 qntstride, int nw_h,
                                            int qh, uint4* nh) {
    const int per = nw_h >> 3;
    for (int i = threadIdx.x; i < qh * per; i += blockDim.x) {
        const int r = i / per, c = (i - r * per) * 8;
        const float* s = qn + qnoff + (i64)t * qntstride + (i64)r * qnstride + c;
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) o[j] = (u32)f2h_sat(s[2 * j]) | (u32)f2h_sat(s[2 * j + 1]) << 16;
        nh[((i64)t * qh + r) * per + (i - r * per)] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
#define NORM_ROPE_CACHE_INST(NAME, C)                                                                          \
    extern "C" __global__ void NAME(float* x, i64 xoff, i64 xstride, int width, int nw, const float* w, int has_w,   \
                                    float eps, const int* pos, const int* slot, int slot_len, const float* freqs,    \
                                    int half, int mode, float mscale, C* cache, const float* q, i64 qoff,            \
                                    i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw, int qh,                 \
                                    const float* qn, i64 qnoff, i64 qnstride, int nw_h, uint4* nh, i64 qtstride,     \
                                    i64 qntstride) {                                                                 \
        const int last = gridDim.y - 1;                                                                              \
        if (nh && (int)blockIdx.y == last) {                                                                         \
            PDL_ENTRY();                                                                                             \
            nope_h_rows(blockIdx.x, qn, qnoff, qnstride, qntstride, nw_h, qh, nh);                                   \
            return;                                                                                                  \
        }                                                                                                            \
        norm_rope_cache_body<C>(blockIdx.x, blockIdx.y, last - (nh ? 1 : 0), x, xoff, xstride, width, nw, w, has_w,  \
                                eps, pos, slot, slot_len, freqs, half, mode, mscale, cache, q, qoff, qstride, qd,    \
                                qdoff, qdstride, qw, qh, qtstride);                                                  \
    }
NORM_ROPE_CACHE_INST(norm_rope_cache, float)
NORM_ROPE_CACHE_INST(norm_rope_cache_h, u16)

// One decode token's norm_rope_cache (blocks [0, 1 + nqb)) and, beside it in the same launch, the
// absorbed query's product q_nope[h] . W_uk[h] (gemv_q8_1's body over its (tile, matrix) blocks,
// numbered after them): both read only what the q/kv_a product wrote, so one dependent launch
// fewer per layer than the two kernels one after the other, with the same arithmetic. Blocks of
// GQ_THREADS threads (the host takes it only when norm_rope_cache's block size is that too).
template <typename C>
__device__ __forceinline__ void mla_rope_absorb_body(float* x, i64 xoff, i64 xstride, int width, int nw,
                                                     const float* w, int has_w, float eps, const int* pos,
                                                     const int* slot, int slot_len, const float* freqs, int half,
                                                     int mode, float mscale, C* cache, const float* q, i64 qoff,
                                                     i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw, int qh,
                                                     int nqb, const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k,
                                                     i64 goff, i64 gxgstride, i64 ooff, i64 ogstride, int gtiles,
                                                     int lpr) {
    const int b = blockIdx.x;
    if (b <= nqb) {
        norm_rope_cache_body<C>(0, b, nqb, x, xoff, xstride, width, nw, w, has_w, eps, pos, slot, slot_len, freqs,
                                half, mode, mscale, cache, q, qoff, qstride, qd, qdoff, qdstride, qw, qh, 0);
        return;
    }
    const int g = b - (nqb + 1);
    gemv_q8_impl<1>(W, row_bytes, mat_bytes, m, k, q, goff, 0, gxgstride, qd, ooff, 0, ogstride, 1, lpr, g % gtiles,
                    0, g / gtiles, gtiles);
}
#define MLA_ROPE_ABSORB_INST(NAME, C)                                                                            \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS)                                       \
        NAME(float* x, i64 xoff, i64 xstride, int width, int nw, const float* w, int has_w, float eps,            \
             const int* pos, const int* slot, int slot_len, const float* freqs, int half, int mode, float mscale, \
             C* cache, const float* q, i64 qoff, i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw, int qh, \
             int nqb, const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, i64 goff, i64 gxgstride, i64 ooff, \
             i64 ogstride, int gtiles, int lpr) {                                                                 \
        mla_rope_absorb_body<C>(x, xoff, xstride, width, nw, w, has_w, eps, pos, slot, slot_len, freqs, half,     \
                                mode, mscale, cache, q, qoff, qstride, qd, qdoff, qdstride, qw, qh, nqb, W,       \
                                row_bytes, mat_bytes, m, k, goff, gxgstride, ooff, ogstride, gtiles, lpr);        \
    }
MLA_ROPE_ABSORB_INST(mla_rope_absorb_1, float)
MLA_ROPE_ABSORB_INST(mla_rope_absorb_1_h, u16)

// The same with a 16-bit float W_uk (f16 / bf16; rows of k <= 128 values, 16-byte aligned, q's
// head rows 16-byte aligned): blocks after the norm's take RA_ROWS rows of one head per
// half-warp, GQ_WARPS * 2 * RA_ROWS a block (`gtiles` blocks a head). Every weight piece of the
// block is loaded before the PDL wait. A row's sum is gemv_h16_<t>_1's: lane l < k / 8 holds
// h16_row_dot<T, 1>'s one product of piece l (added to a zero), and warp_sum's butterfly from 16
// would first add lanes 16..31, which hold zeros, so the half-warp's butterfly from 8 gives the
// same bits as matmul_grouped's gemv_h16_<t>_1. `lpr` is unused (the Q8_0 launch's arguments).
#define RA_ROWS 4
template <int T, typename C>
__device__ __forceinline__ void mla_rope_absorb_h16_body(float* x, i64 xoff, i64 xstride, int width, int nw,
                                                         const float* w, int has_w, float eps, const int* pos,
                                                         const int* slot, int slot_len, const float* freqs, int half,
                                                         int mode, float mscale, C* cache, const float* q, i64 qoff,
                                                         i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw,
                                                         int qh, int nqb, const u8* W, i64 row_bytes, i64 mat_bytes,
                                                         int m, int k, i64 goff, i64 gxgstride, i64 ooff, i64 ogstride,
                                                         int gtiles) {
    const int b = blockIdx.x;
    if (b <= nqb) {
        norm_rope_cache_body<C>(0, b, nqb, x, xoff, xstride, width, nw, w, has_w, eps, pos, slot, slot_len, freqs,
                                half, mode, mscale, cache, q, qoff, qstride, qd, qdoff, qdstride, qw, qh, 0);
        return;
    }
    const int g = b - (nqb + 1), head = g / gtiles, tile = g - head * gtiles;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hl = lane & 15;
    const int r0 = tile * (GQ_WARPS * 2 * RA_ROWS) + (2 * warp + (lane >> 4)) * RA_ROWS;
    const bool on = hl < (k >> 3);
    const u8* wm = W + head * mat_bytes + 16 * hl;
    uint4 v[RA_ROWS];
#pragma unroll
    for (int u = 0; u < RA_ROWS; u++)
        v[u] = on && r0 + u < m ? ldw16(wm + (i64)(r0 + u) * row_bytes) : make_uint4(0, 0, 0, 0);
    pdl_trigger();  // weights first (never written by a kernel), then wait for the query
    pdl_wait();
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f), c = a;
    if (on) {
        const float* xb = q + goff + head * gxgstride + 8 * hl;
        a = *(const float4*)xb;
        c = *(const float4*)(xb + 4);
    }
#pragma unroll
    for (int u = 0; u < RA_ROWS; u++) {
        float acc = 0.f;
        if (on) {
            float wv[8];
            h16_unpack(T, v[u], wv);
            acc += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * c.x + wv[5] * c.y + wv[6] * c.z +
                   wv[7] * c.w;
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (hl == 0 && r0 + u < m) qd[ooff + head * ogstride + r0 + u] = acc;
    }
}
#define MLA_ROPE_ABSORB_H16_INST(NAME, T, C)                                                                     \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS)                                       \
        NAME(float* x, i64 xoff, i64 xstride, int width, int nw, const float* w, int has_w, float eps,            \
             const int* pos, const int* slot, int slot_len, const float* freqs, int half, int mode, float mscale, \
             C* cache, const float* q, i64 qoff, i64 qstride, float* qd, i64 qdoff, i64 qdstride, int qw, int qh, \
             int nqb, const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, i64 goff, i64 gxgstride, i64 ooff, \
             i64 ogstride, int gtiles, int lpr) {                                                                 \
        mla_rope_absorb_h16_body<T, C>(x, xoff, xstride, width, nw, w, has_w, eps, pos, slot, slot_len, freqs,    \
                                       half, mode, mscale, cache, q, qoff, qstride, qd, qdoff, qdstride, qw, qh,  \
                                       nqb, W, row_bytes, mat_bytes, m, k, goff, gxgstride, ooff, ogstride,       \
                                       gtiles);                                                                   \
    }
MLA_ROPE_ABSORB_H16_INST(mla_rope_absorb_bf16_1, T_BF16, float)
MLA_ROPE_ABSORB_H16_INST(mla_rope_absorb_bf16_1_h, T_BF16, u16)
MLA_ROPE_ABSORB_H16_INST(mla_rope_absorb_f16_1, T_F16, float)
MLA_ROPE_ABSORB_H16_INST(mla_rope_absorb_f16_1_h, T_F16, u16)

// ---- several Q8_0 matrices of one input in one launch (Backend::matmul_many) ------------------
// As gemv_q8_<NT> (fast.cu), for up to 3 weights that share the input x (same k): the activation
// rows are quantised once per block, and the row tiles of the jobs are numbered one after the
// other (job 0: tiles [0, t1), job 1: [t1, t2), job 2: [t2, ntiles)). Unused jobs have m = 0.
struct GemvJob {
    const u8* W;
    i64 row_bytes;
    int m;
    float* out;
    i64 ooff, ostride;
};

// With the layer's first norm in front (gemv_q8_multi_norm_1, Backend::add_rms_norm_matmul_many,
// one token; Backend::rms_norm_matmul_many with d null: v = x, x not written, block 0 writes h,
// no counter): every block computes v = x + d and the normed row h = rms_norm(v) * w itself,
// with add_rms_norm's register path (256 threads, NORM_PER values a thread, the same sums: the
// same bits) into shared memory, and quantises h from there. x is read by every block, so the
// last block past its loads (`done` counts them; zero between launches, that block resets it)
// writes x and h. Needs 128 < k <= NORM_PER * 256 (add_rms_norm's block is 256 threads), k % 128
// == 0 (h's shared row 16-byte aligned), n == 1.
struct NormIn {
    float* x;
    i64 xoff;
    const float* d;
    i64 doff;
    const float* w;
    int has_w;
    float eps;
    float* h;
    i64 hoff;
    unsigned* done;
};

// (A measurement define, gemv_q8_multi_impl's norm: see NM_RACY there.)
#ifndef NM_RACY
#define NM_RACY 0
#endif
// The norm of gemv_q8_multi_norm_1 and gemv_h16_multi_norm_<t>_1 (256 threads, after the PDL
// wait, wv from norm_load_w): v = x (+ d), hs = rms_norm(v) * w in shared memory, x (with d) and
// h written by the last block past its loads (with d) or h by block 0 (without). Ends with hs
// complete (a barrier).
__device__ __forceinline__ void multi_norm_row(const NormIn& nm, int k, const float* wv, float* hs) {
    __shared__ float part[32];
    __shared__ int last;
    const int tid = threadIdx.x;
    const float* xr = nm.x + nm.xoff;
    const float* dr = nm.d + nm.doff;
    float v[NORM_PER];
#pragma unroll
    for (int u = 0; u < NORM_PER; u++) {
        const int i = tid + u * GQ_THREADS;
        v[u] = i < k ? (nm.d ? xr[i] + dr[i] : xr[i]) : 0.f;
    }
    // block_rms_inv's barriers follow every thread's use of its x loads.
    norm_store(v, wv, nm.has_w, block_rms_inv(norm_ss(v, k), part, k, nm.eps), k, hs);
    // Without a delta (d null: the norm only) x is not written, and block 0 writes h.
#if NM_RACY
    // A measurement define only (TS_CUDA_DEFINES=NM_RACY=1: wrong results): what the counter
    // below costs, block 0 writing x with no regard for the others' reads.
    if (tid == 0) last = blockIdx.x == 0 && nm.done;
#else
    if (tid == 0) {
        if (nm.d) {
            __threadfence();
            last = atomicAdd(nm.done, 1u) == gridDim.x - 1;
        } else {
            last = blockIdx.x == 0;
        }
    }
#endif
    __syncthreads();  // also: hs is complete
    if (last) {
#pragma unroll
        for (int u = 0; u < NORM_PER; u++) {
            const int i = tid + u * GQ_THREADS;
            if (i < k) {
                if (nm.d) nm.x[nm.xoff + i] = v[u];
                nm.h[nm.hoff + i] = hs[i];
            }
        }
        if (tid == 0 && !NM_RACY && nm.d) *nm.done = 0u;
    }
}

template <int NT, bool NORM = false>
__device__ void gemv_q8_multi_impl(GemvJob j0, GemvJob j1, GemvJob j2, int t1, int t2, int ntiles, int k, const float* x, i64 xoff,
                                   i64 xstride, int n, int lpr, NormIn nm = NormIn{}) {
    extern __shared__ __align__(16) u8 smq[];
    const int nb = k >> 5;
    i8* xq = (i8*)smq;
    float* xd = (float*)(smq + NT * k);
    const int tok0 = blockIdx.y * NT;
    const int nt = min(NT, n - tok0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rpw = 32 / lpr, sub = lane & (lpr - 1);
    const int rows_per_tile = GQ_WARPS * rpw;
    const int np = 2 * nb;
    // Tile -> (job, first row of the tile within the job). Selects, not an indexed array, so the
    // job table stays in registers.
    auto locate = [&](int tile, GemvJob& jb, int& r0) {
        if (tile < t1) { jb = j0; r0 = tile * rows_per_tile; }
        else if (tile < t2) { jb = j1; r0 = (tile - t1) * rows_per_tile; }
        else { jb = j2; r0 = (tile - t2) * rows_per_tile; }
    };
    uint4 q[4];
    float dw[4];
    {
        GemvJob jb;
        int r0;
        locate(blockIdx.x, jb, r0);
        load_q8_4(jb.W + (i64)min(r0 + warp * rpw + lane / lpr, jb.m - 1) * jb.row_bytes, sub, np, lpr, q, dw);
    }
    float wv[NORM_PER];
    if (NORM) norm_load_w(nm.w, nm.has_w, k, wv);
    pdl_trigger();  // weights first (never written by a kernel), then wait for the activations
    pdl_wait();
    bool have = true;
    if (NORM) {
        float* hs = (float*)(smq + NT * k + 4 * NT * nb);  // k % 128 == 0: 16-byte aligned
        multi_norm_row(nm, k, wv, hs);
        quant_rows_smem(hs, 0, nullptr, 1, k, xq, xd);
    } else {
        quant_rows_smem(x + xoff + tok0 * xstride, xstride, nullptr, nt, k, xq, xd);
    }
    __syncthreads();
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        GemvJob jb;
        int r0;
        locate(tile, jb, r0);
        const int m = jb.m;
        const int row = r0 + warp * rpw + lane / lpr;
        const u8* wr = jb.W + (i64)min(row, m - 1) * jb.row_bytes;
        float acc[NT];
#pragma unroll
        for (int jj = 0; jj < NT; jj++) acc[jj] = 0.f;
        for (int p0 = sub; p0 < np; p0 += 4 * lpr) {
            if (!have) load_q8_4(wr, p0, np, lpr, q, dw);
            have = false;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int p = p0 + u * lpr;
                if (p < np) {
#pragma unroll
                    for (int jj = 0; jj < NT; jj++)
                        if (jj < nt) acc[jj] += (float)dot16(q[u], xq + jj * k + 16 * p) * (dw[u] * xd[jj * nb + (p >> 1)]);
                }
            }
        }
#pragma unroll
        for (int jj = 0; jj < NT; jj++) {
            float s = group_sum(acc[jj], lpr);
            if (sub == 0 && row < m && jj < nt) jb.out[jb.ooff + (i64)(tok0 + jj) * jb.ostride + row] = s;
        }
    }
}

#define GEMVQ_MULTI_INST(NT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS) gemv_q8_multi_##NT(                                 \
        const u8* W0, i64 rb0, int m0, float* o0, i64 ooff0, i64 ostr0, const u8* W1, i64 rb1, int m1, float* o1, \
        i64 ooff1, i64 ostr1, const u8* W2, i64 rb2, int m2, float* o2, i64 ooff2, i64 ostr2, int t1, int t2,     \
        int ntiles, int k, const float* x, i64 xoff, i64 xstride, int n, int lpr) {                               \
        gemv_q8_multi_impl<NT>(GemvJob{W0, rb0, m0, o0, ooff0, ostr0}, GemvJob{W1, rb1, m1, o1, ooff1, ostr1},    \
                               GemvJob{W2, rb2, m2, o2, ooff2, ostr2}, t1, t2, ntiles, k, x, xoff, xstride, n, lpr); \
    }
GEMVQ_MULTI_INST(1)
GEMVQ_MULTI_INST(2)
GEMVQ_MULTI_INST(4)
GEMVQ_MULTI_INST(8)
// (A change here costs more than it looks: the fiftieth session's routing prediction, extra blocks
// after the tiles behind a branch at the entry, ran tg128 at 568.6 against 617-619 on the same
// H100 with the branch never taken, inlined (36 B of spills) or as a call (every thread stored
// the norm's arguments to local memory before the branch). Measure any change to this kernel.)
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS) gemv_q8_multi_norm_1(
    const u8* W0, i64 rb0, int m0, float* o0, i64 ooff0, i64 ostr0, const u8* W1, i64 rb1, int m1, float* o1, i64 ooff1,
    i64 ostr1, const u8* W2, i64 rb2, int m2, float* o2, i64 ooff2, i64 ostr2, int t1, int t2, int ntiles, int k,
    int lpr, float* x, i64 xoff, const float* d, i64 doff, const float* w, int has_w, float eps, float* h, i64 hoff,
    unsigned* done) {
    gemv_q8_multi_impl<1, true>(GemvJob{W0, rb0, m0, o0, ooff0, ostr0}, GemvJob{W1, rb1, m1, o1, ooff1, ostr1},
                                GemvJob{W2, rb2, m2, o2, ooff2, ostr2}, t1, t2, ntiles, k, nullptr, 0, 0, 1, lpr,
                                NormIn{x, xoff, d, doff, w, has_w, eps, h, hoff, done});
}

// The same for 16-bit float weights (Backend::add_rms_norm_matmul_many / rms_norm_matmul_many, one
// token, jobs all f16 or all bf16 with 16-byte aligned rows of a multiple of 8 values): the norm
// as gemv_q8_multi_norm_1's (multi_norm_row: the same bits as add_rms_norm / rms_norm), then one
// row a warp, eight a tile, with gemv_h16_<t>_1's arithmetic over the normed row in shared memory
// (h16_row_dot's order, then warp_sum: the same bits as matmul after the norm). Each warp's first
// four weight pieces are loaded before the PDL wait. hs: 4k bytes of dynamic shared memory.
template <int T>
__device__ void gemv_h16_multi_norm_impl(GemvJob j0, GemvJob j1, GemvJob j2, int t1, int t2, int ntiles, int k, NormIn nm) {
    extern __shared__ __align__(16) u8 smh[];
    float* hs = (float*)smh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n8 = k >> 3;
    auto locate = [&](int tile, GemvJob& jb, int& r0) {
        if (tile < t1) { jb = j0; r0 = tile * GQ_WARPS; }
        else if (tile < t2) { jb = j1; r0 = (tile - t1) * GQ_WARPS; }
        else { jb = j2; r0 = (tile - t2) * GQ_WARPS; }
    };
    uint4 v[4];
    {
        GemvJob jb;
        int r0;
        locate(blockIdx.x, jb, r0);
        const u8* wr = jb.W + (i64)min(r0 + warp, jb.m - 1) * jb.row_bytes;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = lane + 32 * u;
            v[u] = c < n8 ? ldw16(wr + (i64)c * 16) : make_uint4(0, 0, 0, 0);
        }
    }
    float wv[NORM_PER];
    norm_load_w(nm.w, nm.has_w, k, wv);
    pdl_trigger();  // weights first (never written by a kernel), then wait for the activations
    pdl_wait();
    multi_norm_row(nm, k, wv, hs);
    bool have = true;
    for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        GemvJob jb;
        int r0;
        locate(tile, jb, r0);
        const int row = r0 + warp;
        const u8* wr = jb.W + (i64)min(row, jb.m - 1) * jb.row_bytes;
        float acc = 0.f;
        // h16_row_dot<T, 1>'s loop, its first loads made above for the block's first tile.
        for (int c0 = lane; c0 < n8; c0 += 128) {
            if (!have) {
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int c = c0 + 32 * u;
                    v[u] = c < n8 ? ldw16(wr + (i64)c * 16) : make_uint4(0, 0, 0, 0);
                }
            }
            have = false;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int c = c0 + 32 * u;
                if (c >= n8) break;
                float w[8];
                h16_unpack(T, v[u], w);
                const float4 a = *(const float4*)(hs + 8 * c);
                const float4 b = *(const float4*)(hs + 8 * c + 4);
                acc += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
            }
        }
        const float sum = warp_sum(acc);
        if (lane == 0 && row < jb.m) jb.out[jb.ooff + row] = sum;
    }
}
#define GEMV_H16_MULTI_NORM(name, T)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS) gemv_h16_multi_norm_##name##_1(                            \
        const u8* W0, i64 rb0, int m0, float* o0, i64 ooff0, i64 ostr0, const u8* W1, i64 rb1, int m1, float* o1,       \
        i64 ooff1, i64 ostr1, const u8* W2, i64 rb2, int m2, float* o2, i64 ooff2, i64 ostr2, int t1, int t2,           \
        int ntiles, int k, float* x, i64 xoff, const float* d, i64 doff, const float* w, int has_w, float eps, float* h, \
        i64 hoff, unsigned* done) {                                                                                     \
        gemv_h16_multi_norm_impl<T>(GemvJob{W0, rb0, m0, o0, ooff0, ostr0}, GemvJob{W1, rb1, m1, o1, ooff1, ostr1},    \
                                    GemvJob{W2, rb2, m2, o2, ooff2, ostr2}, t1, t2, ntiles, k,                          \
                                    NormIn{x, xoff, d, doff, w, has_w, eps, h, hoff, done});                            \
    }
GEMV_H16_MULTI_NORM(f16, T_F16)
GEMV_H16_MULTI_NORM(bf16, T_BF16)

// ---- MoE decode with the shared experts folded in (Backend::moe_shared) -------------------------
// A token has ks = k + nsh slots: k routed experts (sel_e / sel_w) and nsh shared "experts", the
// shared FFN's rows cut into nsh chunks of m rows (gate/up) or of kdim columns (down), each with
// weight 1. The GLU activations are laid out per token: row t*ks + s of `out` / `act`.

// The activations come quantised (quant_q8_groups: ggml's Q8_0 rounding, the numbers the
// in-block quantisation of the unfused kernels gives) in the weights' own 144-byte group layout,
// so a lane reads the activation piece of each weight piece with the same addressing and no
// block re-quantises the input (at batch 1 that prologue cost as much as the weights' stream).
__device__ __forceinline__ int dot16v(uint4 w, uint4 x) {
    int s = dp4a((int)w.x, (int)x.x, 0);
    s = dp4a((int)w.y, (int)x.y, s);
    s = dp4a((int)w.z, (int)x.z, s);
    return dp4a((int)w.w, (int)x.w, s);
}

// Token t and slot s of a decode-MoE gate/up block (blockIdx.y; gridDim.y = tokens * (k + nsh)):
// the shared slots of every token first, then the routed ones. Blocks become resident in this
// order while the routing still runs, and only the shared slots' weights are known before it
// ends: the first resident blocks load instead of waiting.
// (moe_slot_of: the same for unit y of ny.)
__device__ __forceinline__ void moe_slot_of(int y, int ny, int k, int nsh, int* t, int* s) {
    const int ks = k + nsh, nshared = ny / ks * nsh;
    if (y < nshared) {
        *t = y / nsh;
        *s = k + y % nsh;
    } else {
        *t = (y - nshared) / k;
        *s = (y - nshared) % k;
    }
}
__device__ __forceinline__ void moe_slot_of_block(int k, int nsh, int* t, int* s) {
    moe_slot_of(blockIdx.y, gridDim.y, k, nsh, t, s);
}

// (quant_group_body: kernels/mmq.cu, declared at the top of this file; the one-launch MoE's
// block 0 runs it.)

// As moe_down_q8 over the ks slots of token t (block (x, t)): slot s's quantised activation row
// (already times its router weight; 1 for the shared slots) at hq + (t*ks + s)*hrow, and shared
// chunk j of output row r is bytes [j*row_bytes, (j+1)*row_bytes) of the shared down row r
// (needs kdim % 128 == 0: whole 4-block groups, checked by the host). Two warps per output row,
// each over half of the slots' pieces, summed in a fixed order: twice the loads in flight of one
// warp per row, which left the SMs a third full at batch 1.
#define MOE_SH_MAX_SLOTS 64
// (DN_PIPE: the one-token down kernels asking for a warp's next round of weights before summing
// the round they hold, the same bits, measured on an H100 (fifty-fifth session, gpu-next182):
// Q8_0 tg128 550.3 / 550.2 against 631.1 / 630.8 at 3 blocks an SM (80 registers; 3 blocks
// alone: 631.2), 579.1 at 4 with spills; bf16 436.0 / 436.1 against 452.4 / 452.3; tg64 at 16k
// 437.2 against 487.2. Its static SASS issues the next round's weight loads before the sums,
// as meant, but each piece in a branch of its own with the piece's place computed twice (once
// for the weights, once for the activations: 278 IMAD), and the loop's register moves (q =
// next) wait for the next round's weights before the following round's activations are asked
// for: a DRAM trip and then an L2 trip a round, where the plain loop pays one trip for both.
// Removed; git history has it, commit 9c50214.)
// The down kernel starts early: moe_gateup_sh_q8q lets it launch only after its own wait for
// the routing kernel has returned (so the routed experts' ids, sel_e, written two launches back,
// are final), and the down kernel reads those ids past L1 and issues its first round of weight
// loads before its own PDL wait: its resident blocks stream weights during the gate/up kernel's
// tail instead of idling. The same loads and sums as waiting first, so the same bits. Measured
// on the H200 (gpu-next38, synthetic V2-Lite Q8_0, tg128 twice each way, same hash): 585.8 /
// 581.2 -> 603.2 / 602.1 tok/s (+3.3%).
// One block's rows (bx) of token t. red, es: the block's shared words.
// SYNC (moe_sh_q8_one, one token): instead of the PDL wait before its activations, each warp
// waits until the counters (cnt) of the slots its pieces read show all `need` gate/up units of
// the slot done, and reads the activations past L1 (other blocks of the same launch wrote them).
// A decode-MoE down warp's place: its output row (row0; row, clamped, for the weights) of
// block bx, its part hw of the row's WPR warps, and its share [Pa, Pb) of the row's `total`
// pieces (the slots' pieces in order).
struct DownShare {
    int row0, row, hw, Pa, Pb;
};
template <int WPR>
__device__ __forceinline__ DownShare down_share(int bx, int m, int total) {
    const int warp = threadIdx.x >> 5;
    DownShare d;
    d.row0 = bx * (GQ_WARPS / WPR) + warp / WPR;
    d.row = min(d.row0, m - 1);
    d.hw = warp % WPR;
    const int per = (total + WPR - 1) / WPR;
    d.Pa = d.hw * per;
    d.Pb = min(total, d.Pa + per);
    return d;
}
// The end of a down row: each warp's sum (warp_sum), the row's WPR warp sums added in warp
// order (red: GQ_WARPS floats of shared memory; WPR 1 needs none) into *o, or to it (radd: the
// residual row, read and written by this thread alone).
template <int WPR>
__device__ __forceinline__ void down_row_finish(float acc, float* red, const DownShare& d, int m, float* o, int radd) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    acc = warp_sum(acc);
    if constexpr (WPR == 1) {
        if (lane == 0 && d.row0 < m) *o = radd ? *o + acc : acc;
    } else {
        if (lane == 0) red[warp] = acc;
        __syncthreads();
        if (d.hw == 0 && lane == 0 && d.row0 < m) {
            float v = red[warp];
            for (int j = 1; j < WPR; j++) v += red[warp + j];
            *o = radd ? *o + v : v;
        }
    }
}
template <int DOWN_WPR, bool SYNC = false>
__device__ __forceinline__ void moe_down_unit(int bx, int t, const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim,
                                              int k, const int* sel_e, const u8* Sd, i64 srow_bytes, int nsh,
                                              const u8* hq, i64 hrow, float* out, i64 ooff, i64 ostride, float* red,
                                              int* es, const unsigned* cnt = nullptr, unsigned need = 0, int radd = 0) {
    const int ks = k + nsh;
    const int lane = threadIdx.x & 31;
    const int nb = kdim >> 5, np = 2 * nb, total = ks * np;
    const DownShare d = down_share<DOWN_WPR>(bx, m, total);
    const int row = d.row, Pa = d.Pa, Pb = d.Pb;
    if (threadIdx.x < ks) es[threadIdx.x] = (int)threadIdx.x < k ? max(__ldcg(sel_e + t * k + threadIdx.x), 0) : 0;
    __syncthreads();
    const u8* hr = hq + (i64)t * ks * hrow;
    // Piece P's place: its weights at gp, activations at xp, block b, quants at offset qo.
    auto locate = [&](int P, const u8*& gp, const u8*& xp, int& qo, int& b) {
        const int s = P / np, p = P - s * np;
        b = p >> 1;
        const i64 go = (i64)(b >> 2) * 144;
        gp = s < k ? Wd + es[s] * mat_bytes + (i64)row * row_bytes + go : Sd + (i64)row * srow_bytes + (i64)(s - k) * row_bytes + go;
        xp = hr + (i64)s * hrow + go;
        qo = 16 + 32 * (b & 3) + 16 * (p & 1);
    };
    float acc = 0.f;
    auto ldx = [&](const u8* p) -> uint4 { return SYNC ? __ldcg((const uint4*)p) : *(const uint4*)p; };
    auto ldd = [&](const u8* p) -> u16 { return SYNC ? __ldcg((const unsigned short*)p) : *(const u16*)p; };
    {
    // The first round's weights before the wait (the activations come from the gate/up kernel);
    // the same loads and sums as below.
    uint4 q[4];
    float dw[4];
    const u8* xps[4];
    int qos[4], bs[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int P = Pa + lane + 32 * u;
        q[u] = make_uint4(0u, 0u, 0u, 0u);
        dw[u] = 0.f;
        if (P < Pb) {
            const u8* gp;
            locate(P, gp, xps[u], qos[u], bs[u]);
            q[u] = ldw16(gp + qos[u]);
            dw[u] = ldw_scale(gp + 2 * (bs[u] & 3));
        }
    }
    if (SYNC) {
        // The slots of pieces [Pa, Pb): spin on their counters (acquire), then the warp goes on.
        if (lane == 0 && Pa < Pb) {
            for (int s = Pa / np; s <= (Pb - 1) / np; s++) {
                unsigned v;
                do {
                    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(cnt + s) : "memory");
                } while (v < need);
            }
        }
        __syncwarp();
    } else {
        pdl_wait();
    }
    if (Pa + lane < Pb) {
        uint4 x[4];
        float dx[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            x[u] = make_uint4(0u, 0u, 0u, 0u);
            dx[u] = 0.f;
            if (Pa + lane + 32 * u < Pb) {
                x[u] = ldx(xps[u] + qos[u]);
                dx[u] = h2f(ldd(xps[u] + 2 * (bs[u] & 3)));
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) acc += (float)dot16v(q[u], x[u]) * (dw[u] * dx[u]);
    }
    }
    for (int P0 = Pa + lane + 128; P0 < Pb; P0 += 128) {
        uint4 q[4], x[4];
        float dw[4], dx[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int P = P0 + 32 * u;
            if (P < Pb) {
                const u8 *gp, *xp;
                int qo, b;
                locate(P, gp, xp, qo, b);
                q[u] = ldw16(gp + qo);
                dw[u] = ldw_scale(gp + 2 * (b & 3));
                x[u] = ldx(xp + qo);
                dx[u] = h2f(ldd(xp + 2 * (b & 3)));
            } else {
                q[u] = make_uint4(0u, 0u, 0u, 0u);
                x[u] = q[u];
                dw[u] = 0.f;
                dx[u] = 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) acc += (float)dot16v(q[u], x[u]) * (dw[u] * dx[u]);
    }
    // radd: out is the residual row and the sum is added to it (the add the next layer's norm
    // would make: x + y, the same bits).
    down_row_finish<DOWN_WPR>(acc, red, d, m, out + ooff + (i64)t * ostride + d.row0, radd);
}
template <int DOWN_WPR>
__device__ __forceinline__ void moe_down_sh_q8_impl(const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim,
                                                    int k, const int* sel_e, const u8* Sd, i64 srow_bytes, int nsh,
                                                    const u8* hq, i64 hrow, float* out, i64 ooff, i64 ostride, int radd) {
    pdl_trigger();
    __shared__ float red[GQ_WARPS];
    __shared__ int es[MOE_SH_MAX_SLOTS];
    moe_down_unit<DOWN_WPR>(blockIdx.x, blockIdx.y, Wd, row_bytes, mat_bytes, m, kdim, k, sel_e, Sd, srow_bytes, nsh, hq,
                            hrow, out, ooff, ostride, red, es, nullptr, 0, radd);
}
// Two warps a row (the default) or four (TS_CUDA_DOWN_WPR=4: a warp's 11 rounds of loads at
// V2-Lite's shapes become 6, in 2 dependent batches instead of 3; another summation order).
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS)
    moe_down_sh_q8(const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k, const int* sel_e,
                   const u8* Sd, i64 srow_bytes, int nsh, const u8* hq, i64 hrow, float* out, i64 ooff,
                   i64 ostride, int radd) {
    moe_down_sh_q8_impl<2>(Wd, row_bytes, mat_bytes, m, kdim, k, sel_e, Sd, srow_bytes, nsh, hq, hrow, out, ooff,
                           ostride, radd);
}
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS)
    moe_down_sh_q8_w4(const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k, const int* sel_e,
                      const u8* Sd, i64 srow_bytes, int nsh, const u8* hq, i64 hrow, float* out, i64 ooff,
                      i64 ostride, int radd) {
    moe_down_sh_q8_impl<4>(Wd, row_bytes, mat_bytes, m, kdim, k, sel_e, Sd, srow_bytes, nsh, hq, hrow, out, ooff,
                           ostride, radd);
}
// ---- MoE decode with the shared experts folded in, f16/bf16 experts (Backend::moe_shared) --------
// The same slots and block order as moe_gateup_sh_q8q / moe_down_sh_q8, for 16-bit float weights
// with 16-byte aligned rows of a multiple of 8 values and f32 activations (16-byte aligned): a
// lane reads 16-byte weight pieces (8 values) with the activations as float4 pairs, four pieces
// of each matrix in flight (h16_row_dot's pattern, matmul.cu). The gate/up kernel writes
// act(gate) * up times the slot's router weight (1 for shared slots), so the down kernel sums the
// slots' products plainly. One warp per output row in the down kernel: a piece is 48 bytes of
// loads (weights and activations), so four per lane at 8 warps per block keep enough in flight.
__device__ __forceinline__ float dot8f(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
}

// GU_SH_EARLY (1; a measurement define, TS_CUDA_DEFINES=GU_SH_EARLY=0 for the old code): the
// decode MoE gate/up kernels' shared-slot blocks issue their first weight loads in a branch of
// their own before the PDL wait. Written as straight-line code (loads, then the wait) ptxas
// scheduled the wait (ACQBULK) above every load, so the shared slots' loads waited for the
// routing kernel after all (static SASS, sm_90 and sm_90a, forty-sixth session). Measured on an
// H100 (forty-eighth / ninth sessions), the same hashes: Q8_0 tg128 618.74 against 617.50, tg64
// at 16k 478.52 against 476.41, bf16 tg128 442.92 against 435.08 (+1.8%).
#ifndef GU_SH_EARLY
#define GU_SH_EARLY 1
#endif
// DN16_EARLY (1; a measurement define, TS_CUDA_DEFINES=DN16_EARLY=0 for the old order): the
// 16-bit decode MoE as the Q8_0 one (moe_down_unit): the gate/up kernel lets the down kernel
// launch only after its own wait for the routing has returned, so the down kernel may read the
// routed experts' ids (written two launches back) past L1 and issue its first round of weight
// loads before its own PDL wait, streaming weights during the gate/up kernel's tail. The same
// loads and sums, the same bits. Measured: bf16 tg128 444.92 / 444.90 / 445.02 against 442.92 /
// 443.03 / 442.93 tok/s (+0.45%, hash fc4c0eeac361bb3a; H100, forty-ninth session).
#ifndef DN16_EARLY
#define DN16_EARLY 1
#endif
template <int T>
__device__ void moe_gateup_sh_h16_impl(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim,
                                       const int* sel_e, const float* sel_w, int k, const u8* Sg, const u8* Su,
                                       int nsh, const float* x, i64 xoff, i64 xstride, int act, float* out,
                                       i64 ostride) {
    if (!DN16_EARLY) pdl_trigger();
    const int ks = k + nsh;
    int t, s;
    moe_slot_of_block(k, nsh, &t, &s);
    const int P = t * ks + s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * GQ_WARPS + warp;
    const int rr = min(row, m - 1);
    const int n8 = kdim >> 3;
    uint4 vg[4], vu[4];
    const u8 *wg, *wu;
    auto load = [&](int c0) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c0 + 32 * u;
            vg[u] = c < n8 ? ldw16(wg + (i64)c * 16) : make_uint4(0, 0, 0, 0);
            vu[u] = c < n8 ? ldw16(wu + (i64)c * 16) : make_uint4(0, 0, 0, 0);
        }
    };
    float wsl = 1.f;
    if (s < k) {
        pdl_wait();  // the routed experts' ids come from the previous kernel
        if (DN16_EARLY) pdl_trigger();  // (after the wait: see DN16_EARLY)
        const int e = sel_e[t * k + s];
        if (e < 0) {
            if (lane == 0 && row < m) out[(i64)P * ostride + row] = 0.f;
            return;
        }
        wsl = sel_w[t * k + s];
        wg = Wg + e * mat_bytes + (i64)rr * row_bytes;
        wu = Wu + e * mat_bytes + (i64)rr * row_bytes;
        load(lane);
    } else {
        // The shared experts' weights are known before the previous kernel ends. (The loads in
        // a branch of their own: in one basic block with the wait, ptxas scheduled the wait
        // first, ACQBULK before every load, so they did wait for the routing; common.cuh.)
        const i64 srow = (i64)(s - k) * m + rr;
        wg = Sg + srow * row_bytes;
        wu = Su + srow * row_bytes;
        if (GU_SH_EARLY ? n8 > 0 : true) load(lane);
        pdl_wait();
        if (DN16_EARLY) pdl_trigger();
    }
    if (row >= m) return;
    const float* xr = x + xoff + (i64)t * xstride;
    float g = 0.f, u = 0.f;
    for (int c0 = lane; c0 < n8; c0 += 128) {
        if (c0 != lane) load(c0);
#pragma unroll
        for (int v = 0; v < 4; v++) {
            const int c = c0 + 32 * v;
            if (c < n8) {
                float a[8], b[8];
                h16_unpack(T, vg[v], a);
                h16_unpack(T, vu[v], b);
                const float4 x0 = *(const float4*)(xr + 8 * c), x1 = *(const float4*)(xr + 8 * c + 4);
                g += dot8f(a, x0, x1);
                u += dot8f(b, x0, x1);
            }
        }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) out[(i64)P * ostride + row] = act_fn(act == 0 ? 1 : 2, g) * u * wsl;
}

// WPR warps a row, each over its share of the slots' pieces, summed in warp order (WPR 4, the
// default since the tenth session: 11 dependent batches of loads at V2-Lite's shapes become 3,
// bf16 tg128 +5.4%; WPR 1 with TS_CUDA_DOWN_WPR=1).
template <int T, int WPR>
__device__ void moe_down_sh_h16_impl(const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k,
                                     const int* sel_e, const u8* Sd, i64 srow_bytes, int nsh, const float* h,
                                     i64 hstride, float* out, i64 ooff, i64 ostride) {
    pdl_trigger();
    __shared__ int es[MOE_SH_MAX_SLOTS];
    __shared__ float red[GQ_WARPS];
    const int t = blockIdx.y;
    const int ks = k + nsh;
    const int lane = threadIdx.x & 31;
    const int n8 = kdim >> 3;
    const DownShare d = down_share<WPR>(blockIdx.x, m, ks * n8);
    const int row = d.row, Pa = d.Pa, total = d.Pb;
    if (!DN16_EARLY) pdl_wait();
    // (DN16_EARLY: the ids past L1 before the wait; the gate/up kernel launched this one only
    // once its own wait for the routing had returned)
    if (threadIdx.x < ks) es[threadIdx.x] = (int)threadIdx.x < k ? (DN16_EARLY ? __ldcg(sel_e + t * k + threadIdx.x) : sel_e[t * k + threadIdx.x]) : 0;
    __syncthreads();
    const float* hr = h + (i64)t * ks * hstride;
    float acc = 0.f;
    // Piece P's weights and activations (zeros for a slot without an expert, whose weights are
    // not read and whose activations the gate/up kernel wrote as zeros, or past the warp's
    // share), and a round's sums.
    // (W: the weights; X: the activations; both where the loop reads them in one go)
    auto piece = [&](int P, bool W, bool X, uint4& q, float4& a, float4& b) {
        const int s = P / n8, c = P - s * n8;
        if (P < total && (s >= k || es[s] >= 0)) {
            if (W) {
                const u8* gp = s < k ? Wd + es[s] * mat_bytes + (i64)row * row_bytes : Sd + (i64)row * srow_bytes + (i64)(s - k) * row_bytes;
                q = ldw16(gp + (i64)c * 16);
            }
            if (X) {
                a = *(const float4*)(hr + (i64)s * hstride + 8 * c);
                b = *(const float4*)(hr + (i64)s * hstride + 8 * c + 4);
            }
        } else {
            if (W) q = make_uint4(0, 0, 0, 0);
            if (X) a = b = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    auto round_sum = [&](const uint4(&q)[4], const float4(&a)[4], const float4(&b)[4]) {
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float w[8];
            h16_unpack(T, q[u], w);
            acc += dot8f(w, a[u], b[u]);
        }
    };
    int P0 = Pa + lane;
    if (DN16_EARLY) {
        // The first round's weights before the wait (in a branch of their own, so that ptxas
        // keeps them there), then its activations and sums as the loop's.
        uint4 q[4];
        float4 a[4], b[4];
        if (P0 < total) {
#pragma unroll
            for (int u = 0; u < 4; u++) piece(P0 + 32 * u, true, false, q[u], a[u], b[u]);
        }
        pdl_wait();
        if (P0 < total) {
#pragma unroll
            for (int u = 0; u < 4; u++) piece(P0 + 32 * u, false, true, q[u], a[u], b[u]);
            round_sum(q, a, b);
        }
        P0 += 128;
    }
    for (; P0 < total; P0 += 128) {
        uint4 q[4];
        float4 a[4], b[4];
#pragma unroll
        for (int u = 0; u < 4; u++) piece(P0 + 32 * u, true, true, q[u], a[u], b[u]);
        round_sum(q, a, b);
    }
    down_row_finish<WPR>(acc, red, d, m, out + ooff + (i64)t * ostride + d.row0, 0);
}

#define MOE_SH_H16(name, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS) moe_gateup_sh_##name(           \
        const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,              \
        const float* sel_w, int k, const u8* Sg, const u8* Su, int nsh, const float* x, i64 xoff, i64 xstride,  \
        int act, float* out, i64 ostride) {                                                                      \
        moe_gateup_sh_h16_impl<T>(Wg, Wu, row_bytes, mat_bytes, m, kdim, sel_e, sel_w, k, Sg, Su, nsh, x, xoff,  \
                                  xstride, act, out, ostride);                                                   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_DOWN16_MIN_BLOCKS) moe_down_sh_##name(          \
        const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k, const int* sel_e, const u8* Sd,      \
        i64 srow_bytes, int nsh, const float* h, i64 hstride, float* out, i64 ooff, i64 ostride) {               \
        moe_down_sh_h16_impl<T, 1>(Wd, row_bytes, mat_bytes, m, kdim, k, sel_e, Sd, srow_bytes, nsh, h, hstride, \
                                   out, ooff, ostride);                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_DOWN16_MIN_BLOCKS) moe_down_sh_##name##_w4(      \
        const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k, const int* sel_e, const u8* Sd,      \
        i64 srow_bytes, int nsh, const float* h, i64 hstride, float* out, i64 ooff, i64 ostride) {               \
        moe_down_sh_h16_impl<T, 4>(Wd, row_bytes, mat_bytes, m, kdim, k, sel_e, Sd, srow_bytes, nsh, h, hstride, \
                                   out, ooff, ostride);                                                          \
    }
MOE_SH_H16(f16, T_F16)
MOE_SH_H16(bf16, T_BF16)

// The decode MoE's gate/up (as moe_gateup_q8, one warp per row, token t's activation row at
// xq + t*xrow) with the down projection's input quantisation folded in: a block computes 32
// consecutive rows (one Q8_0 block of the GLU output; a warp does 4 rows, one after the other)
// of one slot, and its first warp quantises them, times the slot's router weight (1 for shared
// slots), into the slot's row of hq exactly as quant_q8_groups does (the same products in the
// same order, the max of the same values, the same rounding): one launch and the f32 round trip
// through global memory fewer per layer, the same bits. Needs m % 32 == 0 (the host checks
// m % 128 == 0).
#define GU_ROWS 32
// One block's 32 rows (bx) of token t's slot s, with the PDL wait (the routed slots before they
// read sel_e, the shared ones after their first loads) and the trigger for the down kernel after
// it (see moe_down_unit). glu: the block's 32 shared words.
// Spin until *flag != 0 (thread 0, acquire, then a fence), then the block barrier: what the
// flag's writer wrote before it is visible to the whole block. Null: nothing to wait for.
__device__ __forceinline__ void mo_wait_flag(const unsigned* flag) {
    if (!flag) return;
    if (threadIdx.x == 0) {
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
        } while (v == 0u);
        __threadfence();
    }
    __syncthreads();
}
// One warp's gate and up sums of a Q8_0 row pair (wg, wu: np 16-byte pieces) with the Q8_0 row
// xr, each warp-summed into g and u (added to them; start them at 0). first_loaded: qg/dg and
// qu/du already hold the pieces at p0 = lane (moe_gateup_q8q_unit's rows).
__device__ __forceinline__ void gu_row_dot(const u8* wg, const u8* wu, const u8* xr, int np, int lane, bool first_loaded,
                                           uint4* qg, float* dg, uint4* qu, float* du, float& g, float& u) {
    for (int p0 = lane; p0 < np; p0 += 128) {
        if (!first_loaded || p0 != lane) {
            load_q8_4w(wg, p0, np, 32, qg, dg);
            load_q8_4w(wu, p0, np, 32, qu, du);
        }
        uint4 xv[4];
        float dx[4];
        load_q8_4(xr, p0, np, 32, xv, dx);
#pragma unroll
        for (int v = 0; v < 4; v++) {
            if (p0 + 32 * v < np) {
                g += (float)dot16v(qg[v], xv[v]) * (dg[v] * dx[v]);
                u += (float)dot16v(qu[v], xv[v]) * (du[v] * dx[v]);
            }
        }
    }
    g = warp_sum(g);
    u = warp_sum(u);
}
// ready (moe_sh_q8_one): the flag its block 0 sets once sel_e, sel_w and xq are written; null
// (moe_gateup_sh_q8q): they come from the previous kernel. waited (moe_gateup_sh_q8d): this
// block has passed its PDL wait already (a second wait would return at once, but block 0's
// would add a second trace record), and sel_e / sel_w are its shared-memory copies.
__device__ __forceinline__ void moe_gateup_q8q_unit(int bx, int t, int s, const u8* Wg, const u8* Wu, i64 row_bytes,
                                                    i64 mat_bytes, int m, int kdim, const int* sel_e, const float* sel_w,
                                                    int k, const u8* Sg, const u8* Su, int nsh, const u8* xq, i64 xrow,
                                                    int act, u8* hq, i64 hrow, float* glu, const unsigned* ready = nullptr,
                                                    bool waited = false) {
    const int ks = k + nsh;
    const int P = t * ks + s;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rpw = GU_ROWS / GQ_WARPS;
    const int row0 = bx * GU_ROWS + warp * rpw;
    const int np = 2 * (kdim >> 5);
    uint4 qg[4], qu[4];
    float dg[4], du[4];
    const u8 *Wtg, *Wtu;
    i64 rstride;  // bytes from one row to the next in the chosen matrices
    float wsl = 1.f;
    bool zero = false;
    if (s < k) {
        if (!waited) {
            pdl_wait();  // the routed experts' ids come from the previous kernel
            pdl_trigger();
        }
        mo_wait_flag(ready);
        const int e = sel_e[t * k + s];
        zero = e < 0;
        wsl = zero ? 0.f : sel_w[t * k + s];
        Wtg = Wg + (i64)max(e, 0) * mat_bytes;
        Wtu = Wu + (i64)max(e, 0) * mat_bytes;
        rstride = row_bytes;
        if (!zero) {
            load_q8_4w(Wtg + (i64)row0 * row_bytes, lane, np, 32, qg, dg);
            load_q8_4w(Wtu + (i64)row0 * row_bytes, lane, np, 32, qu, du);
        }
    } else {
        // The shared experts' weights are known before the previous kernel ends. (The loads in
        // a branch of their own: in one basic block with the wait, ptxas scheduled the wait
        // first, ACQBULK before every load, so they did wait for the routing; common.cuh.)
        Wtg = Sg + (i64)(s - k) * m * row_bytes;
        Wtu = Su + (i64)(s - k) * m * row_bytes;
        rstride = row_bytes;
        if (GU_SH_EARLY ? np > 0 : true) {
            load_q8_4w(Wtg + (i64)row0 * row_bytes, lane, np, 32, qg, dg);
            load_q8_4w(Wtu + (i64)row0 * row_bytes, lane, np, 32, qu, du);
        }
        pdl_wait();
        pdl_trigger();
        mo_wait_flag(ready);
    }
    const u8* xr = xq + (i64)t * xrow;
    for (int i = 0; i < rpw; i++) {
        const int row = row0 + i;
        float g = 0.f, u = 0.f;
        if (!zero) gu_row_dot(Wtg + (i64)row * rstride, Wtu + (i64)row * rstride, xr, np, lane, i == 0, qg, dg, qu, du, g, u);
        // act(g) * u (0 for a slot without an expert), times the router weight below, as
        // quant_q8_groups' weighted form rounds it.
        if (lane == 0) glu[warp * rpw + i] = zero ? 0.f : act_fn(act == 0 ? 1 : 2, g) * u;
    }
    __syncthreads();
    if (warp == 0) {
        float v = glu[lane];
        v *= wsl;
        // (bx & 3: this block's Q8_0 block within its 128-value group)
        quant_block32_store(v, lane, hq + (i64)P * hrow + (i64)(bx >> 2) * 144, bx & 3);
    }
}
// Eight warps of four rows each: 16 warps of two rows (two blocks an SM, so 264 of the 352
// blocks resident at once) ran tg128 at 642 and 32 warps of one row at 617 against 705
// (gpu-next70): the grid must be resident in one wave.
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_gateup_sh_q8q(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,
                      const float* sel_w, int k, const u8* Sg, const u8* Su, int nsh, const u8* xq, i64 xrow, int act,
                      u8* hq, i64 hrow) {
    __shared__ float glu[GU_ROWS];
    int t, s;
    moe_slot_of_block(k, nsh, &t, &s);
    moe_gateup_q8q_unit(blockIdx.x, t, s, Wg, Wu, row_bytes, mat_bytes, m, kdim, sel_e, sel_w, k, Sg, Su, nsh, xq,
                              xrow, act, hq, hrow, glu);
}
// moe_gateup_sh_q8q for one token with its routed units claimed from a counter (Path::GuDyn):
// the launch's 32-row units go to whichever blocks are free, not by block index, so that an SM
// that was given three blocks does not set the launch's end while others ran two (the
// sixty-second session's Nsight: 88 SMs ran 3 of the 352 blocks, 44 ran 2). Block b < nsh * ux
// (ux = m / 32 units a slot) computes shared unit b as moe_gateup_sh_q8q's block b does (its
// weights loaded before the PDL wait). Then, past its wait, every block copies the k expert ids
// and weights into shared memory while its thread 0 claims a routed unit c (slot c / ux, rows
// block c % ux) by atomicAdd on *ctr, and goes on claiming (the next claim asked for while the
// current unit is read) until a claim passes the last unit. Each unit is computed as
// moe_gateup_q8q_unit computes it in either kernel: the same bits. Every block ends with
// exactly one claim past the last unit, so the claims number k * ux + gridDim.x; the block
// whose claim is the last of them (no other block claims after it) resets *ctr to zero for the
// next launch. Claims are made only past the wait: the previous launch's reset is then
// complete (the wait returns once every earlier kernel has ended). Needs one token,
// m % 32 == 0 and k <= MOE_SH_MAX_SLOTS.
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_gateup_sh_q8d(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,
                      const float* sel_w, int k, const u8* Sg, const u8* Su, int nsh, const u8* xq, i64 xrow, int act,
                      u8* hq, i64 hrow, unsigned* ctr) {
    __shared__ float glu[GU_ROWS];
    __shared__ int se[MOE_SH_MAX_SLOTS];
    __shared__ float sw[MOE_SH_MAX_SLOTS];
    __shared__ unsigned next;
    const int ux = m / GU_ROWS;
    const unsigned nshared = (unsigned)(nsh * ux), nrouted = (unsigned)(k * ux);
    if (blockIdx.x >= nshared) {
        pdl_wait();
        pdl_trigger();
    } else {
        // (Its PDL wait inside, after the weights' loads.)
        moe_gateup_q8q_unit(blockIdx.x % ux, 0, k + blockIdx.x / ux, Wg, Wu, row_bytes, mat_bytes, m, kdim, sel_e, sel_w,
                                  k, Sg, Su, nsh, xq, xrow, act, hq, hrow, glu);
    }
    if (threadIdx.x < k) {
        se[threadIdx.x] = sel_e[threadIdx.x];
        sw[threadIdx.x] = sel_w[threadIdx.x];
    }
    if (threadIdx.x == 0) next = atomicAdd(ctr, 1u);
    __syncthreads();
    for (;;) {
        const unsigned c = next;
        if (c >= nrouted) {
            if (threadIdx.x == 0 && c == nrouted + gridDim.x - 1) *ctr = 0u;
            break;
        }
        // Every thread has read `next` (and the last unit's warp 0 has used glu: the barrier
        // inside moe_gateup_q8q_unit came before its store, the one below after it).
        __syncthreads();
        if (threadIdx.x == 0) next = atomicAdd(ctr, 1u);
        moe_gateup_q8q_unit((int)(c % ux), 0, (int)(c / ux), Wg, Wu, row_bytes, mat_bytes, m, kdim, se, sw, k, Sg, Su,
                                  nsh, xq, xrow, act, hq, hrow, glu, nullptr, true);
        __syncthreads();
    }
}
// moe_gateup_sh_q8q for one token with the routed slots' rows read from the experts' 16-row
// tiled copies (Path::GuTile; CudaWeight::tiled, the layout of mmq.cu's MMQ_TG groups), which
// have no pad bytes: 2,176 bytes for 16 rows' 128-value group where the row-major layout the
// kernel reads otherwise has 16 x 144, 5.6% fewer bytes a routed slot. The grid, the slot order
// and the shared slots' units (row-major, their weights loaded before the PDL wait) are
// moe_gateup_sh_q8q's. A routed unit's 32 rows are tiles 2 bx and 2 bx + 1 of gate and up: warp
// w reads matrix w / 4 (gate, up), tile 2 bx + (w / 2) % 2 and half w % 2 of the groups. In a
// group, lane l = 4 r + c loads quant chunks 8 + 32 u + l (u = block 0..3: bytes 8c..8c+8 of
// block u of rows r and r + 8, interleaved by words) and lanes 0-7 the scale chunk of rows l
// and l + 8; the rows' scales reach the other lanes by shuffles. Each lane sums its two rows'
// dp4a products times their scales; the four lanes of a row, then the two halves (through
// shared memory, part: 128 floats) are added, and warp 0 applies the GLU and quantises the 32
// values times the slot's weight, as moe_gateup_q8q_unit does. Another summation order than the
// row-major kernel's: close to it, not the same bits. Needs n = 1, kdim % 128 == 0, m % 32 == 0.
#define GU_TG 2176  // MMQ_TG (mmq.cu): bytes of a tile's group
__device__ __forceinline__ void moe_gateup_q8t_unit(int bx, int s, const u8* Tg, const u8* Tu, i64 tmat, int kdim,
                                                    const int* sel_e, const float* sel_w, const u8* xq, int act, u8* hq,
                                                    i64 hrow, float* part) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    pdl_wait();  // the routed experts' ids come from the previous kernel
    pdl_trigger();
    const int e = sel_e[s];
    const bool zero = e < 0;
    const float wsl = zero ? 0.f : sel_w[s];
    const int ng = kdim >> 7, mat = warp >> 2, tile = 2 * bx + ((warp >> 1) & 1), half = warp & 1;
    const int gb = (ng * half) >> 1, ge = (ng * (half + 1)) >> 1;
    float a0 = 0.f, a1 = 0.f;
    if (!zero) {
        const u8* tp = (mat ? Tu : Tg) + (i64)e * tmat + (i64)tile * ng * GU_TG;
#pragma unroll 2
        for (int gi = gb; gi < ge; gi++) {
            const u8* gp = tp + (i64)gi * GU_TG;
            uint4 q[4];
            uint4 sc = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int u = 0; u < 4; u++) q[u] = ldw16(gp + 16 * (8 + 32 * u + lane));
            if (lane < 8) sc = ldw16(gp + 16 * lane);
            // Row r's four scales (words x, y of lane r's chunk), row r + 8's (z, w).
            const u32 s01 = __shfl_sync(0xffffffffu, sc.x, r), s23 = __shfl_sync(0xffffffffu, sc.y, r);
            const u32 t01 = __shfl_sync(0xffffffffu, sc.z, r), t23 = __shfl_sync(0xffffffffu, sc.w, r);
            const u8* xg = xq + (i64)gi * 144;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const uint2 xv = *(const uint2*)(xg + 16 + 32 * u + 8 * c);
                const float dx = h2f(((const u16*)xg)[u]);
                const int ia = dp4a((int)q[u].z, (int)xv.y, dp4a((int)q[u].x, (int)xv.x, 0));
                const int ib = dp4a((int)q[u].w, (int)xv.y, dp4a((int)q[u].y, (int)xv.x, 0));
                const u32 wa = u < 2 ? s01 : s23, wb = u < 2 ? t01 : t23;
                const float da = h2f((u16)((u & 1) ? wa >> 16 : wa & 0xffffu));
                const float db = h2f((u16)((u & 1) ? wb >> 16 : wb & 0xffffu));
                a0 += (float)ia * (da * dx);
                a1 += (float)ib * (db * dx);
            }
        }
    }
    a0 += __shfl_xor_sync(0xffffffffu, a0, 1);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
    a0 += __shfl_xor_sync(0xffffffffu, a0, 2);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 2);
    const int row = 16 * ((warp >> 1) & 1) + r;  // of the unit's 32
    if (c == 0) {
        part[(mat * 32 + row) * 2 + half] = a0;
        part[(mat * 32 + row + 8) * 2 + half] = a1;
    }
    __syncthreads();
    if (warp == 0) {
        const float g = part[lane * 2] + part[lane * 2 + 1], u = part[(32 + lane) * 2] + part[(32 + lane) * 2 + 1];
        float v = zero ? 0.f : act_fn(act == 0 ? 1 : 2, g) * u;
        v *= wsl;
        quant_block32_store(v, lane, hq + (i64)s * hrow + (i64)(bx >> 2) * 144, bx & 3);
    }
}
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_gateup_sh_q8t(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,
                      const float* sel_w, int k, const u8* Sg, const u8* Su, int nsh, const u8* xq, i64 xrow, int act,
                      u8* hq, i64 hrow, const u8* Tg, const u8* Tu, i64 tmat) {
    __shared__ float glu[2 * 2 * GU_ROWS];
    int t, s;
    moe_slot_of_block(k, nsh, &t, &s);
    if (s < k)
        moe_gateup_q8t_unit(blockIdx.x, s, Tg, Tu, tmat, kdim, sel_e, sel_w, xq, act, hq, hrow, glu);
    else
        moe_gateup_q8q_unit(blockIdx.x, t, s, Wg, Wu, row_bytes, mat_bytes, m, kdim, sel_e, sel_w, k, Sg, Su, nsh, xq,
                            xrow, act, hq, hrow, glu);
}
// ---- The decode MoE in one launch (one token): moe_gateup_sh_q8q's units, then moe_down_sh_q8's
// units, each down warp starting as soon as the slots it reads are done ---------------------------
// Work items: the ks * m/32 gate/up units (moe_slot_of's order: the shared slots first, whose
// weights are loaded before the PDL wait), then the down units (4 output rows each, two warps a
// row, as moe_down_sh_q8). Block b takes items b, b + gridDim.x, ...; the host makes the grid no
// larger than the blocks the card holds at once, so every block is resident and a unit a down
// warp waits for belongs to a block that is running or done, whatever order blocks start in.
// A gate/up unit ends by adding 1 to its slot's counter, after its quantised GLU words are
// visible (each writer fences, then the block barrier, then the atomic); a down unit issues its
// first weights, then its warps wait on the counters of their slots (moe_down_unit<.., true>).
// The units' loads, sums and order are the two kernels': the same bits. Between launches the
// counters are zero: the last down unit to finish (cnt[ks] counts them) resets them.
// Against the two launches it removes the kernel boundary and the wait for the whole gate/up
// grid: a down warp whose slots are done starts while other slots still stream.
// With logits (non-null): the routing and the input's quantisation too (moe_route_quant's
// bodies, the same bits), done by block 0 before its items; the other blocks' units wait for
// the flag cnt[ks + 1] it sets (mo_wait_flag): one launch fewer again.
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_sh_q8_one(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, int* sel_e,
                  float* sel_w, int k, const u8* Sg, const u8* Su, int nsh, u8* xq, i64 xrow, int act,
                  u8* hq, i64 hrow, const u8* Wd, i64 drow_bytes, i64 dmat_bytes, int hdim, const u8* Sd,
                  i64 srow_bytes, float* out, i64 ooff, unsigned* cnt, const float* logits, i64 loff, int E,
                  int gating, int norm_topk, float scale, const float* src, i64 soff) {
    __shared__ float glu[GU_ROWS];
    __shared__ float red[GQ_WARPS];
    __shared__ int es[MOE_SH_MAX_SLOTS];
    const int ks = k + nsh;
    const int gu_units = m / GU_ROWS, ngu = ks * gu_units;
    const int nd = (hdim + 3) / 4, items = ngu + nd;
    const unsigned* ready = logits ? cnt + ks + 1 : nullptr;
    if (logits && blockIdx.x == 0) {
        pdl_wait();
        pdl_trigger();
        const int warp = threadIdx.x >> 5;
        if (warp == 0) route_warp_body(0, logits, loff, 0, 1, E, k, gating, norm_topk, scale, sel_e, sel_w);
        for (int g = warp; g < (kdim + 127) / 128; g += GQ_WARPS)
            quant_group_body(g, src, nullptr, soff, 0, 1, kdim, 0, nullptr, 0, 1, xq, xrow);
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(cnt + ks + 1), "r"(1u) : "memory");
    }
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
        if (it < ngu) {
            int t, s;
            moe_slot_of(it / gu_units, ks, k, nsh, &t, &s);
            moe_gateup_q8q_unit(it % gu_units, t, s, Wg, Wu, row_bytes, mat_bytes, m, kdim, sel_e, sel_w, k, Sg, Su, nsh,
                                xq, xrow, act, hq, hrow, glu, ready);
            if (threadIdx.x < 32) __threadfence();  // warp 0 wrote the unit's GLU words
            __syncthreads();
            if (threadIdx.x == 0) atomicAdd(cnt + s, 1u);
        } else {
            pdl_wait();  // sel_e comes from the routing kernel (or block 0: the flag)
            pdl_trigger();
            mo_wait_flag(ready);
            // (The down product's input width is the gate/up rows, m.)
            moe_down_unit<2, true>(it - ngu, 0, Wd, drow_bytes, dmat_bytes, hdim, m, k, sel_e, Sd, srow_bytes, nsh, hq,
                                   hrow, out, ooff, 0, red, es, cnt, (unsigned)gu_units);
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                if (atomicAdd(cnt + ks, 1u) == (unsigned)nd - 1) {
                    for (int s = 0; s <= ks + 1; s++) cnt[s] = 0u;
                    __threadfence();
                }
            }
        }
        __syncthreads();  // the shared words are the next item's
    }
    pdl_wait();  // a block with no item still waits (it must not end before its predecessor)
}

// ---- The MLA decode's output side in one launch (Backend::mla_attention_out, one token) ---------
// Block (c, h), 256 threads: head h's merge of the context splits (mla_combine's formulas: the
// splits' maxima, their weights exp(m_s - M), the weighted sum of the splits' rows, times 1/L;
// warp w sums splits w, w + 8, ... and the warps' sums meet in shared memory in warp order), its
// value row v_h = W_uv[h] . lat_h (lat_h quantised to Q8_0 as quant_rows_smem does, dp4a over
// 16-quant pieces, 8 lanes a row), and head h's share of output rows [c*R, c*R + nr) of W_o:
// part[h][r] = W_o[r, 128h .. 128h+128) . v_h, with v_h quantised the same way (o_proj's input
// blocks do not straddle heads: vd = 128). add_rms_norm_parts then adds the heads' rows in head
// order to the residual. Both weight slices (W_uv[h]: vd rows; the W_o slice: nr rows of one
// 144-byte group) are copied to shared memory before the PDL wait, so they are on chip when the
// attention ends: the merge, the W_uv product and the W_o product were three dependent launches.
// Needs kl % 128 == 0, kl <= 512, vd == 128, W_o rows of nh groups (its input nh * 128), part's
// rows as the split kernels write them (m, l, kl sums), or lat (part null: the split wrote the
// merged rows itself) at lat + loff + h * lstride, or with q (non-null) no split kernel at all:
// the block attends itself (mo_attend; V2's shapes, the token's rows of an f16 cache at slot[0]).
#define MO_THREADS 256
#define MO_WARPS (MO_THREADS / 32)
#define MO_VD 128
#define MO_KL 512
// Splits a warp of mo_merge loads at once (8 float2 each) before adding them in split order:
// more trips to L2 in flight for a long context's 132 splits, the same sums in the same order.
// A measurement define (TS_CUDA_DEFINES=MO_MU=4), 2 by default: 4 gave the same 16k figure
// (539.3 against 539.4, gpu-next87).
#ifndef MO_MU
#define MO_MU 2
#endif
static_assert(MLA_MAX_SPLITS <= MO_THREADS, "mla_out_q8: a thread reads at most one split's (m, l)");
// Head h's attention in the block itself (q non-null: short contexts, CudaBackend::mo_att, where
// the split kernel's launch and its merge cost more than every block of the head reading the
// head's keys; V2's shapes only: an f16 cache of 576-value rows, kl 512): lanes hold the scaled
// query's 576 values as 9 f16 pairs' places, warp w takes key rows 4w .. 4w+3, then 32 on, each
// row loaded once for its score and its latent sum, an online softmax over each 4 (mla_split's
// formulas); the warps' (max, sum, rows) then meet in shared memory in warp order. Returns this
// thread's two latent values 2 tid, 2 tid + 1, normalised. Other bits than the split kernels'
// (another order of the same sums).
__device__ __forceinline__ float2 mo_attend(const float* qh, float scale, const u16* rows, int end, float* wsum,
                                            float* red) {
    constexpr int KL = 512, W = 576;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float2 qv[9];
#pragma unroll
    for (int i = 0; i < 9; i++) {
        const float2 t = *(const float2*)(qh + 2 * (lane + 32 * i));
        qv[i] = make_float2(t.x * scale, t.y * scale);
    }
    float m = NEG_INF, L = 0.f;
    float2 acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = make_float2(0.f, 0.f);
    for (int j0 = 4 * warp; j0 < end; j0 += 4 * MO_WARPS) {
        float2 c[4][9];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const u32* r = (const u32*)(rows + (i64)min(j0 + u, end - 1) * W);
#pragma unroll
            for (int i = 0; i < 9; i++) {
                const u32 v = r[lane + 32 * i];
                c[u][i] = make_float2(h2f((u16)v), h2f((u16)(v >> 16)));
            }
        }
        float sc[4], mt = m;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float d = 0.f;
#pragma unroll
            for (int i = 0; i < 9; i++) d += qv[i].x * c[u][i].x + qv[i].y * c[u][i].y;
            d = warp_sum(d);
            sc[u] = j0 + u < end ? d : NEG_INF;
            mt = fmaxf(mt, sc[u]);
        }
        const float corr = expf(m - mt);
        float ps = 0.f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            sc[u] = expf(sc[u] - mt);
            ps += sc[u];
        }
        L = L * corr + ps;
        m = mt;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float x = acc[i].x * corr, y = acc[i].y * corr;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                x += sc[u] * c[u][i].x;
                y += sc[u] * c[u][i].y;
            }
            acc[i] = make_float2(x, y);
        }
    }
    if (lane == 0) {
        red[warp] = m;
        red[MO_WARPS + warp] = L;
    }
    __syncthreads();
    float M = red[0];
    for (int w = 1; w < MO_WARPS; w++) M = fmaxf(M, red[w]);
    const float f = expf(m - M);  // 0 for a warp without rows (m = -inf)
#pragma unroll
    for (int i = 0; i < 8; i++) *(float2*)(wsum + warp * KL + 2 * (lane + 32 * i)) = make_float2(acc[i].x * f, acc[i].y * f);
    float den = 0.f;
    for (int w = 0; w < MO_WARPS; w++) den += red[MO_WARPS + w] * expf(red[w] - M);
    __syncthreads();
    float2 r = *(const float2*)(wsum + 2 * tid);
    for (int w = 1; w < MO_WARPS; w++) {
        const float2 t = *(const float2*)(wsum + w * KL + 2 * tid);
        r.x += t.x;
        r.y += t.y;
    }
    const float inv = 1.0f / den;
    return make_float2(r.x * inv, r.y * inv);
}
// mo_merge's first part: head h's split rows in part (pp, sstride floats
// apart), how many of the nsp splits hold keys (returned), each one's weight exp(m_s - M) into
// fw, and each warp's share of L (the weighted sum of the splits' l) into red[MO_WARPS + warp].
// HP: rows of m, l and kl / 2 f16 pairs of values already divided by l (mla_split_tc_hep), so
// a split's weight is l_s exp(m_s - M).
template <bool HP = false>
__device__ __forceinline__ int mo_split_weights(const float* part, int nsp, int nh, int kl, int h, int end, float* fw,
                                                float* red, const float*& pp, i64& sstride) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int chunk = ((end + nsp - 1) / nsp + MLA_T - 1) / MLA_T * MLA_T;
    const int nact = min(nsp, (end + chunk - 1) / chunk);
    const int stride = HP ? kl / 2 + 2 : kl + 2;
    sstride = (i64)nh * stride;
    pp = part + (i64)h * stride;
    float ms = NEG_INF, ls = 0.f;
    if (tid < nact) {
        ms = pp[tid * sstride];
        ls = pp[tid * sstride + 1];
    }
    float M = warp_max(ms);
    if (lane == 0) red[warp] = M;
    __syncthreads();
    M = red[0];
    for (int w = 1; w < MO_WARPS; w++) M = fmaxf(M, red[w]);
    // (nsp <= MLA_MAX_SPLITS == MO_THREADS: a thread has at most one split.)
    float L = 0.f;
    if (tid < nact) {
        const float f = expf(ms - M);
        fw[tid] = HP ? ls * f : f;
        L = ls * f;
    }
    L = warp_sum(L);
    if (lane == 0) red[MO_WARPS + warp] = L;
    __syncthreads();
    return nact;
}
// Head h's merged latent row for mla_out_q8 / mla_out_h16 (after the PDL wait): the splits' rows
// in part (nsp of them, as the split kernels write them: m, l, kl sums) merged with mla_combine's
// formulas (the splits' maxima, their weights exp(m_s - M), the weighted sum of the splits' rows,
// times 1/L; warp w sums splits w, w + 8, ... and the warps' sums meet in shared memory in warp
// order), or (part null) the merged row the split kernel wrote at lat + loff + h * lstride.
// Returns this thread's two values 2 tid, 2 tid + 1 (zeros past kl). wsum: MO_WARPS x kl floats;
// fw: MLA_MAX_SPLITS; red: 2 x MO_WARPS.
// HP: the split rows as mla_split_tc_hep writes them (mo_split_weights<true>): lane reads the
// f16 pair at the same values as the float2 it reads otherwise.
template <bool HP = false>
__device__ __forceinline__ float2 mo_merge(const float* part, int nsp, const float* lat, i64 loff, i64 lstride, int nh,
                                           int kl, int h, int end, float* wsum, float* fw, float* red) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int i = 2 * tid;
    float2 lv = make_float2(0.f, 0.f);
    if (part) {
        const float* pp;
        i64 sstride;
        const int nact = mo_split_weights<HP>(part, nsp, nh, kl, h, end, fw, red, pp, sstride);
        // Warp w: splits w, w + MO_WARPS, ...; lane: the float2 at 2 * lane + 64 * j (kl / 64 of
        // them; a split's row starts 2 floats past a multiple of kl + 2, so 8-byte loads).
        const int nj = kl >> 6;
        float2 acc[MO_KL / 64];
#pragma unroll
        for (int j = 0; j < MO_KL / 64; j++) acc[j] = make_float2(0.f, 0.f);
        for (int s0 = warp; s0 < nact; s0 += MO_MU * MO_WARPS) {
            float2 v[MO_MU][MO_KL / 64];
            float f[MO_MU];
#pragma unroll
            for (int u = 0; u < MO_MU; u++) {
                const int s = s0 + u * MO_WARPS;
                f[u] = s < nact ? fw[s] : 0.f;
#pragma unroll
                for (int j = 0; j < MO_KL / 64; j++) {
                    if constexpr (HP) {
                        const u32 w = s < nact && j < nj ? ((const u32*)(pp + s * sstride + 2))[lane + 32 * j] : 0u;
                        v[u][j] = make_float2(h2f((u16)w), h2f((u16)(w >> 16)));
                    } else {
                        v[u][j] = s < nact && j < nj ? *(const float2*)(pp + s * sstride + 2 + 2 * lane + 64 * j)
                                                     : make_float2(0.f, 0.f);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < MO_MU; u++)
#pragma unroll
                for (int j = 0; j < MO_KL / 64; j++) {
                    acc[j].x += v[u][j].x * f[u];
                    acc[j].y += v[u][j].y * f[u];
                }
        }
#pragma unroll
        for (int j = 0; j < MO_KL / 64; j++)
            if (j < nj) *(float2*)(wsum + warp * kl + 2 * lane + 64 * j) = acc[j];
        __syncthreads();
        float den = 0.f;
        for (int w = 0; w < MO_WARPS; w++) den += red[MO_WARPS + w];
        if (i < kl) {
            float2 r = *(const float2*)(wsum + i);
            for (int w = 1; w < MO_WARPS; w++) {
                const float2 t = *(const float2*)(wsum + w * kl + i);
                r.x += t.x;
                r.y += t.y;
            }
            const float inv = 1.0f / den;
            lv = make_float2(r.x * inv, r.y * inv);
        }
    } else if (i < kl) {
        lv = *(const float2*)(lat + loff + (i64)h * lstride + i);
    }
    return lv;
}
// x += parts[0] + parts[1] + ... + parts[np - 1] (np rows pstride apart, added in that order),
// then out = rms_norm(x) * w: add_rms_norm with the delta in per-head rows (mla_out_q8). One row
// of up to NP_PER * NP_THREADS values, np <= MO_MAX_PARTS. 1,024 threads with every load of a
// thread (its x values and all their partial rows) issued before any is used: one L2 round trip.
// (At 256 threads, eight values a thread and the partial rows loaded as they were added, this
// kernel took 16 us a layer on the H200, more than the three launches mla_out_q8 replaces.)
#define MO_MAX_PARTS 16
#define NP_THREADS 1024
#define NP_PER 2
// A thread's norm weights (1 past the row or without weights).
__device__ __forceinline__ void np_load_w(const float* w, int has_w, int width, float* wv) {
#pragma unroll
    for (int k = 0; k < NP_PER; k++) {
        const int i = threadIdx.x + k * NP_THREADS;
        wv[k] = has_w && i < width ? w[i] : 1.f;
    }
}
// A thread's values v = x + parts[0] + ... + parts[np - 1] (in part order; every load issued
// before any is used), and their sum of squares.
__device__ __forceinline__ float np_sum(const float* xr, const float* parts, i64 pstride, int np, int width, float* v) {
    const int tid = threadIdx.x;
    float xv[NP_PER], pv[NP_PER][MO_MAX_PARTS];
#pragma unroll
    for (int k = 0; k < NP_PER; k++) {
        const int i = min(tid + k * NP_THREADS, width - 1);
        xv[k] = xr[i];
#pragma unroll
        for (int j = 0; j < MO_MAX_PARTS; j++) pv[k][j] = parts[(i64)min(j, np - 1) * pstride + i];
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NP_PER; k++) {
        float d = pv[k][0];
#pragma unroll
        for (int j = 1; j < MO_MAX_PARTS; j++)
            if (j < np) d += pv[k][j];
        v[k] = tid + k * NP_THREADS < width ? xv[k] + d : 0.f;
        ss += v[k] * v[k];
    }
    return ss;
}
extern "C" __global__ void __launch_bounds__(NP_THREADS)
    add_rms_norm_parts(float* x, i64 xoff, const float* parts, i64 pstride, int np, const float* w, int has_w,
                       float eps, float* out, i64 ooff, int width) {
    __shared__ float red[32];
    const int tid = threadIdx.x;
    float wv[NP_PER];
    np_load_w(w, has_w, width, wv);
    PDL_ENTRY();
    float* xr = x + xoff;
    float v[NP_PER];
    const float ss = np_sum(xr, parts, pstride, np, width, v);
#pragma unroll
    for (int k = 0; k < NP_PER; k++)
        if (tid + k * NP_THREADS < width) xr[tid + k * NP_THREADS] = v[k];
    const float inv = block_rms_inv(ss, red, width, eps);
#pragma unroll
    for (int k = 0; k < NP_PER; k++) {
        const int i = tid + k * NP_THREADS;
        if (i < width) out[ooff + i] = has_w ? v[k] * inv * wv[k] : v[k] * inv;
    }
}

// The router's share of a thread in add_rms_norm_parts_router(_route): row 8 * blockIdx.x +
// warp / 4, quarter warp % 4 of its width; its four float4s of weights (zeros past the quarter).
__device__ __forceinline__ void rr_load_rows(const float* R, int m, int width, float4* wq) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = 8 * blockIdx.x + (warp >> 2), quarter = warp & 3;
    const int q4 = width / 16;  // float4s a quarter
    const float4* wr = (const float4*)(R + (i64)min(r, m - 1) * width) + quarter * q4;
#pragma unroll
    for (int u = 0; u < 4; u++) wq[u] = lane + 32 * u < q4 ? wr[lane + 32 * u] : make_float4(0.f, 0.f, 0.f, 0.f);
}
// The normed row (v times inv, times the norm weights) into hs, and into out when `write`.
__device__ __forceinline__ void rr_norm_store(const float* v, float inv, const float* wv, int has_w, int width, float* hs,
                                              float* out, i64 ooff, bool write) {
#pragma unroll
    for (int k = 0; k < NP_PER; k++) {
        const int i = threadIdx.x + k * NP_THREADS;
        if (i < width) {
            const float o = has_w ? v[k] * inv * wv[k] : v[k] * inv;
            hs[i] = o;
            if (write) out[ooff + i] = o;
        }
    }
}
// After the barrier that follows rr_norm_store: each warp's quarter of its row's product with
// hs into qsum[warp], then a barrier; the row's logit is then the four quarters added in order.
__device__ __forceinline__ void rr_dot(const float* hs, const float4* wq, int width, float* qsum) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q4 = width / 16;
    const float4* h4 = (const float4*)hs + (warp & 3) * q4;
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        if (lane + 32 * u < q4) {
            const float4 hv = h4[lane + 32 * u];
            acc += wq[u].x * hv.x + wq[u].y * hv.y + wq[u].z * hv.z + wq[u].w * hv.w;
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) qsum[warp] = acc;
    __syncthreads();
}
// add_rms_norm_parts, then the normed row's product with a few-row f32 matrix (the MoE router,
// Backend::mla_attention_out's `next`): block b of ceil(m / 8) normalises the row itself (the
// same loads and sums as add_rms_norm_parts: the same bits; block 0 writes out, and the last
// block to finish reading the residual writes x: every block reads x, so a block that wrote it
// while another had yet to read it would add the delta twice there; `done` counts the blocks
// past their loads, zero between launches) and
// computes rows 8b .. 8b+7 of W . h with gemv_f32_split's arithmetic (four warps a row, a
// quarter of the width each, the quarters added in order: the same logits). Its weight rows are
// loaded before the PDL wait. Needs width % 128 == 0 and width <= NP_PER * NP_THREADS.
extern "C" __global__ void __launch_bounds__(NP_THREADS)
    add_rms_norm_parts_router(float* x, i64 xoff, const float* parts, i64 pstride, int np, const float* w, int has_w,
                              float eps, float* out, i64 ooff, int width, const float* R, int m, float* lg, i64 loff,
                              unsigned* done) {
    __shared__ float red[32];
    __shared__ float qsum[NP_THREADS / 32];
    __shared__ int last;
    __shared__ __align__(16) float hs[NP_PER * NP_THREADS];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r = 8 * blockIdx.x + (warp >> 2), quarter = warp & 3;
    float4 wq[4];
    rr_load_rows(R, m, width, wq);
    float wv[NP_PER];
    np_load_w(w, has_w, width, wv);
    PDL_ENTRY();
    float* xr = x + xoff;
    float v[NP_PER];
    const float ss = np_sum(xr, parts, pstride, np, width, v);
    // block_rms_inv's barrier follows every thread's use of its x loads: past it this block no
    // longer reads x.
    const float inv = block_rms_inv(ss, red, width, eps);
    if (tid == 0) {
        __threadfence();
        last = atomicAdd(done, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {
#pragma unroll
        for (int k = 0; k < NP_PER; k++)
            if (tid + k * NP_THREADS < width) xr[tid + k * NP_THREADS] = v[k];
        if (tid == 0) *done = 0u;
    }
    rr_norm_store(v, inv, wv, has_w, width, hs, out, ooff, blockIdx.x == 0);
    __syncthreads();
    rr_dot(hs, wq, width, qsum);
    if (quarter == 0 && lane == 0 && r < m) lg[loff + r] = qsum[warp] + qsum[warp + 1] + qsum[warp + 2] + qsum[warp + 3];
}

// ---- add_rms_norm_parts_router with the one-token MoE's routing, in a cluster of 8 blocks -------
// (CudaBackend::pre_route.) add_rms_norm_parts_router's work for one row and up to 64 router rows
// (block b: rows 8b .. 8b+7, the same loads and sums: the same out and logits), and then
// moe_route_quant's: block 0 quantises the normed row it holds (hs, the values it writes to out)
// into xq with quant_group_body while the products run, and routes the logits with
// route_warp_body (top rk, gating, norm_topk, scale) into sel_e / sel_w: the same bodies on the
// same values, so the same bits as moe_route_quant after the two-launch norm. The blocks are one
// thread-block cluster (sm_90): each writes its logits into block 0's shared memory as well as
// to lg, and the cluster barrier (arrive.release / wait.acquire) is the only cross-block step:
// no counter, no fence through L2 (the reverted counter-and-fence version of this cost 4 us a
// layer). The same barrier orders every block's reads of x before block 0 writes it.
// Needs width % 128 == 0, width <= NP_PER * NP_THREADS, m <= 64, rk <= 32, exactly 8 blocks.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// A store of v into block `rank`'s copy of the shared word at p (distributed shared memory).
__device__ __forceinline__ void st_cluster(float* p, unsigned rank, float v) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(v) : "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
#define RR_CLUSTER_DIMS __cluster_dims__(RR_CLUSTER, 1, 1)
#else
#define RR_CLUSTER_DIMS
#endif
#define RR_CLUSTER 8
// (Two blocks an SM, 32 registers a thread instead of 52 (40 bytes spilled), so that a block
// would fit beside an mla_out_q8 block and be placed before that launch ends: measured slower
// on an H100 in the seventy-third session, tg128 603.5 / 603.5 against 634.4 / 635.9, 16k
// 491.4 against 509.9; its blocks still waited only 0.05 µs at their release, and the launch
// took 9.47 µs against 7.47. The define RR_MINB is gone; commit 48e928f has it.)
// (Defined on every architecture, as the module must export it; the body is sm_90's.)
extern "C" __global__ void RR_CLUSTER_DIMS __launch_bounds__(NP_THREADS)
    add_rms_norm_parts_router_route(float* x, i64 xoff, const float* parts, i64 pstride, int np, const float* w,
                                    int has_w, float eps, float* out, i64 ooff, int width, const float* R, int m,
                                    float* lg, i64 loff, int rk, int gating, int norm_topk, float scale, int* sel_e,
                                    float* sel_w, u8* xq) {
#if __CUDA_ARCH__ >= 900
    __shared__ float red[32];
    __shared__ float qsum[NP_THREADS / 32];
    __shared__ float lgs[8 * RR_CLUSTER];
    __shared__ __align__(16) float hs[NP_PER * NP_THREADS];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned rank = cluster_rank();
    // Every block of the cluster is running before any writes another's shared memory: the
    // first phase of the cluster barrier, waited on just before those writes.
    cluster_arrive_relaxed();
    const int r = 8 * blockIdx.x + (warp >> 2), quarter = warp & 3;
    float4 wq[4];
    rr_load_rows(R, m, width, wq);
    float wv[NP_PER];
    np_load_w(w, has_w, width, wv);
    PDL_ENTRY();
    float* xr = x + xoff;
    float v[NP_PER];
    const float ss = np_sum(xr, parts, pstride, np, width, v);
    const float inv = block_rms_inv(ss, red, width, eps);
    rr_norm_store(v, inv, wv, has_w, width, hs, out, ooff, rank == 0);
    __syncthreads();
    rr_dot(hs, wq, width, qsum);
    cluster_wait();
    if (quarter == 0 && lane == 0 && r < m) {
        const float l = qsum[warp] + qsum[warp + 1] + qsum[warp + 2] + qsum[warp + 3];
        lg[loff + r] = l;
        st_cluster(&lgs[r], 0, l);
    }
    // Block 0 quantises its normed row while the other blocks' logits arrive.
    if (rank == 0)
        for (int g = warp; g < width / 128; g += NP_THREADS / 32)
            quant_group_body(g, hs, nullptr, 0, 0, 1, width, 0, nullptr, 0, 1, xq, 0);
    cluster_arrive();
    cluster_wait();
    if (rank != 0) return;
    // Every block has read x (its loads were used before its first barrier): the residual now.
#pragma unroll
    for (int k = 0; k < NP_PER; k++)
        if (tid + k * NP_THREADS < width) xr[tid + k * NP_THREADS] = v[k];
    if (warp == 0) route_warp_body(0, lgs, 0, 0, 1, m, rk, gating, norm_topk, scale, sel_e, sel_w);
#endif
}

// ---- The MLA decode's output side with 16-bit value and output weights, in clusters -----------
// (Backend::mla_attention_out, one token, W_uv and W_o both f16 or both bf16: mla_out_q8's work
// for them.) Block (c, h), 256 threads, the 8 blocks of head h one thread-block cluster: head h's
// merged latent row (mo_merge, as mla_out_q8), then rows [16c, 16c + 16) of v_h = W_uv[h] . lat_h
// with gemv_h16_<t>_1's arithmetic (a row a warp, h16_row_dot's order over the row, then
// warp_sum: the bits of the plain chain's W_uv product on the same latent row). Each block
// stores its 16 values into every block's copy of v_h (distributed shared memory; the cluster
// barrier is the only cross-block step), then computes head h's share of output rows
// [c * R, c * R + R) of W_o, R = H / 8: part[h][r] = W_o[r, 128h .. 128h + 128) . v_h, half a
// warp a row (a lane's 8 products, then the half-warp's butterfly), which add_rms_norm_parts
// (_router(_route)) adds in head order. Both weight slices (16 rows of W_uv[h], R rows of 256
// bytes of W_o) are copied to shared memory before the PDL wait, so they are on chip when the
// attention ends. With q (non-null) no split kernel ran: every block attends head h itself
// (mo_attend, as mla_out_q8; V2's shapes, the token's rows of an f16 cache at slot[0]).
// Needs kl % 8 == 0, kl <= 512, vd == 128, H % 8 == 0, rows 16-byte aligned.
#define MH_CLUSTER 8
#define MH_UV_ROWS (MO_VD / MH_CLUSTER)
#if __CUDA_ARCH__ >= 900
#define MH_CLUSTER_DIMS __cluster_dims__(MH_CLUSTER, 1, 1)
#else
#define MH_CLUSTER_DIMS
#endif
template <int T>
__device__ __forceinline__ void mla_out_h16_body(const float* part, int nsp, const float* lat, i64 loff, i64 lstride,
                                                 const int* pos, int nh, int kl, const u8* Wuv, i64 uv_row_bytes,
                                                 i64 uv_mat_bytes, const u8* Wo, i64 o_row_bytes, int H, float* outp,
                                                 const float* q, i64 qoff, i64 q_head, const u16* cache,
                                                 const int* slot, int slot_len, float scale) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(16) u8 smo[];
    const int c = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned rank = cluster_rank();
    const int R = H / MH_CLUSTER, r0 = c * R;
    u8* suv = smo;                                         // MH_UV_ROWS rows of uv_row_bytes
    u8* so = suv + MH_UV_ROWS * uv_row_bytes;              // R rows of 2 * MO_VD bytes
    float* wsum = (float*)(so + (i64)R * 2 * MO_VD);       // MO_WARPS x kl: the warps' merge sums
    float* ls = wsum + MO_WARPS * kl;                      // kl: the merged latent row
    float* vs = ls + kl;                                   // MO_VD: v_h, from every block
    float* fw = vs + MO_VD;                                // MLA_MAX_SPLITS split weights
    float* red = fw + MLA_MAX_SPLITS;                      // 2 x MO_WARPS
    // Every block of the cluster is running before any writes another's shared memory.
    cluster_arrive_relaxed();
    {
        const u8* g = Wuv + (i64)h * uv_mat_bytes + (i64)(MH_UV_ROWS * c) * uv_row_bytes;
        const int n16 = (int)(MH_UV_ROWS * uv_row_bytes / 16);
        for (int i = tid; i < n16; i += MO_THREADS) cp_async16(suv + 16 * i, g + 16 * (i64)i);
        for (int i = tid; i < R * 16; i += MO_THREADS) {
            const int r = i >> 4, j = i & 15;
            cp_async16(so + r * 2 * MO_VD + 16 * j, Wo + (i64)(r0 + r) * o_row_bytes + (i64)h * 2 * MO_VD + 16 * j);
        }
        cp_commit();
    }
    const int end = pos[0] + 1;
    pdl_trigger();
    pdl_wait();
    const float2 lv = q ? mo_attend(q + qoff + (i64)h * q_head, scale, cache + (i64)slot[0] * slot_len * 576, end, wsum, red)
                        : mo_merge(part, nsp, lat, loff, lstride, nh, kl, h, end, wsum, fw, red);
    if (2 * tid < kl) *(float2*)(ls + 2 * tid) = lv;
    cp_async_wait_all();
    __syncthreads();
    // v rows 16c + 2w, 16c + 2w + 1: h16_row_dot<T, 1>'s loop over the row in shared memory.
    const int n8 = kl >> 3;
    float vr[2];
#pragma unroll
    for (int u2 = 0; u2 < 2; u2++) {
        const u8* wr = suv + (2 * warp + u2) * uv_row_bytes;
        float acc = 0.f;
        for (int c0 = lane; c0 < n8; c0 += 128) {
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int cc = c0 + 32 * u;
                if (cc >= n8) break;
                float w[8];
                h16_unpack(T, *(const uint4*)(wr + 16 * cc), w);
                const float4 a = *(const float4*)(ls + 8 * cc);
                const float4 b = *(const float4*)(ls + 8 * cc + 4);
                acc += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
            }
        }
        vr[u2] = warp_sum(acc);
    }
    cluster_wait();
    if (lane < MH_CLUSTER) {
#pragma unroll
        for (int u2 = 0; u2 < 2; u2++) st_cluster(&vs[MH_UV_ROWS * c + 2 * warp + u2], lane, vr[u2]);
    }
    cluster_arrive();
    cluster_wait();
    // Output rows: half a warp a row (its 16 pieces of 8 values), 16 rows a pass of the block.
    const int hl = lane & 15;
    const float4 a = *(const float4*)(vs + 8 * hl), b = *(const float4*)(vs + 8 * hl + 4);
    for (int rr = 2 * warp + (lane >> 4); rr < R; rr += 2 * MO_WARPS) {
        float w[8];
        h16_unpack(T, *(const uint4*)(so + rr * 2 * MO_VD + 16 * hl), w);
        float acc = w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (hl == 0) outp[(i64)h * H + r0 + rr] = acc;
    }
#endif
}
#define MLA_OUT_H16(name, T)                                                                                     \
    extern "C" __global__ void MH_CLUSTER_DIMS __launch_bounds__(MO_THREADS)                                     \
        mla_out_##name(const float* part, int nsp, const float* lat, i64 loff, i64 lstride, const int* pos, int nh, \
                       int kl, const u8* Wuv, i64 uv_row_bytes, i64 uv_mat_bytes, const u8* Wo, i64 o_row_bytes,   \
                       int H, float* outp, const float* q, i64 qoff, i64 q_head, const u16* cache, const int* slot, \
                       int slot_len, float scale) {                                                              \
        mla_out_h16_body<T>(part, nsp, lat, loff, lstride, pos, nh, kl, Wuv, uv_row_bytes, uv_mat_bytes, Wo,       \
                            o_row_bytes, H, outp, q, qoff, q_head, cache, slot, slot_len, scale);                \
    }
MLA_OUT_H16(bf16, T_BF16)
MLA_OUT_H16(f16, T_F16)

// ---- mla_out_q8 (described above, at "The MLA decode's output side in one launch"). Its merge
// spread over a cluster of a head's 8 blocks (each merging 64 columns and sending them to the
// others through distributed shared memory) was measured in gpu-next87: tg64 at 16k 510.7
// against 539.4, and removed. W_o's pieces loaded to registers before the wait instead of
// shared memory (mla_out_q8g, Path::OutWoReg: 86 KB a block instead of 122, so that a block fits
// beside a 136 KB split block and loads its weights during the split; the same bits) was
// measured in the fifty-ninth session on an H100: tg64 at 16k 488.1 / 488.5 against 488.3 /
// 489.2, with the largest shared-memory carveout asked for the split kernels and it 479.4 /
// 482.0; removed (commit df31e0a has it). One token's rope, cache write and absorbed query done
// by this launch's blocks at a short context (mla_out_q8_ra, Path::RaOut: a head's 8 blocks one
// cluster, 64 absorbed rows a block sent to the others; one dependent launch a layer fewer, the
// same bits) was measured on H100s in the seventy-fourth and seventy-fifth sessions: tg128 520.5
// against 629.7 with all of W_uv[h] in every block (124 KB, one block an SM), 609.6 against
// 631.9 with W_uv split over the cluster (~68 KB a block); its clusters were placed only at
// their release, and the launch before it grew by 1.6 µs. Removed (commit 10038ce has it).
template <bool HP>
__device__ __forceinline__ void mla_out_q8_body(const float* part, int nsp, const float* lat, i64 loff, i64 lstride,
                                                const int* pos, int nh, int kl, const u8* Wuv, i64 uv_row_bytes,
                                                i64 uv_mat_bytes, const u8* Wo, i64 o_row_bytes, int H, int R, float* outp,
                                                const float* q, i64 qoff, i64 q_head, const u16* cache, const int* slot,
                                                int slot_len, float scale) {
    extern __shared__ __align__(16) u8 smo[];
    const int c = blockIdx.x, h = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r0 = c * R, nr = min(R, H - r0);
    u8* suv = smo;                                     // MO_VD rows of uv_row_bytes
    u8* so = suv + MO_VD * uv_row_bytes;               // R rows of 144 bytes
    float* wsum = (float*)(so + (i64)R * 144);         // MO_WARPS x kl: the warps' merge sums
    i8* latq = (i8*)(wsum + MO_WARPS * kl);            // kl quants
    float* latd = (float*)(latq + kl);                 // kl / 32 scales
    i8* vq = (i8*)(latd + kl / 32);                    // MO_VD quants
    float* vdd = (float*)(vq + MO_VD);                 // MO_VD / 32 scales
    float* fw = vdd + MO_VD / 32;                      // MLA_MAX_SPLITS split weights
    float* red = fw + MLA_MAX_SPLITS;                  // 2 x MO_WARPS
    {
        const u8* g = Wuv + (i64)h * uv_mat_bytes;
        const int n16 = (int)(MO_VD * uv_row_bytes / 16);
        for (int i = tid; i < n16; i += MO_THREADS) cp16_any(suv + 16 * i, g + 16 * (i64)i);
        for (int i = tid; i < nr * 9; i += MO_THREADS) {
            const int r = i / 9, j = i - r * 9;
            cp16_any(so + r * 144 + 16 * j, Wo + (i64)(r0 + r) * o_row_bytes + (i64)h * 144 + 16 * j);
        }
        cp_commit_any();
    }
    // Positions come from the batch upload, which no kernel of the step writes.
    const int end = pos[0] + 1;
    pdl_trigger();
    pdl_wait();
    const int i = 2 * tid;
    float2 lv = make_float2(0.f, 0.f);
    if (q) {
        lv = mo_attend(q + qoff + (i64)h * q_head, scale, cache + (i64)slot[0] * slot_len * 576, end, wsum, red);
    } else {
        lv = mo_merge<HP>(part, nsp, lat, loff, lstride, nh, kl, h, end, wsum, fw, red);
    }
    // lat_h to Q8_0: 16 lanes a 32-value block (ggml's quantize_row_q8_0, the scale f16-rounded).
    {
        float a = fmaxf(fabsf(lv.x), fabsf(lv.y));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 8));
        const float d = a / 127.f, id = d != 0.f ? 1.0f / d : 0.f;
        if (i < kl) {
            latq[i] = (i8)(int)roundf(lv.x * id);
            latq[i + 1] = (i8)(int)roundf(lv.y * id);
            if ((tid & 15) == 0) latd[i >> 5] = h2f(f2h(d));
        }
    }
    cp_wait_all_any();
    __syncthreads();
    // v_h: 8 lanes a row (up to 4 pieces of 16 quants each), 4 rows a warp a pass, 4 passes;
    // warp w's lane group g has rows 32p + 4w + g. The value rows go to the o phase through
    // shared memory quantised: first the floats (in wsum, free now).
    const int np = kl >> 4, sub = lane & 7, g8 = lane >> 3;
    float* vf = wsum;
#pragma unroll
    for (int ps = 0; ps < MO_VD / (4 * MO_WARPS); ps++) {
        const int row = 32 * ps + 4 * warp + g8;
        const u8* wr = suv + row * uv_row_bytes;
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int p = sub + 8 * u;
            if (p < np) {
                const int b = p >> 1;
                const u8* gp = wr + (b >> 2) * 144;
                const uint4 q = *(const uint4*)(gp + 16 + 32 * (b & 3) + 16 * (p & 1));
                acc += (float)dot16(q, latq + 16 * p) * (h2f(((const u16*)gp)[b & 3]) * latd[b]);
            }
        }
        acc = group_sum(acc, 8);
        if (sub == 0) vf[row] = acc;
    }
    __syncthreads();
    if (warp < MO_VD / 32) {
        const float v = vf[32 * warp + lane];
        const float d = warp_max(fabsf(v)) / 127.f, id = d != 0.f ? 1.0f / d : 0.f;
        vq[32 * warp + lane] = (i8)(int)roundf(v * id);
        if (lane == 0) vdd[warp] = h2f(f2h(d));
    }
    __syncthreads();
    // Output rows: 8 lanes a row (the head's 8 pieces), 32 rows a pass of the block.
#pragma unroll 4
    for (int rr0 = warp * 4; rr0 < nr; rr0 += 4 * MO_WARPS) {
        const int rr = rr0 + g8;
        float acc = 0.f;
        if (rr < nr) {
            const u8* gp = so + rr * 144;
            const int b = sub >> 1;
            const uint4 q = *(const uint4*)(gp + 16 + 32 * b + 16 * (sub & 1));
            acc = (float)dot16(q, vq + 16 * sub) * (h2f(((const u16*)gp)[b]) * vdd[b]);
        }
        acc = group_sum(acc, 8);
        if (sub == 0 && rr < nr) outp[(i64)h * H + r0 + rr] = acc;
    }
}
// mla_out_q8 merges f32 partial rows; mla_out_q8p those of mla_split_tc_hep (Path::HalfParts).
#define MLA_OUT_Q8_INST(NAME, HP)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MO_THREADS)                                                           \
        NAME(const float* part, int nsp, const float* lat, i64 loff, i64 lstride, const int* pos, int nh, int kl,      \
             const u8* Wuv, i64 uv_row_bytes, i64 uv_mat_bytes, const u8* Wo, i64 o_row_bytes, int H, int R,           \
             float* outp, const float* q, i64 qoff, i64 q_head, const u16* cache, const int* slot, int slot_len,       \
             float scale) {                                                                                            \
        mla_out_q8_body<HP>(part, nsp, lat, loff, lstride, pos, nh, kl, Wuv, uv_row_bytes, uv_mat_bytes, Wo,          \
                            o_row_bytes, H, R, outp, q, qoff, q_head, cache, slot, slot_len, scale);                   \
    }
MLA_OUT_Q8_INST(mla_out_q8, false)
MLA_OUT_Q8_INST(mla_out_q8p, true)

