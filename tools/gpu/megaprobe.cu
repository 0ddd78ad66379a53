// Would a persistent decode kernel reach issue 5's 1,000 tok/s? (docs/PERF.md, seventy-sixth
// session.) A one-token MoE layer of today's chain takes 54.8 µs on an H100 (six launches)
// against ~30 µs of its bytes at the 3.1 TB/s a launch streams at the margin; the rest is the
// chain: every launch waits for the one before, then starts loading its weights. PERF.md's
// "What 1,000 tok/s asks" names what could beat it: one kernel whose blocks stream the next
// steps' weights while the current step's dependencies resolve. Before anyone writes that
// kernel (thousands of lines), this probe measures its skeleton at V2-Lite's bytes.
//   nvcc -O3 -arch=sm_90a -o /tmp/megaprobe tools/gpu/megaprobe.cu && /tmp/megaprobe   (with probe.cuh beside it)
// One cooperative launch is one token: NL = 27 layers (layer 0, whose dense FFN reads 75.6
// MB, is modelled as a MoE layer of 77.8), then the head (102,400 Q8_0 rows, 236 MB) and its
// arg-max; one block an SM of 512 threads. A layer is eight phases, each ended by a grid
// barrier (a counter, release / acquire, as syncprobe's `grid`), each phase reading the last
// one's outputs from L2:
//   qkv     q and kv_a: 3,648 Q8_0 rows of K 2,048 (8.4 MB) on the layer input's norm;
//   absorb  W_uk: 8,192 rows of K 128 (1.2 MB) on each head's 128 q_nope values;
//   attend  16 heads x 8 splits of the context (`ctx` rows of 576 f16 in the cache), blocks
//           0-127: scores, softmax and the weighted latent sum, as partial rows;
//   uv      W_uv: 2,048 rows of K 512 (1.2 MB) on each head's merged latent row;
//   wo      W_o: 2,048 rows of K 2,048 (4.7 MB), added to the residual;
//   router  64 f32 rows of 2,048 (0.5 MB) in 512 chunks on the new residual's norm;
//   gateup  every block: softmax top-6 of the 64 router logits (no renormalisation), then
//           8 slots (2 shared experts, 6 routed) x 1,408 (gate, up) row pairs (51.9 MB),
//           a unit (slot, row) a warp, the GLU written as f32;
//   down    every block quantises the 8 x 1,408 GLU values, then 2,048 rows of 8 slots x
//           K 1,408 (26.0 MB), weighted by the routing and added to the residual.
// The products are Q8_0 rows in the kernels' layout (groups of 16 bytes of scales then 4 x 32
// quants) against activations quantised to int8 (dp4a), as the decode kernels compute them.
// Rows of the first five phases are split over the blocks by fixed ranges (a block's share
// of a matrix is one contiguous run of bytes), the MoE's over all warps.
// Modes (µs a token, the median of REPS tokens, each a launch of its own, so tok/s compares
// with tg128 on the same card; µs a layer is the token's time / 27):
//   chain     the weights of every phase loaded after its barrier (what launches do now);
//   pipe      the first five phases' weights of layer l + 1 (16 MB, ~124 KB a block) copied
//             into shared memory by one cp.async.bulk per matrix a block, issued as layer l's
//             gate/up begins and awaited at layer l + 1's first phase: the weight stream
//             runs on during the attention's dependent steps, which then read shared memory;
//   pipe2     pipe, and each layer's shared experts (19.5 MB) asked into L2 by one
//             cp.async.bulk.prefetch.L2 a matrix a block as its attention begins, so that
//             DRAM streams during the attention's dependent steps too;
//   late      the same slices copied only as their layer begins (a slice an mbarrier, so each
//             phase waits for its own): what one launch of a layer's attention side could do
//             without the MoE before it, its weights streaming while its steps resolve;
//   bytes     pipe without the grid barriers (only each block's own): the stream alone;
//   sync      chain without the weights: the barriers, staging and attention alone.
// Measured: gate/up experts drawn from 16 routed (+ 2 shared) a layer (every layer its own
// matrices; the 27 layers and the head are 5.4 GB, far more than L2), at contexts 64 (tg128's
// mean) and 512.
// Written by hand: a micro-benchmark of a kernel design's skeleton, nothing a crate offers.
#include <algorithm>
#include <cstdint>
#include <cuda_fp16.h>
#include <vector>
#include "probe.cuh"

typedef signed char s8;
typedef unsigned long long u64;

