// Matmul kernels. Hand-written because cuBLAS cannot read ggml block formats:
//  * gemv_<type>_<N>: decode-size products (N <= 8 tokens) straight from the quantised weights.
//    One warp per output row; each lane dequantises whole 32-element chunks (aligned 32-bit loads
//    of the repacked blocks) and multiplies them with the f32 activations of up to N tokens, so
//    each weight byte is read once for all N tokens. blockIdx.z selects the matrix of a 3-D
//    weight (grouped matmul), blockIdx.y the tile of N tokens.
//  * dequant_bf16_<type>: weight matrix -> bf16 scratch for cuBLAS (prefill-size products).
//  * rows_to_bf16: a strided activation view -> packed bf16 rows for cuBLAS.

#define GEMV_WARPS 4

template <int T, int N> __device__ void h16_row_dot(const u8* wr, int k, const float* xb, i64 xstride, int nj, float* acc);

// VEC: the row dot of the 16-bit vector kernels (h16_row_dot below) instead of whole chunks.
template <int T, int N, bool VEC = false>
__device__ void gemv_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const float* x, i64 xoff,
                          i64 xstride, i64 xgstride, float* out, i64 ooff, i64 ostride, i64 ogstride, int n) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * GEMV_WARPS + warp;
    if (row >= m) return;
    const int g = blockIdx.z;
    const int tok0 = blockIdx.y * N;
    const u8* wr = W + g * mat_bytes + row * row_bytes;
    const float* xb = x + xoff + g * xgstride + tok0 * xstride;
    float acc[N];
#pragma unroll
    for (int j = 0; j < N; j++) acc[j] = 0.f;
    if constexpr (VEC) {
        h16_row_dot<T, N>(wr, k, xb, xstride, min(N, n - tok0), acc);
    } else {
    const int nch = k / 32;
    for (int c = lane; c < nch; c += 32) {
        float w[32];
        dq_chunk<T>(wr, c, w);
#pragma unroll
        for (int j = 0; j < N; j++) {
            if (tok0 + j < n) {
                const float* xr = xb + j * xstride + 32 * c;
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < 32; i++) s += w[i] * xr[i];
                acc[j] += s;
            }
        }
    }
    if constexpr (is_float_type(T)) {
        for (int i = nch * 32 + lane; i < k; i += 32) {
            float w = dq_elem<T>(wr, i);
#pragma unroll
            for (int j = 0; j < N; j++)
                if (tok0 + j < n) acc[j] += w * xb[j * xstride + i];
        }
    }
    }
#pragma unroll
    for (int j = 0; j < N; j++) {
        float s = warp_sum(acc[j]);
        if (lane == 0 && tok0 + j < n) out[ooff + g * ogstride + (i64)(tok0 + j) * ostride + row] = s;
    }
}

#define GEMV_INST_N(name, T, N)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_##name##_##N(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const float* x, i64 xoff,  \
                          i64 xstride, i64 xgstride, float* out, i64 ooff, i64 ostride, i64 ogstride, int n) { PDL_ENTRY(); \
        gemv_impl<T, N>(W, row_bytes, mat_bytes, m, k, x, xoff, xstride, xgstride, out, ooff, ostride,       \
                        ogstride, n);                                                                         \
    }
#define GEMV_INST(name, T) GEMV_INST_N(name, T, 1) GEMV_INST_N(name, T, 4) GEMV_INST_N(name, T, 8)
FOR_ALL_TYPES(GEMV_INST)

// 16-bit float weights (f16, bf16) whose rows start 16-byte aligned and hold a multiple of 8
// values: the generic kernel above reads them 2 bytes per load with lanes 64 bytes apart (Nsight-
// free estimate from the bf16 V2-Lite decode: ~250 GB/s). Here lane l reads 16-byte pieces
// l, l+32, l+64, l+96 of the row at once (a warp covers 1,024 contiguous values per step, four
// loads in flight per lane), with the f32 activations as float4 pairs (they must be 16-byte
// aligned too: `off` and `stride` multiples of 4). Same products in f32, summed in a different
// order than the generic kernel.
__device__ __forceinline__ void h16_unpack(int T, uint4 v, float* w) {
    const u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (T == T_BF16) {
            w[2 * i] = __uint_as_float(q[i] << 16);
            w[2 * i + 1] = __uint_as_float(q[i] & 0xffff0000u);
        } else {
            w[2 * i] = h2f((u16)(q[i] & 0xffffu));
            w[2 * i + 1] = h2f((u16)(q[i] >> 16));
        }
    }
}

