// Prompt-size Q8_0 matrix products on the int8 tensor cores (mma.sync m16n8k32 s8*s8 -> s32),
// after llama.cpp's mmq. Hand-written because no library multiplies ggml's Q8_0 blocks (int8
// quants with one f16 scale per 32) without first widening them, and because the MoE needs the
// tokens of each expert gathered by an index list that only the device knows.
//
//  * Weights stay in their device layout (groups of 4 blocks, 144 B: 4 f16 scales, 8 pad bytes,
//    128 quants; see common.cuh). Activations are quantised once per row into the same group
//    layout (quant_q8_groups: ggml's quantize_row_q8_0, d = amax/127, q = round(x/d), the dot
//    uses d rounded to f16; exactly what the decode GEMV and the CPU backend do), so a tile of
//    weights and a tile of activations are copied to shared memory the same way.
//  * One m16n8k32 covers exactly one 32-value block: its int32 result is scaled by the weight
//    block's scale and the activation block's scale and summed in f32 (the same arithmetic as
//    ggml_vec_dot_q8_0_q8_0, only the summation order differs).
//  * Block tile 64 rows x 64 tokens, 4 warps of 32x32, K in stages of one group (128 values),
//    three stages in flight with cp.async. Shared rows keep the 144-byte group stride: 36 words,
//    so the 8 rows of an ldmatrix phase fall in 32 different banks.
//  * Dense products (one matrix or `g` matrices, row j of group z at activation row j*g + z) and
//    grouped expert products (tile y walks the experts' token lists: perm[off[e] ..+ cnt[e]]) are
//    one kernel: the tile decides its matrix and its row gather at the start.

#define MMQ_BM 64
#define MMQ_BN 64
#define MMQ_THREADS 128
#define MMQ_GB 144
// Bytes of one group of a 16-row tile of the tiled expert copy (CudaWeight::tiled, tile16_q8):
// 8 x 16 bytes of scales (rows g and g+8 for g < 8), then per block 32 lanes x 16 bytes (lane
// 4g+t: its 8 bytes of rows g and g+8 word by word, the A fragment's register order). No
// padding: 2,176 bytes where 16 rows of the row-major layout hold 2,304.
#define MMQ_TG 2176
#ifndef MMQ_OFF_EARLY
#define MMQ_OFF_EARLY 1
#endif
#define MMQ_ROWS (MMQ_BM + MMQ_BN)

// Quantise `n` rows of `k` values into groups of 4 Q8_0 blocks (dst row j at dst + j*drow bytes,
// ceil(k/128) groups, zero blocks past k). With `act` (1 = SiLU, 2 = GELU-tanh) the value is
// act(src) * src2 (the GLU of gate and up rows, same offsets and strides). With `rw`, row r is
// first multiplied by its router weight: slot s = r % rks of token r / rks has rw[token * rk + s]
// for s < rk and 1 for the shared experts' slots past it. One warp per group.
// The body, for group gid (one whole warp; also run by moe_route_quant below).
// One warp's group of 128 values (lane l holds values 4l..4l+3) as Q8_0 into the 144-byte group
// at gp: four blocks of 32 (8 lanes each), d = amax / 127, q = round(x / d), d stored as f16.
__device__ __forceinline__ void quant_group_store(const float (&v)[4], int lane, u8* gp) {
    float a = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
    const float d = a / 127.f;
    const float id = d != 0.f ? 1.0f / d : 0.f;
    const u32 packed = ((u32)(u8)(i8)(int)roundf(v[0] * id)) | ((u32)(u8)(i8)(int)roundf(v[1] * id) << 8) |
                       ((u32)(u8)(i8)(int)roundf(v[2] * id) << 16) | ((u32)(u8)(i8)(int)roundf(v[3] * id) << 24);
    *(u32*)(gp + 16 + lane * 4) = packed;
    if ((lane & 7) == 0) ((u16*)gp)[lane >> 3] = f2h(d);
    if (lane < 2) ((u32*)gp)[2 + lane] = 0u;  // the pad words
}
__device__ __forceinline__ void quant_group_body(i64 gid, const float* src, const float* src2, i64 off, i64 stride, int n,
                                                 int k, int act, const float* rw, int rk, int rks, u8* dst, i64 drow) {
    const int ng = (k + 127) >> 7;
    if (gid >= (i64)n * ng) return;
    const int lane = threadIdx.x & 31;
    const int row = (int)(gid / ng), g = (int)(gid - (i64)row * ng);
    const int i0 = g * 128 + lane * 4;
    const float* s = src + off + (i64)row * stride;
    const float* s2 = src2 ? src2 + off + (i64)row * stride : nullptr;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float x = 0.f;
        if (i0 + j < k) {
            x = s[i0 + j];
            if (act) x = act_fn(act, x) * s2[i0 + j];
        }
        v[j] = x;
    }
    if (rw) {
        const int t = row / rks, sl = row - t * rks;
        const float w = sl < rk ? rw[t * rk + sl] : 1.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] *= w;
    }
    quant_group_store(v, lane, dst + (i64)row * drow + (i64)g * MMQ_GB);
}
// pf0/pb0: a weight region asked into L2 before the PDL wait (CudaBackend::xpf_glu: the down
// stack's first experts, from the GLU's quantisation between a decode batch's gate/up and down).
extern "C" __global__ void quant_q8_groups(const float* src, const float* src2, i64 off, i64 stride, int n, int k,
                                           int act, const float* rw, int rk, int rks, u8* dst, i64 drow,
                                           const u8* pf0, i64 pb0) {
    if (pf0) l2_prefetch4(pf0, pb0, nullptr, 0, nullptr, 0, nullptr, 0);
    PDL_ENTRY();
    quant_group_body((i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), src, src2, off, stride, n, k, act, rw,
                     rk, rks, dst, drow);
}

// moe_route_warp and quant_q8_groups (plain rows, no GLU, no router weights) in one launch: the
// decode MoE needs both (the routing of the logits, the input quantised for the experts), each
// depends only on kernels before it, and one launch is one dependent step fewer per layer. The
// first ceil(n / warps) blocks route (a warp per token), the rest quantise (a warp per group):
// the same bodies, so the same bits.
extern "C" __global__ void moe_route_quant(const float* logits, i64 loff, i64 lstride, int n, int E, int k, int gating,
                                           int norm_topk, float scale, int* sel_e, float* sel_w, const float* src,
                                           i64 off, i64 stride, int kdim, u8* dst, i64 drow) { PDL_ENTRY();
    const int wpb = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const int rb = (n + wpb - 1) / wpb;
    if ((int)blockIdx.x < rb)
        route_warp_body(blockIdx.x * wpb + warp, logits, loff, lstride, n, E, k, gating, norm_topk, scale, sel_e, sel_w);
    else
        quant_group_body((i64)(blockIdx.x - rb) * wpb + warp, src, nullptr, off, stride, n, kdim, 0, nullptr, 0, 1, dst,
                         drow);
}

// (The routing, grouping and input quantisation of a decode batch's MoE in one launch,
// Path::RouteGroup / moe_route_group_quant: block 0 routed every token, a warp two at 64, then
// grouped; the other blocks quantised. The same bits (route_group_exact passed), but 64
// sequences 9,453 against 9,835 without it and 128 15,628 against ~16,785 on the H200
// (gpu-next150). Removed; git history has it, commit a63dc44.)

#if __CUDA_ARCH__ >= 800
// Scale s (0..3) of a group header read as 4 packed f16.
__device__ __forceinline__ float hsel(uint2 h, int s) {
    const u32 w = s < 2 ? h.x : h.y;
    return h2f((u16)((s & 1) ? (w >> 16) : (w & 0xffffu)));
}
#endif


// Tile y of a grouped product's expert tiles (ceil(cnt[e]/BN) each, in expert order) for the
// first warp (tid < 32) to find: tile_e (-1 past the last tile) and tile_start, in shared memory;
// the caller syncs.
// skip (mmq_q8_rows with its first tiles early, see mmq_rows_impl): every expert's first tile is
// left out (blocks y < n_exp take those), so tile y - n_exp of the rest; ybase >= 0: tile
// blockIdx.y - ybase of the rest instead (the blocks before take other tiles); by >= 0: tile
// index by in place of blockIdx.y (the rows kernels' tail halves).
template <int BN>
__device__ __forceinline__ void mmq_find_tile(const int* cnt, int n_exp, int tid, int& tile_e, int& tile_start,
                                              int skip = 0, int ybase = -1, int by = -1) {
    // The first warp loads the counts at once (lane l holds experts l*per ..), scans the per-lane
    // tile totals, and the lane whose range holds y walks its few experts. (A serial walk over the
    // experts costs one dependent load per expert before the first weight is requested.)
    const int per = (n_exp + 31) >> 5;  // <= MOE_MAX_EXPERTS / 32 = 16
    int tl[16];
    int mine = 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int x = tid * per + i;
        tl[i] = (i < per && x < n_exp) ? max((cnt[x] + BN - 1) / BN - skip, 0) : 0;
        mine += tl[i];
    }
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += v;
    }
    const int y = (by >= 0 ? by : (int)blockIdx.y) - (ybase >= 0 ? ybase : skip * n_exp), excl = incl - mine;
    if (tid == 31 && y >= incl) tile_e = -1;  // past the last tile
    if (y >= excl && y < incl) {
        int yy = y - excl;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            if (yy >= 0 && yy < tl[i]) {
                tile_e = tid * per + i;
                tile_start = (yy + skip) * BN;
            }
            yy -= tl[i];
        }
    }
}

// The tile a block covers: for grouped products (cnt != null) the expert and first token that
// mmq_find_tile gives (false: the block is past the last tile); for dense ones matrix
// blockIdx.z / nsplit and the tokens from blockIdx.y * BN. Every thread of the block calls it
// (grouped: one barrier). tile_e / tile_start: the caller's shared words.
// The tile's token rows, by the first BN threads (a barrier follows in the caller): where
// token j of the tile reads its activations (src_row) and writes its output (dst_row). Grouped
// products (perm != null): the j-th pair of expert e from `start` (activation row pair / in_div);
// dense ones: row (start + j) * zg + e. Past the tile's nt tokens the last row again (loaded,
// never stored). off_e >= 0: off[e], already read by the caller.
template <int BN>
__device__ __forceinline__ void mmq_tile_rows(const int* perm, const int* off, int e, int start, int nt,
                                              int in_div, int zg, int* src_row, int* dst_row, int off_e = -1) {
    const int tid = threadIdx.x;
    if (tid < BN) {
        const int j = min(tid, nt - 1);
        int s, d;
        if (perm) {
            const int p = perm[(off_e >= 0 ? off_e : off[e]) + start + j];
            s = p / in_div;
            d = p;
        } else {
            s = (start + j) * zg + e;
            d = s;
        }
        src_row[tid] = s;
        dst_row[tid] = d;
    }
}