constexpr int H = 2048, NH = 16, QKV = 3072 + 576, LAT = 512, NOPE = 128, ABS = NH * LAT, UV = NH * NOPE;
constexpr int M = 1408, ER = 16, ES = 2, EX = ER + ES, TOPK = 6, NEXP = 64, SLOTS = ES + TOPK, RCH = 8;
constexpr int NL = 27, VOCAB = 102400, SPL = 8, THREADS = 512, WARPS = THREADS / 32, REPS = 9, CTX_MAX = 1024;

__host__ __device__ constexpr i64 rb(int k) { return (i64)(k / 128) * 144; }  // Q8_0 row bytes
__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ inline int lo(int n, int b, int nb) { return (int)((i64)n * b / nb); }

struct Layer {
    const u8 *qkv, *abs, *uv, *wo, *gate, *up, *down;  // gate / up [EX][M] rows, down [EX][H] rows
    const float* router;                              // [NEXP][H]
    const __half* cache;                              // [CTX_MAX][576]
};
struct Act {
    float *x;     // [NL + 1][H]: layer inputs
    float *x2;    // [NL][H]: after the attention
    float *y1;    // [QKV]
    float *y2;    // [ABS]
    float *part;  // [NH * SPL][LAT + 2]
    float *y4;    // [UV]
    float *rp;    // [NEXP * RCH]
    float *glu;   // [SLOTS * M]
    float *best;  // [nb][2]: each block's best logit and its row
    int* token;   // the head's arg-max
    unsigned* bar;
};

// Shared memory of a block: the prefetched slices (sized for nb blocks), then the staged inputs.
struct Smem {
    int qkv, abs, uv, wo, rt, w_end, xq, xd, xf, sel, sw, red, mbar, total;
};
__host__ __device__ inline Smem smem_layout(int nb) {
    Smem s;
    s.qkv = 0;
    s.abs = s.qkv + cdiv(QKV, nb) * (int)rb(H);
    s.uv = s.abs + cdiv(ABS, nb) * (int)rb(NOPE);
    s.wo = s.uv + cdiv(UV, nb) * (int)rb(LAT);
    s.rt = s.wo + cdiv(H, nb) * (int)rb(H);
    s.w_end = s.rt + cdiv(NEXP * RCH, nb) * 1024;
    s.xq = s.w_end;                       // int8, up to SLOTS * M
    s.xd = s.xq + SLOTS * M;              // f32 scales, SLOTS * M / 32
    s.xf = s.xd + SLOTS * M / 32 * 4;     // f32, H (normalised residual; attention's q / scores)
    s.sel = s.xf + (H + 128) * 4;         // int, SLOTS
    s.sw = s.sel + SLOTS * 4;             // f32, SLOTS
    s.red = s.sw + SLOTS * 4;             // f32, 32
    s.mbar = (s.red + 32 * 4 + 7) / 8 * 8;
    s.total = s.mbar + 5 * 8;  // an mbarrier a slice
    return s;
}

__device__ __forceinline__ unsigned sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// The n-th grid barrier of this launch (or only the block's own without BAR).
template <bool BAR>
__device__ __forceinline__ void gbar(unsigned* bar, unsigned n) {
    __syncthreads();
    if (BAR && threadIdx.x == 0) {
        __threadfence();
        red_release(bar, 1u);
        const unsigned want = (n + 1) * gridDim.x;
        while (ld_acquire(bar) < want) {
        }
    }
    __syncthreads();
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < WARPS; w++) s += red[w];
    __syncthreads();
    return s;
}