// acc[j] += row . x_j over the row's k values (k % 8 == 0), for the tokens j < nj of x.
template <int T, int N>
__device__ void h16_row_dot(const u8* wr, int k, const float* xb, i64 xstride, int nj, float* acc) {
    const int lane = threadIdx.x & 31;
    const int n8 = k >> 3;
    for (int c0 = lane; c0 < n8; c0 += 128) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c0 + 32 * u;
            v[u] = c < n8 ? ldw16(wr + (i64)c * 16) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int c = c0 + 32 * u;
            if (c >= n8) break;
            float w[8];
            h16_unpack(T, v[u], w);
#pragma unroll
            for (int j = 0; j < N; j++) {
                if (j < nj) {
                    const float4 a = *(const float4*)(xb + j * xstride + 8 * c);
                    const float4 b = *(const float4*)(xb + j * xstride + 8 * c + 4);
                    acc[j] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
                              w[7] * b.w;
                }
            }
        }
    }
}

#define GEMV_H16_N(name, T, N)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                             \
        gemv_h16_##name##_##N(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const float* x, i64 xoff, \
                              i64 xstride, i64 xgstride, float* out, i64 ooff, i64 ostride, i64 ogstride, int n) { PDL_ENTRY(); \
        gemv_impl<T, N, true>(W, row_bytes, mat_bytes, m, k, x, xoff, xstride, xgstride, out, ooff, ostride, \
                              ogstride, n);                                                                   \
    }
GEMV_H16_N(f16, T_F16, 1) GEMV_H16_N(f16, T_F16, 4) GEMV_H16_N(f16, T_F16, 8)
GEMV_H16_N(bf16, T_BF16, 1) GEMV_H16_N(bf16, T_BF16, 4) GEMV_H16_N(bf16, T_BF16, 8)

// rows x k weight (rows of row_bytes) -> packed bf16 [rows, k].
template <int T> __device__ void dequant_bf16_impl(const u8* W, i64 row_bytes, i64 rows, int k, u16* out) {
    const int cpr = (k + 31) / 32;
    const i64 total = rows * cpr;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        i64 r = idx / cpr;
        int c = (int)(idx % cpr);
        const u8* row = W + r * row_bytes;
        u16* o = out + r * k + 32 * c;
        if (32 * c + 32 <= k) {
            float y[32];
            dq_chunk<T>(row, c, y);
            if ((k & 1) == 0) {
#pragma unroll
                for (int i = 0; i < 32; i += 2) *(u32*)(o + i) = (u32)f2bf(y[i]) | ((u32)f2bf(y[i + 1]) << 16);
            } else {
#pragma unroll
                for (int i = 0; i < 32; i++) o[i] = f2bf(y[i]);
            }
        } else if constexpr (is_float_type(T)) {
            for (int i = 32 * c; i < k; i++) out[r * k + i] = f2bf(dq_elem<T>(row, i));
        }
    }
}
#define DQ_INST(name, T)                                                                                     \
    extern "C" __global__ void dequant_bf16_##name(const u8* W, i64 row_bytes, i64 rows, int k, u16* out) { PDL_ENTRY(); \
        dequant_bf16_impl<T>(W, row_bytes, rows, k, out);                                                   \
    }
FOR_ALL_TYPES(DQ_INST)

extern "C" __global__ void rows_to_bf16(const float* x, i64 off, i64 stride, i64 width, i64 total, u16* out) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        out[i] = f2bf(x[off + (i / width) * stride + i % width]);
}
