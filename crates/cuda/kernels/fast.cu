// Decode-path kernels for Q8_0 weights and MLA. Hand-written because they read ggml's Q8_0
// blocks directly (no library GEMV reads them), fuse what a library call cannot (activation
// quantisation, expert selection read on the device, GLU, the router-weighted sum of experts),
// and because batch-1 decode is bound by bytes: every matrix must stream at close to the card's
// bandwidth, which a per-matrix library call (15-23 us each, see shared/reference/h200.md) cannot.
//
// Q8_0 GEMV (gemv_q8_<NT>), after llama.cpp's mmvq:
//  * the block quantises its activation rows once into shared memory (int8 + one f16-rounded
//    scale per 32 values, exactly ggml's quantize_row_q8_0, which the CPU backend also uses);
//  * weights are in groups of 4 blocks (144 B, see common.cuh), so each lane reads 16 quants with
//    one 16-byte load, and consecutive lanes read consecutive 16-byte pieces of a row;
//  * the dot product is 4 dp4a per piece and one float FMA with the two scales;
//  * `lpr` lanes share a row (32 for k >= 512; fewer for short rows, so a warp covers several
//    rows), 4 pieces per lane are loaded before any is used, and each block loops over row
//    tiles so the prologue is amortised over many rows.

#define GQ_THREADS 256
#define GQ_WARPS (GQ_THREADS / 32)
// At least this many blocks per SM: caps registers at 64 per thread, so 32 warps per SM keep
// their weight loads in flight (at 2 blocks per SM, the register-limited default, the decode
// GEMVs reached ~1.2 TB/s; Nsight Compute: "Block Limit Registers 2").
#define GQ_MIN_BLOCKS 4
// The MoE decode kernels hold two rows' loads (gate and up) or eight at once: at 3 blocks (80
// registers) they spill at most a few bytes. (A measurement define: TS_CUDA_DEFINES=
// GQ_MOE_MIN_BLOCKS=n.)
#ifndef GQ_MOE_MIN_BLOCKS
#define GQ_MOE_MIN_BLOCKS 3
#endif
// The 16-bit decode MoE's down kernels alone (moe_down_sh_<t>, _w4): 4 blocks an SM, 64
// registers without spills, where 67 at 3 blocks (Nsight on the H200: "Block Limit Registers
// 3") put their 1,024 blocks in 2.6 waves. H200 (gpu-next79): bf16 tg128 519.9 against 515.6,
// the same hash. A measurement define: TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=n.
#ifndef GQ_DOWN16_MIN_BLOCKS
#define GQ_DOWN16_MIN_BLOCKS 4
#endif

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// One warp's 32-value Q8_0 block b (0..3) of the 144-byte group at gp, value `lane` in each
// lane: d = amax / 127 (stored as f16), q = round(v / d), as quant_group_store (mmq.cu) rounds
// a whole group; block 0 also clears the group's pad words. (For kernels that make a group's
// blocks one warp at a time: the one-token MoE's gate/up.)
__device__ __forceinline__ void quant_block32_store(float v, int lane, u8* gp, int b) {
    const float a = warp_max(fabsf(v));
    const float d = a / 127.f;
    const float id = d != 0.f ? 1.0f / d : 0.f;
    gp[16 + 32 * b + lane] = (u8)(i8)(int)roundf(v * id);
    if (lane == 0) ((u16*)gp)[b] = f2h(d);
    if (b == 0 && lane < 2) ((u32*)gp)[2 + lane] = 0u;  // the pad words
}

// ---- the MLA latent cache: f32 rows, or f16 rows (Backend::alloc_latent_cache) ------------------
// An f16 cache holds what the tensor-core MLA kernels stage from an f32 one (pack_h: clamped to the
// f16 range, rounded to nearest), so they read the same keys from either: half the bytes a key.
// The kernels that touch the cache are templated on its element (float or u16).
__device__ __forceinline__ u16 f2h_sat(float v) { return f2h(fminf(fmaxf(v, -65504.f), 65504.f)); }
__device__ __forceinline__ void cache_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void cache_st(u16* p, float v) { *p = f2h_sat(v); }
// Four consecutive values (16-byte aligned for f32, 8-byte for f16) as floats.
__device__ __forceinline__ float4 cache_ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 cache_ld4(const u16* p) {
    const uint2 v = *(const uint2*)p;
    return make_float4(h2f((u16)v.x), h2f((u16)(v.x >> 16)), h2f((u16)v.y), h2f((u16)(v.y >> 16)));
}
// Rows of src into the cache rows of their tokens (slot * slot_len + pos), f32 or f16.
template <typename C>
__device__ __forceinline__ void cache_write_body(C* cache, const float* src, i64 soff, i64 sstride, i64 width, i64 ntok,
                                                 const int* pos, const int* slot, int slot_len) {
    i64 total = ntok * width;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        i64 t = idx / width, i = idx % width;
        i64 row = (i64)slot[t] * slot_len + pos[t];
        cache_st(cache + row * width + i, src[soff + t * sstride + i]);
    }
}
#define CACHE_WRITE_INST(NAME, C)                                                                              \
    extern "C" __global__ void NAME(C* cache, const float* src, i64 soff, i64 sstride, i64 width, i64 ntok,     \
                                    const int* pos, const int* slot, int slot_len) {                            \
        PDL_ENTRY();                                                                                            \
        cache_write_body<C>(cache, src, soff, sstride, width, ntok, pos, slot, slot_len);                       \
    }
