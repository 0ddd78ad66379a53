// Prompt-size MLA attention on the f16 tensor cores (mma.sync m16n8k16, f32 accumulate), after
// FlashAttention-2 and FlashMLA. Hand-written: absorbed MLA is multi-query attention with a
// 576-wide key and a 512-wide value read from the same latent cache row, a shape no library
// kernel takes, and the causal mask comes from the device-resident batch positions.
//
// A "row group" is 16 heads of one token (one m16 tile: n_heads must be a multiple of 16). A block
// takes MP_RG = 4 consecutive row groups (4 tokens of a 16-head model) and walks the keys of its
// slot in tiles of 32, once for all its rows, so every key tile read from the cache serves 64
// query rows. Two warps per row group: for each key tile, warp h of a group computes the scores of
// keys [16h, 16h+16) over all 576 dims and writes them to shared memory; both warps then run the
// same online softmax over the 32 scores of each row (so they agree on the running max and sum)
// and each accumulates its half (256 values) of the 512-wide output in registers.
// Queries, keys and probabilities are rounded to f16 (11 significant bits: 8x closer to the f32
// reference than bf16; activations here are far inside its range, and outliers saturate) in
// shared memory, rows padded to 584 values (1168 B, so the 8 rows of an ldmatrix phase fall in
// different banks); scores, softmax and outputs are f32.
//
// Every token of the batch must read the same slot (the host checks; otherwise the per-token
// kernel runs): prefill of one sequence.

// The online softmax without branches around its exps (mla_softmax_tile); the same bits. On by
// default since gpu-next80 (tg64 at 16k 503.7 against 487.5, pp2048 43,110 against 41,108);
// TS_CUDA_DEFINES=MLA_SM_BRANCHLESS=0 restores the branches.
#ifndef MLA_SM_BRANCHLESS
#define MLA_SM_BRANCHLESS 1
#endif
// The prompt kernels' output rows stored two floats a store where aligned; the same values. On
// by default since gpu-next83 (pp2048 44,529 against 44,018, pp512 32,561 against 32,379);
// TS_CUDA_DEFINES=MP_ST2=0 is the old way.
#ifndef MP_ST2
#define MP_ST2 1
#endif
// The MLA tensor-core kernels read their ldmatrix fragments from shared-space addresses, each
// fragment's row address computed once and the dim steps as constant offsets; the score loop's
// step count is known at compile time (qk_scores), and the split kernels copy key tiles by a
// thread map whose addresses are constant offsets (no division by the row's 72 pieces). The
// generic pointers cost a window conversion and 64-bit adds at every ldmatrix, a runtime loop
// bound a branch and a WARPSYNC a step, the copies a division and 64-bit products each. Static
// SASS (sm_90a): mla_split_tc_hb 2,680 -> 1,792 instructions, mla_split_tc_he 3,176 -> 2,024;
// the prompt kernels' tile loops 793 -> 659. The same bits. Measured against the generic form
// (MLA_LDSM_S, fifty-eighth session, H100, gpu-next193): tg64 at 16k 487.7 -> 496.1 (+1.7%),
// 64 sequences 8,189 / 8,183 -> 8,240 / 8,233 (+0.6%), pp2048 41,695 -> 43,224 (+3.7%),
// pp512 +0.5-0.9%, tg128 -0.1 to -0.5% (634.2 / 634.5 against 633.5 / 631.5); same hashes.
#define MP_RG 4
#define MP_W 576
#define MP_V 512
#define MP_LD 584
#define MP_KT 32
#define MP_THREADS (MP_RG * 64)

#if __CUDA_ARCH__ >= 800
// Two values as f16 (round to nearest), clamped to the f16 range so that an outlier saturates
// instead of becoming inf.
__device__ __forceinline__ u32 pack_h(float lo, float hi) {
    lo = fminf(fmaxf(lo, -65504.f), 65504.f);
    hi = fminf(fmaxf(hi, -65504.f), 65504.f);
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}

// Four cache values as loaded (f32: a float4, f16: their bits) and as two packed f16 words: loads
// first, conversions after, so the loads of a tile are in flight together.
template <typename C> struct CacheRaw;
template <> struct CacheRaw<float> { typedef float4 T; };
template <> struct CacheRaw<u16> { typedef uint2 T; };
__device__ __forceinline__ float4 cache_raw(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ uint2 cache_raw(const u16* p) { return *(const uint2*)p; }
__device__ __forceinline__ uint2 raw_h4(float4 v) { return make_uint2(pack_h(v.x, v.y), pack_h(v.z, v.w)); }
__device__ __forceinline__ uint2 raw_h4(uint2 v) { return v; }

// NT m16n8 f32 accumulator tiles (keys c0 + [0, 8 NT)) of scores into S (rows of ld floats): a
// thread holds rows g and g+8, columns 2t and 2t+1 of each tile.
template <int NT = 2>
__device__ __forceinline__ void store_scores(float* S, int ld, int c0, int g, int t, const float (*s)[4]) {
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int c = c0 + j * 8 + 2 * t;
        S[g * ld + c] = s[j][0];
        S[g * ld + c + 1] = s[j][1];
        S[(g + 8) * ld + c] = s[j][2];
        S[(g + 8) * ld + c + 1] = s[j][3];
    }
}

