// Shared device helpers for every turbospark kernel: integer types (NVRTC has no <stdint.h>),
// half/bfloat16 conversions (done by hand so no CUDA header is needed at run time), warp
// reductions, and the per-format dequantisation of one 32-element chunk of a weight row.
//
// Weight rows on the device are the file's ggml blocks, repacked once at upload so every block
// starts on a 4-byte boundary (see `repack` in src/weights.rs):
//   Q4_0 20 B  { f16 d; u16 pad; u8 qs[16] }
//   Q4_1 20 B  { f16 d; f16 m; u8 qs[16] }               (unchanged)
//   Q5_0 24 B  { f16 d; u16 pad; u8 qh[4]; u8 qs[16] }
//   Q5_1 24 B  { f16 d; f16 m; u8 qh[4]; u8 qs[16] }    (unchanged)
//   Q8_0 in groups of 4 blocks, 144 B { f16 d[4]; u8 pad[8]; i8 qs[4][32] }, each row padded to a
//        whole number of groups (pad blocks: d = 0, qs = 0), so rows and quants are 16-byte
//        aligned and the GEMV reads them with 16-byte loads (see gemv_q8 in matmul.cu)
//   Q4_K 144 B, Q5_K 176 B                               (unchanged)
//   Q6_K 212 B { u8 ql[128]; u8 qh[64]; i8 sc[16]; f16 d; u16 pad }
// so quants are read as aligned 32-bit words.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_BF16 30

// Every weight type, as (name, id): used to instantiate one extern "C" kernel per type.
#define FOR_ALL_TYPES(X) X(f32, T_F32) X(f16, T_F16) X(bf16, T_BF16) X(q4_0, T_Q4_0) X(q4_1, T_Q4_1) \
    X(q5_0, T_Q5_0) X(q5_1, T_Q5_1) X(q8_0, T_Q8_0) X(q4_k, T_Q4_K) X(q5_k, T_Q5_K) X(q6_k, T_Q6_K)

#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+; the host sets the launch attribute only there). Every
// kernel lets the next one be scheduled at once (`pdl_trigger`) and, before it touches memory
// another kernel writes (activations, cache, scratch) or writes anything, waits until the
// previous kernel has finished and its writes are visible (`pdl_wait`). Weights are never written
// by a kernel, so a kernel may load them before the wait: that is the overlap PDL buys. Every
// thread of every kernel must reach `pdl_wait` before its first such access, and before it
// exits, so that a kernel never completes before its predecessor (the next one relies on it).
// Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#ifdef TS_TRACE
// TS_CUDA_TRACE=1 (docs/GPU.md, "Where a decode token goes"): block (0,0,0) of every kernel
// records, by the global nanosecond timer, when it reached its wait for the previous kernel and
// when that wait returned (the previous kernel had ended), with its grid id. The host reads the
// records back and names them by launch order.
#define TS_TRACE_CAP (1 << 20)
__device__ unsigned long long ts_trace[3 * TS_TRACE_CAP];
__device__ unsigned int ts_trace_n;
#endif
// The global nanosecond timer (the trace's records).
__device__ __forceinline__ unsigned long long ts_gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// Loads meant to be issued before the wait go in a branch of their own: in one basic block with
// it, ptxas scheduled the wait (ACQBULK) above them (GU_SH_EARLY, fused.cu; static SASS).
__device__ __forceinline__ void pdl_wait() {
#ifdef TS_TRACE
    const unsigned long long t0 = ts_gtimer();
#endif
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef TS_TRACE
    if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0) {
        const unsigned long long t1 = ts_gtimer();
        unsigned long long g;
        asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
        const unsigned i = atomicAdd(&ts_trace_n, 1u);
        if (i < TS_TRACE_CAP) {
            ts_trace[3 * i] = g;
            ts_trace[3 * i + 1] = t0;
            ts_trace[3 * i + 2] = t1;
        }
    }