CACHE_WRITE_INST(cache_write, float)
CACHE_WRITE_INST(cache_write_h, u16)
__device__ __forceinline__ int dot16(uint4 w, const i8* x) {
    const int4 xv = *(const int4*)x;
    int s = dp4a((int)w.x, xv.x, 0);
    s = dp4a((int)w.y, xv.y, s);
    s = dp4a((int)w.z, xv.z, s);
    return dp4a((int)w.w, xv.w, s);
}

// Quantise `nrows` rows of `k` f32 values (row j at src + j*stride, times mul[j] when mul is
// given) into shared memory:
// xq[j*k + i] int8, xd[j*(k/32) + b] the block scale. ggml's quantize_row_q8_0: d = amax/127,
// q = round(x/d), and the dot uses d rounded to f16. 8 lanes per 32-block, 4 values per lane,
// QR_UNROLL groups of 4 blocks' loads per warp in flight (4: the decode kernels run at 64
// registers, see GQ_MIN_BLOCKS).
__device__ __forceinline__ float act_fn(int kind, float g) {
    if (kind == 1) return g / (1.0f + expf(-g));
    const float C = 0.7978846f;
    return 0.5f * g * (1.0f + tanhf(C * (g + 0.044715f * g * g * g)));
}
#define QR_UNROLL 4
__device__ void quant_rows_smem(const float* src, i64 stride, const float* mul, int nrows, int k, i8* xq, float* xd) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int nb = k >> 5;
    const int total = nrows * nb;
    const int sub = lane >> 3, q4 = lane & 7;  // block (of the warp's 4) and 4-value piece of this lane
    for (int b0 = warp * 4; b0 < total; b0 += nw * 4 * QR_UNROLL) {
        float4 v[QR_UNROLL];
#pragma unroll
        for (int u = 0; u < QR_UNROLL; u++) {
            int b = b0 + u * nw * 4 + sub;
            if (b < total) {
                int j = b / nb, c = b - j * nb;
                const i64 o = j * stride + 32 * c + 4 * q4;
                // 16-byte loads only when aligned (strided views may not be).
                if ((((unsigned long long)(src + o)) & 15) == 0) v[u] = *(const float4*)(src + o);
                else v[u] = make_float4(src[o], src[o + 1], src[o + 2], src[o + 3]);
                if (mul) {
                    float m = mul[j];
                    v[u] = make_float4(v[u].x * m, v[u].y * m, v[u].z * m, v[u].w * m);
                }
            } else {
                v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
#pragma unroll
        for (int u = 0; u < QR_UNROLL; u++) {
            int b = b0 + u * nw * 4 + sub;
            float a = fmaxf(fmaxf(fabsf(v[u].x), fabsf(v[u].y)), fmaxf(fabsf(v[u].z), fabsf(v[u].w)));
            a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
            a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
            a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
            if (b < total) {
                float d = a / 127.f;
                float id = d != 0.f ? 1.0f / d : 0.f;
                int j = b / nb, c = b - j * nb;
                u32 packed = ((u32)(u8)(i8)(int)roundf(v[u].x * id)) | ((u32)(u8)(i8)(int)roundf(v[u].y * id) << 8) |
                             ((u32)(u8)(i8)(int)roundf(v[u].z * id) << 16) | ((u32)(u8)(i8)(int)roundf(v[u].w * id) << 24);
                *(u32*)(xq + j * k + 32 * c + 4 * q4) = packed;
                if (q4 == 0) xd[b] = h2f(f2h(d));
            }
        }
    }
}

// Bytes of shared memory the prologue needs for `nrows` rows of `k`.
// (host side: nrows * k * 9 / 8)

// Pieces p0 + u*lpr (u < 4) of a Q8_0 row: 16 quants (one 16-byte load) and the block scale;
// W: through ldw16 / ldw_scale (weights read once, past L1), else plain loads.
template <bool W>
__device__ __forceinline__ void load_q8_4_impl(const u8* wr, int p0, int np, int lpr, uint4* q, float* dw) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int p = p0 + u * lpr;
        const int b = p >> 1;
        if (p < np) {
            const u8* gp = wr + (i64)(b >> 2) * 144;
            const u8* qp = gp + 16 + 32 * (b & 3) + 16 * (p & 1);
            q[u] = W ? ldw16(qp) : *(const uint4*)qp;
            dw[u] = W ? ldw_scale(gp + 2 * (b & 3)) : h2f(((const u16*)gp)[b & 3]);
        } else {
            q[u] = make_uint4(0u, 0u, 0u, 0u);
            dw[u] = 0.f;
        }
    }
}
__device__ __forceinline__ void load_q8_4(const u8* wr, int p0, int np, int lpr, uint4* q, float* dw) {
    load_q8_4_impl<false>(wr, p0, np, lpr, q, dw);
}
__device__ __forceinline__ void load_q8_4w(const u8* wr, int p0, int np, int lpr, uint4* q, float* dw) {
    load_q8_4_impl<true>(wr, p0, np, lpr, q, dw);
}