// n values get(i) (n a multiple of 32), optionally RMS-normalised (n <= 4 THREADS), quantised
// to int8 by 32 into xq / xd; xf (if not null) gets the f32 values.
template <typename F>
__device__ void stage(F get, int n, bool norm, s8* xq, float* xd, float* xf, float* red) {
    float scale = 1.f;
    if (norm) {
        float ss = 0.f;
        for (int i = threadIdx.x * 4; i < n; i += THREADS * 4)
            for (int k = 0; k < 4; k++) {
                const float v = get(i + k);
                ss += v * v;
            }
        scale = rsqrtf(block_sum(ss, red) / n + 1e-6f);
    }
    for (int base = 0; base < n; base += THREADS * 4) {
        const int i = base + threadIdx.x * 4;
        float v[4] = {0.f, 0.f, 0.f, 0.f}, a = 0.f;
        if (i < n)
            for (int k = 0; k < 4; k++) {
                v[k] = get(i + k) * scale;
                a = fmaxf(a, fabsf(v[k]));
            }
        for (int o = 1; o < 8; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        const float d = a > 0.f ? a / 127.f : 1.f;
        if (i < n) {
            char4 q;
            q.x = (s8)__float2int_rn(v[0] / d);
            q.y = (s8)__float2int_rn(v[1] / d);
            q.z = (s8)__float2int_rn(v[2] / d);
            q.w = (s8)__float2int_rn(v[3] / d);
            *(char4*)(xq + i) = q;
            if ((threadIdx.x & 7) == 0) xd[i / 32] = d;
            if (xf)
                for (int k = 0; k < 4; k++) xf[i + k] = v[k];
        }
    }
    __syncthreads();
}

// R rows' dots (a warp, np 16-value pieces each, up to 32 NPL) against their inputs; all loads
// first. row(k): the k-th row (null: none); off(k): where its input starts in xq (a multiple of
// 32). G: the rows are in global memory (loads past L1), else in shared memory.
template <bool G, bool W, int R, int NPL, typename RowF, typename OffF>
__device__ __forceinline__ void dots(RowF row, int np, const s8* xq, const float* xd, OffF off, float (&out)[R]) {
    const int lane = threadIdx.x & 31;
    if (W) {
        uint4 q[R][NPL];
        float d[R][NPL];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* rp = row(r);
#pragma unroll
            for (int j = 0; j < NPL; j++) {
                const int p = lane + 32 * j, b = p >> 1;
                if (p < np && rp) {
                    const u8* gp = rp + (i64)(b >> 2) * 144;
                    const u8* qp = gp + 16 + 32 * (b & 3) + 16 * (p & 1);
                    q[r][j] = G ? ldw16(qp) : *(const uint4*)qp;
                    d[r][j] = h2f(G ? ldw_u16(gp + 2 * (b & 3)) : *(const unsigned short*)(gp + 2 * (b & 3)));
                } else {
                    q[r][j] = make_uint4(0, 0, 0, 0);
                    d[r][j] = 0.f;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int o = off(r);
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < NPL; j++) {
                const int p = min(lane + 32 * j, np - 1);
                acc += (float)dot16(q[r][j], *(const uint4*)(xq + o + 16 * p)) * (d[r][j] * xd[(o >> 5) + (p >> 1)]);
            }
            out[r] = warp_sum(acc);
        }
    } else {
#pragma unroll
        for (int r = 0; r < R; r++) out[r] = 0.f;
    }
}

// W_uk rows (K = 128, 8 pieces): a warp takes 4 rows at once, 8 lanes a row; row r reads head
// r / 512's staged q_nope.
template <bool G, bool W>
__device__ __forceinline__ float dot_k128(const u8* row, int r, const s8* xq, const float* xd) {
    const int lane = threadIdx.x & 31, p = lane & 7, b = p >> 1;
    float acc = 0.f;
    if (W && row) {
        const u8* qp = row + 16 + 32 * b + 16 * (p & 1);
        const uint4 q = G ? ldw16(qp) : *(const uint4*)qp;
        const float d = h2f(G ? ldw_u16(row + 2 * b) : *(const unsigned short*)(row + 2 * b));
        const int h = r / LAT;
        acc = (float)dot16(q, *(const uint4*)(xq + h * NOPE + 16 * p)) * (d * xd[(h * NOPE + 16 * p) >> 5]);
    }
    for (int o = 1; o < 8; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

__device__ __forceinline__ void bulk(u8* dst, const u8* src, unsigned bytes, u64* mbar) {
    if (bytes)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
                     "l"(src), "r"(bytes), "r"(sa(mbar))
                     : "memory");
}

// Thread 0: layer lw's slices of block b into shared memory, slice i (q / kv_a, W_uk, W_uv, W_o,
// router) completing one phase of mbar[i], so that each phase waits for its own slice only.
__device__ void prefetch(const Layer& lw, u8* sm, const Smem& L, u64* mbar) {
    const int nb = gridDim.x, b = blockIdx.x;
    const int q0 = lo(QKV, b, nb), q1 = lo(QKV, b + 1, nb), a0 = lo(ABS, b, nb), a1 = lo(ABS, b + 1, nb);
    const int u0 = lo(UV, b, nb), u1 = lo(UV, b + 1, nb), o0 = lo(H, b, nb), o1 = lo(H, b + 1, nb);
    const int r0 = lo(NEXP * RCH, b, nb), r1 = lo(NEXP * RCH, b + 1, nb);
    const unsigned n[5] = {(unsigned)((q1 - q0) * rb(H)), (unsigned)((a1 - a0) * rb(NOPE)), (unsigned)((u1 - u0) * rb(LAT)),
                           (unsigned)((o1 - o0) * rb(H)), (unsigned)((r1 - r0) * 1024)};
    u8* dst[5] = {sm + L.qkv, sm + L.abs, sm + L.uv, sm + L.wo, sm + L.rt};
    const u8* src[5] = {lw.qkv + q0 * rb(H), lw.abs + a0 * rb(NOPE), lw.uv + u0 * rb(LAT), lw.wo + o0 * rb(H),
                        (const u8*)lw.router + (i64)r0 * 1024};
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    for (int i = 0; i < 5; i++) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(mbar + i)), "r"(n[i]) : "memory");
        bulk(dst[i], src[i], n[i], mbar + i);
    }
}