// A block's place in its product's grid: blockIdx / gridDim, or, in a launch of several dense
// products (mmq_q8_64_jobs), its place in its own product's grid.
struct MmqBlk {
    int x, y, z, gx, gz;
};
__device__ __forceinline__ MmqBlk mmq_blk() {
    return MmqBlk{(int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.x, (int)gridDim.z};
}

template <int BN>
__device__ __forceinline__ bool mmq_block_tile(const int* cnt, int n_exp, int n, int nsplit, int& tile_e,
                                               int& tile_start, int& e, int& start, int& count,
                                               MmqBlk blk = mmq_blk()) {
    if (cnt) {
        if (threadIdx.x < 32) mmq_find_tile<BN>(cnt, n_exp, threadIdx.x, tile_e, tile_start);
        __syncthreads();
        e = tile_e;
        if (e < 0) return false;
        start = tile_start;
        count = cnt[e];
    } else {
        e = blk.z / nsplit;
        start = blk.y * BN;
        count = n;
    }
    return true;
}

// out[ooff + dst_j * ostride + row] = W_e[row] . X[src_j] for the tile's rows and tokens.
//   W, row_bytes, mat_bytes, m: the weights (matrix e at W + e*mat_bytes), m rows.
//   ngroups: groups of 128 per row (weights and activations alike).
//   X, xrow: the quantised activations, row r at X + r*xrow bytes.
//   Dense (cnt == null): n tokens per matrix, g = gridDim.z / nsplit matrices, token j of matrix
//     z is activation and output row j*g + z.
//   Grouped (cnt != null): tile y walks experts 0.. (ceil(cnt[e]/BN) tiles each); position j of
//     expert e is pair p = perm[off[e] + j], activation row p / in_div, output row p. Experts
//     e >= e_sh are chunks of a shared FFN's matrix: chunk e - e_sh at Ws + (e - e_sh)*ws_stride,
//     rows ws_row_bytes apart (gate/up: ff-row blocks; down: ff-column blocks of every row).
//   W2 (else null): two products of one input in one launch (the MoE's gate and up): blocks
//     x >= gridDim.x / 2 take W2, Ws2 and out2 for W, Ws and out.
// Fragments come from shared memory with ldmatrix (an 8x8 b16 matrix is 8 rows of 16 int8, the
// m16n8k32 fragment layout), the scales once per stage as 4 packed f16 per row; NST stages
// in flight (cp.async). Warps: WR along the rows x WC along the tokens, each MI m16 tiles x NI n8
// tiles: the block tile is 64 rows x BN = WC*NI*8 tokens (BN 64 for prompts, 16 when experts
// see few tokens each, as in batched decode: the per-stage work then shrinks with the tokens).
// GPS groups per stage: the 16-token tiles stream their 64 weight rows 2 groups (288 bytes, nine
// whole 32-byte sectors) at a time, halving the barriers per byte and the DRAM pages touched per
// stage; a shared row then holds GPS groups plus 16 pad bytes (304 bytes = 76 words: the 8 rows
// of an ldmatrix phase still fall in 32 different banks).
// A warp's MI x NI m16n8 accumulator tiles (rows from r0, tokens from j0 of the block's tile) to
// out[ooff + dst_row[j] * ostride + row], rows below m and tokens below nt only.
template <int MI, int NI>
__device__ __forceinline__ void acc_store(const float (&acc)[MI][NI][4], float* out, i64 ooff, i64 ostride, const int* dst_row,
                                          int r0, int j0, int m, int nt, int g, int t) {
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int row = r0 + mi * 16 + g + (c >> 1) * 8;
                const int j = j0 + ni * 8 + 2 * t + (c & 1);
                if (row < m && j < nt) out[ooff + (i64)dst_row[j] * ostride + row] = acc[mi][ni][c];
            }
}
// A warp's MI x NI m16n8 accumulator tiles, zeroed.
template <int MI, int NI>
__device__ __forceinline__ void acc_zero(float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int b = 0; b < NI; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.f;
}
// One 128-value group of an int8 tile (mmq_ws_impl; mmq_impl keeps the same body inline, as it
// was measured: through this function its static SASS moves by a few instructions and spills):
// the warp's MI m16 x NI n8 tiles from the weight rows at As and the activation rows at Bs (rows
// RS bytes apart; As_s and Bs_s the same places as shared-space addresses), m16n8k32 int8
// products scaled by the rows' and tokens' block scales and summed in block order; SKIP leaves out n8 tiles past the tile's nt
// tokens (wn: the warp's first token). The fragment loads take the shared-space addresses:
// 32-bit address arithmetic instead of generic pointers (measured 2026-11-30: pp512 +3%,
// pp2048 +3%, 64 sequences +1%; with generic pointers each of a stage's 16 ldmatrix paid 64-bit
// adds).
template <int MI, int NI, int RS, bool SKIP>
__device__ __forceinline__ void mmq_group(float (&acc)[MI][NI][4], const u8* As, const u8* Bs, u32 As_s, u32 Bs_s, int wn,
                                          int nt, int g, int t, int lr, int li) {
    uint2 ha[MI][2], hb[NI][2];
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
        ha[mi][0] = *(const uint2*)(As + (mi * 16 + g) * RS);
        ha[mi][1] = *(const uint2*)(As + (mi * 16 + g + 8) * RS);
    }
#pragma unroll
    for (int ni = 0; ni < NI; ni++) {
        hb[ni][0] = *(const uint2*)(Bs + (ni * 8 + 2 * t) * RS);
        hb[ni][1] = *(const uint2*)(Bs + (ni * 8 + 2 * t + 1) * RS);
    }
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 a[MI][4], b[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            ldsm4_s(a[mi], As_s + (u32)((mi * 16 + (li & 1) * 8 + lr) * RS + 16 + s * 32 + (li >> 1) * 16));
        }
#pragma unroll
        for (int np = 0; np < NI / 2; np++) {
            u32 r[4];
            if (SKIP && wn + np * 16 >= nt) break;  // only padding tokens past here (warp-uniform)
            ldsm4_s(r, Bs_s + (u32)((np * 16 + (li >> 1) * 8 + lr) * RS + 16 + s * 32 + (li & 1) * 16));
            b[2 * np][0] = r[0];
            b[2 * np][1] = r[1];
            b[2 * np + 1][0] = r[2];
            b[2 * np + 1][1] = r[3];
        }
        float da[MI][2], db[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            da[mi][0] = hsel(ha[mi][0], s);
            da[mi][1] = hsel(ha[mi][1], s);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            db[ni][0] = hsel(hb[ni][0], s);
            db[ni][1] = hsel(hb[ni][1], s);
        }
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                // n8 tiles holding only padding tokens are skipped: an expert with 8 or
                // fewer tokens (most, in batched decode) costs half the 16-token tile's work.
                if (SKIP && wn + ni * 8 >= nt) break;
                int c[4] = {0, 0, 0, 0};
                mma_s8(c, a[mi], b[ni]);
                acc[mi][ni][0] += (float)c[0] * (da[mi][0] * db[ni][0]);
                acc[mi][ni][1] += (float)c[1] * (da[mi][0] * db[ni][1]);
                acc[mi][ni][2] += (float)c[2] * (da[mi][1] * db[ni][0]);
                acc[mi][ni][3] += (float)c[3] * (da[mi][1] * db[ni][1]);
            }
    }
}
// EARLY (dense products only, the caller has triggered but not waited): the first NST - 1
// stages' weight rows are copied before the PDL wait (the next four stages' asked of L2), their
// activation rows after it, so the weights' DRAM latency overlaps the previous kernel
// (Path::DenseEarly; the same bits).
template <int WR, int WC, int MI, int NI, int GPS, int NST, bool SKIP, bool EARLY = false>
__device__ __forceinline__ void mmq_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X,
                                         i64 xrow, int n, const int* cnt, const int* off, const int* perm, int n_exp,
                                         int in_div, float* out, i64 ooff, i64 ostride, int nsplit, i64 split_stride,
                                         const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2,
                                         const u8* Ws2, float* out2, const MmqBlk blk) {
#if __CUDA_ARCH__ >= 800
    int bx = blk.x;
    if (W2 && bx >= (blk.gx >> 1)) {
        bx -= blk.gx >> 1;
        W = W2;
        Ws = Ws2;
        out = out2;
    }
    constexpr int BN = WC * NI * 8;
    constexpr int ROWS = MMQ_BM + BN;
    constexpr int RS = GPS == 1 ? MMQ_GB : GPS * MMQ_GB + 16;  // shared row stride, bytes
    constexpr int STAGE = ROWS * RS;
    constexpr int PIECES = 9 * GPS;  // 16-byte pieces per row per stage
    static_assert(WR * MI * 16 == MMQ_BM && WR * WC * 32 == MMQ_THREADS && NI % 2 == 0, "mmq tile");
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ int src_row[BN], dst_row[BN];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    if (EARLY && cnt) pdl_wait();  // (grouped products read the counts: no early copies)
    // Which matrix and which tokens this tile covers.
    int e = 0, start, count;
    if (!mmq_block_tile<BN>(cnt, n_exp, n, nsplit, tile_e, tile_start, e, start, count, blk)) return;
    // Split K (dense products with too few tiles to fill the device): this block sums groups
    // [g0, g1) into its own partial output (reduced by mmq_sum_splits in a fixed order).
    const int split = cnt ? 0 : blk.z % nsplit, zg = blk.gz / nsplit;
    const int gps = (ngroups + nsplit - 1) / nsplit;
    const int g0 = split * gps, g1 = min(ngroups, g0 + gps);
    out += split * split_stride;
    const int nt = min(BN, count - start);
    if (nt <= 0) {
        if (EARLY) pdl_wait();  // (every thread waits before it exits)
        return;
    }
    mmq_tile_rows<BN>(cnt ? perm : nullptr, off, e, start, nt, in_div, zg, src_row, dst_row);
    __syncthreads();
    const int m0 = bx * MMQ_BM;
    const bool sh = cnt && e >= e_sh;
    const u8* Wt = sh ? Ws + (i64)(e - e_sh) * ws_stride : W + (i64)e * mat_bytes;
    const i64 rb = sh ? ws_row_bytes : row_bytes;
    // This thread's 16-byte pieces of every stage: (row r, piece q) for c = tid + i*128,
    // r = c / PIECES; piece q lies in group q / 9 of the stage and at byte q*16 of the row's
    // stage (144 = 9 * 16). The same rows in every stage, so the source pointers are computed
    // once (only the group offset moves). dsto packs the shared offset (< 2^16) and, from bit 16,
    // the piece's group within the stage.
    constexpr int PER = (ROWS * PIECES + MMQ_THREADS - 1) / MMQ_THREADS;
    const u8* srcp[PER];
    u32 dsto[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = tid + i * MMQ_THREADS;
        srcp[i] = nullptr;
        dsto[i] = 0;
        if (c < ROWS * PIECES) {
            const int r = c / PIECES, q = c - r * PIECES;
            const u8* rowp = r < MMQ_BM ? Wt + (i64)min(m0 + r, m - 1) * rb : X + (i64)src_row[r - MMQ_BM] * xrow;
            srcp[i] = rowp + (i64)g0 * MMQ_GB + q * 16;
            dsto[i] = (u32)(r * RS + q * 16) | (GPS == 1 ? 0u : (u32)(q / 9) << 16);
        }
    }
    const int nstages = (g1 - g0 + GPS - 1) / GPS;
    // The stages' shared-space address, once (see cp_async16_s), and the pieces that exist
    // known from the thread index alone (no 64-bit null test a copy). Through generic pointers
    // each copy cost two S2R, a 64-bit add and the test (Nsight, the prompt expert product: ~130
    // of 778 instructions a warp and stage); on the H200 this gave pp512 16,350 -> 16,922,
    // pp2048 14,635 -> 15,048, 64 sequences 7,530 -> 7,605 (same tokens).
    const u32 sm0 = smem_addr(mmq_sm);
    // part: 3 the whole stage, 1 its weight rows only, 2 its activation rows only (EARLY);
    // a weight piece's shared offset lies below MMQ_BM rows.
    auto copy = [&](int gi, int part) {  // local stage gi = groups g0 + gi*GPS ..
        const int left = g1 - g0 - gi * GPS;  // groups of this stage that exist
        if (left > 0) {
            const u32 st = sm0 + (u32)((gi % NST) * STAGE);
#pragma unroll
            for (int i = 0; i < PER; i++)
                if ((ROWS * PIECES) % MMQ_THREADS == 0 || i < PER - 1 || tid + i * MMQ_THREADS < ROWS * PIECES)
                    if (GPS == 1 || (int)(dsto[i] >> 16) < left)
                        if (part == 3 || (part == 1) == ((dsto[i] & 0xffffu) < (u32)(MMQ_BM * RS)))
                            cp_async16_s(st + (GPS == 1 ? dsto[i] : dsto[i] & 0xffffu), srcp[i] + (i64)gi * GPS * MMQ_GB);
        }
    };
    auto load = [&](int gi) {
        copy(gi, 3);
        cp_commit();  // (empty groups keep the count uniform)
    };
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int lr = lane & 7, li = lane >> 3;
    const int wm = (warp % WR) * MI * 16, wn = (warp / WR) * NI * 8;
    float acc[MI][NI][4];
    acc_zero(acc);
    if (EARLY && !cnt) {
        // The weight rows of the first stages, then the wait, then their activation rows:
        // the first commit group holds stage 0 whole (and stage 1's weights), the next ones
        // one stage's activation rows each, so the loop's waits still find stage gi complete.
#pragma unroll
        for (int st = 0; st < NST - 1; st++) copy(st, 1);
        // The next few stages' weight rows into L2 (a split-K block has only a few stages): the
        // first and last 16-byte piece of each row's group, the lines it spans.
        for (int gi = NST - 1; gi < min(nstages, NST - 1 + 4); gi++)
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const u32 so = dsto[i] & 0xffffu, q = (so % RS) / 16;
                const bool exists = (ROWS * PIECES) % MMQ_THREADS == 0 || tid + i * MMQ_THREADS < ROWS * PIECES;
                if (exists && so < (u32)(MMQ_BM * RS) && (q % 9 == 0 || q % 9 == 8) &&
                    (GPS == 1 || (int)(dsto[i] >> 16) < g1 - g0 - gi * GPS))
                    prefetch_l2(srcp[i] + (i64)gi * GPS * MMQ_GB);
            }
        pdl_wait();
#pragma unroll
        for (int st = 0; st < NST - 1; st++) {
            copy(st, 2);
            cp_commit();
        }
    } else {
#pragma unroll
        for (int st = 0; st < NST - 1; st++) load(st);
    }
    for (int gi = 0; gi < nstages; gi++) {
        cp_wait<NST - 2>();
        __syncthreads();          // stage gi has landed for every thread; stage gi-1 is consumed
        load(gi + NST - 1);   // into the buffer of stage gi-1
#pragma unroll
        for (int h = 0; h < GPS; h++) {
        if (GPS > 1 && gi * GPS + h >= g1 - g0) break;  // a short last stage
        const u8* As = mmq_sm + (gi % NST) * STAGE + wm * RS + h * MMQ_GB;
        const u8* Bs = mmq_sm + (gi % NST) * STAGE + (MMQ_BM + wn) * RS + h * MMQ_GB;
        // The same two places as shared-space addresses, for the fragment loads: 32-bit address
        // arithmetic instead of generic pointers (measured 2026-11-30: pp512 +3%, pp2048 +3%,
        // 64 sequences +1%; with generic pointers each of a stage's 16 ldmatrix paid 64-bit adds).
        const u32 As_s = sm0 + (u32)((gi % NST) * STAGE + wm * RS + h * MMQ_GB);
        const u32 Bs_s = sm0 + (u32)((gi % NST) * STAGE + (MMQ_BM + wn) * RS + h * MMQ_GB);
        uint2 ha[MI][2], hb[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            ha[mi][0] = *(const uint2*)(As + (mi * 16 + g) * RS);
            ha[mi][1] = *(const uint2*)(As + (mi * 16 + g + 8) * RS);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            hb[ni][0] = *(const uint2*)(Bs + (ni * 8 + 2 * t) * RS);
            hb[ni][1] = *(const uint2*)(Bs + (ni * 8 + 2 * t + 1) * RS);
        }
#pragma unroll
        for (int s = 0; s < 4; s++) {
            u32 a[MI][4], b[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                ldsm4_s(a[mi], As_s + (u32)((mi * 16 + (li & 1) * 8 + lr) * RS + 16 + s * 32 + (li >> 1) * 16));
            }
#pragma unroll
            for (int np = 0; np < NI / 2; np++) {
                u32 r[4];
                if (SKIP && wn + np * 16 >= nt) break;  // only padding tokens past here (warp-uniform)
                ldsm4_s(r, Bs_s + (u32)((np * 16 + (li >> 1) * 8 + lr) * RS + 16 + s * 32 + (li & 1) * 16));
                b[2 * np][0] = r[0];
                b[2 * np][1] = r[1];
                b[2 * np + 1][0] = r[2];
                b[2 * np + 1][1] = r[3];
            }
            float da[MI][2], db[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                da[mi][0] = hsel(ha[mi][0], s);
                da[mi][1] = hsel(ha[mi][1], s);
            }
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                db[ni][0] = hsel(hb[ni][0], s);
                db[ni][1] = hsel(hb[ni][1], s);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    // n8 tiles holding only padding tokens are skipped: an expert with 8 or
                    // fewer tokens (most, in batched decode) costs half the 16-token tile's work.
                    if (SKIP && wn + ni * 8 >= nt) break;
                    int c[4] = {0, 0, 0, 0};
                    mma_s8(c, a[mi], b[ni]);
                    acc[mi][ni][0] += (float)c[0] * (da[mi][0] * db[ni][0]);
                    acc[mi][ni][1] += (float)c[1] * (da[mi][0] * db[ni][1]);
                    acc[mi][ni][2] += (float)c[2] * (da[mi][1] * db[ni][0]);
                    acc[mi][ni][3] += (float)c[3] * (da[mi][1] * db[ni][1]);
                }
        }
        }
    }
    acc_store(acc, out, ooff, ostride, dst_row, m0 + wm, wn, m, nt, g, t);