__device__ __forceinline__ float group_sum(float v, int lpr) {
    for (int o = lpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// out[g][t][row] = W[g] row . x[g][t] for NT tokens per block (blockIdx.y = token tile,
// blockIdx.z = matrix of a 3-D weight). Row tiles of GQ_WARPS * 32/lpr rows, looped over by
// the grid.
// (bx, by, bz): the block's (tile, token tile, matrix), gx the tile blocks (the kernel passes
// blockIdx and gridDim.x; mla_rope_absorb_1, fused.cu, its own numbering).
template <int NT>
__device__ void gemv_q8_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const float* x, i64 xoff,
                             i64 xstride, i64 xgstride, float* out, i64 ooff, i64 ostride, i64 ogstride, int n,
                             int lpr, int bx, int by, int bz, int gx) {
    extern __shared__ __align__(16) u8 smq[];
    const int nb = k >> 5;
    i8* xq = (i8*)smq;
    float* xd = (float*)(smq + NT * k);
    const int g = bz, tok0 = by * NT;
    const int nt = min(NT, n - tok0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rpw = 32 / lpr, sub = lane & (lpr - 1);
    const int rows_per_tile = GQ_WARPS * rpw;
    const int ntiles = (m + rows_per_tile - 1) / rows_per_tile;
    const int np = 2 * nb;
    uint4 q[4];
    float dw[4];
    // The first weights are requested before the activations are quantised: the prologue's
    // latency overlaps the first loads.
    load_q8_4(W + g * mat_bytes + (i64)min(bx * rows_per_tile + warp * rpw + lane / lpr, m - 1) * row_bytes, sub, np,
              lpr, q, dw);
    // Weights are never written by a kernel: they may be read before the previous kernel ends.
    pdl_trigger();
    pdl_wait();
    bool have = true;
    quant_rows_smem(x + xoff + g * xgstride + tok0 * xstride, xstride, nullptr, nt, k, xq, xd);
    __syncthreads();
    for (int tile = bx; tile < ntiles; tile += gx) {
        const int row = tile * rows_per_tile + warp * rpw + lane / lpr;
        const u8* wr = W + g * mat_bytes + (i64)min(row, m - 1) * row_bytes;
        float acc[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) acc[j] = 0.f;
        for (int p0 = sub; p0 < np; p0 += 4 * lpr) {
            if (!have) load_q8_4(wr, p0, np, lpr, q, dw);
            have = false;
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int p = p0 + u * lpr;
                if (p < np) {
#pragma unroll
                    for (int j = 0; j < NT; j++)
                        if (j < nt) acc[j] += (float)dot16(q[u], xq + j * k + 16 * p) * (dw[u] * xd[j * nb + (p >> 1)]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NT; j++) {
            float s = group_sum(acc[j], lpr);
            if (sub == 0 && row < m && j < nt) out[ooff + g * ogstride + (i64)(tok0 + j) * ostride + row] = s;
        }
    }
}

#define GEMVQ_INST(NT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MIN_BLOCKS)                                                   \
        gemv_q8_##NT(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const float* x, i64 xoff,       \
                     i64 xstride, i64 xgstride, float* out, i64 ooff, i64 ostride, i64 ogstride, int n, int lpr) {       \
        gemv_q8_impl<NT>(W, row_bytes, mat_bytes, m, k, x, xoff, xstride, xgstride, out, ooff, ostride,        \
                         ogstride, n, lpr, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x);                     \
    }
GEMVQ_INST(1)
GEMVQ_INST(2)
GEMVQ_INST(4)
GEMVQ_INST(8)

// ---- MoE decode (Q8_0 experts) -------------------------------------------------------------------
// Routing for plain top-k (one group): one warp per token, each lane holding E/32 scores; k rounds
// of a warp arg-max (ties to the lower index, as ts_cpu::route). Replaces the one-thread-per-token
// moe_route when E <= 256 and there are no expert groups.
// The body, for token t (one whole warp; also run by moe_route_quant, mmq.cu).
__device__ __forceinline__ void route_warp_body(int t, const float* logits, i64 loff, i64 lstride, int n, int E, int k,
                                                int gating, int norm_topk, float scale, int* sel_e, float* sel_w) {
    const int lane = threadIdx.x & 31;
    if (t >= n) return;
    const float* lg = logits + loff + (i64)t * lstride;
    float sc[8];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int e = lane + 32 * i;
        sc[i] = e < E ? lg[e] : NEG_INF;
        mx = fmaxf(mx, sc[i]);
    }
    if (gating == 0) {
        mx = warp_max(mx);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int e = lane + 32 * i;
            sc[i] = e < E ? expf(sc[i] - mx) : 0.f;
            sum += sc[i];
        }
        sum = warp_sum(sum);
        float inv = 1.0f / sum;
#pragma unroll
        for (int i = 0; i < 8; i++) sc[i] = lane + 32 * i < E ? sc[i] * inv : NEG_INF;
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) sc[i] = lane + 32 * i < E ? 1.0f / (1.0f + expf(-sc[i])) : NEG_INF;
    }
    unsigned taken = 0;
    float wsum = 0.f, wsel = 0.f;
    int esel = -1;
    for (int s = 0; s < k; s++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (!((taken >> i) & 1u) && lane + 32 * i < E && (sc[i] > bv || bi == 0x7fffffff)) { bv = sc[i]; bi = lane + 32 * i; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi == 0x7fffffff) break;
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
        wsum += bv;
        if (lane == s) { esel = bi; wsel = bv; }
    }
    const float inv = norm_topk ? 1.0f / (wsum + 1e-20f) : 1.0f;
#if defined(MOE_PIN_ROUTE) && MOE_PIN_ROUTE
    // A measurement define (TS_CUDA_DEFINES=MOE_PIN_ROUTE=1): token t's k experts fixed by its
    // index, k distinct ones spread evenly over the E (as real routing spreads them), whatever
    // the scores, so that knockouts (MMQ_ROWS_KO) that change values keep the bytes read. The
    // weights stay the scores'. Wrong tokens, on purpose.
    if (lane < k && esel >= 0) esel = (int)(((long long)t * 37 + (long long)lane * (E / k + 1)) % E);
#endif
    if (lane < k) {
        sel_e[t * k + lane] = esel;
        sel_w[t * k + lane] = esel >= 0 ? (norm_topk ? wsel * inv : wsel) * scale : 0.f;
    }
}
extern "C" __global__ void moe_route_warp(const float* logits, i64 loff, i64 lstride, int n, int E, int k, int gating,
                                          int norm_topk, float scale, int* sel_e, float* sel_w) { PDL_ENTRY();
    route_warp_body(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), logits, loff, lstride, n, E, k, gating,
                    norm_topk, scale, sel_e, sel_w);
}

