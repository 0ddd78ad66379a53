// Mixture-of-experts kernels. Hand-written because routing (softmax/sigmoid, group-limited top-k,
// renormalisation) must stay on the device (no host round trip between the router matmul and the
// experts), and because each token's experts are only known on the device, so the expert products
// read the expert index from device memory instead of being launched per expert from the host.

#define MOE_MAX_EXPERTS 512
#define MOE_MAX_GROUPS 64

// One thread per token: scores, eligible groups, top-k, weights. Mirrors ts_cpu::route exactly
// (ties go to the lower index; fewer than k eligible experts leave expert -1, weight 0).
extern "C" __global__ void moe_route(const float* logits, i64 loff, i64 lstride, int n, int E, int k, int gating,
                                     int norm_topk, float scale, int n_group, int topk_group, int* sel_e,
                                     float* sel_w) { PDL_ENTRY();
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* lg = logits + loff + (i64)t * lstride;
    float sc[MOE_MAX_EXPERTS];
    unsigned elig[MOE_MAX_EXPERTS / 32];
    if (gating == 0) {
        float mx = NEG_INF;
        for (int i = 0; i < E; i++) mx = fmaxf(mx, lg[i]);
        float sum = 0.f;
        for (int i = 0; i < E; i++) { sc[i] = expf(lg[i] - mx); sum += sc[i]; }
        float inv = 1.0f / sum;
        for (int i = 0; i < E; i++) sc[i] *= inv;
    } else {
        for (int i = 0; i < E; i++) sc[i] = 1.0f / (1.0f + expf(-lg[i]));
    }
    for (int i = 0; i < MOE_MAX_EXPERTS / 32; i++) elig[i] = 0xffffffffu;
    if (n_group > 1 && topk_group < n_group) {
        int gs = E / n_group;
        float gmax[MOE_MAX_GROUPS];
        for (int g = 0; g < n_group; g++) {
            float mx = NEG_INF;
            for (int i = g * gs; i < (g + 1) * gs; i++) mx = fmaxf(mx, sc[i]);
            gmax[g] = mx;
        }
        for (int g = 0; g < n_group; g++) {
            int rank = 0;
            for (int o = 0; o < n_group; o++)
                if (gmax[o] > gmax[g] || (gmax[o] == gmax[g] && o < g)) rank++;
            if (rank >= topk_group)
                for (int i = g * gs; i < (g + 1) * gs; i++) elig[i >> 5] &= ~(1u << (i & 31));
        }
    }
    float sum = 0.f;
    int got = 0;
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int i = 0; i < E; i++)
            if (((elig[i >> 5] >> (i & 31)) & 1u) && (best < 0 || sc[i] > sc[best])) best = i;
        if (best < 0) break;
        elig[best >> 5] &= ~(1u << (best & 31));
        sel_e[t * k + s] = best;
        sel_w[t * k + s] = sc[best];
        sum += sc[best];
        got++;
    }
    for (int s = got; s < k; s++) { sel_e[t * k + s] = -1; sel_w[t * k + s] = 0.f; }
    float inv = norm_topk ? 1.0f / (sum + 1e-20f) : 1.0f;
    for (int s = 0; s < got; s++) {
        float w = sel_w[t * k + s];
        if (norm_topk) w = w * inv;
        sel_w[t * k + s] = w * scale;
    }
}