#endif
}

#define MMQ_INST(NAME, WR, WC, MI, NI, GPS, NST, MINB, SKIP)                                                  \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MINB)                                             \
        NAME(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X, i64 xrow, int n,       \
             const int* cnt, const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff,      \
             i64 ostride, int nsplit, i64 split_stride, const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, \
             const u8* W2, const u8* Ws2, float* out2) {                                                        \
        PDL_ENTRY();                                                                                            \
        mmq_impl<WR, WC, MI, NI, GPS, NST, SKIP>(W, row_bytes, mat_bytes, m, ngroups, X, xrow, n, cnt, off, perm, n_exp, \
                                                 in_div, out, ooff, ostride, nsplit, split_stride, Ws, ws_row_bytes, \
                                                 ws_stride, e_sh, W2, Ws2, out2, mmq_blk());                    \
    }
// 64 x 64 tiles (2 x 2 warps of 32 x 32), one group per stage, 3 stages, 3 blocks per SM (at 4
// they spill). 64 x 16 tiles (4 x 1 warps of 16 x 16): two groups per stage, double-buffered,
// 4 blocks per SM (2 stages x 80 rows x 304 bytes of shared memory each). Nsight on the batched
// decode's expert products: latency-bound (half the issue slots empty; "wait" and short-scoreboard
// stalls first). Measured on the H200 (bench --parallel 64, same run): this tile 5,372 tok/s;
// one group per stage, 3 stages, 6 blocks (mmq_q8_16g1, TS_CUDA_MMQ16=1) 5,184; two groups, 3
// stages, 3 blocks 5,291; two groups split over two warp sets of 8 warps 5,277 (dropped).
// The padding-tile skip pays on the 16-token tiles (batched decode: most experts see <= 8
// tokens) and costs the 64-token tiles 2% of pp512 (15,424-15,448 without vs 15,032-15,136 with,
// same H200 run; 148 vs 168 registers): those run without it.
// (At 3 blocks an SM mmq_q8_64 spills 20 bytes: one local load a stage in Nsight's SASS view of
// the 64-sequence step's dense products. TS_CUDA_DEFINES="MMQ64_MINB=2" measures 2 blocks
// without the spill: on the H200 (gpu-next38) 64 sequences 7,655 -> 7,708 tok/s (+0.7%), pp512
// 22,001 -> 21,589 (-1.9%); kept at 3.)
#ifndef MMQ64_MINB
#define MMQ64_MINB 3
#endif
MMQ_INST(mmq_q8_64, 2, 2, 2, 4, 1, 3, MMQ64_MINB, false)
// mmq_q8_64 with its first stages' weight copies before the PDL wait (Path::DenseEarly: dense
// products only; the same bits).
extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ64_MINB)
    mmq_q8_64e(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X, i64 xrow, int n,
               const int* cnt, const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff, i64 ostride,
               int nsplit, i64 split_stride, const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2,
               const u8* Ws2, float* out2) {
    pdl_trigger();  // (the wait is mmq_impl's, after the first weight copies)
    mmq_impl<2, 2, 2, 4, 1, 3, false, true>(W, row_bytes, mat_bytes, m, ngroups, X, xrow, n, cnt, off, perm, n_exp,
                                            in_div, out, ooff, ostride, nsplit, split_stride, Ws, ws_row_bytes,
                                            ws_stride, e_sh, W2, Ws2, out2, mmq_blk());
}
// (64 x 128 tiles for 65-128-token batches, Path::Dense128 / mmq_q8_128*, measured slower twice: 80 sequences 8,529 -> 8,379 (gpu-next102) and 8,546 -> 8,365 with a one-wave split (gpu-next103), 128 13,916 -> 13,362; removed, commit 06e7140 has it.)
// (A partly padded last 64-token tile skipping the padding, Path::DenseSkip / mmq_q8_64es, measured 80 sequences 8,546 -> 8,345 and 96 10,384 -> 10,060, gpu-next103, and was removed; commit 06e7140 has it.)
MMQ_INST(mmq_q8_16, 4, 1, 1, 2, 2, 2, 4, true)
MMQ_INST(mmq_q8_16g1, 4, 1, 1, 2, 1, 3, 6, true)

// Up to three dense products of one quantised input in one launch (Path::DenseJobs: a decode
// batch's q and kv_a): job j's blocks are the mmq_q8_64 grid it would have alone (gx x gy x
// nsplit, x fastest), numbered after the jobs before it, so every block computes what it
// computes in its own launch: the same bits, one launch instead of one a job (each a chain of
// ~1,600 instructions a warp over a few groups; Nsight, gpu-next96/97). Job j: the weights
// (W, row bytes, m rows), its output (pointer, offset, row stride; or its split-K partials:
// split s at s * split_stride floats, rows of m), its splits and blocks. Unused jobs: 0 blocks.
#define MMQ_JOB_ARGS(j)                                                                                         \
    const u8 *W##j, i64 rb##j, int m##j, float *out##j, i64 ooff##j, i64 ost##j, int ns##j, i64 ss##j, int nb##j
template <bool EARLY>
__device__ __forceinline__ void mmq_jobs_impl(MMQ_JOB_ARGS(0), MMQ_JOB_ARGS(1), MMQ_JOB_ARGS(2), int ngroups,
                                              const u8* X, i64 xrow, int n) {
    int b = blockIdx.x;
    const u8* W = W0;
    i64 rb = rb0, ooff = ooff0, ost = ost0, ss = ss0;
    int m = m0, ns = ns0;
    float* out = out0;
    if (b >= nb0) {
        b -= nb0;
        const bool two = b >= nb1;
        b -= two ? nb1 : 0;
        W = two ? W2 : W1;
        rb = two ? rb2 : rb1;
        m = two ? m2 : m1;
        out = two ? out2 : out1;
        ooff = two ? ooff2 : ooff1;
        ost = two ? ost2 : ost1;
        ns = two ? ns2 : ns1;
        ss = two ? ss2 : ss1;
    }
    const int gx = (m + MMQ_BM - 1) / MMQ_BM, gy = (n + MMQ_BN - 1) / MMQ_BN;
    const MmqBlk blk{b % gx, (b / gx) % gy, b / (gx * gy), gx, ns};
    mmq_impl<2, 2, 2, 4, 1, 3, false, EARLY>(W, rb, 0, m, ngroups, X, xrow, n, nullptr, nullptr, nullptr, 0, 1, out, ooff,
                                             ost, ns, ss, nullptr, 0, 0, 0, nullptr, nullptr, nullptr, blk);
}
#define MMQ_JOBS_PASS(j) W##j, rb##j, m##j, out##j, ooff##j, ost##j, ns##j, ss##j, nb##j
extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ64_MINB)
    mmq_q8_64_jobs(MMQ_JOB_ARGS(0), MMQ_JOB_ARGS(1), MMQ_JOB_ARGS(2), int ngroups, const u8* X, i64 xrow, int n) {
    PDL_ENTRY();
    mmq_jobs_impl<false>(MMQ_JOBS_PASS(0), MMQ_JOBS_PASS(1), MMQ_JOBS_PASS(2), ngroups, X, xrow, n);
}
// With Path::DenseEarly: the weights of the first stages before the PDL wait (mmq_q8_64e).
extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MMQ64_MINB)
    mmq_q8_64_jobse(MMQ_JOB_ARGS(0), MMQ_JOB_ARGS(1), MMQ_JOB_ARGS(2), int ngroups, const u8* X, i64 xrow, int n) {
    pdl_trigger();  // (the wait is mmq_impl's)
    mmq_jobs_impl<true>(MMQ_JOBS_PASS(0), MMQ_JOBS_PASS(1), MMQ_JOBS_PASS(2), ngroups, X, xrow, n);
}

// mmq_q8_64's tile with the stage copies on a fifth warp (TS_CUDA_MMQ_WS=1; written in the
// seventeenth session, NOT yet run on a GPU): the 4 multiplying warps issue no copies, so none
// of their registers waits on one (the static SASS of mmq_q8_64 has the stage's ldmatrix
// writing registers that the copies issued just before it use as addresses; the dense products
// of the 64-sequence step take ~10 us each whatever their loop costs). Lane l of the producer
// copies rows l + 32i (i < 4: the 64 weight rows, then the 64 activation rows), nine pieces
// each, pointers advanced in place, its copies of a stage ending in an asynchronous arrival on
// the stage's `full` mbarrier (32 arrivals); each multiplying warp arrives on `empty` (4) when
// its fragments are read. Split K, groups, shared chunks and W2 as mmq_impl; the same loads and
// sums, so the same bits. 160 threads, two blocks an SM (its 168 registers; at three the cap
// would be 136).
template <int NST>
__device__ __forceinline__ void mmq_ws_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X,
                                            i64 xrow, int n, const int* cnt, const int* off, const int* perm, int n_exp,
                                            int in_div, float* out, i64 ooff, i64 ostride, int nsplit, i64 split_stride,
                                            const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2,
                                            const u8* Ws2, float* out2) {
#if __CUDA_ARCH__ >= 900
    constexpr int WR = 2, MI = 2, NI = 4, CW = 4, BN = 64, ROWS = MMQ_BM + BN, RS = MMQ_GB, STAGE = ROWS * RS;
    int bx = blockIdx.x;
    if (W2 && bx >= (int)(gridDim.x >> 1)) {
        bx -= gridDim.x >> 1;
        W = W2;
        Ws = Ws2;
        out = out2;
    }
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ int src_row[BN], dst_row[BN];
    __shared__ int tile_e, tile_start;
    __shared__ __align__(8) unsigned long long bars[2 * NST];
    const int tid = threadIdx.x;
    int e = 0, start, count;
    if (!mmq_block_tile<BN>(cnt, n_exp, n, nsplit, tile_e, tile_start, e, start, count)) return;
    const int split = cnt ? 0 : blockIdx.z % nsplit, zg = gridDim.z / nsplit;
    const int gps = (ngroups + nsplit - 1) / nsplit;
    const int g0 = split * gps, g1 = min(ngroups, g0 + gps);
    out += split * split_stride;
    const int nt = min(BN, count - start);
    if (nt <= 0) return;
    mmq_tile_rows<BN>(cnt ? perm : nullptr, off, e, start, nt, in_div, zg, src_row, dst_row);
    const u32 full0 = smem_addr(bars), empty0 = full0 + 8 * NST;
    if (tid == 0) {
        for (int s = 0; s < NST; s++) {
            mbar_init(full0 + 8 * s, 32);
            mbar_init(empty0 + 8 * s, CW);
        }
    }
    __syncthreads();  // the tile's rows and the barriers; no block-wide barrier past here
    const int m0 = bx * MMQ_BM;
    const int nstages = g1 - g0;  // (one group a stage; a split without groups writes zeros)
    const u32 sm0 = smem_addr(mmq_sm);
    const int warp = tid >> 5, lane = tid & 31;
    if (warp == CW) {
        const bool sh = cnt && e >= e_sh;
        const u8* Wt = sh ? Ws + (i64)(e - e_sh) * ws_stride : W + (i64)e * mat_bytes;
        const i64 rb = sh ? ws_row_bytes : row_bytes;
        const u8* rp[ROWS / 32];
#pragma unroll
        for (int i = 0; i < ROWS / 32; i++) {
            const int r = lane + 32 * i;
            rp[i] = (r < MMQ_BM ? Wt + (i64)min(m0 + r, m - 1) * rb : X + (i64)src_row[r - MMQ_BM] * xrow) + (i64)g0 * MMQ_GB;
        }
        for (int s = 0; s < nstages; s++) {
            const int b = s % NST;
            if (s >= NST) mbar_wait(empty0 + 8 * b, ((s / NST) - 1) & 1);
            const u32 st = sm0 + (u32)(b * STAGE);
#pragma unroll
            for (int i = 0; i < ROWS / 32; i++) {
                const u32 d = st + (u32)((lane + 32 * i) * RS);
#pragma unroll
                for (int q = 0; q < 9; q++) cp_async16_s(d + q * 16, rp[i] + q * 16);
                rp[i] += MMQ_GB;
            }
            cp_async_arrive(full0 + 8 * b);
        }
        cp_async_wait_all();
        return;
    }
    const int g = lane >> 2, t = lane & 3, lr = lane & 7, li = lane >> 3;
    const int wm = (warp % WR) * MI * 16, wn = (warp / WR) * NI * 8;
    float acc[MI][NI][4];
    acc_zero(acc);
    for (int s = 0; s < nstages; s++) {
        const int b = s % NST;
        mbar_wait(full0 + 8 * b, (s / NST) & 1);
        const int a0 = b * STAGE + wm * RS, b0 = b * STAGE + (MMQ_BM + wn) * RS;
        mmq_group<MI, NI, RS, false>(acc, mmq_sm + a0, mmq_sm + b0, sm0 + (u32)a0, sm0 + (u32)b0, wn, nt, g, t, lr, li);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * b);
    }
    acc_store(acc, out, ooff, ostride, dst_row, m0 + wm, wn, m, nt, g, t);