// Gate and up products of every (token, slot) pair in one launch: block (x, p) computes rows
// [GQ_WARPS*x, +GQ_WARPS) of pair p's expert (sel_e[p]; the input row is token p / in_div), both
// matrices at once, and writes act(gate) * up. Pairs without an expert write zeros.
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_gateup_q8(const u8* Wg, const u8* Wu, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,
                  const float* in, i64 ioff, i64 istride, int in_div, int act, float* out, i64 ostride) { PDL_ENTRY();
    extern __shared__ __align__(16) u8 smq[];
    const int p = blockIdx.y;
    const int e = sel_e[p];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * GQ_WARPS + warp;
    if (e < 0) {
        if (lane == 0 && row < m) out[(i64)p * ostride + row] = 0.f;
        return;
    }
    i8* xq = (i8*)smq;
    float* xd = (float*)(smq + kdim);
    const int np = 2 * (kdim >> 5);
    const int rr = min(row, m - 1);
    const u8* wg = Wg + e * mat_bytes + (i64)rr * row_bytes;
    const u8* wu = Wu + e * mat_bytes + (i64)rr * row_bytes;
    uint4 qg[4], qu[4];
    float dg[4], du[4];
    load_q8_4(wg, lane, np, 32, qg, dg);  // before the prologue, to overlap its latency
    load_q8_4(wu, lane, np, 32, qu, du);
    quant_rows_smem(in + ioff + (i64)(p / in_div) * istride, istride, nullptr, 1, kdim, xq, xd);
    __syncthreads();
    if (row >= m) return;
    float g = 0.f, u = 0.f;
    for (int p0 = lane; p0 < np; p0 += 128) {
        if (p0 != lane) {
            load_q8_4(wg, p0, np, 32, qg, dg);
            load_q8_4(wu, p0, np, 32, qu, du);
        }
#pragma unroll
        for (int v = 0; v < 4; v++) {
            const int pp = p0 + 32 * v;
            if (pp < np) {
                const float dx = xd[pp >> 1];
                g += (float)dot16(qg[v], xq + 16 * pp) * (dg[v] * dx);
                u += (float)dot16(qu[v], xq + 16 * pp) * (du[v] * dx);
            }
        }
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) out[(i64)p * ostride + row] = act_fn(act == 0 ? 1 : 2, g) * u;
}