// Group the (token, slot) pairs by expert: cnt[e], off[e] (exclusive prefix sum) and perm, the
// pair indices of expert e at perm[off[e] .. off[e] + cnt[e]). One block. Each of the ntok tokens
// has k routed slots (sel_e[t*k + j], -1: none) and then nsh shared slots, slot k + s going to
// expert E + s (the shared FFN's s-th chunk of ff rows): pair p = t*(k+nsh) + slot; E + nsh <=
// MOE_MAX_EXPERTS.
__device__ __forceinline__ int moe_pair_expert(const int* sel_e, int p, int k, int ks, int E) {
    const int t = p / ks, j = p - t * ks;
    return j < k ? sel_e[t * k + j] : E + (j - k);
}
// (The body, by one whole block.)
__device__ __forceinline__ void moe_group_body(const int* sel_e, int ntok, int k, int nsh, int E, int* cnt, int* off,
                                               int* perm) {
    __shared__ int c[MOE_MAX_EXPERTS], o[MOE_MAX_EXPERTS];
    const int ks = k + nsh, npairs = ntok * ks;
    E += nsh;  // the shared chunks count as experts from here on
    for (int e = threadIdx.x; e < E; e += blockDim.x) c[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        int e = moe_pair_expert(sel_e, p, k, ks, E - nsh);
        if (e >= 0) atomicAdd(&c[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int e = 0; e < E; e++) { o[e] = acc; acc += c[e]; }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) { cnt[e] = c[e]; off[e] = o[e]; c[e] = 0; }
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        int e = moe_pair_expert(sel_e, p, k, ks, E - nsh);
        if (e >= 0) perm[o[e] + atomicAdd(&c[e], 1)] = p;
    }
}
extern "C" __global__ void moe_group(const int* sel_e, int ntok, int k, int nsh, int E, int* cnt, int* off, int* perm) { PDL_ENTRY();
    moe_group_body(sel_e, ntok, k, nsh, E, cnt, off, perm);
}

// Decode-size expert product: block row y = pair p (token p / k, slot p % k); out row p =
// W[sel_e[p]] * in row (p / in_div). Warp per output row as in gemv. Pairs without an expert
// write zeros.
// VEC: the 16-byte vector row dot of gemv_h16 (matmul.cu) for f16/bf16 experts.
template <int T, bool VEC = false>
__device__ void moe_gemv_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,
                              const float* in, i64 ioff, i64 istride, int in_div, float* out, i64 ostride) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    if (row >= m) return;
    const int p = blockIdx.y;
    const int e = sel_e[p];
    float* o = out + (i64)p * ostride + row;
    if (e < 0) { if (lane == 0) *o = 0.f; return; }
    const u8* wr = W + e * mat_bytes + row * row_bytes;
    const float* xr = in + ioff + (i64)(p / in_div) * istride;
    float acc = 0.f;
    if constexpr (VEC) {
        h16_row_dot<T, 1>(wr, kdim, xr, 0, 1, &acc);
    } else {
        const int nch = kdim / 32;
        for (int c = lane; c < nch; c += 32) {
            float w[32];
            dq_chunk<T>(wr, c, w);
#pragma unroll
            for (int i = 0; i < 32; i++) acc += w[i] * xr[32 * c + i];
        }
        if constexpr (is_float_type(T))
            for (int i = nch * 32 + lane; i < kdim; i += 32) acc += dq_elem<T>(wr, i) * xr[i];
    }
    acc = warp_sum(acc);
    if (lane == 0) *o = acc;
}

// Prefill-size expert product, tokens grouped by expert: block (x, y, z) computes output rows
// [64x, 64x+64) for the pairs perm[off[z] + 64y ...] of expert z (blocks past the expert's count
// exit at once). Tiles of 64 pairs x 64 outputs x 32 inputs in shared memory, 4x4 per thread.
#define MT 64
template <int T>
__device__ void moe_gemm_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* cnt,
                              const int* off, const int* perm, const float* in, i64 ioff, i64 istride, int in_div,
                              float* out, i64 ostride) {
    __shared__ float Xs[MT][33];
    __shared__ float Ws[MT][33];
    __shared__ int pr[MT];
    const int e = blockIdx.z;
    const int count = cnt[e];
    const int r0 = blockIdx.y * MT;
    if (r0 >= count) return;
    const int o0 = blockIdx.x * MT;
    const int tid = threadIdx.x;
    if (tid < MT) pr[tid] = r0 + tid < count ? perm[off[e] + r0 + tid] : -1;
    const u8* We = W + e * mat_bytes;
    const int ty = tid / 16, tx = tid % 16;
    float acc[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) acc[a][b] = 0.f;
    __syncthreads();
    for (int k0 = 0; k0 < kdim; k0 += 32) {
        // weights: 64 rows x 32 inputs
        if constexpr (is_float_type(T)) {
            for (int idx = tid; idx < MT * 32; idx += blockDim.x) {
                int r = idx / 32, c = idx % 32;
                Ws[r][c] = (o0 + r < m && k0 + c < kdim) ? dq_elem<T>(We + (i64)(o0 + r) * row_bytes, k0 + c) : 0.f;
            }
        } else {
            if (tid < MT) {
                float y[32];
                if (o0 + tid < m) dq_chunk<T>(We + (i64)(o0 + tid) * row_bytes, k0 / 32, y);
                else {
#pragma unroll
                    for (int i = 0; i < 32; i++) y[i] = 0.f;
                }
#pragma unroll
                for (int i = 0; i < 32; i++) Ws[tid][i] = y[i];
            }
        }
        // activations: 64 pairs x 32 inputs
        for (int idx = tid; idx < MT * 32; idx += blockDim.x) {
            int r = idx / 32, c = idx % 32;
            int p = pr[r];
            Xs[r][c] = (p >= 0 && k0 + c < kdim) ? in[ioff + (i64)(p / in_div) * istride + k0 + c] : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int c = 0; c < 32; c++) {
            float xa[4], wb[4];
#pragma unroll
            for (int a = 0; a < 4; a++) xa[a] = Xs[ty * 4 + a][c];
#pragma unroll
            for (int b = 0; b < 4; b++) wb[b] = Ws[tx + 16 * b][c];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) acc[a][b] += xa[a] * wb[b];
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        int p = pr[ty * 4 + a];
        if (p < 0) continue;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int o = o0 + tx + 16 * b;
            if (o < m) out[(i64)p * ostride + o] = acc[a][b];
        }
    }
}