__device__ __forceinline__ void mbar_wait(u64* mbar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" ::"r"(sa(mbar)), "r"(parity)
        : "memory");
}

// Thread 0: block b's share of layer lw's shared experts (gate, up and down of experts ER and
// ER + 1: 19.5 MB a layer) asked into L2, for the gate/up and down phases after the attention.
__device__ void prefetch_shared_l2(const Layer& lw) {
    const int nb = gridDim.x, b = blockIdx.x;
    const i64 gu = (i64)ES * M * rb(H), dn = (i64)ES * H * rb(M);
    const i64 g0 = lo((int)(gu / 16), b, nb) * 16ll, g1 = lo((int)(gu / 16), b + 1, nb) * 16ll;
    const i64 d0 = lo((int)(dn / 16), b, nb) * 16ll, d1 = lo((int)(dn / 16), b + 1, nb) * 16ll;
    const u8* srcs[3] = {lw.gate + (i64)ER * M * rb(H) + g0, lw.up + (i64)ER * M * rb(H) + g0, lw.down + (i64)ER * H * rb(M) + d0};
    const unsigned n[3] = {(unsigned)(g1 - g0), (unsigned)(g1 - g0), (unsigned)(d1 - d0)};
    for (int k = 0; k < 3; k++)
        if (n[k]) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(srcs[k]), "r"(n[k]) : "memory");
}