// Down products and the weighted sum over a token's k experts in one launch: block (x, t)
// quantises the k activation rows of token t, each times its router weight, and computes output
// rows [GQ_WARPS*x, +GQ_WARPS) as one dot product over the k concatenated rows. Overwrites out.
extern "C" __global__ void __launch_bounds__(GQ_THREADS, GQ_MOE_MIN_BLOCKS)
    moe_down_q8(const u8* Wd, i64 row_bytes, i64 mat_bytes, int m, int kdim, int k, const int* sel_e,
                const float* sel_w, const float* act, i64 astride, float* out, i64 ooff, i64 ostride) { PDL_ENTRY();
    extern __shared__ __align__(16) u8 smq[];
    const int t = blockIdx.y;
    i8* xq = (i8*)smq;
    float* xd = (float*)(smq + k * kdim);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = min(blockIdx.x * GQ_WARPS + warp, m - 1);
    const int nb = kdim >> 5, np = 2 * nb, total = k * np;
    // Piece P of the concatenation = piece P % np of slot P / np's expert row (slots without an
    // expert read expert 0's row; their activations are 0).
    auto load = [&](int P, uint4& q, float& d) {
        if (P < total) {
            const int s = P / np, p = P - s * np, b = p >> 1;
            const int e = max(sel_e[t * k + s], 0);
            const u8* gp = Wd + e * mat_bytes + (i64)row * row_bytes + (i64)(b >> 2) * 144;
            q = *(const uint4*)(gp + 16 + 32 * (b & 3) + 16 * (p & 1));
            d = h2f(((const u16*)gp)[b & 3]);
        } else {
            q = make_uint4(0u, 0u, 0u, 0u);
            d = 0.f;
        }
    };
    uint4 q[8];
    float dw[8];
#pragma unroll
    for (int u = 0; u < 8; u++) load(lane + 32 * u, q[u], dw[u]);  // before the prologue
    quant_rows_smem(act + (i64)t * k * astride, astride, sel_w + t * k, k, kdim, xq, xd);
    __syncthreads();
    if (blockIdx.x * GQ_WARPS + warp >= m) return;
    float acc = 0.f;
    for (int P0 = lane; P0 < total; P0 += 256) {
        if (P0 != lane) {
#pragma unroll
            for (int u = 0; u < 8; u++) load(P0 + 32 * u, q[u], dw[u]);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int P = P0 + 32 * u;
            // xq / xd of slot s start at s*kdim / s*nb, so piece P sits at 16P and block P/2.
            if (P < total) acc += (float)dot16(q[u], xq + 16 * P) * (dw[u] * xd[P >> 1]);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) out[ooff + (i64)t * ostride + row] = acc;
}

// ---- MLA decode: split over the context (flash-decoding) -----------------------------------------
// Block (s, t): token t, keys of split s (the context [0, pos+1) cut into gridDim.x runs of whole
// tiles, computed on the device so one launch shape serves every position: CUDA graphs replay it).
// All heads in one block, since they all read the same latent cache row: warp w owns heads 2w and
// 2w+1, lane l owns row values l + 32i (both heads' scaled queries in registers). Tiles of MLA_T
// rows are staged in shared memory (the next tile is loaded into registers while the current one
// is used), then per tile: the scores of both heads (warp-reduced), one online-softmax update,
// and the weighted latent sum (KL32 values per lane per head). Writes per (token, split, head) the
// running max, sum and unnormalised output; mla_combine merges the splits.
#define MLA_T 8
// With `out` (one split, gridDim.x == 1) the block writes the normalised output there instead
// (token t, head h at out + ooff + t*o_tok + h*o_head): acc * (1 / l), the bits mla_combine
// gives for one split, one launch fewer.
template <int W32, int KL32, int NTHR, typename C>
__device__ void mla_split_impl(const float* q, i64 qoff, i64 q_tok, i64 q_head, const C* cache,
                               const int* pos, const int* slot, int slot_len, int nh, float scale, float* part,
                               float* out, i64 ooff, i64 o_tok, i64 o_head) {
    constexpr int W = W32 * 32, KL = KL32 * 32, TF4 = MLA_T * W / 4, PF = (TF4 + NTHR - 1) / NTHR;
    __shared__ __align__(16) float tile[2][MLA_T * W];
    const int t = blockIdx.y, sp = blockIdx.x, nsp = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h0 = 2 * warp;
    const int end = pos[t] + 1;
    const int chunk = ((end + nsp - 1) / nsp + MLA_T - 1) / MLA_T * MLA_T;
    const int j0 = sp * chunk, j1 = min(end, j0 + chunk);
    const i64 base = (i64)slot[t] * slot_len;
    const int stride = KL + 2;
    if (j0 >= j1) {
        if (lane == 0)
            for (int hh = 0; hh < 2; hh++) {
                float* o = part + (((i64)t * nsp + sp) * nh + h0 + hh) * stride;
                o[0] = NEG_INF;
                o[1] = 0.f;
            }
        return;
    }
    float qr[2][W32];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const float* qp = q + qoff + t * q_tok + (h0 + hh) * q_head;
#pragma unroll
        for (int i = 0; i < W32; i++) qr[hh][i] = qp[lane + 32 * i] * scale;
    }
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    float acc[2][KL32];
#pragma unroll
    for (int hh = 0; hh < 2; hh++)
#pragma unroll
        for (int i = 0; i < KL32; i++) acc[hh][i] = 0.f;
    float4 pf[PF];
    auto load = [&](int tj) {
#pragma unroll
        for (int u = 0; u < PF; u++) {
            const int idx = threadIdx.x + u * NTHR;
            const int key = idx / (W / 4), off = idx - key * (W / 4);
            if (idx < TF4 && tj + key < j1) pf[u] = cache_ld4(cache + (base + tj + key) * W + 4 * off);
            else pf[u] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    const int ntile = (j1 - j0 + MLA_T - 1) / MLA_T;
    load(j0);
    for (int it = 0; it < ntile; it++) {
        float* buf = tile[it & 1];
#pragma unroll
        for (int u = 0; u < PF; u++) {
            const int idx = threadIdx.x + u * NTHR;
            if (idx < TF4) ((float4*)buf)[idx] = pf[u];
        }
        __syncthreads();
        const int tj = j0 + it * MLA_T;
        if (it + 1 < ntile) load(tj + MLA_T);
        const int nk = min(MLA_T, j1 - tj);
        float sc[2][MLA_T];
#pragma unroll
        for (int kk = 0; kk < MLA_T; kk++) {
            float s0 = 0.f, s1 = 0.f;
#pragma unroll
            for (int i = 0; i < W32; i++) {
                const float v = buf[kk * W + lane + 32 * i];
                s0 += qr[0][i] * v;
                s1 += qr[1][i] * v;
            }
            s0 = warp_sum(s0);
            s1 = warp_sum(s1);
            sc[0][kk] = kk < nk ? s0 : NEG_INF;
            sc[1][kk] = kk < nk ? s1 : NEG_INF;
        }
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float mt = m[hh];
#pragma unroll
            for (int kk = 0; kk < MLA_T; kk++) mt = fmaxf(mt, sc[hh][kk]);
            const float corr = expf(m[hh] - mt);
            float ps = 0.f;
#pragma unroll
            for (int kk = 0; kk < MLA_T; kk++) {
                sc[hh][kk] = expf(sc[hh][kk] - mt);
                ps += sc[hh][kk];
            }
            l[hh] = l[hh] * corr + ps;
            m[hh] = mt;
#pragma unroll
            for (int i = 0; i < KL32; i++) acc[hh][i] *= corr;
        }
#pragma unroll
        for (int kk = 0; kk < MLA_T; kk++) {
#pragma unroll
            for (int i = 0; i < KL32; i++) {
                const float v = buf[kk * W + lane + 32 * i];
                acc[0][i] += sc[0][kk] * v;
                acc[1][i] += sc[1][kk] * v;
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        if (out) {
            const float inv = 1.0f / l[hh];
            float* o = out + ooff + t * o_tok + (h0 + hh) * o_head;
#pragma unroll
            for (int i = 0; i < KL32; i++) o[lane + 32 * i] = acc[hh][i] * inv;
            continue;
        }
        float* o = part + (((i64)t * nsp + sp) * nh + h0 + hh) * stride;
        if (lane == 0) { o[0] = m[hh]; o[1] = l[hh]; }
#pragma unroll
        for (int i = 0; i < KL32; i++) o[2 + lane + 32 * i] = acc[hh][i];
    }
}

// Up to four weight regions (pointer null: none) asked into L2 with the bulk copy engine's
// prefetch (one instruction a 64 KB chunk, nothing waits for it), spread over the grid's
// blocks, lanes of warp 0: Backend::prefetch_hint's weights, from the one-token attention kernel
// (latency-bound, most of its blocks idle at short contexts), so that the MoE that follows finds
// its shared experts and router in L2. Weights are never written: before the PDL wait.
#define PF_CHUNK 65536
#ifndef L2PF_LAST
#define L2PF_LAST 0
#endif
__device__ __forceinline__ void l2_prefetch_part(const u8* p, i64 bytes, i64 c0, i64 step) {
#if __CUDA_ARCH__ >= 900
    for (i64 c = c0; c * PF_CHUNK < bytes; c += step) {
        const i64 off = c * PF_CHUNK;
        const unsigned sz = (unsigned)min((i64)PF_CHUNK, bytes - off);
#if L2PF_LAST
        // (TS_CUDA_DEFINES=L2PF_LAST=1, a measurement: the lines kept past streaming traffic
        // until a plain load reads them, which sets them back to evict_normal)
        u64 pol;
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p + off), "r"(sz), "l"(pol) : "memory");
#else
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(sz) : "memory");
#endif
    }
#endif
}
__device__ __forceinline__ void l2_prefetch4(const u8* p0, i64 b0, const u8* p1, i64 b1, const u8* p2, i64 b2,
                                             const u8* p3, i64 b3) {
    if (threadIdx.x >= 32) return;
    const i64 nb = (i64)gridDim.x * gridDim.y * gridDim.z;
    const i64 b = blockIdx.x + (i64)gridDim.x * (blockIdx.y + (i64)gridDim.y * blockIdx.z);
    const i64 c0 = b + nb * threadIdx.x, step = nb * 32;
    if (p0) l2_prefetch_part(p0, b0, c0, step);
    if (p1) l2_prefetch_part(p1, b1, c0, step);
    if (p2) l2_prefetch_part(p2, b2, c0, step);
    if (p3) l2_prefetch_part(p3, b3, c0, step);
}
#define MLA_SPLIT_INST(NAME, W32, KL32, NTHR, C)                                                            \
    extern "C" __global__ void __launch_bounds__(NTHR) NAME(const float* q, i64 qoff, i64 q_tok, i64 q_head,     \
                                                            const C* cache, const int* pos, const int* slot,      \
                                                            int slot_len, int nh, float scale, float* part,       \
                                                            float* out, i64 ooff, i64 o_tok, i64 o_head,          \
                                                            const u8* pf0, i64 pb0, const u8* pf1, i64 pb1,       \
                                                            const u8* pf2, i64 pb2, const u8* pf3, i64 pb3) {     \
        l2_prefetch4(pf0, pb0, pf1, pb1, pf2, pb2, pf3, pb3);                                                  \
        PDL_ENTRY();                                                                                           \
        mla_split_impl<W32, KL32, NTHR, C>(q, qoff, q_tok, q_head, cache, pos, slot, slot_len, nh, scale, part, \
                                           out, ooff, o_tok, o_head);                                          \
    }