#define MOE_INST(name, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                              \
        moe_gemv_##name(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,          \
                        const float* in, i64 ioff, i64 istride, int in_div, float* out, i64 ostride) { PDL_ENTRY();         \
        moe_gemv_impl<T>(W, row_bytes, mat_bytes, m, kdim, sel_e, in, ioff, istride, in_div, out, ostride);    \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                                          \
        moe_gemm_##name(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* cnt,            \
                        const int* off, const int* perm, const float* in, i64 ioff, i64 istride, int in_div,   \
                        float* out, i64 ostride) { PDL_ENTRY();                                                             \
        moe_gemm_impl<T>(W, row_bytes, mat_bytes, m, kdim, cnt, off, perm, in, ioff, istride, in_div, out,     \
                         ostride);                                                                             \
    }
FOR_ALL_TYPES(MOE_INST)

// moe_gemv for 16-bit float experts with 16-byte aligned rows of a multiple of 8 values (and
// 16-byte aligned f32 inputs): the vector loads of gemv_h16 (matmul.cu).
#define MOE_H16(name, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                              \
        moe_gemv_h16_##name(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int kdim, const int* sel_e,      \
                            const float* in, i64 ioff, i64 istride, int in_div, float* out, i64 ostride) { PDL_ENTRY(); \
        moe_gemv_impl<T, true>(W, row_bytes, mat_bytes, m, kdim, sel_e, in, ioff, istride, in_div, out, ostride); \
    }
MOE_H16(f16, T_F16)
MOE_H16(bf16, T_BF16)

// out[t] = sum_j w[t*k+j] * y[t*ks+j] over the k routed slots with an expert, then plus
// y[t*ks+j] for the shared slots k <= j < ks (moe_group's pairs). Overwrites every element.
// add (or null): add_n rows of width a token added last, in order (the shared FFN's rows from
// another launch: CudaBackend::shared_blas's, add_n 1).
// Element i of token t's sum (moe_combine's body).
__device__ __forceinline__ float moe_comb_elem(const float* y, int k, int ks, i64 width, const int* sel_e,
                                               const float* sel_w, const float* add, int add_n, i64 t, i64 i) {
    float s = 0.f;
    for (int j = 0; j < k; j++) {
        i64 q = t * k + j;
        if (sel_e[q] >= 0) s += sel_w[q] * y[(t * ks + j) * width + i];
    }
    for (int j = k; j < ks; j++) s += y[(t * ks + j) * width + i];
    if (add)
        for (int j = 0; j < add_n; j++) s += add[(t * add_n + j) * width + i];
    return s;
}
extern "C" __global__ void moe_combine(const float* y, int k, int ks, i64 width, i64 ntok, const int* sel_e,
                                       const float* sel_w, float* out, i64 ooff, i64 ostride, const float* add,
                                       int add_n) { PDL_ENTRY();
    i64 total = ntok * width;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        i64 t = idx / width, i = idx % width;
        out[ooff + t * ostride + i] = moe_comb_elem(y, k, ks, width, sel_e, sel_w, add, add_n, t, i);
    }
}