// s (NT m16n8 f32 tiles) = Q K^T over the NK dim steps of 16 from kk0 for 16 query rows at Q and
// 8 NT keys at K (rows of MP_LD halves), U steps unrolled: Q and K as shared-space addresses
// with the steps as constant offsets, no runtime bound.
template <int NK, int U, int NT = 2>
__device__ __forceinline__ void qk_scores(float (*s)[4], const u16* Q, const u16* K, int kk0, int li, int lr) {
    const u32 qa = smem_addr(Q + ((li & 1) * 8 + lr) * MP_LD + kk0 + (li >> 1) * 8);
    const u32 ka = smem_addr(K + ((li >> 1) * 8 + lr) * MP_LD + kk0 + (li & 1) * 8);
#pragma unroll U
    for (int st = 0; st < NK; st++) {
        u32 a[4];
        ldsm4_s(a, qa + 32 * st);
#pragma unroll
        for (int h = 0; h < NT / 2; h++) {
            u32 b[4];
            ldsm4_s(b, ka + 2 * h * 16 * MP_LD + 32 * st);
            mma_f16(s[2 * h], a, b);
            mma_f16(s[2 * h + 1], a, b + 2);
        }
    }
}

// The scaled scores this thread holds for the online softmax of a 32-key tile (columns
// {8i + 2t, 8i + 2t + 1 : i < 4} of rows g and g+8, the A-fragment layout of P), -inf from
// column `valid` on, into p0 / p1 with their maxima mx0 / mx1. S: rows of ld floats; a score is
// the sum of NS blocks of S, sstride floats apart (a split over dims), in order.
// (NI groups of 8 columns: 4 for a 32-key tile, 8 for a 64-key one; p0 / p1 hold 2 NI.)
template <int NS, int NI = 4>
__device__ __forceinline__ void gather_scores(const float* S, int ld, int sstride, int g, int t, int valid, float scale,
                                              float* p0, float* p1, float& mx0, float& mx1) {
    mx0 = NEG_INF;
    mx1 = NEG_INF;
#pragma unroll
    for (int i = 0; i < NI; i++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int c = 8 * i + 2 * t + e;
            const bool ok = c < valid;
            float a0 = S[g * ld + c], a1 = S[(g + 8) * ld + c];
#pragma unroll
            for (int b = 1; b < NS; b++) {
                a0 += S[b * sstride + g * ld + c];
                a1 += S[b * sstride + (g + 8) * ld + c];
            }
            const float v0 = ok ? a0 * scale : NEG_INF;
            const float v1 = ok ? a1 * scale : NEG_INF;
            p0[2 * i + e] = v0;
            p1[2 * i + e] = v1;
            mx0 = fmaxf(mx0, v0);
            mx1 = fmaxf(mx1, v1);
        }
}

// o[2j], o[2j+1] (j < NJ) += P V for a 32-key tile: P as two k16 A fragments, V the tile's rows
// in shared memory from column V (rows of MP_LD halves), 16 columns per j, read transposed.
// (KS k16 fragments of P: 2 for a 32-key tile, 4 for a 64-key one.)
template <int NJ, int KS = 2>
__device__ __forceinline__ void pv_accumulate(float (*o)[4], const u32 (*pa)[4], const u16* V, int li, int lr) {
    const u32 va = smem_addr(V + ((li & 1) * 8 + lr) * MP_LD + (li >> 1) * 8);
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            u32 b[4];
            ldsm4_ts(b, va + 2 * (ks * 16 * MP_LD + j * 16));
            mma_f16(o[2 * j], pa[ks], b);
            mma_f16(o[2 * j + 1], pa[ks], b + 2);
        }
}

// One online-softmax step over a 32-key tile for rows g and g+8, of which a thread holds columns
// {8i + 2t, 8i + 2t + 1 : i < 4} (the A-fragment layout of P): p0/p1 hold the scaled, masked
// scores (-inf where masked) and the thread's maxima mx0/mx1 of them; they come back as the
// probabilities. m, l: the rows' running max and sum; o: NO n8 output tiles, rescaled; pa: P as
// two k16 A fragments (f16). A row with no key yet (max -inf) keeps zeros: no exp of -inf - -inf.
// (NP probabilities a row a thread: 8 for a 32-key tile, 16 for a 64-key one; pa: NP / 4
// fragments.)
template <int NO, int NP = 8>
__device__ __forceinline__ void mla_softmax_tile(float* p0, float* p1, float mx0, float mx1, float& m0, float& m1,
                                                 float& l0, float& l1, float (*o)[4], u32 (*pa)[4]) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
#if MLA_SM_BRANCHLESS
    // A row with no key yet (n = -inf) subtracts 0 instead: its exps are then exp(-inf) = 0, as
    // the zeros the branches below give, and its c 0 where they give 1, which only multiplies
    // that row's zero sum and outputs: the same results, without a branch around each exp (the
    // compiler keeps 18 of them, each exp's latency exposed, on every warp's chain).
    const float b0 = n0 == NEG_INF ? 0.f : n0, b1 = n1 == NEG_INF ? 0.f : n1;
    const float c0 = expf(m0 - b0), c1 = expf(m1 - b1);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int i = 0; i < NP; i++) {
        p0[i] = expf(p0[i] - b0);
        p1[i] = expf(p1[i] - b1);
        s0 += p0[i];
        s1 += p1[i];
    }