#endif
}
extern "C" __global__ void __launch_bounds__(160, 2)
    mmq_q8_64ws(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X, i64 xrow, int n, const int* cnt,
                const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff, i64 ostride, int nsplit,
                i64 split_stride, const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2,
                float* out2) {
    PDL_ENTRY();
    mmq_ws_impl<3>(W, row_bytes, mat_bytes, m, ngroups, X, xrow, n, cnt, off, perm, n_exp, in_div, out, ooff, ostride,
                   nsplit, split_stride, Ws, ws_row_bytes, ws_stride, e_sh, W2, Ws2, out2);
}

// The grouped expert product for tiles of few tokens (the batched decode: about 6 tokens an
// expert) with the weights read the way the decode GEMVs read them, straight into the mma
// fragments, with no shared-memory staging and no barrier after the start. mmq_q8_16 at 64
// sequences is latency-bound (Nsight: 2.1 TB/s, half the issue slots empty, 73M instructions a
// gate/up launch, most of them the cp.async staging and its bookkeeping), and a 64-row tile
// stream reads at most 3.6 TB/s on the H200 where whole rows read 4.2 (tools/gpu/bwprobe.cu).
//  * The tile's (<= 16) activation rows are copied whole into shared memory once (row stride 8
//    words mod 32: the 4 rows of a half-warp's 8-byte fragment loads fall in different banks).
//  * Each warp owns 16 weight rows (g and g+8 of the m16 tile) and walks K a group at a time,
//    the next group's loads in flight while one is multiplied.
//  * Within a 32-value block the int32 dot product does not depend on the order of k, so thread
//    t takes the block's bytes 8t..8t+7 of its row (one 8-byte load) as the fragment's k
//    4t..4t+3 (a0/a1) and 16+4t..16+4t+3 (a2/a3), and reads the activations' block the same
//    way: the same int32 per block as mmq_q8_16, scaled and summed in the same order, so the
//    same bits.
// Grouped and dense products (split K too: the block's groups only are copied and walked); the
// grid and arguments are mmq_q8_16's (64 rows a block of 4 warps, tiles of 16 tokens along y,
// W2 in the upper half of x, split and matrix along z). Dynamic shared memory: at most 16 rows
// of ngroups*144 + 124 bytes.
// Measurement defines (TS_CUDA_DEFINES="MMQ_ROWS_PAD=0 MMQ_ROWS_MINB=4"): the activation rows'
// padding rule and the grouped kernel's blocks-an-SM bound.
#ifndef MMQ_ROWS_PAD
#define MMQ_ROWS_PAD 1
#endif
// MMQ_ROWS_NA: the grouped rows kernels load their tiled weights with L1::no_allocate (ldw16;
// each byte is read once). On by default since gpu-next114 (H200, 64 sequences at -d 96: 8,335
// against 8,254 / 8,249 tok/s, the same hash); MMQ_ROWS_NA=0 (TS_CUDA_DEFINES) is the old way,
// as is TS_WNA=0, which makes ldw16 itself a plain load.
// (The tile's activation rows copied in two halves on mbarriers, so a warp starts on its first
// groups while the second half lands, MMQ_ROWS_STAGE, measured 7,915 there (-4%) and 8,138 with
// NA: removed; git history has it at 4a83369.)
#ifndef MMQ_ROWS_NA
#define MMQ_ROWS_NA 1
#endif
#ifndef MMQ_ROWS_MINB
#define MMQ_ROWS_MINB 5
#endif
// MMQ_GU_PF=B / MMQ_DN_PF=B: in a grouped launch, the first B blocks of the launch's order
// that take their tile before the PDL wait (`early`) also ask the rest of their tiled weights
// into L2 (cp.async.bulk.prefetch.L2, one request a 16-row tile) before they wait. GU: the
// gate/up pair launches (W2 set; 128 blocks are the first ~6 experts' gate and up rows, ~36
// MB); DN: launches of single matrices (the down product; 128 blocks are the first 8 experts'
// down rows, ~24 MB). Those blocks land while the launches before still run: for gate/up the
// router's, routing's and quantisation's small launches (~12 µs a layer with the memory bus
// nearly idle), for the down the GLU's quantisation waiting on gate/up's ragged tail (~11% of
// its SM time idle, PERF.md thirty-seventh session). Once the wait returns their loads find L2.
// The same loads and sums after the wait, so the same bits (every figure below had the
// 64-sequence hash 0a9cb67b57a58e7a).
// Measured on H100s (fifty-sixth session, 64 sequences at -d 96, alternating in one call):
//   DN alone (gpu-next188 and a sweep): B = 64 / 96 / 128 / 192 / 256: 7,934 / 7,937 / 7,940 /
//   7,925 / 7,901 tok/s and 7,929 / 7,935 / 7,935 / 7,926 / 7,897, against 7,888 / 7,885 /
//   7,894 / 7,898 with B = 0 (+0.5-0.6% at 128); the GLU launch asking 24 MB of the down stack
//   itself (TS_CUDA_XPF_GLU=24) 7,865 / 7,875.
//   GU on top of DN = 128 (gpu-next189, another H100): GU = 64: 8,037 / 8,038; GU = 128:
//   8,139 / 8,142, then 8,137; GU = 256: 8,036; 384: 7,880; against 7,927 / 7,932 with GU = 0
//   (+2.7% at 128) and 7,887 / 7,890 with DN = 0 too. The server (64 clients, 40-45 s):
//   7,920.5 tok/s with both against 7,710.5 with DN only and 7,702.6 with neither (+2.7%).
//   GU = 128 with the expert prefetch from the merge off (TS_CUDA_XPF=0): 8,153 (one run): the
//   two ask for the same first experts' gate/up rows.
// Fifty-seventh session (H100, alternating in one call): GU = 96 / 160 / 192: 8,106 / 8,154 /
//   8,134 against 8,144 at 128 (160 within noise: 128 stays). The merge's prefetch off: 8,180 /
//   8,183 / 8,191 against 8,144 / 8,148 / 8,144 at 64 sequences, but slower at 16-32 rows, so it
//   now serves batches of up to 32 rows only (CudaBackend::xpf_rows). Both off: 7,895; 32
//   sequences 4,299 against 4,268 with both off, 128 sequences 13,438 against 13,099 (+2.6%).
#ifndef MMQ_DN_PF
#define MMQ_DN_PF 128
#endif
#ifndef MMQ_GU_PF
#define MMQ_GU_PF 128
#endif
// One group of a thread's two rows in the rows kernels (g and g+8 of a 16-row tile): the 4
// scales of each, its 8 bytes of each 32-value block.
struct RowsGrp {
    uint2 ha, hb, qa[4], qb[4];
};
// (The pipeline in 64-k half groups, MMQ_ROWS_HALF: 77 registers without a spill at 6 blocks
// an SM, 469 instructions a group against 315, the same bits. H200, gpu-next122, 64 sequences
// at -d 96: 7,253 tok/s against 8,456 (-14%), with 7 blocks an SM 6,864, 128 sequences 12,636
// against 14,107. Removed; git history has it, commit 242ecb7.)
// MMQ_ROWS_KO (a measurement define, wrong results on purpose; docs/GPU.md): parts of the
// grouped rows kernels left out, to see what each costs. Bit 1: no activation tile copy (the
// multiply reads whatever shared memory holds); bit 2: no token list (the tile's rows are
// pairs 0..15: no loads of perm); bit 4: no multiply (each group's loaded words XORed into the
// accumulator, so the loads stay).
#ifndef MMQ_ROWS_KO
#define MMQ_ROWS_KO 0
#endif
// acc[ni][c] += the products of NBL blocks of a group, blocks bl0.. (quants qa[j] / qb[j] and
// weight scales dg[j] / dg8[j] of rows g and g+8 for block bl0 + j), with the tile's (<= 16)
// activation rows, whose group starts at xg (rows rs bytes apart): one m16n8k32 int8 mma a
// block and n8 tile, each int32 scaled by the weight row's and the token's block scales and
// summed in block order.
template <int NBL>
__device__ __forceinline__ void rows_mul_blocks(float (&acc)[2][4], const uint2* qa, const uint2* qb, const float* dg,
                                                const float* dg8, int bl0, const u8* xg, int rs, int nt, int g, int t) {
#if __CUDA_ARCH__ >= 800
#pragma unroll
    for (int ni = 0; ni < 2; ni++) {
        if (ni * 8 >= nt) break;  // only padding tokens (block-uniform)
        const uint2 h0 = *(const uint2*)(xg + (ni * 8 + 2 * t) * rs);
        const uint2 h1 = *(const uint2*)(xg + (ni * 8 + 2 * t + 1) * rs);
        const u8* xq = xg + (ni * 8 + g) * rs + 16 + 8 * t;
#pragma unroll
        for (int j = 0; j < NBL; j++) {
            const int bl = bl0 + j;
            const uint2 bq = *(const uint2*)(xq + 32 * bl);
            const u32 a[4] = {qa[j].x, qb[j].x, qa[j].y, qb[j].y};
            const u32 b[2] = {bq.x, bq.y};
            int c[4] = {0, 0, 0, 0};
            mma_s8(c, a, b);
            const float d0 = hsel(h0, bl), d1 = hsel(h1, bl);
            acc[ni][0] += (float)c[0] * (dg[j] * d0);
            acc[ni][1] += (float)c[1] * (dg[j] * d1);
            acc[ni][2] += (float)c[2] * (dg8[j] * d0);
            acc[ni][3] += (float)c[3] * (dg8[j] * d1);
        }
    }
#endif
}
// A whole group's products (its four blocks).
__device__ __forceinline__ void rows_mul(float (&acc)[2][4], const RowsGrp& v, const u8* xg, int rs, int nt, int g, int t) {
#if __CUDA_ARCH__ >= 800
    float dg[4], dg8[4];  // the scales of rows g and g+8
#pragma unroll
    for (int bl = 0; bl < 4; bl++) {
        dg[bl] = hsel(v.ha, bl);
        dg8[bl] = hsel(v.hb, bl);
    }
    rows_mul_blocks<4>(acc, v.qa, v.qb, dg, dg8, 0, xg, rs, nt, g, t);
#endif
}
// The warp's 16 rows from rr0 (rows < m) for the tile's nt tokens, to their output rows.
__device__ __forceinline__ void rows_store(const float (&acc)[2][4], float* out, i64 ooff, i64 ostride, const int* dst_row, int rr0,
                                           int m, int nt, int g, int t) {
#pragma unroll
    for (int ni = 0; ni < 2; ni++)
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int row = rr0 + g + (c >> 1) * 8;
            const int j = ni * 8 + 2 * t + (c & 1);
            if (row < m && j < nt) out[ooff + (i64)dst_row[j] * ostride + row] = acc[ni][c];
        }
}

