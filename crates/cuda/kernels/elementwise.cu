// Element-wise and row-wise ops over strided `Rows` views. Hand-written because each is a few
// lines and must address arbitrary (off, stride) views of one buffer, in place where the trait
// allows it; no library op takes these views. Indices are 64-bit: buffers can exceed 2^31.

// Index `idx` of a flattened [n, width] view -> element offset.
__device__ __forceinline__ i64 at(i64 idx, i64 width, i64 off, i64 stride) {
    return off + (idx / width) * stride + idx % width;
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w optional). One block per row. In place allowed:
// every thread reads its elements before the block-wide barrier and writes them after.
// Rows of up to NORM_PER * blockDim values (2,048 at 256 threads) stay in registers: the weights
// load before the PDL wait and all of a thread's activation loads are in flight at once (a
// strided loop waits one L2 round trip per element, several us on a 2,048-wide decode row). Same
// elements per thread, summed in the same order as the loop: the same bits.
extern "C" __global__ void rms_norm(const float* x, i64 xoff, i64 xstride, const float* w, int has_w, float eps,
                                    float* out, i64 ooff, i64 ostride, int width) {
    norm_block_row<false>(x + xoff + blockIdx.x * xstride, nullptr, nullptr, w, has_w, eps, out + ooff + blockIdx.x * ostride,
                          width);
}

extern "C" __global__ void add_rows(const float* a, i64 aoff, i64 astride, const float* b, i64 boff, i64 bstride,
                                    float* out, i64 ooff, i64 ostride, i64 width, i64 total) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        out[at(i, width, ooff, ostride)] = a[at(i, width, aoff, astride)] + b[at(i, width, boff, bstride)];
}

extern "C" __global__ void scale_rows(float* x, i64 off, i64 stride, i64 width, i64 total, float s) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        x[at(i, width, off, stride)] *= s;
}

extern "C" __global__ void softcap_rows(float* x, i64 off, i64 stride, i64 width, i64 total, float cap) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 j = at(i, width, off, stride);
        x[j] = cap * tanhf(x[j] / cap);
    }
}

extern "C" __global__ void copy_rows(const float* src, i64 soff, i64 sstride, float* dst, i64 doff, i64 dstride,
                                     i64 width, i64 total) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        dst[at(i, width, doff, dstride)] = src[at(i, width, soff, sstride)];
}

// The tiled copy of a stack of Q8_0 matrices in the device layout (CudaWeight::tiled; the host
// reference is backend/layout.rs's tile16): per matrix, per tile of 16 rows, per 144-byte group, 2,176
// bytes in mmq_q8_rows' load order (MMQ_TG in mmq.cu): 16-byte chunk c < 8 holds the 4 f16
// scales of rows c and c+8; chunk 8 + 32*bl + 4*g + t holds bytes 8t..8t+7 of block bl of rows g
// and g+8, word by word (row g's first 4 bytes, row g+8's, row g's next 4, row g+8's): the int8
// mma's A fragment {a0, a1, a2, a3} as one 16-byte load puts it in four registers, with no moves.
// Rows past `rows` are zeros. One thread per 16 bytes of the output.
extern "C" __global__ void tile16_q8(const u8* src, uint4* dst, i64 rows, i64 rows16, i64 ng, i64 total) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 j = i / 136;
        const int c = (int)(i - j * 136);
        const i64 gi = j % ng;
        j /= ng;
        const i64 tiles = rows16 / 16, tile = j % tiles, e = j / tiles;
        int r, o;  // row within the tile (of the first half), byte offset within the row's group
        if (c < 8) {
            r = c;
            o = 0;
        } else {
            const int q = c - 8, bl = q >> 5, lane = q & 31;
            r = lane >> 2;
            o = 16 + 32 * bl + 8 * (lane & 3);
        }
        const i64 ra = tile * 16 + r, rb = ra + 8, rowb = ng * 144;
        const u8* base = src + e * rows * rowb + gi * 144 + o;
        const uint2 a = ra < rows ? *(const uint2*)(base + ra * rowb) : make_uint2(0, 0);
        const uint2 b = rb < rows ? *(const uint2*)(base + rb * rowb) : make_uint2(0, 0);
        dst[i] = c < 8 ? make_uint4(a.x, a.y, b.x, b.y) : make_uint4(a.x, b.x, a.y, b.y);
    }
}