#else
    const float c0 = n0 == NEG_INF ? 1.f : expf(m0 - n0), c1 = n1 == NEG_INF ? 1.f : expf(m1 - n1);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int i = 0; i < NP; i++) {
        p0[i] = n0 == NEG_INF ? 0.f : expf(p0[i] - n0);
        p1[i] = n1 == NEG_INF ? 0.f : expf(p1[i] - n1);
        s0 += p0[i];
        s1 += p1[i];
    }
#endif
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    l0 = l0 * c0 + s0;
    l1 = l1 * c1 + s1;
    m0 = n0;
    m1 = n1;
#pragma unroll
    for (int i = 0; i < NO; i++) {
        o[i][0] *= c0;
        o[i][1] *= c0;
        o[i][2] *= c1;
        o[i][3] *= c1;
    }
#pragma unroll
    for (int ks = 0; ks < NP / 4; ks++) {
        pa[ks][0] = pack_h(p0[4 * ks], p0[4 * ks + 1]);
        pa[ks][1] = pack_h(p1[4 * ks], p1[4 * ks + 1]);
        pa[ks][2] = pack_h(p0[4 * ks + 2], p0[4 * ks + 3]);
        pa[ks][3] = pack_h(p1[4 * ks + 2], p1[4 * ks + 3]);
    }
}
#endif

// q: token t, head h at q + qoff + t*q_tok + h*q_head (576 values: absorbed nope ; rope).
// cache: rows of 576 f32 or f16 (C); token t reads rows slot[0]*slot_len + [0, pos[t]].
// out: token t, head h at out + ooff + t*o_tok + h*o_head (512 values).
// ASYNC (f16 caches only): the key tiles stream through two shared buffers by cp.async, the
// next tile's copies in flight while one is used (otherwise every thread loads a tile into
// registers and stores it between two barriers, and no load overlaps the multiplies). The same
// f16 bits land in shared memory either way, so the same results.
template <typename C, bool ASYNC>
__device__ __forceinline__ void mla_prefill_impl(const float* q, i64 qoff, i64 q_tok, i64 q_head, const C* cache,
                                                 const int* pos, const int* slot, int slot_len, int n, int nh,
                                                 float scale, float* out, i64 ooff, i64 o_tok, i64 o_head) {
#if __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) u8 mp_sm[];
    u16* Qs = (u16*)mp_sm;                           // [MP_RG*16][MP_LD]
    static_assert(!ASYNC || sizeof(C) == 2, "cp.async copies f16 cache rows as they are");
    constexpr int NKB = ASYNC ? 2 : 1;                // key tile buffers
    u16* Ks = Qs + MP_RG * 16 * MP_LD;               // [NKB][MP_KT][MP_LD]
    float* Ss = (float*)(Ks + NKB * MP_KT * MP_LD);  // [MP_RG][16][MP_KT]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int hg = nh >> 4;                          // row groups per token
    const int n_rg = n * hg;
    const int rg0 = blockIdx.x * MP_RG;
    // Queries -> bf16 shared rows (row r = 16*(rg - rg0) + head in group).
    for (int idx = tid; idx < MP_RG * 16 * (MP_W / 4); idx += MP_THREADS) {
        const int r = idx / (MP_W / 4), c4 = idx - r * (MP_W / 4);
        const int rg = rg0 + (r >> 4);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rg < n_rg) {
            const int tok = rg / hg, h = (rg - tok * hg) * 16 + (r & 15);
            v = *(const float4*)(q + qoff + (i64)tok * q_tok + (i64)h * q_head + 4 * c4);
        }
        u32* d = (u32*)(Qs + r * MP_LD + 4 * c4);
        d[0] = pack_h(v.x, v.y);
        d[1] = pack_h(v.z, v.w);
    }
    // Key range of the block: up to the largest position among its tokens.
    int kmax = -1;
    for (int i = 0; i < MP_RG; i++) {
        const int rg = rg0 + i;
        if (rg < n_rg) kmax = max(kmax, pos[rg / hg]);
    }
    const i64 base = (i64)slot[0] * slot_len;
    const int my_rg = rg0 + (warp >> 1), half = warp & 1;
    const bool active = my_rg < n_rg;
    const int my_pos = active ? pos[my_rg / hg] : -1;
    float o[32][4];