// Group gi of a warp's 16 rows into v: from the 16-row tiled copy at pa (tl: MMQ_TG bytes a
// group, in the order the lanes load them, see tile16_q8; one 16-byte load a lane for the scales
// of rows g and g+8, one a block for its 8 bytes of each: every block a warp's 512 contiguous
// bytes), else from row-major rows pa (row g) and pb (row g+8), MMQ_GB bytes a group.
__device__ __forceinline__ void rows_load(RowsGrp& v, const u8* pa, const u8* pb, bool tl, int gi, int g, int t,
                                          int lane) {
    if (tl) {
        const u8* p = pa + (i64)gi * MMQ_TG;
#if MMQ_ROWS_NA
        const uint4 h = ldw16(p + 16 * g);
#else
        const uint4 h = __ldg((const uint4*)(p + 16 * g));
#endif
        v.ha = make_uint2(h.x, h.y);
        v.hb = make_uint2(h.z, h.w);
#pragma unroll
        for (int bl = 0; bl < 4; bl++) {
            // Words: row g's first 4 bytes, row g+8's, row g's next 4, row g+8's (a0..a3).
#if MMQ_ROWS_NA
            const uint4 q = ldw16(p + 128 + 512 * bl + 16 * lane);
#else
            const uint4 q = __ldg((const uint4*)(p + 128 + 512 * bl + 16 * lane));
#endif
            v.qa[bl] = make_uint2(q.x, q.z);
            v.qb[bl] = make_uint2(q.y, q.w);
        }
        return;
    }
    const u8* a = pa + (i64)gi * MMQ_GB;
    const u8* b = pb + (i64)gi * MMQ_GB;
    v.ha = __ldg((const uint2*)a);
    v.hb = __ldg((const uint2*)b);
#pragma unroll
    for (int bl = 0; bl < 4; bl++) {
        v.qa[bl] = __ldg((const uint2*)(a + 16 + 32 * bl + 8 * t));
        v.qb[bl] = __ldg((const uint2*)(b + 16 + 32 * bl + 8 * t));
    }
}

// The rows kernels' pair launch (gate and up): blocks of the upper half along x take the second
// matrix (W2 and its shared, output and tiled copies). Returns the block's row block.
__device__ __forceinline__ int rows_pair_half(const u8*& W, const u8*& Ws, float*& out, const u8*& Wtl, const u8* W2,
                                              const u8* Ws2, float* out2, const u8* W2tl) {
    int bx = blockIdx.x;
    if (W2 && bx >= (int)(gridDim.x >> 1)) {
        bx -= gridDim.x >> 1;
        W = W2;
        Ws = Ws2;
        out = out2;
        Wtl = W2tl;
    }
    return bx;
}

// The weights are the only input known before the previous kernel ends, so each warp issues
// its first NBUF groups before the PDL wait whenever the block's matrix follows from its index:
// always for dense products (matrix blockIdx.z / nsplit), and for grouped ones with `early`
// (the host's choice when the experts are busy, pairs >= 2 x experts): blocks y < n_exp then
// take expert y's first tile (an expert without tokens leaves after the wait, its loads unused)
// and blocks y >= n_exp the experts' later tiles (mmq_find_tile with skip). Without `early` every
// grouped block finds its tile from the counts first. The same loads and sums either way, so
// the same bits; only when the weight stream starts moves: during the previous kernel's tail
// instead of two dependent loads (counts, then the token list) after it.
// early = 1 + S with S > 0 (shared chunks first; the experts from e_sh on are the shared FFN's
// chunks, every token in each): blocks y < S take the chunks' tiles, S / (n_exp - e_sh) a chunk
// (matrix known before the wait), then blocks S + e for routed expert e's first tile, then the
// routed experts' later tiles. The chunks' full 16-token tiles are the launch's longest blocks;
// placed last (after every first tile) they were its ragged tail, two blocks an SM.
// (The GLU and its quantisation in the gate/up launch's epilogue, a block taking the same 64
// rows of gate and up as its two row sets, Path::GluEpi, measured 64 sequences 8,229 -> 7,709 on
// the H200, gpu-next99, and was removed; git history has it, commit ffed77c.)
// (The GLU quantised in the gate/up pair's second blocks, Path::GluPair / mmq_q8_rows_r2g, measured 64 sequences 8,460 -> 8,120 and 80 8,546 -> 8,224 on the H200, gpu-next103, and was removed; git history has it, commit 06e7140.)
// (The MoE flow, Path::MoeFlow / mmq_q8_rows_r2f: the down launch's blocks waiting on per-tile
// flags instead of the gate/up launch's end, the GLU quantised by 128-group by the last gate/up
// block on its rows, no quantisation launch between; the same bits. Nsight had the gate/up's
// SMs idle 11% of its time on average (ragged tail), which the down was to fill. Measured on the
// H200, gpu-next120: 64 sequences at -d 96 8,436 / 8,441 against 8,461 / 8,475, -d 400 8,067
// against 8,107, 128 sequences 13,841 against 14,138, the server 7,971 against 8,020. A first
// form (a tile's whole GLU by its last block, serial) lost 13%. Removed; git history has it,
// commit 970bbc0. Its code in the same kernel made the r2 loop spill 16 B, -4%: flow code stays
// out of the default kernels.)
template <int NBUF, bool DENSE, int R>
__device__ __forceinline__ void mmq_rows_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups,
                                              const u8* X, i64 xrow, int n, const int* cnt, const int* off,
                                              const int* perm, int n_exp, int in_div, float* out, i64 ooff,
                                              i64 ostride, int nsplit, i64 split_stride, const u8* Ws,
                                              i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2,
                                              float* out2, const u8* Wtl, const u8* W2tl, i64 tl_mat_bytes, int early,
                                              int tail0, int tail1) {
#if __CUDA_ARCH__ >= 800
    constexpr int BN = 16;
    const int bx = rows_pair_half(W, Ws, out, Wtl, W2, Ws2, out2, W2tl);
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ int src_row[BN], dst_row[BN];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    // Split K (dense only): this block sums groups [g0, g1) into its own partial output.
    const int split = DENSE ? blockIdx.z % nsplit : 0, zg = gridDim.z / nsplit;
    const int gps = DENSE ? (ngroups + nsplit - 1) / nsplit : ngroups;
    const int g0 = DENSE ? split * gps : 0, ng = DENSE ? min(ngroups, g0 + gps) - g0 : ngroups;
    if (DENSE) out += split * split_stride;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    // R row sets a warp (grouped only): rows r0 + s*MMQ_BM for s < R, one after the other.
    static_assert(R == 1 || !DENSE, "row sets are for grouped products");
    // Tail halves (R > 1): the tiles [tail0, tail1) of the launch's y order (its last blocks:
    // the first tiles' last few, and the later tiles) each as 2 blocks of one row set along y
    // (grid.y has tail1 - tail0 more), so that the launch's last blocks take half as long and
    // its ragged tail shrinks; the same rows, the same sums.
    // yb: the block's tile index in the order without halves; sub: its row set (-1: all R).
    int yb = blockIdx.y, sub = -1;
    if (R > 1 && yb >= tail0 && tail1 > tail0) {
        const int d = yb - tail0, w = tail1 - tail0;
        if (d < 2 * w) {
            yb = tail0 + (d >> 1);
            sub = d & 1;
        } else {
            yb -= w;
        }
    }
    const int r0 = bx * (MMQ_BM * R) + (sub > 0 ? MMQ_BM : 0) + warp * 16;
    // The block's matrix before the wait (pre), or from the counts after it.
    const int shT = !DENSE && early > 1 ? early - 1 : 0;  // shared chunks' tiles first (S)
    bool pre = DENSE || (early && yb < n_exp);
    int e = DENSE ? blockIdx.z / nsplit : yb, start = DENSE ? blockIdx.y * BN : 0, count = n;
    if (shT) {
        const int y = yb, per = shT / (n_exp - e_sh);
        pre = y < shT + e_sh;
        e = y < shT ? e_sh + y / per : y - shT;
        start = y < shT ? (y % per) * BN : 0;
    }
    const u8* Wt = nullptr;
    i64 rb = 0;
    bool tl = false;
    const u8* pa = nullptr;
    const u8* pb = nullptr;
    auto matrix = [&]() {
        const bool sh = !DENSE && e >= e_sh;
        Wt = sh ? Ws + (i64)(e - e_sh) * ws_stride : W + (i64)e * mat_bytes;
        rb = sh ? ws_row_bytes : row_bytes;
        // Routed experts with a tiled copy (CudaWeight::tiled): the warp's 16 rows are one tile,
        // MMQ_TG bytes a group, in the order the lanes load them (see tile16_q8).
        tl = !DENSE && Wtl && !sh;
        if (tl) {
            pa = Wtl + (i64)e * tl_mat_bytes + (i64)min(r0 >> 4, (m - 1) >> 4) * ngroups * MMQ_TG;
            pb = pa;
        } else {
            pa = Wt + (i64)min(r0 + g, m - 1) * rb + (i64)g0 * MMQ_GB;
            pb = Wt + (i64)min(r0 + g + 8, m - 1) * rb + (i64)g0 * MMQ_GB;
        }
    };
    // (Group indices from here on count from g0.)
    auto load = [&](RowsGrp& v, int gi) {
        rows_load(v, pa, pb, tl, min(gi, ng - 1), g, t, lane);
    };
    // NBUF groups in flight: group gi in buffer gi % NBUF, reloaded with gi + NBUF once used.
    // R > 1: the warp's row sets that exist walk as one stream of nrs * ng groups (the next
    // set's first groups load while the last ones of the set before are multiplied; the block's
    // start is paid once for R sets).
    RowsGrp v[NBUF];
    int nrs = 0;
#pragma unroll
    for (int s2 = 0; s2 < R; s2++) nrs += (s2 == 0 || sub < 0) && r0 + s2 * MMQ_BM < m;
    const int nv = R == 1 ? ng : nrs * ng;
    int ls = 0, lg = 0;  // the next group to load: row set ls, group lg (R > 1)
    auto load_next = [&](RowsGrp& x) {
        load(x, lg);
        if (++lg == ng) {
            lg = 0;
            ++ls;
            const int rs0 = r0 + ls * MMQ_BM;
            if (tl) {
                pa = Wtl + (i64)e * tl_mat_bytes + (i64)min(rs0 >> 4, (m - 1) >> 4) * ngroups * MMQ_TG;
                pb = pa;
            } else {
                pa = Wt + (i64)min(rs0 + g, m - 1) * rb;
                pb = Wt + (i64)min(rs0 + g + 8, m - 1) * rb;
            }
        }
    };
    auto first_loads = [&]() {
        if constexpr (R == 1) {
            if (ng > 0) {
#pragma unroll
                for (int i = 0; i < NBUF; i++) load(v[i], i);
            }
        } else {
#pragma unroll
            for (int i = 0; i < NBUF; i++)
                if (i < nv) load_next(v[i]);
        }
    };
    if (pre) {
        matrix();
        first_loads();
#if (MMQ_DN_PF || MMQ_GU_PF) && __CUDA_ARCH__ >= 900
        // (W2 is null for a launch of single matrices; rows_pair_half kept it as passed)
        const int pf_blocks = W2 == nullptr ? MMQ_DN_PF : MMQ_GU_PF;
        if (!DENSE && tl && lane == 0 && (int)(blockIdx.y * gridDim.x + blockIdx.x) < pf_blocks) {
#pragma unroll
            for (int s2 = 0; s2 < R; s2++) {
                const int rs0 = r0 + s2 * MMQ_BM;
                if ((s2 > 0 && sub >= 0) || rs0 >= m) continue;
                const int skip = s2 == 0 ? NBUF : 0;  // groups already in registers
                if (ngroups <= skip) continue;
                const u8* p = Wtl + (i64)e * tl_mat_bytes + ((i64)(rs0 >> 4) * ngroups + skip) * MMQ_TG;
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"((unsigned)((ngroups - skip) * MMQ_TG))
                             : "memory");
            }
        }
#endif
    }
    pdl_wait();
    // (Grouped: the expert's count and list offset read together, one trip to L2 for both
    // before the token list; the same values. The exit below tests both, so that neither
    // compiler sinks the offset's load past it to where the offset is used. MMQ_OFF_EARLY=0, a
    // measurement define: the offset read where it is used, after the count's test. H200,
    // gpu-next93, 64 sequences, two rounds: 8,045 / 8,045 tok/s against 8,024 / 8,025, the same
    // hash.)
    int off_e = -1;
    if (!DENSE) {
        if (pre) {
            count = cnt[e];
#if MMQ_OFF_EARLY
            off_e = off[e];
            if (count == 0 && off_e >= 0) return;  // every thread alike, before any barrier (off_e >= 0 always)
#else
            if (count == 0) return;  // every thread alike, before any barrier
#endif
        } else {
            // (shT: the routed experts' later tiles, from block shT + e_sh on)
            if (tid < 32)
                mmq_find_tile<BN>(cnt, shT ? e_sh : n_exp, tid, tile_e, tile_start, early ? 1 : 0, shT ? shT + e_sh : -1, yb);
            __syncthreads();
            e = tile_e;
            if (e < 0) return;
            start = tile_start;
            count = cnt[e];
            off_e = off[e];
        }
    }
    const int nt = min(BN, count - start);
    if (nt <= 0) return;  // (a split with no groups, ng <= 0, still writes its zero partials)
    if ((MMQ_ROWS_KO & 2) && !DENSE) {
        if (tid < BN) {
            src_row[tid] = 0;
            dst_row[tid] = min(tid, nt - 1);
        }
    } else {
        mmq_tile_rows<BN>(DENSE ? nullptr : perm, off, e, start, nt, in_div, zg, src_row, dst_row, off_e);
    }
    if (!pre) {
        matrix();
        first_loads();
    }
    __syncthreads();
    // The activation rows of the n8 tiles in use, groups g0.. only. A row's stride in words is
    // 8 mod 32, so the 4 rows of a half-warp's 8-byte fragment loads start 8 banks apart.
    // (MMQ_ROWS_PAD=0, a measurement define: rows padded by 16 bytes instead, a stride of
    // 4 words mod 32 for 16 groups.)