MLA_SPLIT_INST(mla_split_18_16, 18, 16, 256, float)
MLA_SPLIT_INST(mla_split_18_16_h, 18, 16, 256, u16)
MLA_SPLIT_INST(mla_split_5_4, 5, 4, 64, float)

// Merge the splits of one (token, head) and a run of 64 outputs: block (t*nh + h, c), up to 8
// warps (the host gives one per split up to 8: a batch of 64 tokens has 4 splits each).
// Only the first ceil(end / chunk) splits saw keys (same chunking as mla_split); their weights
// exp(m_s - M) go to shared memory first. Lane l owns outputs 64c + 2l, +1 (one float2: rows are
// kl + 2 floats, kl even, so the pair is 8-byte aligned); warp w of nw sums splits w, w + nw, ...
// and the partial sums meet in shared memory in a fixed order. At 16k context (256 splits) a 64-thread
// block walking all splits one dependent load after another took ~31 us per layer, more than the
// attention itself; 8 warps keep 8x the loads in flight.
#define MLA_MAX_SPLITS 256
#define MC_WARPS 8
extern "C" __global__ void __launch_bounds__(32 * MC_WARPS) mla_combine(const float* part, int nsp, int nh, int kl,
                                                                       const int* pos, float* out, i64 ooff, i64 o_tok,
                                                                       i64 o_head) { PDL_ENTRY();
    __shared__ float fw[MLA_MAX_SPLITS];
    __shared__ float red[2][MC_WARPS];
    __shared__ float2 sums[MC_WARPS][32];
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int end = pos[t] + 1;
    const int chunk = ((end + nsp - 1) / nsp + MLA_T - 1) / MLA_T * MLA_T;
    const int nact = min(nsp, (end + chunk - 1) / chunk);
    const int stride = kl + 2;
    const i64 sstride = (i64)nh * stride;
    const float* pp = part + ((i64)t * nsp * nh + h) * stride;
    float M = NEG_INF;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) M = fmaxf(M, pp[s * sstride]);
    M = warp_max(M);
    if (lane == 0) red[0][warp] = M;
    __syncthreads();
    M = red[0][0];
    for (int w = 1; w < nw; w++) M = fmaxf(M, red[0][w]);
    float L = 0.f;
    for (int s = threadIdx.x; s < nact; s += blockDim.x) {
        const float f = expf(pp[s * sstride] - M);
        fw[s] = f;
        L += pp[s * sstride + 1] * f;
    }
    L = warp_sum(L);
    if (lane == 0) red[1][warp] = L;
    __syncthreads();
    const int i = blockIdx.y * 64 + 2 * lane;
    float2 acc = make_float2(0.f, 0.f);
    if (i < kl) {
#pragma unroll 4
        for (int s = warp; s < nact; s += nw) {
            const float2 v = *(const float2*)(pp + s * sstride + 2 + i);
            acc.x += v.x * fw[s];
            acc.y += v.y * fw[s];
        }
    }
    sums[warp][lane] = acc;
    __syncthreads();
    if (warp != 0 || i >= kl) return;
    float den = 0.f;
    for (int w = 0; w < nw; w++) den += red[1][w];
    const float inv = 1.0f / den;
    float2 r = sums[0][lane];
    for (int w = 1; w < nw; w++) {
        r.x += sums[w][lane].x;
        r.y += sums[w][lane].y;
    }
    float* o = out + ooff + t * o_tok + h * o_head + i;
    o[0] = r.x * inv;
    o[1] = r.y * inv;
}