template <bool PIPE, bool BAR, bool W, bool SHPF, bool LATE = false>
__global__ void __launch_bounds__(THREADS, 1) mega(const Layer* layers, const u8* head, Act a, int ctx) {
    extern __shared__ __align__(128) u8 sm[];
    const Smem L = smem_layout(gridDim.x);
    s8* xq = (s8*)(sm + L.xq);
    float* xd = (float*)(sm + L.xd);
    float* xf = (float*)(sm + L.xf);
    int* sel = (int*)(sm + L.sel);
    float* sw = (float*)(sm + L.sw);
    float* red = (float*)(sm + L.red);
    u64* mbar = (u64*)(sm + L.mbar);
    const int nb = gridDim.x, b = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gw = b * WARPS + warp, nw = nb * WARPS;
    constexpr bool G = !PIPE;  // where the first five phases read their weights
    if (PIPE && threadIdx.x == 0) {
        for (int i = 0; i < 5; i++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(mbar + i)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (PIPE && W && threadIdx.x == 0) prefetch(layers[0], sm, L, mbar);
    unsigned nbar = 0;
    for (int l = 0; l < NL; l++) {
        const Layer& lw = layers[l];
        const float* x = a.x + (i64)l * H;
        float* x2 = a.x2 + (i64)l * H;
        float* xn = a.x + (i64)(l + 1) * H;
        // qkv
        stage([&](int i) { return __ldcg(x + i); }, H, true, xq, xd, nullptr, red);
        if (SHPF && threadIdx.x == 0) prefetch_shared_l2(lw);
        if (LATE && W && threadIdx.x == 0 && l > 0) prefetch(lw, sm, L, mbar);
        if (PIPE && W) mbar_wait(mbar, l & 1);
        {
            const int r0 = lo(QKV, b, nb), r1 = lo(QKV, b + 1, nb);
            const u8* base = PIPE ? sm + L.qkv - r0 * rb(H) : lw.qkv;
            for (int r = r0 + warp * 2; r < r1; r += WARPS * 2) {
                float o[2];
                dots<G, W, 2, 4>([&](int k) { return r + k < r1 ? base + (r + k) * rb(H) : nullptr; }, 16, xq, xd,
                                 [](int) { return 0; }, o);
                if (lane == 0) {
                    a.y1[r] = o[0];
                    if (r + 1 < r1) a.y1[r + 1] = o[1];
                }
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // absorb
        stage([&](int i) { return __ldcg(a.y1 + (i / NOPE) * 192 + i % NOPE); }, NH * NOPE, false, xq, xd, nullptr, red);
        {
            const int r0 = lo(ABS, b, nb), r1 = lo(ABS, b + 1, nb);
            if (PIPE && W) mbar_wait(mbar + 1, l & 1);
            const u8* base = PIPE ? sm + L.abs - r0 * rb(NOPE) : lw.abs;
            for (int r4 = r0 + warp * 4; r4 < r1; r4 += WARPS * 4) {
                const int r = r4 + (lane >> 3);
                const float o = dot_k128<G, W>(r < r1 ? base + r * rb(NOPE) : nullptr, r, xq, xd);
                if ((lane & 7) == 0 && r < r1) a.y2[r] = o;
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // attend: block h * SPL + s, rows [s ctx / SPL, (s + 1) ctx / SPL) of the cache
        if (b < NH * SPL) {
            const int h = b / SPL, s = b % SPL, p0 = lo(ctx, s, SPL), p1 = lo(ctx, s + 1, SPL);
            float* q = xf;               // LAT
            float* sc = xf + LAT;        // scores, up to CTX_MAX / SPL
            q[threadIdx.x] = __ldcg(a.y2 + h * LAT + threadIdx.x);
            __syncthreads();
            for (int p = p0 + warp; p < p1; p += WARPS) {
                const __half* kr = lw.cache + (i64)p * 576;
                float acc = 0.f;
                for (int i = lane * 8; i < LAT; i += 256) {
                    const uint4 v = *(const uint4*)(kr + i);
                    const __half2* hv = (const __half2*)&v;
                    for (int k = 0; k < 4; k++) {
                        const float2 f = __half22float2(hv[k]);
                        acc += f.x * q[i + 2 * k] + f.y * q[i + 2 * k + 1];
                    }
                }
                acc = warp_sum(acc);
                if (lane == 0) sc[p - p0] = acc * 0.0625f;
            }
            __syncthreads();
            float m = -1e30f, sum = 0.f;
            for (int p = p0; p < p1; p++) m = fmaxf(m, sc[p - p0]);
            float o = 0.f;
            for (int p = p0; p < p1; p++) {
                const float e = __expf(sc[p - p0] - m);
                sum += e;
                o += e * __half2float(lw.cache[(i64)p * 576 + threadIdx.x]);
            }
            float* pr = a.part + (i64)b * (LAT + 2);
            pr[threadIdx.x] = o;
            if (threadIdx.x == 0) {
                pr[LAT] = m;
                pr[LAT + 1] = sum;
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // uv: a block's rows cover heads hA..hB; each head's splits merged as staged
        {
            const int r0 = lo(UV, b, nb), r1 = lo(UV, b + 1, nb), hA = r0 / NOPE, hB = (r1 - 1) / NOPE;
            // the splits' weights first (warp 0: 8 lanes a head), then 8 loads a value
            float* wts = xf;
            if (warp == 0) {
                const int h = hA + (lane >> 3), s = lane & 7;
                const bool on = h <= hB;
                const float* pr = a.part + (i64)(h * SPL + s) * (LAT + 2);
                const float m = on ? __ldcg(pr + LAT) : -1e30f, l = on ? __ldcg(pr + LAT + 1) : 0.f;
                float mx = m;
                for (int o = 1; o < 8; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float e = __expf(m - mx);
                float den = e * l;
                for (int o = 1; o < 8; o <<= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
                if (on && lane < 16) wts[lane] = den > 0.f ? e / den : 0.f;
            }
            __syncthreads();
            auto merged = [&](int i) {
                const int hh = i / LAT, k = i % LAT;
                const float* pr = a.part + (i64)(hA + hh) * SPL * (LAT + 2) + k;
                float v = 0.f;
#pragma unroll
                for (int s = 0; s < SPL; s++) v += wts[hh * SPL + s] * __ldcg(pr + s * (LAT + 2));
                return v;
            };
            stage(merged, (hB - hA + 1) * LAT, false, xq, xd, nullptr, red);
            if (PIPE && W) mbar_wait(mbar + 2, l & 1);
            const u8* base = PIPE ? sm + L.uv - r0 * rb(LAT) : lw.uv;
            for (int r = r0 + warp * 4; r < r1; r += WARPS * 4) {
                float o[4];
                dots<G, W, 4, 1>([&](int k) { return r + k < r1 ? base + (r + k) * rb(LAT) : nullptr; }, 32, xq, xd,
                                 [&](int k) { return (min(r + k, r1 - 1) / NOPE - hA) * LAT; }, o);
                if (lane == 0)
                    for (int k = 0; k < 4; k++)
                        if (r + k < r1) a.y4[r + k] = o[k];
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // wo, into the residual
        stage([&](int i) { return __ldcg(a.y4 + i); }, UV, false, xq, xd, nullptr, red);
        {
            const int r0 = lo(H, b, nb), r1 = lo(H, b + 1, nb);
            if (PIPE && W) mbar_wait(mbar + 3, l & 1);
            const u8* base = PIPE ? sm + L.wo - r0 * rb(H) : lw.wo;
            for (int r = r0 + warp * 2; r < r1; r += WARPS * 2) {
                float o[2];
                dots<G, W, 2, 4>([&](int k) { return r + k < r1 ? base + (r + k) * rb(H) : nullptr; }, 16, xq, xd,
                                 [](int) { return 0; }, o);
                if (lane == 0) {
                    x2[r] = __ldcg(x + r) + o[0];
                    if (r + 1 < r1) x2[r + 1] = __ldcg(x + r + 1) + o[1];
                }
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // router: the new residual's norm, kept (f32 and int8) for the gate/up
        stage([&](int i) { return __ldcg(x2 + i); }, H, true, xq, xd, xf, red);
        {
            const int u0 = lo(NEXP * RCH, b, nb), u1 = lo(NEXP * RCH, b + 1, nb);
            if (PIPE && W) mbar_wait(mbar + 4, l & 1);
            const float* base = PIPE ? (const float*)(sm + L.rt) - (i64)u0 * 256 : lw.router;
            for (int u = u0 + warp; u < u1; u += WARPS) {
                float acc = 0.f;
                if (W) {
                    const float* rr = base + (i64)u * 256 + lane * 8;
                    const float4 w0 = G ? __ldcg((const float4*)rr) : *(const float4*)rr;
                    const float4 w1 = G ? __ldcg((const float4*)rr + 1) : *((const float4*)rr + 1);
                    const float* xs = xf + (u % RCH) * 256 + lane * 8;
                    acc = w0.x * xs[0] + w0.y * xs[1] + w0.z * xs[2] + w0.w * xs[3] + w1.x * xs[4] + w1.y * xs[5] +
                          w1.z * xs[6] + w1.w * xs[7];
                }
                acc = warp_sum(acc);
                if (lane == 0) a.rp[u] = acc;
            }
        }
        gbar<BAR>(a.bar, nbar++);
        // gateup: the next layer's slices go into shared memory while the MoE streams
        if (PIPE && !LATE && W && threadIdx.x == 0 && l + 1 < NL) prefetch(layers[l + 1], sm, L, mbar);
        if (warp == 0) {
            float v0 = 0.f, v1 = 0.f;
            for (int c = 0; c < RCH; c++) {
                v0 += __ldcg(a.rp + lane * RCH + c);
                v1 += __ldcg(a.rp + (lane + 32) * RCH + c);
            }
            if (!(v0 == v0)) v0 = -1e30f;
            if (!(v1 == v1)) v1 = -1e30f;
            float mx = fmaxf(v0, v1);
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float e0 = __expf(v0 - mx), e1 = __expf(v1 - mx);
            const float den = warp_sum(e0 + e1);
            for (int k = 0; k < TOPK; k++) {
                float bv = fmaxf(e0, e1);
                int bi = e0 >= e1 ? lane : lane + 32;
                for (int o = 16; o; o >>= 1) {
                    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                    if (ov > bv || (ov == bv && oi < bi)) {
                        bv = ov;
                        bi = oi;
                    }
                }
                if (lane == 0) {
                    sel[ES + k] = bi % ER;
                    sw[ES + k] = bv / den;
                }
                if (bi == lane) e0 = -1.f;
                if (bi == lane + 32) e1 = -1.f;
            }
            if (lane < ES) {
                sel[lane] = ER + lane;
                sw[lane] = 1.f;
            }
        }
        __syncthreads();
        for (int u = gw; u < SLOTS * M; u += nw) {
            const int s = u / M, r = u % M;
            const i64 off = ((i64)sel[s] * M + r) * rb(H);
            float o[2];
            dots<true, W, 2, 4>([&](int k) { return (k ? lw.up : lw.gate) + off; }, 16, xq, xd, [](int) { return 0; }, o);
            if (lane == 0) a.glu[u] = o[0] / (1.f + __expf(-o[0])) * o[1];
        }
        gbar<BAR>(a.bar, nbar++);
        // down: the 8 slots' GLU quantised by every block, then a row (all slots) a warp
        stage([&](int i) { return __ldcg(a.glu + i); }, SLOTS * M, false, xq, xd, nullptr, red);
        for (int r = gw; r < H; r += nw) {
            float acc = 0.f;
            for (int s0 = 0; s0 < SLOTS; s0 += 4) {
                float o[4];
                dots<true, W, 4, 3>([&](int k) { return lw.down + ((i64)sel[s0 + k] * H + r) * rb(M); }, M / 16, xq, xd,
                                    [&](int k) { return (s0 + k) * M; }, o);
                for (int k = 0; k < 4; k++) acc += sw[s0 + k] * o[k];
            }
            if (lane == 0) xn[r] = __ldcg(x2 + r) + acc;
        }
        gbar<BAR>(a.bar, nbar++);
    }
    // the head (Q8_0, VOCAB rows) on the last layer's norm, two rows a warp, then the arg-max
    stage([&](int i) { return __ldcg(a.x + (i64)NL * H + i); }, H, true, xq, xd, nullptr, red);
    float bv = -1e30f;
    int bi = 0;
    for (int r = gw * 2; r < VOCAB; r += nw * 2) {
        float o[2];
        dots<true, W, 2, 4>([&](int k) { return head + (i64)(r + k) * rb(H); }, 16, xq, xd, [](int) { return 0; }, o);
        if (o[0] > bv) bv = o[0], bi = r;
        if (o[1] > bv) bv = o[1], bi = r + 1;
    }
    if (lane == 0) {
        red[warp] = bv;
        ((int*)red)[16 + warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < WARPS; w++)
            if (red[w] > bv) bv = red[w], bi = ((int*)red)[16 + w];
        a.best[2 * b] = bv;
        a.best[2 * b + 1] = __int_as_float(bi);
    }
    gbar<BAR>(a.bar, nbar++);
    if (b == 0 && warp == 0) {
        float v = -1e30f;
        int i = 0;
        for (int k = lane; k < nb; k += 32)
            if (__ldcg(a.best + 2 * k) > v) v = __ldcg(a.best + 2 * k), i = __float_as_int(__ldcg(a.best + 2 * k + 1));
        for (int o = 16; o; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
        }
        if (lane == 0) *a.token = i;
    }
}

// Q8_0 groups: 4 f16 scales in [0.5, 1.5) / 256 (8 bytes, then 8 zero bytes), 128 random quants.
__global__ void fill_q8(u8* p, i64 groups, unsigned seed) {
    for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < groups; g += (i64)gridDim.x * blockDim.x) {
        u8* gp = p + g * 144;
        unsigned h = (unsigned)g * 2654435761u ^ seed;
        for (int k = 0; k < 4; k++) {
            h = h * 1664525u + 1013904223u;
            ((__half*)gp)[k] = __float2half((0.5f + (h >> 8) * (1.f / 16777216.f)) / 256.f);
        }
        ((unsigned*)gp)[2] = ((unsigned*)gp)[3] = 0;
        for (int k = 4; k < 36; k++) {
            h = h * 1664525u + 1013904223u;
            ((unsigned*)gp)[k] = h;
        }
    }
}
__global__ void fill_f(float* p, i64 n, float amp, unsigned seed) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned h = ((unsigned)i * 2654435761u ^ seed) * 1664525u + 1013904223u;
        p[i] = amp * ((h >> 8) * (2.f / 16777216.f) - 1.f);
    }
}
__global__ void fill_h(__half* p, i64 n, unsigned seed) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned h = ((unsigned)i * 2654435761u ^ seed) * 1664525u + 1013904223u;
        p[i] = __float2half((h >> 8) * (2.f / 16777216.f) - 1.f);
    }
}

int main() {
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, 0));
    const int nb = pr.multiProcessorCount;
    if (nb < NH * SPL) {
        printf("megaprobe: needs at least %d SMs, the card has %d\n", NH * SPL, nb);
        return 1;
    }
    const Smem L = smem_layout(nb);
    printf("megaprobe: %s, %d SMs, L2 %d bytes; %d blocks x %d threads, %d bytes of shared memory a block (%d of "
           "them prefetched weights)\n",
           pr.name, nb, pr.l2CacheSize, nb, THREADS, L.total, L.w_end);
    const i64 b_qkv = QKV * rb(H), b_abs = ABS * rb(NOPE), b_uv = UV * rb(LAT), b_wo = H * rb(H);
    const i64 b_gu = (i64)EX * M * rb(H), b_dn = (i64)EX * H * rb(M), b_rt = (i64)NEXP * H * 4,
              b_ca = (i64)CTX_MAX * 576 * 2;
    const i64 q8 = b_qkv + b_abs + b_uv + b_wo + 2 * b_gu + b_dn;
    const double per_layer = (double)(b_qkv + b_abs + b_uv + b_wo + b_rt) + SLOTS * (2.0 * M * rb(H) + (double)H * rb(M));
    printf("a layer reads %.1f MB of weights (attention side %.1f MB, MoE %.1f MB); stored %.0f MB a layer\n",
           per_layer / 1e6, (b_qkv + b_abs + b_uv + b_wo + b_rt) / 1e6, SLOTS * (2.0 * M * rb(H) + (double)H * rb(M)) / 1e6,
           (q8 + b_rt + b_ca) / 1e6);
    std::vector<Layer> hl(NL);
    for (int l = 0; l < NL; l++) {
        u8* p;
        float* r;
        __half* c;
        CK(cudaMalloc(&p, q8));
        CK(cudaMalloc(&r, b_rt));
        CK(cudaMalloc(&c, b_ca));
        fill_q8<<<1024, 256>>>(p, q8 / 144, 0x9e3779b9u * (l + 1));
        fill_f<<<256, 256>>>(r, NEXP * H, 0.05f, 0x85ebca6bu * (l + 1));
        fill_h<<<256, 256>>>(c, (i64)CTX_MAX * 576, 0xc2b2ae35u * (l + 1));
        Layer& y = hl[l];
        y.qkv = p;
        y.abs = y.qkv + b_qkv;
        y.uv = y.abs + b_abs;
        y.wo = y.uv + b_uv;
        y.gate = y.wo + b_wo;
        y.up = y.gate + b_gu;
        y.down = y.up + b_gu;
        y.router = r;
        y.cache = c;
    }
    u8* head;
    const i64 b_head = (i64)VOCAB * rb(H);
    CK(cudaMalloc(&head, b_head));
    fill_q8<<<1024, 256>>>(head, b_head / 144, 0x27d4eb2fu);
    Layer* dl;
    CK(cudaMalloc(&dl, NL * sizeof(Layer)));
    CK(cudaMemcpy(dl, hl.data(), NL * sizeof(Layer), cudaMemcpyHostToDevice));
    Act a;
    CK(cudaMalloc(&a.x, (NL + 1) * H * 4));
    CK(cudaMalloc(&a.x2, NL * H * 4));
    CK(cudaMalloc(&a.y1, QKV * 4));
    CK(cudaMalloc(&a.y2, ABS * 4));
    CK(cudaMalloc(&a.part, NH * SPL * (LAT + 2) * 4));
    CK(cudaMalloc(&a.y4, UV * 4));
    CK(cudaMalloc(&a.rp, NEXP * RCH * 4));
    CK(cudaMalloc(&a.glu, SLOTS * M * 4));
    CK(cudaMalloc(&a.best, nb * 2 * 4));
    CK(cudaMalloc(&a.token, 4));
    CK(cudaMalloc(&a.bar, 4));
    fill_f<<<8, 256>>>(a.x, H, 1.f, 7u);
    CK(cudaDeviceSynchronize());

    struct Mode {
        const char* name;
        const void* fn;
    };
    const Mode modes[] = {
        {"chain", (const void*)mega<false, true, true, false>},
        {"pipe", (const void*)mega<true, true, true, false>},
        {"pipe2", (const void*)mega<true, true, true, true>},
        {"late", (const void*)mega<true, true, true, false, true>},
        {"bytes", (const void*)mega<true, false, true, false>},
        {"sync", (const void*)mega<false, true, false, false>},
    };
    for (const Mode& m : modes)
        CK(cudaFuncSetAttribute(m.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("%-6s %5s %10s %9s %9s %9s   (%d tokens a figure, median; us/layer: the token / %d)\n", "mode", "ctx",
           "us/token", "us/layer", "tok/s", "TB/s", REPS, NL);
    for (int ctx : {64, 512}) {
        for (int round = 0; round < 2; round++)
            for (const Mode& m : modes) {
                std::vector<float> t;
                for (int rep = 0; rep < REPS + 1; rep++) {
                    CK(cudaMemsetAsync(a.bar, 0, 4));
                    void* args[] = {(void*)&dl, (void*)&head, (void*)&a, (void*)&ctx};
                    CK(cudaEventRecord(e0));
                    CK(cudaLaunchCooperativeKernel(m.fn, dim3(nb), dim3(THREADS), args, L.total, 0));
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    if (rep > 0) t.push_back(ms * 1000.f);
                }
                std::sort(t.begin(), t.end());
                const float us = t[t.size() / 2];
                printf("%-6s %5d %10.1f %9.2f %9.1f %9.3f\n", m.name, ctx, us, us / NL, 1e6f / us,
                       (per_layer * NL + b_head) / us * 1e-6);
            }
    }
    float chk = 0.f;
    std::vector<float> hx(H);
    CK(cudaMemcpy(hx.data(), a.x + (i64)NL * H, H * 4, cudaMemcpyDeviceToHost));
    for (float v : hx) chk += v;
    int tok = -1;
    CK(cudaMemcpy(&tok, a.token, 4, cudaMemcpyDeviceToHost));
    printf("checksum of the last layer's output: %g (finite: %s); token %d\n", chk, chk == chk ? "yes" : "NO", tok);
    CK(cudaGetLastError());
    return 0;
}