#if MMQ_ROWS_PAD
    const int xb = ng * MMQ_GB, rs = xb + 4 * (((8 - 4 * ng) % 32 + 32) % 32), pieces = xb >> 4;
#else
    const int xb = ng * MMQ_GB, rs = xb + 16, pieces = xb >> 4;
#endif
    const int nb = nt > 8 ? 16 : 8;
    for (int c = tid; c < ((MMQ_ROWS_KO & 1) && !DENSE ? 0 : nb * pieces); c += MMQ_THREADS) {
        const int r = c / pieces, q = c - r * pieces;
        cp_async16(mmq_sm + r * rs + q * 16, X + (i64)src_row[r] * xrow + (i64)g0 * MMQ_GB + q * 16);
    }
    cp_commit();
    float acc[2][4];
#pragma unroll
    for (int ni = 0; ni < 2; ni++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[ni][c] = 0.f;
    auto mul = [&](const RowsGrp& v, int gi) {
        if ((MMQ_ROWS_KO & 4) && !DENSE) {
            u32 x = v.ha.x ^ v.ha.y ^ v.hb.x ^ v.hb.y;
#pragma unroll
            for (int bl = 0; bl < 4; bl++) x ^= v.qa[bl].x ^ v.qa[bl].y ^ v.qb[bl].x ^ v.qb[bl].y;
            acc[0][0] += __int_as_float(x & 0x3fffffffu);
        } else {
            rows_mul(acc, v, mmq_sm + gi * MMQ_GB, rs, nt, g, t);
        }
    };
    auto store = [&](int rr0) { rows_store(acc, out, ooff, ostride, dst_row, rr0, m, nt, g, t); };
    cp_wait<0>();
    __syncthreads();
    if constexpr (R == 1) {
        if (r0 >= m) return;  // no barrier past here
        for (int gi = 0; gi < ng; gi += NBUF) {
#pragma unroll
            for (int i = 0; i < NBUF; i++) {
                if (gi + i < ng) {
                    mul(v[i], gi + i);
                    if (gi + i + NBUF < ng) load(v[i], gi + i + NBUF);
                }
            }
        }
        store(r0);
    } else {
        if (nv == 0) return;  // no barrier past here
        int ms = 0, mg = 0;  // the group to multiply: row set ms, group mg
        for (int vi = 0; vi < nv; vi += NBUF) {
#pragma unroll
            for (int i = 0; i < NBUF; i++) {
                if (vi + i < nv) {
                    mul(v[i], mg);
                    if (vi + i + NBUF < nv) load_next(v[i]);
                    if (++mg == ng) {
                        store(r0 + ms * MMQ_BM);
                        mg = 0;
                        ++ms;
#pragma unroll
                        for (int ni = 0; ni < 2; ni++)
#pragma unroll
                            for (int c = 0; c < 4; c++) acc[ni][c] = 0.f;
                    }
                }
            }
        }
    }
#else
    pdl_wait();
#endif
}

#define MMQ_ROWS_INST(NAME, NBUF, MINB, DENSE, R)                                                                  \
    extern "C" __global__ void __launch_bounds__(MMQ_THREADS, MINB)                                             \
        NAME(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int ngroups, const u8* X, i64 xrow, int n,       \
             const int* cnt, const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff,      \
             i64 ostride, int nsplit, i64 split_stride, const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh, \
             const u8* W2, const u8* Ws2, float* out2, const u8* Wtl, const u8* W2tl, i64 tl_mat_bytes,        \
             int early, int tail0, int tail1) {                                                                 \
        pdl_trigger(); /* the wait is mmq_rows_impl's, after the first weight loads */                          \
        mmq_rows_impl<NBUF, DENSE, R>(W, row_bytes, mat_bytes, m, ngroups, X, xrow, n, cnt, off, perm, n_exp, in_div, out, \
                            ooff, ostride, nsplit, split_stride, Ws, ws_row_bytes, ws_stride, e_sh, W2, Ws2, out2, \
                            Wtl, W2tl, tl_mat_bytes, early, tail0, tail1);                                      \
    }
// Two groups in flight a warp (96 registers: 5 blocks an SM). Measured on the H200 (bench
// --parallel 64 -n 32, each pair in one call): 6,575 / 6,587 tok/s against mmq_q8_16's 6,150 /
// 6,150, same tokens; three groups in flight (113 registers) 6,633 / 6,634 but 10,861 against
// 11,094 at 128 sequences; four (142) 6,296 / 6,319; the first build (102 registers) 6,652
// against 6,129, and bounded to 6 blocks (79 registers) 5,506. 16 and 32 sequences: +11%, +9%.
// Nsight at 64 sequences (gate/up): 189 us against 204, 45.5M instructions against 73M, 2.3 TB/s
// against 2.1, issue slots 35% busy and 10 cycles between a warp's instructions: still waiting on
// memory, with 20 warps an SM and 2 groups (4.6 KB) in flight each.
// gpu-next11 (same tokens): rows at a stride of 8 words mod 32 halve the shared-memory bank
// conflicts (Nsight: 1.08M against 2.14M a gate/up launch) for no time (181 us against 180);
// padding rule x blocks-bound (MMQ_ROWS_PAD 1/0 x MMQ_ROWS_MINB 5/4): 6,656, 6,673, 6,697, 6,669
// against main's 6,561 / 6,583, all within 0.6% of each other; the tiled expert copy (16 rows,
// group-major, TS_CUDA_MOE_TILED) 7,228 (PAD 1, MINB 5: 91 registers, the defaults) / 7,214:
// DRAM locality, not the shared memory, held it back. (MINB 4 gives PAD 1 102 registers.)
MMQ_ROWS_INST(mmq_q8_rows, 2, MMQ_ROWS_MINB, false, 1)
// Two row sets a warp: 128 rows a block, the same bits (96 registers). The default from 12 pairs
// an expert (CudaBackend::rows_r): 128 sequences 12,663 -> 13,122 tok/s on the H200, 64 the same,
// 32 sequences -1.5%; four row sets (256 rows a block) lost at all three (64: 7,085 vs 7,512).
MMQ_ROWS_INST(mmq_q8_rows_r2, 2, MMQ_ROWS_MINB, false, 2)
// Dense products (TS_CUDA_MMQ_ROWS=n: up to n tokens a matrix, default 48), split K as
// mmq_q8_16 splits it.
MMQ_ROWS_INST(mmq_q8_rows_d, 2, 4, true, 1)

// (The grouped rows product in stream-K form, Path::RowsSk / mmq_q8_rows_sk: one wave of equal shares of the launch's steps, a unit split between two blocks finished from the first one's sums, the same bits; measured 64 sequences 7,125 against 9,624 on the H200, gpu-next146, and was removed; git history has it, commit 901d341.)

// out[ooff + r*ostride + c] = sum over s < nsplit (in order) of part[s*split_stride + r*m + c].
extern "C" __global__ void mmq_sum_splits(const float* part, int nsplit, i64 split_stride, int rows, int m, float* out,
                                          i64 ooff, i64 ostride) { PDL_ENTRY();
    const i64 total = (i64)rows * m;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 r = idx / m, c = idx - r * m;
        float v = 0.f;
        for (int s = 0; s < nsplit; s++) v += part[s * split_stride + idx];
        out[ooff + r * ostride + c] = v;
    }
}

// splits_sum4: the four values at p of each of nsplit splits s4 float4s apart, summed in order
// (one 16-byte load a split, four splits' loads issued before their adds). (Split sums four
// values a thread for every dense product, Path::Sum4, measured 64 sequences 8,229 -> 8,199 on
// the H200, gpu-next99, and were removed; git history has them, commit ffed77c.)
__device__ __forceinline__ float4 splits_sum4(const float4* p, int nsplit, i64 s4) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    int s = 0;
    for (; s + 4 <= nsplit; s += 4) {
        float4 a[4];
#pragma unroll
        for (int u = 0; u < 4; u++) a[u] = p[(s + u) * s4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            v.x += a[u].x;
            v.y += a[u].y;
            v.z += a[u].z;
            v.w += a[u].w;
        }
    }
    for (; s < nsplit; s++) {
        const float4 a = p[s * s4];
        v.x += a.x;
        v.y += a.y;
        v.z += a.z;
        v.w += a.w;
    }
    return v;
}
// mmq_sum_splits of up to three jobs' partials in one launch (after mmq_q8_64_jobs): job j's
// rows * m_j sums follow the jobs before it, each summed as mmq_sum_splits sums it (the same
// bits). A job without splits: m_j = 0. 32-bit indices (the host keeps all rows * m_j below
// 2^31 together).
#define SUM_JOB_ARGS(j) const float *p##j, int ns##j, i64 ss##j, int m##j, float *o##j, i64 oo##j, i64 os##j
extern "C" __global__ void mmq_sum_splits_jobs(SUM_JOB_ARGS(0), SUM_JOB_ARGS(1), SUM_JOB_ARGS(2), int rows) { PDL_ENTRY();
    const int t0 = rows * m0, t1 = t0 + rows * m1, total = t1 + rows * m2;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
        const int j = idx < t0 ? 0 : idx < t1 ? 1 : 2;
        const int i = idx - (j == 0 ? 0 : j == 1 ? t0 : t1);
        const int m = j == 0 ? m0 : j == 1 ? m1 : m2, ns = j == 0 ? ns0 : j == 1 ? ns1 : ns2;
        const float* part = j == 0 ? p0 : j == 1 ? p1 : p2;
        const i64 ss = j == 0 ? ss0 : j == 1 ? ss1 : ss2;
        const int r = i / m, c = i - r * m;
        float v = 0.f;
        for (int s = 0; s < ns; s++) v += part[s * ss + i];
        float* o = j == 0 ? o0 : j == 1 ? o1 : o2;
        o[(j == 0 ? oo0 : j == 1 ? oo1 : oo2) + (i64)r * (j == 0 ? os0 : j == 1 ? os1 : os2) + c] = v;
    }
}

// mmq_sum_splits for rows of whole 128-value groups (m % 128 == 0), which also writes each summed
// row's Q8_0 groups into xq (row r's group g at xq + (r * m/128 + g) * 144) for the int8 product
// that reads them next: one warp a group, the same sums in the same order and the same
// quantisation as mmq_sum_splits then quant_q8_groups (quant_group_store), one launch fewer.
extern "C" __global__ void mmq_sum_splits_q8(const float* part, int nsplit, i64 split_stride, int rows, int m, float* out,
                                             i64 ooff, i64 ostride, u8* xq) { PDL_ENTRY();
    const int gpr = m >> 7, lane = threadIdx.x & 31;
    const int gid = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gid >= rows * gpr) return;
    const int r = gid / gpr;
    const int c0 = (gid - r * gpr) * 128 + lane * 4;
    // The lane's four values are one 16-byte piece of each split (m % 128 == 0, split_stride
    // = rows * m): one load a split, four splits' loads before their adds (as sum4_at).
    const float4 a = splits_sum4((const float4*)(part + (i64)r * m + c0), nsplit, split_stride >> 2);
    const float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; j++) out[ooff + (i64)r * ostride + c0 + j] = v[j];
    quant_group_store(v, lane, xq + (i64)gid * MMQ_GB);
}

// ---- The f16 prompt path: expert products as plain f16 tensor-core GEMMs -------------------------
// The int8 products above pay a per-32 scale epilogue after every mma (I2F, the scale product and
// an FMA per output: 384 of ~560 instructions a warp and stage on the prompt expert tiles). With
// an f16 copy of the weights (CudaWeight::half, each value f16(q * d) of its block: q * d is exact
// in f32, then rounded once) and f16 activations, an m16n8k16 mma accumulates straight into f32
// with nothing after it. Costs the copy's memory (2 bytes a weight), so it is made only where it
// fits (CudaBackend::f16_copy).
// (The I2F there is not the cost: replacing it by sums started at 0x4B400000 and one FADD, the
// same bits, lost on the H200 in gpu-next98: 64 sequences 8,228 -> 8,047 tok/s, pp512 32,579 ->
// 32,415, tg128 709.9 -> 707.9. I2F runs on its own pipe; the FADD took FMA-pipe slots.)