__device__ __forceinline__ float gelu_tanh(float x) {
    const float C = 0.7978846f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(C * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// out = act(gate) * up; kind 0 = SwiGLU, 1 = GELU-tanh. In place allowed (out == gate).
extern "C" __global__ void glu_rows(int kind, const float* g, i64 goff, i64 gstride, const float* u, i64 uoff,
                                    i64 ustride, float* out, i64 ooff, i64 ostride, i64 width, i64 total) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        float gv = g[at(i, width, goff, gstride)], uv = u[at(i, width, uoff, ustride)];
        out[at(i, width, ooff, ostride)] = (kind == 0 ? silu(gv) : gelu_tanh(gv)) * uv;
    }
}

// Rotary embedding in place. One thread per (row, pair); row r belongs to batch token
// r / heads_per_token, whose position is read from the device-resident batch.
// mode 0 = normal (2i, 2i+1), 1 = neox (i, i + dim/2).
extern "C" __global__ void rope_rows(float* x, i64 off, i64 stride, i64 nrows, int heads_per_token,
                                     const int* pos, const float* freqs, int half, int mode, float mscale) { PDL_ENTRY();
    i64 total = nrows * half;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        i64 r = idx / half;
        int i = (int)(idx % half);
        float p = (float)pos[r / heads_per_token];
        float s, c;
        sincosf(p * freqs[i], &s, &c);
        s *= mscale;
        c *= mscale;
        float* row = x + off + r * stride;
        int a = mode == 0 ? 2 * i : i, b = mode == 0 ? 2 * i + 1 : i + half;
        float x0 = row[a], x1 = row[b];
        row[a] = x0 * c - x1 * s;
        row[b] = x0 * s + x1 * c;
    }
}

// Row t of src -> cache row slot[t] * slot_len + pos[t]: cache_write, in fast.cu (templated on the
// cache element, beside the f16 cache helpers).

// out[t] = dequant(table[token[t]]) * scale. One block per token, one thread per 32-element chunk
// (float types: per element past the last whole chunk).
template <int T>
__device__ void embed_impl(const u8* table, i64 row_bytes, const int* tokens, float scale, float* out, i64 ooff,
                           i64 ostride, int dim) {
    const u8* row = table + (i64)tokens[blockIdx.x] * row_bytes;
    float* o = out + ooff + blockIdx.x * ostride;
    int nch = dim / 32;
    for (int c = threadIdx.x; c < nch; c += blockDim.x) {
        float y[32];
        dq_chunk<T>(row, c, y);
#pragma unroll
        for (int i = 0; i < 32; i++) o[32 * c + i] = y[i] * scale;
    }
    if constexpr (is_float_type(T)) {
        for (int i = nch * 32 + threadIdx.x; i < dim; i += blockDim.x) o[i] = dq_elem<T>(row, i) * scale;
    }
}
#define EMBED_INST(name, T)                                                                                  \
    extern "C" __global__ void embed_##name(const u8* table, i64 row_bytes, const int* tokens, float scale, \
                                            float* out, i64 ooff, i64 ostride, int dim) { PDL_ENTRY();                   \
        embed_impl<T>(table, row_bytes, tokens, scale, out, ooff, ostride, dim);                            \
    }
FOR_ALL_TYPES(EMBED_INST)