#pragma unroll
    for (int i = 0; i < 32; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // rows g and g+8
    const u16* Qw = Qs + (warp >> 1) * 16 * MP_LD;
    float* Sw = Ss + (warp >> 1) * 16 * MP_KT;
    const int lr = lane & 7, li = lane >> 3;
    // Tile k0 (rows past kmax zero) into key buffer b: cp.async (ASYNC, one commit group per
    // tile, empty past the last) or loads and stores.
    const u32 ks_sm = ASYNC ? smem_addr(Ks) : 0u;
    auto fill = [&](int kk0, int b) {
        if constexpr (ASYNC) {
            if (kk0 <= kmax) {
                for (int idx = tid; idx < MP_KT * (MP_W / 8); idx += MP_THREADS) {
                    const int r = idx / (MP_W / 8), c8 = idx - r * (MP_W / 8);
                    const bool in = kk0 + r <= kmax;
                    cp_async16_zs(ks_sm + (u32)(((b * MP_KT + r) * MP_LD + 8 * c8) * 2),
                                  cache + (base + (in ? kk0 + r : kk0)) * MP_W + 8 * c8, in ? 16 : 0);
                }
            }
            cp_commit();
        } else {
            for (int idx = tid; idx < MP_KT * (MP_W / 4); idx += MP_THREADS) {
                const int r = idx / (MP_W / 4), c4 = idx - r * (MP_W / 4);
                uint2 h = make_uint2(0u, 0u);
                if (kk0 + r <= kmax) h = raw_h4(cache_raw(cache + (base + kk0 + r) * MP_W + 4 * c4));
                u32* d = (u32*)(Ks + (b * MP_KT + r) * MP_LD + 4 * c4);
                d[0] = h.x;
                d[1] = h.y;
            }
        }
    };
    if constexpr (ASYNC) fill(0, 0);
    int it = 0;
    for (int k0 = 0; k0 <= kmax; k0 += MP_KT, ++it) {
        __syncthreads();  // the previous tile's buffer and Ss are no longer read
        const int b = ASYNC ? (it & 1) : 0;
        if constexpr (ASYNC) {
            fill(k0 + MP_KT, b ^ 1);  // into the buffer the previous tile used
            cp_wait<1>();             // this tile's copies (the next tile's may still fly)
        } else {
            fill(k0, 0);
        }
        __syncthreads();
        const u16* Kt = Ks + b * MP_KT * MP_LD;
        // Scores of keys [k0 + 16*half, +16) for this warp's 16 rows: two n8 tiles.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        qk_scores<MP_W / 16, 4>(s, Qw, Kt + half * 16 * MP_LD, 0, li, lr);
        store_scores(Sw, MP_KT, half * 16, g, t, s);
        __syncthreads();
        // Online softmax over the tile's 32 keys (those up to this row group's position).
        float p0[8], p1[8], mx0, mx1;
        gather_scores<1>(Sw, MP_KT, 0, g, t, my_pos - k0 + 1, scale, p0, p1, mx0, mx1);
        // P (16 x 32) as two k16 A fragments.
        u32 pa[2][4];
        mla_softmax_tile<32>(p0, p1, mx0, mx1, m0, m1, l0, l1, o, pa);
        // O[:, 256*half + (0..256)] += P V: V rows are the tile's keys (first 512 values).
        pv_accumulate<16>(o, pa, Kt + half * 256, li, lr);
    }
    if (!active) return;
    const int tok = my_rg / hg, h0 = (my_rg - tok * hg) * 16;
    const float i0 = l0 > 0.f ? 1.0f / l0 : 0.f, i1 = l1 > 0.f ? 1.0f / l1 : 0.f;
    float* r0 = out + ooff + (i64)tok * o_tok + (i64)(h0 + g) * o_head + half * 256;
    float* r1 = r0 + 8 * o_head;
#if MP_ST2
    // Two floats a store where the rows are 8-byte aligned (the offsets even; c is): the same
    // values (MP_ST2, as the split kernels' MS_ST2).
    if (((ooff | o_tok | o_head) & 1) == 0) {
#pragma unroll
        for (int i = 0; i < 32; i++) {
            const int c = 8 * i + 2 * t;
            *(float2*)(r0 + c) = make_float2(o[i][0] * i0, o[i][1] * i0);
            *(float2*)(r1 + c) = make_float2(o[i][2] * i1, o[i][3] * i1);
        }
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < 32; i++) {
        const int c = 8 * i + 2 * t;
        r0[c] = o[i][0] * i0;
        r0[c + 1] = o[i][1] * i0;
        r1[c] = o[i][2] * i1;
        r1[c + 1] = o[i][3] * i1;
    }
#endif
}
#define MLA_PREFILL_INST(NAME, C, ASYNC)                                                                     \
    extern "C" __global__ void __launch_bounds__(MP_THREADS)                                                    \
        NAME(const float* q, i64 qoff, i64 q_tok, i64 q_head, const C* cache, const int* pos, const int* slot,  \
             int slot_len, int n, int nh, float scale, float* out, i64 ooff, i64 o_tok, i64 o_head) {           \
        PDL_ENTRY();                                                                                            \
        mla_prefill_impl<C, ASYNC>(q, qoff, q_tok, q_head, cache, pos, slot, slot_len, n, nh, scale, out, ooff,  \
                                   o_tok, o_head);                                                              \
    }
MLA_PREFILL_INST(mla_prefill, float, false)
MLA_PREFILL_INST(mla_prefill_h, u16, false)
// Key tiles through two cp.async buffers (the default where the 37 KB more shared memory fit;
// TS_CUDA_MLA_PFA=0 takes mla_prefill_h).
MLA_PREFILL_INST(mla_prefill_ha, u16, true)