// The f16 copy of Q8_0 rows in the device layout (ng groups of 144 bytes a row), each value
// f16(q * d), in 8 KB chunks of 64 rows x 64 values (rows a multiple of 64 per matrix, so tiles
// never straddle two): chunk (r / 64, c / 64) at ((r / 64) * (K / 64) + c / 64) * 4096 halves,
// row r % 64 of it 64 halves from there, so a 64-row tile's K-stage is one contiguous read.
// Measured on the H200 against row-major copies (same call): pp512 19,334 -> 19,522, pp2048
// 17,754 -> 17,874. One thread per 8 values.
// tiled = 0: row-major instead (row r's values at r * K halves), the layout cuBLAS reads: the shared
// FFN's copies where it runs on cuBLAS (CudaBackend::shared_blas).
extern "C" __global__ void q8_to_f16(const u8* src, uint4* dst, i64 total, int ng, int tiled) { PDL_ENTRY();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / (ng * 16);
        const int c = (int)(i - row * ng * 16), gi = c >> 4, p = c & 15;
        const u8* gp = src + (row * ng + gi) * MMQ_GB;
        const float d = h2f(((const u16*)gp)[p >> 2]);
        const uint2 q = *(const uint2*)(gp + 16 + 8 * p);  // block p/4, bytes 8*(p%4)..
        const u32 w[2] = {q.x, q.y};
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 x = w[j >> 1] >> (16 * (j & 1));
            const float lo = (float)(signed char)(x & 0xff) * d, hi = (float)(signed char)((x >> 8) & 0xff) * d;
            o[j] = (u32)f2h(lo) | (u32)f2h(hi) << 16;
        }
        // (the 16-byte piece c of row `row`: value c*8 = stage c/8, piece c%8 of the stage)
        const i64 at = tiled ? ((row >> 6) * (ng * 2) + (c >> 3)) * 512 + (row & 63) * 8 + (c & 7) : i;
        dst[at] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// Activation rows to f16 for the f16 products: dst row j (k halves, k % 8 == 0) = f16(x) with
// x = src[off + j*stride + c], or with act (1 = SiLU, 2 = GELU-tanh) act(src) * src2 (the GLU of
// gate and up rows, same offsets and strides). One thread per 8 values. (Clamped to the f16
// range: an activation past 65504 saturates instead of turning into inf.)
extern "C" __global__ void f16_rows(const float* src, const float* src2, i64 off, i64 stride, int n, int k, int act,
                                    uint4* dst) { PDL_ENTRY();
    const int per = k >> 3;
    const i64 total = (i64)n * per;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / per;
        const int c = (int)(i - row * per) * 8;
        const float* s = src + off + row * stride + c;
        const float* s2 = act ? src2 + off + row * stride + c : nullptr;
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float a = s[2 * j], b = s[2 * j + 1];
            if (act) {
                a = act_fn(act, a) * s2[2 * j];
                b = act_fn(act, b) * s2[2 * j + 1];
            }
            o[j] = (u32)f2h_sat(a) | (u32)f2h_sat(b) << 16;
        }
        dst[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// out[ooff + dst_j * ostride + row] = W_e[row] . X[src_j] with f16 weights and activations, f32
// accumulation: mmq_impl's tiles, gathers, shared chunks and dense layout (see there; no split K,
// no pairs), k % 64 == 0 values a row; W in q8_to_f16's 64 x 64 tiles, `row_bytes` from one
// 64-row tile to the next; rows of X `xrow` bytes apart.
// K in stages of 64 values (128 bytes a row, padded to 144 in shared memory: 36 words, so the 8
// rows of an ldmatrix phase fall in different banks), NST stages in flight (cp.async). Warps WR
// along the rows x WC along the tokens, each MI m16 x NI n8 tiles. The fragments load exactly as
// in mmq_impl: a 32-byte span of a row is 32 int8 there and 16 halves here, in the same places.
// GLU (the MoE's gate and up in one launch, mmf16_gu): W and Ws are the gate's copies, W2 and Ws2
// the up's (same shapes); each warp's m16 tiles mi < MI/2 hold gate rows and mi >= MI/2 the up
// rows of the same ff rows, so a block covers BM/2 ff rows, and the epilogue writes
// f16(act(gate) * up) (act 1 SiLU, 2 GELU-tanh) to the u16 rows at `out` instead of two f32
// products: the same f32 sums as the two plain launches, then f16_rows' arithmetic, so the same
// bits as gate, up and f16_rows one after the other.
// The weight row (clamped to m - 1) that shared row r of an f16 tile stages (mmf_impl and its
// kin), and in `up` whether it is the up matrix's: with GLU, shared row r is warp-row
// r / (MI*16), gate for its first MI*8 rows, up after.
template <int MI, bool GLU>
__device__ __forceinline__ int mmf_weight_row(int r, int m0, int m, bool& up) {
    const int hm = MI * 8, rw = r / (2 * hm), rin = r % (2 * hm);
    up = GLU && rin >= hm;
    return min(GLU ? m0 + rw * hm + rin % hm : m0 + r, m - 1);
}
// The f16 tiles' matrices (mmf_impl, mmfq_impl): expert e's, or for a shared chunk (sh) chunk
// e - e_sh of the shared FFN's; with GLU the up matrix's too (else wt2 = wt); and their row bytes.
template <bool GLU>
__device__ __forceinline__ void mmf_tile_weights(bool sh, int e, const u8* W, i64 row_bytes, i64 mat_bytes, const u8* Ws,
                                                 i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2,
                                                 const u8*& wt, const u8*& wt2, i64& rb) {
    wt = sh ? Ws + (i64)(e - e_sh) * ws_stride : W + (i64)e * mat_bytes;
    wt2 = GLU ? (sh ? Ws2 + (i64)(e - e_sh) * ws_stride : W2 + (i64)e * mat_bytes) : wt;
    rb = sh ? ws_row_bytes : row_bytes;
}
// The f16 tiles' epilogue (mmf_impl, mmfq_impl): the f32 products of the warp's tiles to `out`,
// or with GLU (gate rows in the first MI/2 m16 tiles, up rows in the rest) f16(act(gate) * up)
// to the u16 rows at `out`.
template <int WR, int MI, int NI, bool GLU>
__device__ __forceinline__ void mmf_epilogue(const float (&acc)[MI][NI][4], float* out, i64 ooff, i64 ostride,
                                             const int* dst_row, int m0, int wm, int wn, int m, int nt, int warp, int g,
                                             int t, int act) {
    if constexpr (GLU) {
        u16* oh = (u16*)out;
#pragma unroll
        for (int mi = 0; mi < MI / 2; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const int row = m0 + (warp % WR) * (MI * 8) + mi * 16 + g + (c >> 1) * 8;
                    const int j = wn + ni * 8 + 2 * t + (c & 1);
                    if (row < m && j < nt)
                        oh[ooff + (i64)dst_row[j] * ostride + row] =
                            f2h_sat(act_fn(act, acc[mi][ni][c]) * acc[mi + MI / 2][ni][c]);
                }
    } else {
        acc_store(acc, out, ooff, ostride, dst_row, m0 + wm, wn, m, nt, g, t);
    }
}
// One stage of an f16 tile (mmf_impl): 64 k values of the warp's MI m16 x NI n8
// tiles from the weight rows at As_s and the activation rows at Bs_s (shared-space addresses,
// rows RS bytes apart), by ldmatrix and m16n8k16.
template <int MI, int NI, int RS>
__device__ __forceinline__ void mmf_stage(float (&acc)[MI][NI][4], u32 As_s, u32 Bs_s, int li, int lr) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 a[MI][4], b[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) ldsm4_s(a[mi], As_s + (u32)((mi * 16 + (li & 1) * 8 + lr) * RS + kk * 32 + (li >> 1) * 16));
#pragma unroll
        for (int np = 0; np < NI / 2; np++) {
            u32 r[4];
            ldsm4_s(r, Bs_s + (u32)((np * 16 + (li >> 1) * 8 + lr) * RS + kk * 32 + (li & 1) * 16));
            b[2 * np][0] = r[0];
            b[2 * np][1] = r[1];
            b[2 * np + 1][0] = r[2];
            b[2 * np + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++) mma_f16(acc[mi][ni], a[mi], b[ni]);
    }
}
template <int WR, int WC, int MI, int NI, int NST, bool GLU>
__device__ __forceinline__ void mmf_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const u8* X, i64 xrow,
                                         int n, const int* cnt, const int* off, const int* perm, int n_exp, int in_div,
                                         float* out, i64 ooff, i64 ostride, const u8* Ws, i64 ws_row_bytes,
                                         i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2, int act) {
#if __CUDA_ARCH__ >= 800
    constexpr int BM = WR * MI * 16, BN = WC * NI * 8, THREADS = WR * WC * 32;
    constexpr int RS = 144, ROWS = BM + BN, STAGE = ROWS * RS, PIECES = 8;
    constexpr int PER = (ROWS * PIECES + THREADS - 1) / THREADS;
    static_assert(THREADS >= BN && NI % 2 == 0, "mmf tile");
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ int src_row[BN], dst_row[BN];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    int e = 0, start, count;
    if (!mmq_block_tile<BN>(cnt, n_exp, n, 1, tile_e, tile_start, e, start, count)) return;
    const int nt = min(BN, count - start);
    if (nt <= 0) return;
    mmq_tile_rows<BN>(cnt ? perm : nullptr, off, e, start, nt, in_div, gridDim.z, src_row, dst_row);
    __syncthreads();
    const int m0 = blockIdx.x * (GLU ? BM / 2 : BM);
    const u8 *Wt, *Wt2;
    i64 rb;
    mmf_tile_weights<GLU>(cnt && e >= e_sh, e, W, row_bytes, mat_bytes, Ws, ws_row_bytes, ws_stride, e_sh, W2, Ws2, Wt, Wt2, rb);
    static_assert(!GLU || MI % 2 == 0, "mmf GLU: gate and up halves of a warp's rows");
    // This thread's 16-byte pieces of every stage: (row r, piece q) for c = tid + i*THREADS. The
    // first WPER are weight rows (the tiled copy: `rb` bytes from one 64-row tile to the next, a
    // tile's next stage 8 KB on), the rest activation rows (128 bytes on).
    constexpr int WPER = BM * PIECES / THREADS;
    static_assert(BM * PIECES % THREADS == 0, "mmf: a thread's pieces are weights, then activations");
    const u8* srcp[PER];
    u32 dsto[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = tid + i * THREADS;
        srcp[i] = X;
        dsto[i] = 0;
        if (c < ROWS * PIECES) {
            const int r = c >> 3, q = c & 7;
            bool up;
            const int wr = mmf_weight_row<MI, GLU>(r, m0, m, up);
            const u8* rowp = r >= BM ? X + (i64)src_row[r - BM] * xrow : (up ? Wt2 : Wt) + (i64)(wr >> 6) * rb + (wr & 63) * 128;
            srcp[i] = rowp + q * 16;
            dsto[i] = (u32)(r * RS + q * 16);
        }
    }
    const int nstages = k >> 6;
    const u32 sm0 = smem_addr(mmq_sm);
    auto load = [&](int s) {
        if (s < nstages) {
            const u32 st = sm0 + (u32)((s % NST) * STAGE);
#pragma unroll
            for (int i = 0; i < PER; i++)
                if ((ROWS * PIECES) % THREADS == 0 || tid + i * THREADS < ROWS * PIECES)
                    cp_async16_s(st + dsto[i], srcp[i] + (i64)s * (i < WPER ? 8192 : 128));
        }
        cp_commit();
    };
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3, lr = lane & 7, li = lane >> 3;
    const int wm = (warp % WR) * MI * 16, wn = (warp / WR) * NI * 8;
    float acc[MI][NI][4];
    acc_zero(acc);
#pragma unroll
    for (int s = 0; s < NST - 1; s++) load(s);
    for (int s = 0; s < nstages; s++) {
        cp_wait<NST - 2>();
        __syncthreads();  // stage s has landed for every thread; stage s-1 is consumed
        load(s + NST - 1);
        mmf_stage<MI, NI, RS>(acc, sm0 + (u32)((s % NST) * STAGE + wm * RS), sm0 + (u32)((s % NST) * STAGE + (BM + wn) * RS), li, lr);
    }
    mmf_epilogue<WR, MI, NI, GLU>(acc, out, ooff, ostride, dst_row, m0, wm, wn, m, nt, warp, g, t, act);
#endif
}

#define MMF_INST(NAME, WR, WC, MI, NI, NST, MINB)                                                                   \
    extern "C" __global__ void __launch_bounds__(WR * WC * 32, MINB)                                            \
        NAME(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const u8* X, i64 xrow, int n, const int* cnt, \
             const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff, i64 ostride,          \
             const u8* Ws, i64 ws_row_bytes, i64 ws_stride, int e_sh) {                                          \
        PDL_ENTRY();                                                                                            \
        mmf_impl<WR, WC, MI, NI, NST, false>(W, row_bytes, mat_bytes, m, k, X, xrow, n, cnt, off, perm, n_exp, in_div, \
                                             out, ooff, ostride, Ws, ws_row_bytes, ws_stride, e_sh, nullptr, nullptr, 0); \
    }