// Greedy pick per row (ts_core::argmax): the largest value under total order (so +0 > -0), NaN
// counting as -inf, ties to the lowest index. Each candidate is one 64-bit key,
// (value as an order-preserving u32) << 32 | (~index), so a plain max reduction picks the largest
// value and, among equals, the lowest index; the result is independent of the thread count.
__device__ __forceinline__ unsigned long long argmax_key(float v, unsigned i) {
    if (v != v) v = NEG_INF;
    unsigned b = __float_as_uint(v);
    unsigned k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((unsigned long long)k << 32) | (unsigned long long)(0xFFFFFFFFu - i);
}
// Two passes, so a row is read by many SMs (one block per row read a 102,400-wide logit row at
// one SM's bandwidth, ~38 us a decode token): argmax_part reduces `chunk` values per block to one
// key (grid: chunks x rows), argmax_final the row's keys (one warp per row). The max of keys is
// exact and order-free, so any split gives the same pick.
extern "C" __global__ void argmax_part(const float* x, i64 off, i64 stride, int width, int chunk,
                                       unsigned long long* part) { PDL_ENTRY();
    __shared__ unsigned long long sp[32];
    const float* xr = x + off + blockIdx.y * stride;
    const int lo = blockIdx.x * chunk, hi = min(width, lo + chunk);
    unsigned long long best = 0;  // below the key of every value (-inf's is 0x007fffff << 32)
    for (int i0 = lo + threadIdx.x; i0 < hi; i0 += 4 * blockDim.x) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = i0 + u * (int)blockDim.x < hi ? xr[i0 + u * blockDim.x] : 0.f;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + u * blockDim.x;
            if (i < hi) {
                unsigned long long k = argmax_key(v[u], (unsigned)i);
                best = k > best ? k : best;
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long v = __shfl_xor_sync(0xffffffffu, best, o);
        best = v > best ? v : best;
    }
    if ((threadIdx.x & 31) == 0) sp[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) best = sp[w] > best ? sp[w] : best;
        part[(i64)blockIdx.y * gridDim.x + blockIdx.x] = best;
    }
}
// host (non-null): the ids also into page-locked host memory mapped for the device (a queued
// arg-max, Backend::argmax_rows_queued: no copy on the stream after this kernel).
extern "C" __global__ void argmax_final(const unsigned long long* part, int nparts, int width, unsigned* out,
                                        unsigned* host) { PDL_ENTRY();
    const unsigned long long* pr = part + (i64)blockIdx.x * nparts;
    unsigned long long best = 0;
    for (int i = threadIdx.x; i < nparts; i += 32) best = pr[i] > best ? pr[i] : best;
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long v = __shfl_xor_sync(0xffffffffu, best, o);
        best = v > best ? v : best;
    }
    if (threadIdx.x == 0) {
        const unsigned id = width > 0 ? 0xFFFFFFFFu - (unsigned)(best & 0xFFFFFFFFu) : 0u;
        out[blockIdx.x] = id;
        if (host) host[blockIdx.x] = id;
    }
}

// One decode token's batch (Backend::upload_batch of one token, at most one output row) written
// by a kernel from its arguments, instead of an upload and, for a token that is the last
// arg-max's pick (ids non-null: ids[row]), a device copy: one launch in place of two copies on
// the stream between chained steps. It waits for the previous kernel before writing (that
// kernel may still read the batch).
// It lets the step's next kernel launch only once the batch is written and fenced, not at its
// entry: kernels that read the position before their PDL wait (mla_out_q8, mla_out_<t>,
// mla_split_tc_he) can then never see the last step's (ARCHITECTURE.md). Measured on the H200
// (gpu-next88): with graphs it costs nothing (tg128 709.3 / 709.1 against 709.7 / 709.1: the
// graph's launch waited for this kernel already); eager steps (TS_CUDA_GRAPHS=0, one run each)
// 626 against 675, the price of correct order by construction there.
extern "C" __global__ void batch_fill_1(int* mem, i64 mt, int token, int pos, int slot, int nout, int out0,
                                        const unsigned* ids, int row) {
    pdl_wait();
    if (threadIdx.x != 0) return;  // (an exited thread counts as triggered)
    mem[0] = ids ? (int)ids[row] : token;
    mem[mt] = pos;
    mem[2 * mt] = slot;
    if (nout > 0) mem[3 * mt] = out0;
    __threadfence();
    pdl_trigger();
}

// out row i = x row idx[i] (the batch's output rows, their indices uploaded with the batch). One
// block per output row.
extern "C" __global__ void gather_rows(const float* x, i64 xoff, i64 xstride, const int* idx, float* out, i64 ooff,
                                       i64 ostride, int width) { PDL_ENTRY();
    const float* src = x + xoff + (i64)idx[blockIdx.x] * xstride;
    float* dst = out + ooff + (i64)blockIdx.x * ostride;
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}