// ---- MLA decode split over the context on the f16 tensor cores (flash-decoding) -----------------
// mla_split's job (fast.cu: the context [0, pos+1) of token t cut into gridDim.x runs of whole
// MLA_T tiles, the same chunking, so mla_combine merges the partials unchanged) for one row group
// of 16 heads: block (s, t*hg + rg). Four warps: the scores of a 32-key tile split by keys (16 per
// warp pair) and by dims (288 per warp pair; the two partial sums meet in shared memory), the
// online softmax run identically by every warp over the 32 scores of each row (as mla_prefill), and
// the output split by value columns (128 per warp). Queries, keys and probabilities in f16 as in
// mla_prefill; scores, softmax and the partial outputs in f32. Writes per (token, split, head)
// the running max, sum and unnormalised output, as mla_split. Any head count that is a multiple
// of 16 (V2-Lite's 16, V2's 128); the SIMT kernel reads every latent row from shared memory once
// per head pair, this one once per 16 heads, through the MMA units.
// MS_T: keys a tile. 64-key tiles (a ring of 2, 177 KB; half the barriers and softmax passes a
// key) were measured in gpu-next87: tg64 at 16k 443.2 against 539.4, and removed.
#define MS_T 32
#define MS_THREADS 128
#define MS_LU 18
#ifndef MS_NB
#define MS_NB 3  // an f16 cache's key tiles in the cp.async ring (backend/mod.rs MS_NB, TS_CUDA_MS_NB)
#endif
// The batch kernel's ring (`mla_split_tc_hb`, Path::SplitBatch; backend/mod.rs MS_NB_B,
// TS_CUDA_MS_NB_B): at 3 tiles a block takes 133 KB and one block fits an SM, so the 256 blocks
// of 64 sequences in 4 splits ran in two waves (23 us a layer in the server's trace,
// gpu-next114); at 2 (96 KB) two fit and they run in one. A batch's split holds a few tiles.
#ifndef MS_NB_B
#define MS_NB_B 2
#endif
// KFIRST (the batch kernel; a measurement define, MS_KFIRST=0 to drop it): the first NB key
// tiles go out right after the wait, before the query's loads, so their trips overlap (the
// single-token kernels issue theirs after the query is in shared memory); each later tile is
// issued into the buffer its tile-NB predecessor just left. The same copies, the same bits.
#ifndef MS_KFIRST
#define MS_KFIRST 1
#endif
// Floats a row of the split kernels' score buffer (16 rows of MS_T scores a dim half). At 32,
// the 8 lanes of an m16n8 fragment that share a column (rows g = 0..7) hit one bank: 8-way
// conflicts on every score store (store_scores) and read (gather_scores). 36 or 40 leave 2-way
// ones; the same values, so the same bits. 40 by default since gpu-next80 (16k 492.6 against
// 487.5 alone); a measurement define (TS_CUDA_DEFINES=MS_SLD=n, 32 to MS_SLD_MAX, which
// backend/mod.rs allots).
#ifndef MS_SLD
#define MS_SLD (MS_T + 8)
#endif
#define MS_SLD_MAX (MS_T + 8)
// Dim steps of the split kernels' score loop unrolled (18 steps of 16 a warp): with one warp a
// scheduler, a fuller unroll lets the shared-memory fragment loads run ahead of the multiplies.
// The same multiplies in the same order: the same bits. A measurement define
// (TS_CUDA_DEFINES=MS_QK_U=n, n dividing 18). 18 by default since gpu-next80 (16k 515.5 against
// 510.1 at 2 and 497.5 at 6, with the two defines above).
#ifndef MS_QK_U
#define MS_QK_U 18
#endif
static_assert(MS_SLD >= MS_T && MS_SLD <= MS_SLD_MAX, "MS_SLD: MS_T..=MS_T + 8");
// MS_ST2: the split kernels' partial rows stored two floats a store (full 32-byte sectors where
// single floats at stride 2 fill half of each). The same values. On by default since gpu-next82
// (tg64 at 16k 538.1 against 514.6 / 515.3, the same hash); TS_CUDA_DEFINES=MS_ST2=0 is the old
// way.
#ifndef MS_ST2
#define MS_ST2 1
#endif
// A split's partial rows (the thread's fragment o of the 16 rows' 512 values; m / l of rows g
// and g + 8) at rows (16 of them, ld floats apart): m and l at [0] and [1] (warp 0's lanes that
// hold them), the values from [voff]. voff is even and the rows 8-byte aligned: two floats a
// store (MS_ST2; full 32-byte sectors where single floats at stride 2 fill half of each).
// HP (Path::HalfParts, mla_split_tc_hep): the values divided by the row's l and stored as f16
// pairs (one u32 a pair, from float [voff] on: half the bytes), for mo_merge<true>.
template <bool HP = false>
__device__ __forceinline__ void ms_store_partial(const float (&o)[16][4], float m0, float m1, float l0, float l1,
                                                 float* rows, int ld, int voff) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    float* r0 = rows + g * ld;
    float* r1 = r0 + 8 * ld;
    if (warp == 0 && t4 == 0) {
        r0[0] = m0;
        r0[1] = l0;
        r1[0] = m1;
        r1[1] = l1;
    }
#if __CUDA_ARCH__ >= 800  // (pack_h: sm_80 on, as every caller)
    if constexpr (HP) {
        // (l >= 1 for a split with keys: its largest score contributes exp(0).)
        const float i0 = 1.0f / l0, i1 = 1.0f / l1;
        u32* h0 = (u32*)(r0 + voff);
        u32* h1 = (u32*)(r1 + voff);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int c = warp * 64 + 4 * i + t4;  // the pair of values warp * 128 + 8i + 2 t4
            h0[c] = pack_h(o[i][0] * i0, o[i][1] * i0);
            h1[c] = pack_h(o[i][2] * i1, o[i][3] * i1);
        }
        return;
    }
#endif
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int c = voff + warp * 128 + 8 * i + 2 * t4;
#if MS_ST2
        *(float2*)(r0 + c) = make_float2(o[i][0], o[i][1]);
        *(float2*)(r1 + c) = make_float2(o[i][2], o[i][3]);