// mla_combine for a batch's few splits (nsp <= 8, kl % 4 == 0, kl <= 512): block t*nh + h of
// kl / 4 threads, thread j the outputs 4j .. 4j + 3, no shared memory and no barrier. Every
// thread reads the splits' m and l itself (the block's same addresses: L1 broadcasts) and sums
// exactly as mla_combine does with one warp per split: the outputs split 0's weighted row plus
// split 1's, then 2's, ... (products rounded before each sum), the denominator as warp_sum
// adds lanes 0..7 (xor 4, then 2, then 1; the wider steps add zeros): the same bits.
// (mla_combine takes a block per (token, head) and run of 64 outputs: at 64 sequences with 4
// splits each 8,192 blocks of 4 warps and three barriers for ~10 KB each, ~12 us a layer in the
// server's trace, gpu-next112.)
// The splits' merge weights as mla_combine_few makes them, for every kernel that merges a
// token's splits (so that they give its bits): the active splits (nact of the nsp, from the
// context's end; the later splits saw no keys), f[s] = exp(m_s - max m) for s < nact (0 past
// them), and the return value 1 / sum of l_s f[s], the sum's order warp_sum's (see below).
// m(s), l(s): split s's running max and sum (called for s < nact only).
__device__ __forceinline__ int mla_merge_active(int end, int nsp) {
    const int chunk = ((end + nsp - 1) / nsp + MLA_T - 1) / MLA_T * MLA_T;
    return min(min(nsp, 8), (end + chunk - 1) / chunk);
}
template <typename FM, typename FL>
__device__ __forceinline__ float mla_merge_weights(int nact, FM m, FL l, float (&f)[8]) {
    float a[8];
    float M = NEG_INF;
#pragma unroll
    for (int s = 0; s < 8; s++) {
        f[s] = s < nact ? m(s) : NEG_INF;
        M = fmaxf(M, f[s]);
    }
#pragma unroll
    for (int s = 0; s < 8; s++) {
        f[s] = s < nact ? expf(f[s] - M) : 0.f;
        a[s] = s < nact ? __fmul_rn(l(s), f[s]) : 0.f;
    }
    const float den = __fadd_rn(__fadd_rn(__fadd_rn(a[0], a[4]), __fadd_rn(a[2], a[6])),
                                __fadd_rn(__fadd_rn(a[1], a[5]), __fadd_rn(a[3], a[7])));
    return 1.0f / den;
}
// r[c] += split s's value v[c] times f (r[c] = the product for s == 0): the merge's sum of the
// weighted rows in split order, each product rounded before it is added.
__device__ __forceinline__ void mla_merge_add(float (&r)[4], float4 v, float f, int s) {
    const float p[4] = {__fmul_rn(v.x, f), __fmul_rn(v.y, f), __fmul_rn(v.z, f), __fmul_rn(v.w, f)};
#pragma unroll
    for (int c = 0; c < 4; c++) r[c] = s == 0 ? p[c] : __fadd_rn(r[c], p[c]);
}
// Token t's (of a chunk's partial rows) merge of head h, as mla_combine_few makes it: pp its
// split 0's row (m, l, then kl values), sstride the floats from one split's row to the next,
// nact the active splits, f their weights; returns 1 / the denominator.
__device__ __forceinline__ float mla_merge_row(const float* part, int nsp, int nh, int kl, const int* pos, int t, int h,
                                               const float*& pp, i64& sstride, int& nact, float (&f)[8]) {
    nact = mla_merge_active(pos[t] + 1, nsp);
    const int stride = kl + 2;
    sstride = (i64)nh * stride;
    pp = part + ((i64)t * nsp * nh + h) * stride;
    const float* q = pp;
    const i64 ss = sstride;
    return mla_merge_weights(nact, [&](int s) { return q[s * ss]; }, [&](int s) { return q[s * ss + 1]; }, f);
}
extern "C" __global__ void __launch_bounds__(128) mla_combine_few(const float* part, int nsp, int nh, int kl,
                                                                 const int* pos, float* out, i64 ooff, i64 o_tok,
                                                                 i64 o_head, u16* oh, i64 ohoff, const u8* pf0, i64 pb0,
                                                                 const u8* pf1, i64 pb1, const u8* pf2, i64 pb2,
                                                                 const u8* pf3, i64 pb3) {
    l2_prefetch4(pf0, pb0, pf1, pb1, pf2, pb2, pf3, pb3);  // CudaBackend::xpf (TS_CUDA_XPF_AT=2)
    PDL_ENTRY();
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const float* pp;
    i64 sstride;
    int nact;
    float f[8];
    const float inv = mla_merge_row(part, nsp, nh, kl, pos, t, h, pp, sstride, nact, f);
    const int i = 4 * threadIdx.x;
    if (i >= kl) return;
    float r[4];
#pragma unroll
    for (int s = 0; s < 8; s++) {
        if (s < nact) {
            const float2 v0 = *(const float2*)(pp + s * sstride + 2 + i);
            const float2 v1 = *(const float2*)(pp + s * sstride + 4 + i);
            mla_merge_add(r, make_float4(v0.x, v0.y, v1.x, v1.y), f[s], s);
        }
    }
    float* o = out + ooff + t * o_tok + h * o_head + i;
#pragma unroll
    for (int c = 0; c < 4; c++) o[c] = r[c] * inv;
    // oh (non-null): the same values in f16 as f16_rows rounds them, packed rows [t * nh + h] of
    // kl halves from ohoff (the input of the value product on cuBLAS; one launch fewer).
    if (oh) {
        const u32 lo = (u32)f2h_sat(r[0] * inv) | (u32)f2h_sat(r[1] * inv) << 16;
        const u32 hi = (u32)f2h_sat(r[2] * inv) | (u32)f2h_sat(r[3] * inv) << 16;
        *(uint2*)(oh + ohoff + (i64)blockIdx.x * kl + i) = make_uint2(lo, hi);
    }
}