#endif
}
#define PDL_ENTRY() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// The decode products' weight loads (the Q8_0 MoE, fast.cu / fused.cu; the f16/bf16 MoE and
// GEMVs, matmul.cu / fused.cu): loads that do not allocate in L1 (weights are read once a
// token), so that the activation rows every warp of an SM re-reads stay in L1 whatever the SM's
// shared-memory carve-out left of it (Q8_0 MoE: tg128 634 -> 649, tg64 at 16k 454 -> 476 on the
// H200, gpu-next59). TS_WNA=0 (TS_CUDA_DEFINES, a measurement define): plain loads.
#ifndef TS_WNA
#define TS_WNA 1
#endif
// A 4-byte weight word past L1 (as ldw16).
__device__ __forceinline__ u32 ldw4(const u8* p) {
#if TS_WNA && __CUDA_ARCH__ >= 700
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
#else
    return *(const u32*)p;
#endif
}
__device__ __forceinline__ uint4 ldw16(const u8* p) {
#if TS_WNA && __CUDA_ARCH__ >= 700
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *(const uint4*)p;
#endif
}
__device__ __forceinline__ float ldw_scale(const u8* p) {
#if TS_WNA && __CUDA_ARCH__ >= 700
    unsigned short v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return h2f(v);
#else
    return h2f(*(const u16*)p);
#endif
}
__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }
// f32 -> bf16 bits, round to nearest even (NaN stays NaN).
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// 1/sqrt(sum/width + eps) from a block's per-thread partial sums `ss` (warp sums, then the first
// warp sums the warps' in order): the one reduction every RMS norm kernel uses, so fused and plain
// norms give the same bits. `part`: 32 floats of shared memory. Ends with a barrier.
__device__ __forceinline__ float block_rms_inv(float ss, float* part, int width, float eps) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
        v = warp_sum(v);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    return 1.0f / sqrtf(part[0] / (float)width + eps);
}
// Values per thread the norm kernels keep in registers (rows up to NORM_PER * blockDim wide: 2,048
// at 256 threads; wider rows take the strided loops). 8 keeps them near 50 registers, so prompt-size
// launches (a block per row) still fit several blocks per SM.
#define NORM_PER 8
// The register path of the RMS norm kernels (rows of width <= NORM_PER * blockDim; element
// tid + k * blockDim is a thread's k-th): its weights (1 past the row or without weights), loaded
// before the PDL wait; the sum of squares of its values, in order; the normalised stores.
__device__ __forceinline__ void norm_load_w(const float* w, int has_w, int width, float* wv) {
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        wv[k] = has_w && i < width ? w[i] : 1.f;
    }
}
__device__ __forceinline__ float norm_ss(const float* v, int width) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NORM_PER; k++)
        if (threadIdx.x + k * blockDim.x < width) ss += v[k] * v[k];
    return ss;
}
__device__ __forceinline__ void norm_store(const float* v, const float* wv, int has_w, float inv, int width, float* orow) {
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < width) {
            const float y = v[k] * inv;
            orow[i] = has_w ? y * wv[k] : y;
        }
    }
}
// One row through the register path after its weights are in wv: v = x (ADD: x + d, written
// back to x), the sum of squares, the normalised stores (rms_norm, add_rms_norm).
template <bool ADD>
__device__ __forceinline__ void norm_row(const float* xr, float* xw, const float* dr, const float* wv, int has_w,
                                         float eps, float* orow, int width, float* part) {
    const int bd = blockDim.x, tid = threadIdx.x;
    float v[NORM_PER];
#pragma unroll
    for (int k = 0; k < NORM_PER; k++) v[k] = tid + k * bd < width ? (ADD ? xr[tid + k * bd] + dr[tid + k * bd] : xr[tid + k * bd]) : 0.f;
    if (ADD) {
#pragma unroll
        for (int k = 0; k < NORM_PER; k++)
            if (tid + k * bd < width) xw[tid + k * bd] = v[k];
    }
    norm_store(v, wv, has_w, block_rms_inv(norm_ss(v, width), part, width, eps), width, orow);
}
// A whole rms_norm (ADD: add_rms_norm) row for one block: rows of up to NORM_PER * blockDim
// values through the register path above (weights before the PDL wait), wider ones through
// strided loops (the same elements per thread, summed in the same order). xr == xw with ADD.
template <bool ADD>
__device__ __forceinline__ void norm_block_row(const float* xr, float* xw, const float* dr, const float* w, int has_w,
                                               float eps, float* orow, int width) {
    __shared__ float part[32];
    const int bd = blockDim.x, tid = threadIdx.x;
    if (width <= NORM_PER * bd) {
        float wv[NORM_PER];
        norm_load_w(w, has_w, width, wv);
        PDL_ENTRY();
        norm_row<ADD>(xr, xw, dr, wv, has_w, eps, orow, width, part);
        return;
    }
    PDL_ENTRY();
    float ss = 0.f;
    for (int i = tid; i < width; i += bd) {
        const float v = ADD ? xr[i] + dr[i] : xr[i];
        if (ADD) xw[i] = v;
        ss += v * v;
    }
    const float inv = block_rms_inv(ss, part, width, eps);
    for (int i = tid; i < width; i += bd) {
        float v = xr[i] * inv;
        orow[i] = has_w ? v * w[i] : v;
    }
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__host__ __device__ constexpr bool is_float_type(int T) { return T == T_F32 || T == T_F16 || T == T_BF16; }

// Bytes of one repacked block and elements per block, per type.
__host__ __device__ constexpr int blk_bytes(int T) {
    return T == T_F32 ? 4 : T == T_F16 ? 2 : T == T_BF16 ? 2 : T == T_Q4_0 ? 20 : T == T_Q4_1 ? 20 :
           T == T_Q5_0 ? 24 : T == T_Q5_1 ? 24 : T == T_Q8_0 ? 144 : T == T_Q4_K ? 144 : T == T_Q5_K ? 176 : 212;
}
__host__ __device__ constexpr int blk_elems(int T) {
    return is_float_type(T) ? 1 : (T == T_Q4_K || T == T_Q5_K || T == T_Q6_K) ? 256 : 32;
}

// One element of a float-typed row (used for widths that are not a multiple of 32).
template <int T> __device__ __forceinline__ float dq_elem(const u8* row, i64 i) {
    if constexpr (T == T_F32) return ((const float*)row)[i];
    else if constexpr (T == T_F16) return h2f(((const u16*)row)[i]);
    else return bf2f(((const u16*)row)[i]);
}

__device__ __forceinline__ u32 ld32(const u8* p) { return *(const u32*)p; }

// ggml get_scale_min_k4: 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block.
__device__ __forceinline__ void scale_min_k4(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Dequantise elements [32c, 32c + 32) of a weight row into y (same order, same float math as
// the reference in ts-formats::quant).
template <int T> __device__ __forceinline__ void dq_chunk(const u8* row, int c, float* y) {
    if constexpr (T == T_F32) {
        const float* p = (const float*)row + 32 * (i64)c;
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = p[i];
    } else if constexpr (T == T_F16 || T == T_BF16) {
        // 16-bit loads: a row of an odd number of halves leaves the next row 2-byte aligned only.
        const u16* p = (const u16*)row + 32 * (i64)c;
#pragma unroll
        for (int i = 0; i < 32; i++) y[i] = T == T_F16 ? h2f(p[i]) : bf2f(p[i]);
    } else if constexpr (T == T_Q4_0 || T == T_Q4_1) {
        const u8* b = row + (i64)c * 20;
        float d = h2f(*(const u16*)b);
        float m = T == T_Q4_1 ? h2f(*(const u16*)(b + 2)) : 0.f;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 q = ld32(b + 4 + 4 * w);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int lo = (q >> (8 * k)) & 0xF, hi = (q >> (8 * k + 4)) & 0xF;
                if constexpr (T == T_Q4_0) { y[4 * w + k] = (float)(lo - 8) * d; y[4 * w + k + 16] = (float)(hi - 8) * d; }
                else { y[4 * w + k] = (float)lo * d + m; y[4 * w + k + 16] = (float)hi * d + m; }
            }
        }
    } else if constexpr (T == T_Q5_0 || T == T_Q5_1) {
        const u8* b = row + (i64)c * 24;
        float d = h2f(*(const u16*)b);
        float m = T == T_Q5_1 ? h2f(*(const u16*)(b + 2)) : 0.f;
        u32 qh = ld32(b + 4);
#pragma unroll
        for (int w = 0; w < 4; w++) {
            u32 q = ld32(b + 8 + 4 * w);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int j = 4 * w + k;
                int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                int lo = ((q >> (8 * k)) & 0xF) | h0, hi = ((q >> (8 * k + 4)) & 0xF) | h1;
                if constexpr (T == T_Q5_0) { y[j] = (float)(lo - 16) * d; y[j + 16] = (float)(hi - 16) * d; }
                else { y[j] = (float)lo * d + m; y[j + 16] = (float)hi * d + m; }
            }
        }
    } else if constexpr (T == T_Q8_0) {
        const u8* gp = row + (i64)(c >> 2) * 144;
        float d = h2f(((const u16*)gp)[c & 3]);
        const u8* b = gp + 16 + 32 * (c & 3);
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 q = ld32(b + 4 * w);
#pragma unroll
            for (int k = 0; k < 4; k++) y[4 * w + k] = (float)(i8)((q >> (8 * k)) & 0xFF) * d;
        }
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        const u8* b = row + (i64)(c >> 3) * blk_bytes(T);
        int s = c & 7;  // sub-block of 32 within the super-block
        float d = h2f(*(const u16*)b), dmin = h2f(*(const u16*)(b + 2));
        int sc, mn;
        scale_min_k4(s, b + 4, sc, mn);
        float d1 = d * (float)sc, m1 = dmin * (float)mn;
        const u8* qs = b + (T == T_Q4_K ? 16 : 48) + 32 * (s >> 1);
        int shift = (s & 1) * 4;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 q = ld32(qs + 4 * w);
            u32 hbits = 0;
            if constexpr (T == T_Q5_K) hbits = ld32(b + 16 + 4 * w);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int v = (q >> (8 * k + shift)) & 0xF;
                if constexpr (T == T_Q5_K) v += ((hbits >> (8 * k)) & (1u << s)) ? 16 : 0;
                y[4 * w + k] = d1 * (float)v - m1;
            }
        }
    } else {  // Q6_K
        const u8* b = row + (i64)(c >> 3) * 212;
        int s = c & 7;
        int n = s >> 2, sub = s & 3;
        float d = h2f(*(const u16*)(b + 208));
        const u8* ql = b + 64 * n + (sub & 1) * 32;
        const u8* qh = b + 128 + 32 * n;
        const i8* sc = (const i8*)(b + 192 + 8 * n + 2 * sub);
        int lshift = (sub >> 1) * 4, hshift = 2 * sub;
        float ds0 = d * (float)sc[0], ds1 = d * (float)sc[1];
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 q = ld32(ql + 4 * w), h = ld32(qh + 4 * w);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int v = (((q >> (8 * k + lshift)) & 0xF) | (((h >> (8 * k + hshift)) & 3) << 4)) - 32;
                y[4 * w + k] = (w < 4 ? ds0 : ds1) * (float)v;
            }
        }
    }
}