// 256 rows x 64 tokens: 4 x 2 warps of 64 x 32, 3 stages (138 KB of shared memory, one block an
// SM). Tiles measured on the H200 (pp512 / pp2048 tok/s, same calls; the int8 path 18,067 /
// 16,803): 64 x 64 on 2 x 2 warps of 32 x 32 16,769 / 15,638; 128 x 64 on 4 x 2 warps of 32 x 32
// 19,508 / 17,828; 128 x 64 on 4 warps of 32 x 64 19,482 / 17,743; this one 19,824 / 17,970.
// Without `volatile` on the fragment loads and mma: the same code, 19,554 / 17,831 on 128 x 64.
MMF_INST(mmf16_256, 4, 2, 4, 4, 3, 1)
// Four stages in flight (the default where the device gives its 184 KB of shared memory, past
// the 160 KB the other fast paths may take; TS_CUDA_MMF=s3 keeps three): pp512 21,249 -> 21,842,
// pp2048 19,361 -> 19,760 with the GLU kernels below (same call). A 128-row tile of four stages
// (two blocks an SM) gained 0.6% and was dropped.
MMF_INST(mmf16_256s4, 4, 2, 4, 4, 4, 1)
// The MoE's gate and up with the GLU (default; TS_CUDA_MMF_GU=0 for the three launches): the
// plain tile's 256 rows, 128 ff rows of gate and of up a block, the f16 GLU rows out; saves the
// up launch, the f32 gate and up rows (8 bytes a pair and ff row, written and read again) and the
// f16_rows launch. Measured on the H200 (same call): pp512 19,949 -> 21,538, pp2048 18,229 ->
// 19,454 (three stages). NST stages as the plain tile's.
#define MMF_GU_INST(NAME, NST)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                             \
        NAME(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const u8* X, i64 xrow, int n, const int* cnt,  \
             const int* off, const int* perm, int n_exp, int in_div, float* out, i64 ooff, i64 ostride, const u8* Ws, \
             i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2, int act) {                      \
        PDL_ENTRY(); /* the MMF_INST arguments, then the up copies and the activation; `out` holds u16 rows */        \
        mmf_impl<4, 2, 4, 4, NST, true>(W, row_bytes, mat_bytes, m, k, X, xrow, n, cnt, off, perm, n_exp, in_div, out,  \
                                        ooff, ostride, Ws, ws_row_bytes, ws_stride, e_sh, W2, Ws2, act);              \
    }
MMF_GU_INST(mmf16_gu, 3)
MMF_GU_INST(mmf16_gu_s4, 4)

// ---- Prompt expert products on f16 tensor cores straight from the Q8_0 weights ----------------
// (TS_CUDA_MMF_Q8=1; written 2026-12-01, NOT yet run on a GPU.) The f16 copies above cost 1.88x the
// experts' bytes (~29 GB on V2-Lite) and make each launch read twice the bytes of the Q8_0
// weights; Nsight has mmf16_gu_s4 waiting on its stages' data at 2.4 TB/s. Here the stage holds the
// Q8_0 group as the int8 path stages it (64 rows of 144 bytes per k128: the 16-byte header of four
// f16 scales, then 128 int8), the A fragments come by ldmatrix as in mmq_impl (lane: row g or g+8,
// int8 k = 4t..4t+3 of a 16-value half of a 32-value block) and are turned into f16 in registers:
// q ^ 0x80 placed under the f16 exponent of 1024 (0x64xx = 1024 + q + 128), minus 1152 (exact), times
// the block's f16 scale (one rounding: f16(q * d), the value q8_to_f16 stores, so the weights are the
// f16 copy's bit for bit). The HMMA's k slots (2t, 2t+1 | 2t+8, 2t+9) then hold the actual k
// (4t, 4t+1 | 4t+2, 4t+3): a permutation within each 16-value chunk, so the B fragments are read to
// match, 8 bytes a thread (k 4t..4t+3 of token g) from f16 activation rows in their natural order
// (a row stride of 72 words: a half-warp's 8-byte loads fall in 32 different banks). Same tiles,
// gathers, shared chunks and GLU epilogue as mmf_impl; k % 128 == 0.
__device__ __forceinline__ void q8x4_to_h2(u32 q, u32 d2, u32& lo, u32& hi) {
    const u32 w = q ^ 0x80808080u;
    u32 l = __byte_perm(w, 0x64646464u, 0x4140), h = __byte_perm(w, 0x64646464u, 0x4342);
    const u32 bias = 0x64806480u;  // f16x2 (1152, 1152)
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(l) : "r"(l), "r"(bias));
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(h) : "r"(h), "r"(bias));
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(lo) : "r"(l), "r"(d2));
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(hi) : "r"(h), "r"(d2));
}
__device__ __forceinline__ uint2 lds64_s(u32 a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
// Scale s (0..3) of a group header as f16x2 (the same f16 twice).
__device__ __forceinline__ u32 hsel2(uint2 h, int s) {
    const u32 w = s < 2 ? h.x : h.y;
    const u32 v = (s & 1) ? (w >> 16) : (w & 0xffffu);
    return v | v << 16;
}
template <int WR, int WC, int MI, int NI, int NST, bool GLU>
__device__ __forceinline__ void mmfq_impl(const u8* W, i64 row_bytes, i64 mat_bytes, int m, int k, const u8* X, i64 xrow,
                                          int n, const int* cnt, const int* off, const int* perm, int n_exp, int in_div,
                                          float* out, i64 ooff, i64 ostride, const u8* Ws, i64 ws_row_bytes,
                                          i64 ws_stride, int e_sh, const u8* W2, const u8* Ws2, int act) {
#if __CUDA_ARCH__ >= 800
    constexpr int BM = WR * MI * 16, BN = WC * NI * 8, THREADS = WR * WC * 32;
    constexpr int RA = 144, RB = 288;  // shared row strides: a Q8_0 group row; 128 f16 + 32 pad bytes
    constexpr int SA = BM * RA, STAGE = SA + BN * RB;
    constexpr int WP = BM * 9, NP = WP + BN * 16;  // 16-byte pieces a stage: weights, then activations
    constexpr int PER = (NP + THREADS - 1) / THREADS, WPER = WP / THREADS;
    static_assert(THREADS >= BN && WP % THREADS == 0 && (BN * 16) % THREADS == 0, "mmfq tile");
    static_assert(!GLU || MI % 2 == 0, "mmfq GLU: gate and up halves of a warp's rows");
    extern __shared__ __align__(16) u8 mmq_sm[];
    __shared__ int src_row[BN], dst_row[BN];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    int e = 0, start, count;
    if (!mmq_block_tile<BN>(cnt, n_exp, n, 1, tile_e, tile_start, e, start, count)) return;
    const int nt = min(BN, count - start);
    if (nt <= 0) return;
    mmq_tile_rows<BN>(cnt ? perm : nullptr, off, e, start, nt, in_div, gridDim.z, src_row, dst_row);
    __syncthreads();
    const int m0 = blockIdx.x * (GLU ? BM / 2 : BM);
    const u8 *Wt, *Wt2;
    i64 rb;
    mmf_tile_weights<GLU>(cnt && e >= e_sh, e, W, row_bytes, mat_bytes, Ws, ws_row_bytes, ws_stride, e_sh, W2, Ws2, Wt, Wt2, rb);
    // This thread's pieces: the first WPER weight pieces (row r = c / 9, piece c % 9 of its group;
    // 144 bytes on a stage), the rest activation pieces (row j, piece q of 16; 256 bytes on).
    const u8* srcp[PER];
    u32 dsto[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int c = tid + i * THREADS;
        srcp[i] = X;
        dsto[i] = 0;
        if (i < WPER) {
            const int r = c / 9, q = c - r * 9;
            bool up;
            const int wr = mmf_weight_row<MI, GLU>(r, m0, m, up);
            srcp[i] = (up ? Wt2 : Wt) + (i64)wr * rb + q * 16;
            dsto[i] = (u32)(r * RA + q * 16);
        } else if (c < NP) {
            const int j = (c - WP) >> 4, q = (c - WP) & 15;
            srcp[i] = X + (i64)src_row[j] * xrow + q * 16;
            dsto[i] = (u32)(SA + j * RB + q * 16);
        }
    }
    const int nstages = k >> 7;
    const u32 sm0 = smem_addr(mmq_sm);
    auto load = [&](int s) {
        if (s < nstages) {
            const u32 st = sm0 + (u32)((s % NST) * STAGE);
#pragma unroll
            for (int i = 0; i < PER; i++)
                if (NP % THREADS == 0 || tid + i * THREADS < NP)
                    cp_async16_s(st + dsto[i], srcp[i] + (i64)s * (i < WPER ? 144 : 256));
        }
        cp_commit();
    };
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3, lr = lane & 7, li = lane >> 3;
    const int wm = (warp % WR) * MI * 16, wn = (warp / WR) * NI * 8;
    float acc[MI][NI][4];
    acc_zero(acc);
#pragma unroll
    for (int s = 0; s < NST - 1; s++) load(s);
    for (int s = 0; s < nstages; s++) {
        cp_wait<NST - 2>();
        __syncthreads();  // stage s has landed for every thread; stage s-1 is consumed
        load(s + NST - 1);
        const u8* Ag = mmq_sm + (s % NST) * STAGE + wm * RA;
        const u32 As_s = sm0 + (u32)((s % NST) * STAGE + wm * RA);
        const u32 Bs_s = sm0 + (u32)((s % NST) * STAGE + SA + wn * RB);
        uint2 ha[MI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            ha[mi][0] = *(const uint2*)(Ag + (mi * 16 + g) * RA);
            ha[mi][1] = *(const uint2*)(Ag + (mi * 16 + g + 8) * RA);
        }
#pragma unroll
        for (int b32 = 0; b32 < 4; b32++) {  // the group's four 32-value blocks (one scale each)
            u32 bf[2][NI][2];
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const uint2 v = lds64_s(Bs_s + (u32)((ni * 8 + g) * RB + (b32 * 32 + c * 16 + 4 * t) * 2));
                    bf[c][ni][0] = v.x;
                    bf[c][ni][1] = v.y;
                }
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                u32 q[4];
                ldsm4_s(q, As_s + (u32)((mi * 16 + (li & 1) * 8 + lr) * RA + 16 + b32 * 32 + (li >> 1) * 16));
                const u32 d0 = hsel2(ha[mi][0], b32), d1 = hsel2(ha[mi][1], b32);
                u32 a0[4], a1[4];
                q8x4_to_h2(q[0], d0, a0[0], a0[2]);
                q8x4_to_h2(q[1], d1, a0[1], a0[3]);
                q8x4_to_h2(q[2], d0, a1[0], a1[2]);
                q8x4_to_h2(q[3], d1, a1[1], a1[3]);
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    mma_f16(acc[mi][ni], a0, bf[0][ni]);
                    mma_f16(acc[mi][ni], a1, bf[1][ni]);
                }
            }
        }
    }
    mmf_epilogue<WR, MI, NI, GLU>(acc, out, ooff, ostride, dst_row, m0, wm, wn, m, nt, warp, g, t, act);
#endif
}
// 256 rows (128 ff rows of gate and of up for the GLU one) x 64 tokens on 4 x 2 warps of 64 x 32,
// three stages of 54 KB (162 KB of shared memory).
#define MMFQ_INST_L(NAME, WR, WC, MI, NI, NST, GLU)                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(MMFQ_ARGS) {                            \
        PDL_ENTRY();                                                                                  \
        mmfq_impl<WR, WC, MI, NI, NST, GLU>(W, row_bytes, mat_bytes, m, k, X, xrow, n, cnt, off, perm, \
                                            n_exp, in_div, out, ooff, ostride, Ws, ws_row_bytes, ws_stride, \
                                            e_sh, W2, Ws2, act);                                      \
    }
#define MMFQ_INST(NAME, NST, GLU) MMFQ_INST_L(NAME, 4, 2, 4, 4, NST, GLU)
#define MMFQ_ARGS                                                                                             \
    const u8 *W, i64 row_bytes, i64 mat_bytes, int m, int k, const u8 *X, i64 xrow, int n, const int *cnt,     \
        const int *off, const int *perm, int n_exp, int in_div, float *out, i64 ooff, i64 ostride, const u8 *Ws, \
        i64 ws_row_bytes, i64 ws_stride, int e_sh, const u8 *W2, const u8 *Ws2, int act
// The same tile on 8 x 1 warps of 32 rows x 64 tokens (TS_CUDA_MMF_Q8=2): each weight fragment is
// turned into f16 by one warp instead of two (the 4 x 2 layout's two token columns convert the
// same rows), for twice the activation fragment loads. Static SASS: see GPU.md.
MMFQ_INST_L(mmfq8_256s4, 8, 1, 2, 8, 4, false)
MMFQ_INST_L(mmfq8_gu_s4, 8, 1, 2, 8, 4, true)