// ---- f32 GEMV (the MoE router, kept in f32) ------------------------------------------------------
// Hand-written because the router matrix (E x H, f32) has few rows: one warp per row leaves most
// of the card idle and serialises the row's loads. Here 4 warps share a row (a quarter of k each,
// all of a lane's float4 loads in flight at once), a block covers 2 rows, and the quarters are
// summed through shared memory. Needs k % 128 == 0 and 16-byte aligned rows of x (checked by the
// host). Tokens 8 a block row: block row y takes tokens 8y .. 8y + 7 of the n (a token's sums
// are the same whatever the batch).
#ifndef RS_EARLY
#define RS_EARLY 1
#endif
extern "C" __global__ void __launch_bounds__(256)
    gemv_f32_split(const float* W, int m, int k, const float* x, i64 xoff, i64 xstride, float* out, i64 ooff,
                   i64 ostride, int n) {
    pdl_trigger();
    __shared__ float part[8][8];
    xoff += (i64)blockIdx.y * 8 * xstride;
    ooff += (i64)blockIdx.y * 8 * ostride;
    n = min(8, n - 8 * (int)blockIdx.y);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 2 + (warp >> 2), quarter = warp & 3;
    const int q4 = k / 16;  // float4s per quarter
    const float4* wr = (const float4*)(W + (i64)min(row, m - 1) * k) + quarter * q4;
    // The first round's weights before the PDL wait (the whole of a lane's share at k <= 2,048),
    // in a branch of their own so that ptxas keeps them there (common.cuh, pdl_wait). The same
    // loads and sums as in the loop.
    // (RS_EARLY=0, a measurement define: the wait first, as before.)
    float4 w0[4];
    if (!RS_EARLY) pdl_wait();
    if (lane < q4) {
#pragma unroll
        for (int u = 0; u < 4; u++) w0[u] = lane + 32 * u < q4 ? __ldg(wr + lane + 32 * u) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (RS_EARLY) pdl_wait();
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) acc[j] = 0.f;
    for (int i0 = lane; i0 < q4; i0 += 128) {
        float4 w[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            w[u] = i0 == lane ? w0[u] : i0 + 32 * u < q4 ? wr[i0 + 32 * u] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (j < n) {
                const float4* xr = (const float4*)(x + xoff + j * xstride) + quarter * q4;
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    if (i0 + 32 * u < q4) {
                        const float4 xv = xr[i0 + 32 * u];
                        acc[j] += w[u].x * xv.x + w[u].y * xv.y + w[u].z * xv.z + w[u].w * xv.w;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float s = warp_sum(acc[j]);
        if (lane == 0) part[warp][j] = s;
    }
    __syncthreads();
    if (quarter == 0 && lane < n && row < m) {
        const int b = warp;  // warps 0 and 4 own rows 2x and 2x+1
        out[ooff + (i64)lane * ostride + row] = part[b][lane] + part[b + 1][lane] + part[b + 2][lane] + part[b + 3][lane];
    }
}