#else
        r0[c] = o[i][0];
        r0[c + 1] = o[i][1];
        r1[c] = o[i][2];
        r1[c + 1] = o[i][3];
#endif
    }
}

// EARLY (an f16 cache only; Path::SplitEarly): the kernel has triggered its dependents but not
// waited for the previous kernel; it reads the token's position and slot and issues its first
// NB - 1 key tiles before the wait where none of their rows is the token's own (written by the
// previous kernel, the rope's): the first tiles' trip from memory overlaps the previous kernel's
// tail. The position and slot may still be the last step's there (batch_fill_1 writes them at
// the step's start, and a chain of kernels that trigger at entry can start before it has), so
// after the wait they are read again past L1 and, where either differs, the early copies are
// drained and the tiles issued anew. The same copies into the same buffers in the same commit
// groups: the same bits. One token a launch (the host's rule): in a batch, another token of the
// same sequence has its row written by the same previous kernel, and only the block's own
// token's row is kept out of the early tiles.
template <typename C, bool EARLY, int NBT, bool KFIRST, bool HP = false>
__device__ __forceinline__ void mla_split_tc_impl(const float* q, i64 qoff, i64 q_tok, i64 q_head, const C* cache,
                                                  const int* pos, const int* slot, int slot_len, int nh, float scale,
                                                  float* part) {
#if __CUDA_ARCH__ >= 800
    // An f16 cache's key tiles are copied (cp.async, two buffers), an f32 cache's are loaded and
    // rounded by the threads (one buffer).
    constexpr bool F16 = sizeof(C) == 2;
    constexpr int NB = F16 ? NBT : 1;
    static_assert(!KFIRST || (F16 && !EARLY), "KFIRST: the f16 cache's batch kernel");
    extern __shared__ __align__(16) u8 ms_sm[];
    u16* Qs = (u16*)ms_sm;                         // [16][MP_LD]
    u16* Kb = Qs + 16 * MP_LD;                     // NB x [MS_T][MP_LD]
    float* Ss = (float*)(Kb + NB * MS_T * MP_LD);  // [2 dim halves][16][MS_SLD]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int hg = nh >> 4;
    const int tok = blockIdx.y / hg, h0 = (blockIdx.y - tok * hg) * 16;
    const int sp = blockIdx.x, nsp = gridDim.x;
    const int stride = HP ? MP_V / 2 + 2 : MP_V + 2;  // floats a partial row (HP: m, l, 256 f16 pairs)
    float* prow = part + (((i64)tok * nsp + sp) * nh + h0) * stride;  // head h0 + r at prow + r*stride
    // This split's keys [j0, j1) of the context [0, end), and the slot's first cache row.
    int end = 0, sl = 0, j0 = 0, j1 = 0;
    i64 base = 0;
    auto place = [&](int p, int s) {
        end = p + 1;
        sl = s;
        const int chunk = ((end + nsp - 1) / nsp + MLA_T - 1) / MLA_T * MLA_T;
        j0 = sp * chunk;
        j1 = min(end, j0 + chunk);
        base = (i64)sl * slot_len;
    };
    place(pos[tok], slot[tok]);
    // An f16 cache's tiles go straight to shared memory (cp.async, 16 bytes a copy, 72 a row;
    // rows past j1 zero-filled), a ring of NB buffers: the next
    // NB - 1 tiles stream in while one is used. One commit group per tile slot, empty past
    // the last tile, so that waiting for all but NB - 1 groups always means tile `it` landed.
    // (Bulk copies of a row each, on the ring slot's mbarrier, were measured in gpu-next82 and
    // gpu-next88: +0.2% and -0.1%; removed.)
    // (Warp w copies the tile's rows 8w..8w+7, lane l their 16-byte pieces l, l + 32
    // and, for l < 8, l + 64, so that every address is a constant offset from the thread's
    // first, with no division; the same bytes to the same places. Rows past j1 are zero-filled
    // from row k0, which exists.)
    static_assert(MS_T == 32 && MS_THREADS == 128 && MP_W == 576, "the copy's thread map: 4 warps x 8 rows, 72 pieces a row");
    const u32 cp_s0 = smem_addr(Kb) + 2 * (8 * warp * MP_LD) + 16 * lane;
    auto issue = [&](int it) {
        const int k0 = j0 + it * MS_T;
        if (k0 < j1) {
            const u32 d = cp_s0 + (it % NB) * (2 * MS_T * MP_LD);
            const C* tb = cache + (base + k0) * MP_W;
            const C* s0 = tb + 8 * warp * MP_W + 8 * lane;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const bool in = k0 + 8 * warp + i < j1;
                const C* src = in ? s0 + i * MP_W : tb + 8 * lane;
#pragma unroll
                for (int c = 0; c < 3; c++)
                    if (c < 2 || lane < 8) cp_async16_zs(d + 2 * i * MP_LD + 512 * c, src + 256 * c, in ? 16 : 0);
            }
        }
        cp_commit();
    };
    // The first tiles before the wait (EARLY) where the token's own row (end - 1) is not in them;
    // after it, the position and slot again (past L1; their loads in flight with the query's),
    // and the tiles anew if either moved.
    static_assert(!EARLY || F16, "the early kernel reads an f16 cache");
    bool issued = false;
    int p2 = 0, s2 = 0;
    if constexpr (EARLY) {
        if (j0 < j1 && j0 + (NB - 1) * MS_T <= end - 1) {
#pragma unroll
            for (int it = 0; it < NB - 1; it++) issue(it);
            issued = true;
        }
        pdl_wait();
        p2 = __ldcg(pos + tok);
        s2 = __ldcg(slot + tok);
    } else if (j0 >= j1) {
        if (tid < 16) {
            prow[tid * stride] = NEG_INF;
            prow[tid * stride + 1] = 0.f;
        }
        return;
    }
    if constexpr (KFIRST) {
#pragma unroll
        for (int it = 0; it < NB; it++) issue(it);
    }
    // All 18 of a thread's query loads in flight before any is converted: one trip to L2 after
    // the wait instead of the five the compiler's unroll by 4 left (gpu-next87 / 88: tg64 at 16k
    // 545.8 / 546.6 against 539.4 / 539.2 / 538.5, the same hash). Thread t holds row t / 8,
    // float4 columns t % 8 + 8u, so that every load and store is a constant offset from the
    // thread's first: the map by idx = t + 128u divided by the row's 144 float4 at each u and
    // took 64-bit products, ~560 instructions a warp after the wait where this takes ~220
    // (static SASS, mla_split_tc_he: 2,024 -> 1,696). The same values to the same places.
    // Measured on an H100 (fifty-eighth session, gpu-next199): 16k 487.9 / 488.2 against 487.0
    // / 488.0, 64 sequences 8,062.7 against 8,057.2, the same hashes: within the noise, kept as
    // the simpler form.
    {
        static_assert(16 * (MP_W / 4) == 18 * MS_THREADS, "the query: 18 float4 a thread");
        float4 v[18];
        static_assert(MS_THREADS == 16 * 8 && MP_W / 4 == 18 * 8, "the query's map: 8 threads a row");
        const int qr = tid >> 3, qc = tid & 7;
        const float* qp = q + qoff + (i64)tok * q_tok + (i64)(h0 + qr) * q_head + 4 * qc;
#pragma unroll
        for (int u = 0; u < 18; u++) v[u] = *(const float4*)(qp + 32 * u);
        u32* d = (u32*)(Qs + qr * MP_LD + 4 * qc);
#pragma unroll
        for (int u = 0; u < 18; u++) {
            d[16 * u] = pack_h(v[u].x, v[u].y);
            d[16 * u + 1] = pack_h(v[u].z, v[u].w);
        }
    }
    if constexpr (EARLY) {
        if (p2 + 1 != end || s2 != sl) {
            if (issued) cp_wait<0>();
            issued = false;
            place(p2, s2);
        }
        if (j0 >= j1) {
            if (tid < 16) {
                prow[tid * stride] = NEG_INF;
                prow[tid * stride + 1] = 0.f;
            }
            return;
        }
    }
    const int kh = warp & 1, dh = warp >> 1;  // scores: keys [16kh, +16) over dims [288dh, +288)
    const int lr = lane & 7, li = lane >> 3;
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // rows g and g+8
    // One MS_T-key tile in shared memory (K, first key k0): the scores, the online softmax, P.V.
    // A warp pair's keys: [kh * MS_T / 2, +MS_T / 2), in MS_T / 16 m16n8 tiles a warp.
    constexpr int NT = MS_T / 16;
    auto tile = [&](const u16* Ks, int k0) {
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        qk_scores<MP_W / 32, MS_QK_U, NT>(s, Qs, Ks + kh * (MS_T / 2) * MP_LD, dh * (MP_W / 2), li, lr);
        float* Sw = Ss + dh * 16 * MS_SLD;
        store_scores<NT>(Sw, MS_SLD, kh * (MS_T / 2), g, t4, s);
        __syncthreads();
        // Online softmax over the tile's keys (those before j1); a score is the sum of the two dim halves.
        float p0[MS_T / 4], p1[MS_T / 4], mx0, mx1;
        gather_scores<2, MS_T / 8>(Ss, MS_SLD, 16 * MS_SLD, g, t4, j1 - k0, scale, p0, p1, mx0, mx1);
        u32 pa[MS_T / 16][4];
        mla_softmax_tile<16, MS_T / 4>(p0, p1, mx0, mx1, m0, m1, l0, l1, o, pa);
        // O[:, 128*warp + (0..128)] += P V (V: the tile's keys, first 512 values).
        pv_accumulate<8, MS_T / 16>(o, pa, Ks + warp * 128, li, lr);
    };
    if constexpr (KFIRST) {
        const int ntile = (j1 - j0 + MS_T - 1) / MS_T;
        for (int it = 0; it < ntile; it++) {
            // NB + it groups committed: tile it has landed when at most NB - 1 are pending.
            cp_wait<NB - 1>();
            __syncthreads();
            tile(Kb + (it % NB) * MS_T * MP_LD, j0 + it * MS_T);
            __syncthreads();  // this buffer and Ss free
            issue(it + NB);
        }
    } else if constexpr (F16) {
        if (!issued) {
#pragma unroll
            for (int it = 0; it < NB - 1; it++) issue(it);
        }
        const int ntile = (j1 - j0 + MS_T - 1) / MS_T;
        for (int it = 0; it < ntile; it++) {
            // Tile it + NB - 1 into the buffer tile it - 1 used (every thread has left it: the
            // barrier at the loop's end), then wait for tile it.
            issue(it + NB - 1);
            cp_wait<NB - 1>();
            __syncthreads();
            tile(Kb + (it % NB) * MS_T * MP_LD, j0 + it * MS_T);
            __syncthreads();  // this buffer and Ss free for the next iteration
        }
    } else {
        u16* Ks = Kb;
        for (int k0 = j0; k0 < j1; k0 += MS_T) {
            __syncthreads();  // the previous tile's Ks and Ss are no longer read (and Qs is written)
            // The tile's rows, MS_LU float4 loads per thread in flight before any is converted
            // (MS_T * MP_W / 4 = 4608 = 36 per thread at 32 keys: a multiple of MS_LU * MS_THREADS).
            for (int i0 = tid; i0 < MS_T * (MP_W / 4); i0 += MS_LU * MS_THREADS) {
                typename CacheRaw<C>::T v[MS_LU];
#pragma unroll
                for (int u = 0; u < MS_LU; u++) {
                    const int idx = i0 + u * MS_THREADS, r = idx / (MP_W / 4), c4 = idx - r * (MP_W / 4);
                    v[u] = k0 + r < j1 ? cache_raw(cache + (base + k0 + r) * MP_W + 4 * c4) : typename CacheRaw<C>::T{};
                }
#pragma unroll
                for (int u = 0; u < MS_LU; u++) {
                    const int idx = i0 + u * MS_THREADS, r = idx / (MP_W / 4), c4 = idx - r * (MP_W / 4);
                    const uint2 h = raw_h4(v[u]);
                    u32* d = (u32*)(Ks + r * MP_LD + 4 * c4);
                    d[0] = h.x;
                    d[1] = h.y;
                }
            }
            __syncthreads();
            tile(Ks, k0);
        }
    }
    // (a partial row is 514 floats from an 8-byte aligned buffer: its values 8-byte aligned)
    ms_store_partial<HP>(o, m0, m1, l0, l1, prow, stride, 2);