// ---- tensor-core helpers (sm_80+: cp.async, ldmatrix, mma.sync), for mmq.cu and mla_prefill.cu ----
#if __CUDA_ARCH__ >= 800
// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16(void* s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(s)), "l"(g));
}
// As cp_async16 to a shared-space address (smem_addr of the destination). A generic pointer
// costs a shared-window conversion at every copy (two S2R and a 64-bit add on sm_90).
__device__ __forceinline__ void cp_async16_s(u32 s, const void* g) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g));
}
// As cp_async16_s, copying only the first `bytes` (0 or 16) and zero-filling the rest.
__device__ __forceinline__ void cp_async16_zs(u32 s, const void* g, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(bytes));
}
// Ask L2 for the line holding p (no register written, nothing waited for).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// mbarriers in shared memory (the producer-warp kernels of mmq.cu): init with an arrival count,
// arrive, wait for the phase of the given parity to complete.
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 a, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n)); }
__device__ __forceinline__ void mbar_arrive(u32 a) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory"); }
// An arrival on the mbarrier at `a` once every cp.async this thread has issued so far has landed
// (the thread goes on at once; the barrier's count includes the arrival).
__device__ __forceinline__ void cp_async_arrive(u32 a) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 a, u32 parity) {
    asm volatile(
        "{\n.reg .pred p;\nMBW_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra MBW_%=;\n}\n" ::"r"(a),
        "r"(parity)
        : "memory");
}
#endif
// Four 8x8 b16 matrices (8 rows of 16 bytes each; lane l gives the shared-space address of row
// l % 8 of matrix l / 8), plain and transposed. Shared-space (smem_addr) addresses, not generic
// pointers: 32-bit address arithmetic and no window conversion at every load.
__device__ __forceinline__ void ldsm4_s(u32* r, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm4_ts(u32* r, u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// c += a * b: m16n8k32 int8 -> int32, and m16n8k16 f16 -> f32.
__device__ __forceinline__ void mma_s8(int* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16(float* c, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
// 16 bytes global -> shared on any card: cp.async where it has it (sm_80+), else a plain copy;
// with cp_commit_any / cp_wait_all_any (nothing below sm_80: the copies were plain).
__device__ __forceinline__ void cp16_any(void* s, const void* g) {
#if __CUDA_ARCH__ >= 800
    cp_async16(s, g);
#else
    *(uint4*)s = *(const uint4*)g;
#endif
}
__device__ __forceinline__ void cp_commit_any() {
#if __CUDA_ARCH__ >= 800
    cp_commit();
#endif
}
__device__ __forceinline__ void cp_wait_all_any() {
#if __CUDA_ARCH__ >= 800
    cp_async_wait_all();
#endif
}