#endif
}
// HP: the partial rows as f16 pairs divided by l (Path::HalfParts; mla_out_q8p merges them).
#define MLA_SPLIT_TC_INST(NAME, C, EARLY, NB, KFIRST, HP)                                                      \
    extern "C" __global__ void __launch_bounds__(MS_THREADS)                                                   \
        NAME(const float* q, i64 qoff, i64 q_tok, i64 q_head, const C* cache, const int* pos, const int* slot, \
             int slot_len, int nh, float scale, float* part) {                                                 \
        pdl_trigger();                                                                                         \
        if (!EARLY) pdl_wait();                                                                                \
        mla_split_tc_impl<C, EARLY, NB, KFIRST, HP>(q, qoff, q_tok, q_head, cache, pos, slot, slot_len, nh,    \
                                                    scale, part);                                              \
    }
MLA_SPLIT_TC_INST(mla_split_tc, float, false, MS_NB, false, false)
MLA_SPLIT_TC_INST(mla_split_tc_h, u16, false, MS_NB, false, false)
MLA_SPLIT_TC_INST(mla_split_tc_he, u16, true, MS_NB, false, false)
MLA_SPLIT_TC_INST(mla_split_tc_hb, u16, false, MS_NB_B, (MS_KFIRST != 0), false)
MLA_SPLIT_TC_INST(mla_split_tc_hep, u16, true, MS_NB, false, true)
// (One token's split in two groups of four warps, Path::SplitG2 / mla_split_tc_he2: each group
// every other tile with its own online softmax and 2-tile ring, group 1's state merged into
// group 0's through shared memory at the end; two warps a scheduler with half the chain each.
// Measured on an H100 in the fifty-eighth session, tg64 at 16k: 487.4 / 487.3 against 487.4 /
// 487.3 (the trace: 14.54 us a layer against 14.86), and with both of a group's tiles issued
// before the wait 476.4 / 476.6 against 487.2 / 486.8 (-2.2%); 66 splits 484.0 against 475.4
// one-group. Halving the tile chain does not shorten the launch: it is not the compute chain
// that holds it. Also measured then: the early kernel issuing all 3 ring tiles before its
// wait (MS_EARLY_ALL), 486.9 / 486.4, neutral. Both removed; git history has them, commit
// e1fa830.)
// (One token's splits merged in the split launch's own tail, Path::SplitTail / mla_split_tc_het:
// after a grid barrier in L2, each block merged a 64-column slice of one head, 4.3 MB of L2
// reads a layer instead of mla_out_q8's 34.7 MB at 16k. Measured on an H100 in the fifty-ninth
// session: tg64 at 16k 480.0 / 480.7 against 494.9 / 496.1, 4k -2.2%; the split launch 19.7 us
// a layer against 14.9, mla_out_q8 6.1 against 9.0. No split block leaves before the barrier,
// so mla_out_q8's blocks, which do not fit beside one, load their weights only after the whole
// launch. Removed; git history has it, commit 870b971.)
// (A batch's 1, 2 or 4 splits a token merged inside the split launch in a thread-block cluster, Path::SplitMerge / mla_split_tc_hbm<CL>: no mla_combine_few launch, the same bits; measured 64 sequences 9,485 against 9,624 at -d 96 and 9,033 against 9,202 at -d 400 on the H200, gpu-next146, and was removed; git history has it, commit 901d341.)
