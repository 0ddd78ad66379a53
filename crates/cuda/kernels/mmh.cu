// Prompt-size MoE expert products on Hopper (sm_90a): wgmma with both operands in shared memory,
// fed by the tensor memory accelerator (TMA), a producer warpgroup and two multiplying ones.
//
// Why by hand: cuBLAS runs one expert at ~470-700 TFLOP/s on the H200 at the MoE's shapes, but
// the counts per expert live on the device (a host sync a layer was measured slower, see
// CudaBackend::shared_blas); the grouped mma.sync tiles (mmfq8_*, mmq.cu) reach ~130 TFLOP/s.
// This kernel is the grouped GEMM with cuBLAS-class tiles that reads the counts itself.
//
//   gate/up (mmh_gu): hs[j][f] = f16(act(xs[j] . Wg_e[f]) * (xs[j] . Wu_e[f]))
//   down    (mmh_dn): y[perm[j]][h] = hs[j] . Wd_e[h]
// for the (token, slot) pairs j of expert e in expert order (moe_group's perm/off/cnt): xs holds
// the pairs' input rows in that order (moe_gather_h), hs the GLU rows in that order, y the f32
// output rows by pair index (moe_combine's input). The weights are the f16 row-major copies of
// the expert stacks (CudaWeight::half_rm): expert e's m rows from row e * m.
//
// Tile: 128 pairs (the M side: two consumer warpgroups of 64) x 256 weight rows (the N side; for
// gate/up 128 gate rows then the same 128 up rows, so the GLU is thread-local), 64 k values a
// stage: each operand row is 128 bytes, written by TMA with the 128-byte swizzle that wgmma's
// K-major descriptors read. MMH_NST stages (48 KB each) in flight. Warpgroup 0: one thread waits
// for a free stage (its empty barrier), arms the full barrier with the stage's bytes and asks TMA
// for the boxes; warpgroups 1 and 2 wait for a full stage, issue 4 wgmma m64n256k16 and release
// the previous stage once its wgmma are done (one group in flight). Tiles of 64 or fewer pairs
// leave the second warpgroup idle (it still releases the stages).
//
// Numerics: f16 x f16 products summed in f32 by the tensor cores (the same inputs as mmf16_*:
// f16(q * d) weights, f16 activations clamped to +-65504), GLU as f2h_sat(act_fn(g) * u).

// A CUtensorMap (128 bytes, 64-byte aligned), passed by value as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    u64 v[16];
};
#define MMH_NST 4
#define MMH_A_BYTES (128 * 128)
#define MMH_B_BYTES (256 * 128)
#define MMH_STAGE (MMH_A_BYTES + MMH_B_BYTES)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The 2-D box at (x = k, y = row) of the tensor `map` describes, into shared memory at `dst`,
// completing `bar`'s transaction bytes. Rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_2d(u32 dst, const TmaMap* map, u32 bar, int x, int y) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"((u64)map), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// wgmma shared-memory descriptor: K-major rows of 128 bytes with the 128-byte swizzle, groups of
// 8 rows 1,024 bytes apart (the tile's base 1,024-byte aligned). Adding 32 bytes to the address
// moves 16 k values along.
__device__ __forceinline__ u64 mmh_desc(u32 a) {
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
#define WG8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// d (this thread's share of a 64 x 256 f32 tile: n8 column c's four values at d[4c..4c+3], in
// mma.sync's m16n8 order) += A (64 x 16, descriptor da) B^T (256 x 16, descriptor db).
__device__ __forceinline__ void wgmma_ss_64x256(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "%128, %129, 1, 1, 1, 0, 0;\n"
        : WG8(0), WG8(8), WG8(16), WG8(24), WG8(32), WG8(40), WG8(48), WG8(56), WG8(64), WG8(72), WG8(80), WG8(88),
          WG8(96), WG8(104), WG8(112), WG8(120)
        : "l"(da), "l"(db)
        : "memory");
}
// The same with 200 weight rows (B^T 200 x 16; d[4c..4c+3] for n8 columns c < 25): the output
// head's tiles (mmh8_dn200).
__device__ __forceinline__ void wgmma_ss_64x200(float (&d)[100], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n200k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99}, "
        "%100, %101, 1, 1, 1, 0, 0;\n"
        : WG8(0), WG8(8), WG8(16), WG8(24), WG8(32), WG8(40), WG8(48), WG8(56), WG8(64), WG8(72), WG8(80), WG8(88),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
        : "l"(da), "l"(db)
        : "memory");
}
#undef WG8
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Q8_0 -> f16 for mmh8_*: the 4 int8 of w times the f16 scale pair d2 (both halves d), as two
// f16x2 words (values 0,1 and 2,3): each byte + 128 made a half 1024 + b by placing it under
// 0x64, 1152 subtracted (exact: q), then one f16 product q * d, rounded once as the f16 copies'
// f2h(q * d) is (the f32 product of an int8 and an f16 is exact).
__device__ __forceinline__ void q8x4_h2(u32 w, u32 d2, u32& lo, u32& hi) {
    const u32 x = w ^ 0x80808080u;
    u32 a, b;
    asm("prmt.b32 %0, %1, 0x64646464, 0x4140;" : "=r"(a) : "r"(x));
    asm("prmt.b32 %0, %1, 0x64646464, 0x4342;" : "=r"(b) : "r"(x));
    const u32 k1152 = 0x64806480u;
    asm("{sub.rn.f16x2 %0, %0, %1;\nmul.rn.f16x2 %0, %0, %2;}" : "+r"(a) : "r"(k1152), "r"(d2));
    asm("{sub.rn.f16x2 %0, %0, %1;\nmul.rn.f16x2 %0, %0, %2;}" : "+r"(b) : "r"(k1152), "r"(d2));
    lo = a;
    hi = b;
}
#endif

// A tile's output: thread (warp, lane) of multiplying warpgroup c holds pair rows r = c*64 +
// warp*16 + lane/4 (+8) and weight rows 8q + 2(lane%4) (+1) of n8 column q; GLU: hs rows by
// pair (the gate in columns 0-127 of the tile, the up in 128-255), else y rows by perm[pair].
template <bool GLU, int BN>
__device__ __forceinline__ void mmh_store(const float (&d)[BN / 2], int c, int warp, int lane, int nt, int row0, int n0,
                                          const int* perm, void* out, i64 ostride, int act) {
    const int rb = c * 64 + warp * 16 + (lane >> 2), cb = 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rb + 8 * h;
        if (r >= nt) continue;
        if constexpr (GLU) {
            u32* o = (u32*)((u16*)out + (i64)(row0 + r) * ostride + n0 + cb);
#pragma unroll
            for (int q = 0; q < 16; q++) {
                const float g0 = d[4 * q + 2 * h], g1 = d[4 * q + 2 * h + 1];
                const float u0 = d[4 * (q + 16) + 2 * h], u1 = d[4 * (q + 16) + 2 * h + 1];
                o[4 * q] = (u32)f2h_sat(act_fn(act, g0) * u0) | ((u32)f2h_sat(act_fn(act, g1) * u1) << 16);
            }
        } else {
            float2* o = (float2*)((float*)out + (i64)perm[row0 + r] * ostride + n0 + cb);
#pragma unroll
            for (int q = 0; q < BN / 8; q++) o[4 * q] = make_float2(d[4 * q + 2 * h], d[4 * q + 2 * h + 1]);
        }
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d += A B^T for a tile of BN (256 or 200) weight rows.
template <int BN>
__device__ __forceinline__ void wgmma_ss(float (&d)[BN / 2], u64 da, u64 db) {
    if constexpr (BN == 256) wgmma_ss_64x256(d, da, db);
    else wgmma_ss_64x200(d, da, db);
}
#endif

// The tile loop of the f16 kernels (see the file's head). ta: the pairs' rows (k values each);
// tb the weight rows (tb2 the up rows for GLU); m: weight rows an expert (ff for gate/up, hdim
// for down); out: hs (u16, GLU) or y (f32), row stride ostride.
template <bool GLU>
__device__ __forceinline__ void mmh_impl(const TmaMap* ta, const TmaMap* tb, const TmaMap* tb2, const int* cnt, const int* off,
                                         const int* perm, int n_exp, int m, int k, void* out, i64 ostride, int act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int NST = MMH_NST;
    extern __shared__ __align__(1024) u8 mmh_sm[];
    __shared__ __align__(8) u64 full_bar[NST], empty_bar[NST];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    if (tid < 32) mmq_find_tile<128>(cnt, n_exp, tid, tile_e, tile_start);
    if (tid == 0) {
        for (int s = 0; s < NST; s++) {
            mbar_init(smem_addr(&full_bar[s]), 1);
            mbar_init(smem_addr(&empty_bar[s]), 8);  // lane 0 of each consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int e = tile_e;
    if (e < 0) return;  // past the last tile (uniform over the block)
    const int start = tile_start, nt = min(128, cnt[e] - start), row0 = off[e] + start;
    const int n0 = blockIdx.x * (GLU ? 128 : 256);  // the tile's first weight row of the expert
    const int nk = k >> 6;
    const u32 base = (smem_addr(mmh_sm) + 1023u) & ~1023u;
    const int wg = tid >> 7, lane = tid & 31, warp = (tid & 127) >> 5;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            for (int s = 0; s < nk; s++) {
                const int st = s % NST;
                const u32 fb = smem_addr(&full_bar[st]);
                if (s >= NST) mbar_wait(smem_addr(&empty_bar[st]), ((s / NST) - 1) & 1);
                mbar_expect_tx(fb, MMH_STAGE);
                const u32 sa = base + (u32)(st * MMH_STAGE), sb = sa + MMH_A_BYTES;
                tma_2d(sa, ta, fb, s * 64, row0);
                const int wr = e * m + n0;
                if constexpr (GLU) {
                    tma_2d(sb, tb, fb, s * 64, wr);
                    tma_2d(sb + MMH_B_BYTES / 2, tb2, fb, s * 64, wr);
                } else {
                    tma_2d(sb, tb, fb, s * 64, wr);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1;
    if (c * 64 >= nt) {  // no pairs for this warpgroup: release the stages as they come
        for (int s = 0; s < nk; s++) {
            mbar_wait(smem_addr(&full_bar[s % NST]), (s / NST) & 1);
            if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % NST]));
        }
        return;
    }
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.f;
    for (int s = 0; s < nk; s++) {
        const int st = s % NST;
        mbar_wait(smem_addr(&full_bar[st]), (s / NST) & 1);
        const u32 sa = base + (u32)(st * MMH_STAGE) + (u32)(c * 64 * 128), sb = base + (u32)(st * MMH_STAGE) + MMH_A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_ss_64x256(d, mmh_desc(sa + kk * 32), mmh_desc(sb + kk * 32));
        wg_commit();
        wg_wait<1>();  // the previous stage's wgmma are done with its shared memory
        if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % NST]));
    }
    wg_wait<0>();
    mmh_store<GLU, 256>(d, c, warp, lane, nt, row0, n0, perm, out, ostride, act);
#endif
}

// The tile loop of the Q8_0 kernels (mmh8_*: the repacked rows, groups of 144 bytes). ta: the
// pairs' rows; tq / tq2 the weight rows' quants (64-byte boxes; the up rows' for GLU), ts / ts2
// their group headers (16-byte boxes, the four f16 scales first); the rest as mmh_impl. BN:
// weight rows a tile, 256, or 200 (mmh8_dn200, the output head; not GLU).
// The copies run ahead of the conversion, in two rings:
// - NR stages of copies (TMA): 16 KB of pair rows, 16 KB of raw quants and 4 KB of headers (room
//   for 256 rows; BN of them used);
// - NF stages of the f16 weight rows (32 KB), written from the raw rows by the converting warps
//   (q8x4_h2; the 128-byte swizzle by hand: 16-byte chunk c of row r at chunk c ^ (r % 8)).
// Barriers: full[NR] (a stage's copies landed); rfree[NR] (its raw rows turned into f16 and its
// pair rows multiplied: lane 0 of each converting warp and of the 8 multiplying warps); conv[NF]
// (an f16 stage written, fenced to the async proxy: every converting thread); bfree[NF] (its
// wgmma done: lane 0 of the 8 multiplying warps). Warp 0 of the producer warpgroup issues the
// copies up to NR stages ahead; warps 1-3 convert, and in a tile of 64 or fewer pairs the idle
// second multiplying warpgroup too (seven warps; MMH8_HELP=0: three); warpgroups 1 and 2 wait for
// both rings, issue 4 wgmma a stage and release the previous stage once its wgmma are done.
// The MoE's kernels keep three of each (MMH8_NR_MOE, MMH8_NF_MOE: the copies of stage s wait
// for the multiply of stage s - 3, as when the rows shared three stages; full 128-pair tiles
// want the third f16 stage: pp2048 on mmh8 -1.3% with 4 + 2, H100, sixty-ninth session); the
// output head's launch takes four of copies and two of f16 rows (MMH8_NR_HEAD, MMH8_NF_HEAD).
// The idle warpgroup's conversion took the head's launch from 182 to 160 us on an H100, the
// fourth copy stage to 157 (gpu-next222, 223).
#ifndef MMH8_HELP
#define MMH8_HELP 1
#endif
#ifndef MMH8_NR_MOE
#define MMH8_NR_MOE 3
#endif
#ifndef MMH8_NF_MOE
#define MMH8_NF_MOE 3
#endif
#ifndef MMH8_NR_HEAD
#define MMH8_NR_HEAD 4
#endif
#ifndef MMH8_NF_HEAD
#define MMH8_NF_HEAD 2
#endif
// Measurement probes, off (wrong results when on): MMH8_PROBE=1 skips the group headers' copies
// (scale 1), 2 the conversion (the f16 stage as it was), 4 the wgmma; bits add.
#ifndef MMH8_PROBE
#define MMH8_PROBE 0
#endif
// Dynamic shared memory the host gives every mmh8 launch (MMH8_SMEM in backend/mod.rs: four
// stages of copies and two of f16 rows, the larger of the two defaults' layouts).
#define MMH8_SMEM_BYTES (4 * (MMH_A_BYTES + 256 * 80) + 2 * MMH_B_BYTES + 1024)
#define MMH8_RAW (256 * (64 + 16))
template <bool GLU, int BN, int NR, int NF>
__device__ __forceinline__ void mmh8_impl(const TmaMap* ta, const TmaMap* tq, const TmaMap* ts, const TmaMap* tq2,
                                          const TmaMap* ts2, const int* cnt, const int* off, const int* perm, int n_exp,
                                          int m, int k, void* out, i64 ostride, int act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(BN == 256 || (BN == 200 && !GLU), "200-row tiles only for mmh8_dn200");
    static_assert(NR * (MMH_A_BYTES + MMH8_RAW) + NF * MMH_B_BYTES + 1024 <= MMH8_SMEM_BYTES, "rings past MMH8_SMEM");
    static_assert(NR >= 2 && NF >= 2, "two stages of each ring at least");
    constexpr int RAWQ = 256 * 64, RAWS = 256 * 16;
    constexpr u32 TX = MMH_A_BYTES + BN * ((MMH8_PROBE & 1) ? 64 : 64 + 16);
    extern __shared__ __align__(1024) u8 mmh_sm[];
    __shared__ __align__(8) u64 full_bar[NR], rfree_bar[NR], conv_bar[NF], bfree_bar[NF];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    if (tid < 32) {
        mmq_find_tile<128>(cnt, n_exp, tid, tile_e, tile_start);
        __syncwarp();  // (thread 0 reads the tile below)
    }
    if (tid == 0) {
        // converting warps: 7 where the second multiplying warpgroup has no pairs (`help`)
        const int cw = (MMH8_HELP && tile_e >= 0 && cnt[tile_e] - tile_start <= 64) ? 7 : 3;
        for (int s = 0; s < NR; s++) {
            mbar_init(smem_addr(&full_bar[s]), 1);
            mbar_init(smem_addr(&rfree_bar[s]), cw + 8);
        }
        for (int s = 0; s < NF; s++) {
            mbar_init(smem_addr(&conv_bar[s]), 32 * cw);
            mbar_init(smem_addr(&bfree_bar[s]), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int e = tile_e;
    if (e < 0) return;  // past the last tile (uniform over the block)
    const int start = tile_start, nt = min(128, cnt[e] - start), row0 = off[e] + start;
    const int n0 = blockIdx.x * (GLU ? 128 : BN);  // the tile's first weight row of the expert
    const int nk = k >> 6;
    const u32 base = (smem_addr(mmh_sm) + 1023u) & ~1023u;
    const u32 a0 = base, b0 = a0 + NR * MMH_A_BYTES, r0 = b0 + NF * MMH_B_BYTES;  // the rings
    const int wg = tid >> 7, lane = tid & 31, warp = (tid & 127) >> 5;
    const bool help = MMH8_HELP && nt <= 64;
    // Stage s's raw rows into its f16 slot (once the copies have landed and the slot's last
    // wgmma are done): groups of 8 rows first, first + step, ...; then the conv and rfree
    // arrivals.
    auto convert = [&](int s, int first, int step) {
        const int sr = s % NR, sf = s % NF, q = lane & 3;
        mbar_wait(smem_addr(&full_bar[sr]), (s / NR) & 1);
        if (s >= NF) mbar_wait(smem_addr(&bfree_bar[sf]), ((s / NF) - 1) & 1);
        const u32 sb = b0 + (u32)(sf * MMH_B_BYTES), rq = r0 + (u32)(sr * MMH8_RAW), rs = rq + RAWQ;
        const u32 hs = 2 * (2 * (s & 1) + (q >> 1));  // this lane's scale in the header
        for (int i = first; i < ((MMH8_PROBE & 2) ? 0 : BN / 8); i += step) {
            const int r = i * 8 + (lane >> 2);
            uint4 w;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                         : "r"(rq + (u32)(r * 64 + q * 16)));
            u32 dd;
            if (MMH8_PROBE & 1) dd = 0x3C00u;
            else asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(dd) : "r"(rs + (u32)(r * 16) + hs));
            const u32 d2 = dd | (dd << 16);
            u32 o[8];
            q8x4_h2(w.x, d2, o[0], o[1]);
            q8x4_h2(w.y, d2, o[2], o[3]);
            q8x4_h2(w.z, d2, o[4], o[5]);
            q8x4_h2(w.w, d2, o[6], o[7]);
            const u32 rb = sb + (u32)(r * 128), sw = (u32)(r & 7);
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(rb + (((2u * q) ^ sw) << 4)), "r"(o[0]), "r"(o[1]),
                         "r"(o[2]), "r"(o[3])
                         : "memory");
            asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(rb + (((2u * q + 1) ^ sw) << 4)), "r"(o[4]),
                         "r"(o[5]), "r"(o[6]), "r"(o[7])
                         : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        mbar_arrive(smem_addr(&conv_bar[sf]));
        __syncwarp();  // the warp's raw reads are done
        if (lane == 0) mbar_arrive(smem_addr(&rfree_bar[sr]));
    };
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (tid == 0) {
            for (int s = 0; s < nk; s++) {
                const int sr = s % NR;
                const u32 fb = smem_addr(&full_bar[sr]);
                if (s >= NR) mbar_wait(smem_addr(&rfree_bar[sr]), ((s / NR) - 1) & 1);
                mbar_expect_tx(fb, TX);
                tma_2d(a0 + (u32)(sr * MMH_A_BYTES), ta, fb, s * 64, row0);
                const int wr = e * m + n0, xq = (s >> 1) * 144 + 16 + (s & 1) * 64, xs = (s >> 1) * 144;
                const u32 rq = r0 + (u32)(sr * MMH8_RAW), rs = rq + RAWQ;
                if constexpr (GLU) {
                    tma_2d(rq, tq, fb, xq, wr);
                    tma_2d(rq + RAWQ / 2, tq2, fb, xq, wr);
                    if (!(MMH8_PROBE & 1)) {
                        tma_2d(rs, ts, fb, xs, wr);
                        tma_2d(rs + RAWS / 2, ts2, fb, xs, wr);
                    }
                } else {
                    tma_2d(rq, tq, fb, xq, wr);
                    if (!(MMH8_PROBE & 1)) tma_2d(rs, ts, fb, xs, wr);
                }
            }
        } else if (warp > 0) {
            for (int s = 0; s < nk; s++) convert(s, warp - 1, help ? 7 : 3);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    const int c = wg - 1;
    if (c * 64 >= nt) {  // no pairs for this warpgroup: (help) convert, and release the stages
        for (int s = 0; s < nk; s++) {
            if (help) convert(s, 3 + warp, 7);
            else mbar_wait(smem_addr(&conv_bar[s % NF]), (s / NF) & 1);
            // (stage s's copies were issued and its f16 slot's previous wgmma are done, so
            // these arrivals count toward stage s's phases)
            if (lane == 0) {
                mbar_arrive(smem_addr(&rfree_bar[s % NR]));
                mbar_arrive(smem_addr(&bfree_bar[s % NF]));
            }
        }
        return;
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    for (int s = 0; s < nk; s++) {
        const int sr = s % NR, sf = s % NF;
        mbar_wait(smem_addr(&conv_bar[sf]), (s / NF) & 1);
        mbar_wait(smem_addr(&full_bar[sr]), (s / NR) & 1);
        const u32 sa = a0 + (u32)(sr * MMH_A_BYTES) + (u32)(c * 64 * 128), sb = b0 + (u32)(sf * MMH_B_BYTES);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < ((MMH8_PROBE & 4) ? 0 : 4); kk++) wgmma_ss<BN>(d, mmh_desc(sa + kk * 32), mmh_desc(sb + kk * 32));
        wg_commit();
        wg_wait<1>();  // the previous stage's wgmma are done with its shared memory
        if (s > 0 && lane == 0) {
            mbar_arrive(smem_addr(&rfree_bar[(s - 1) % NR]));
            mbar_arrive(smem_addr(&bfree_bar[(s - 1) % NF]));
        }
    }
    wg_wait<0>();
    mmh_store<GLU, BN>(d, c, warp, lane, nt, row0, n0, perm, out, ostride, act);
#endif
}
// f16 weights. Grid: (ff / 128, expert tiles' upper bound = pairs / 128 + experts), 384 threads,
// MMH_NST * MMH_STAGE + 1024 bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh_gu(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tg, const __grid_constant__ TmaMap tu,
           const int* cnt, const int* off, int n_exp, int ff, int hdim, u16* hs, int act) {
    PDL_ENTRY();
    mmh_impl<true>(&ta, &tg, &tu, cnt, off, nullptr, n_exp, ff, hdim, hs, ff, act);
}
// Grid: (hdim / 256, the same tiles).
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh_dn(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap td, const int* cnt, const int* off,
           const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh_impl<false>(&ta, &td, &td, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
}
// Q8_0 weights (the repacked rows: groups of 144 bytes), the same grids, MMH8_SMEM_BYTES of
// dynamic shared memory.
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_gu(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tgq, const __grid_constant__ TmaMap tgs,
            const __grid_constant__ TmaMap tuq, const __grid_constant__ TmaMap tus, const int* cnt, const int* off, int n_exp,
            int ff, int hdim, u16* hs, int act) {
    PDL_ENTRY();
    mmh8_impl<true, 256, MMH8_NR_MOE, MMH8_NF_MOE>(&ta, &tgq, &tgs, &tuq, &tus, cnt, off, nullptr, n_exp, ff, hdim, hs, ff, act);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_dn(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tdq, const __grid_constant__ TmaMap tds,
            const int* cnt, const int* off, const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh8_impl<false, 256, MMH8_NR_MOE, MMH8_NF_MOE>(&ta, &tdq, &tds, &tdq, &tds, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
}

// The same in tiles of 200 weight rows (grid: hdim / 200): the output head where 256-row tiles
// leave a ragged last wave (CudaBackend::head_mmh: V2-Lite's 102,400 rows are 400 tiles of 256 on
// 132 SMs, 4.00 waves' time for 3.03 waves' work; 512 tiles of 200 are 3.88).
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_dn200(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tdq, const __grid_constant__ TmaMap tds,
               const int* cnt, const int* off, const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh8_impl<false, 200, MMH8_NR_HEAD, MMH8_NF_HEAD>(&ta, &tdq, &tds, &tdq, &tds, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
}

// The output head of a decode batch on mmh8_dn (Path::HeadMmh): its n rows as one expert's
// token list, cnt[0] = n, off[0] = 0, perm[j] = j (j < n). One block.
extern "C" __global__ void head_list(int n, int* cnt, int* off, int* perm) {
    PDL_ENTRY();
    for (int j = threadIdx.x; j < n; j += blockDim.x) perm[j] = j;
    if (threadIdx.x == 0) {
        cnt[0] = n;
        off[0] = 0;
    }
}

// xs[j] = xh[perm[j] / in_div] for the pairs j < (the experts' total) in expert order, rows of
// `pieces` 16-byte pieces (the gate/up input of mmh_gu).
extern "C" __global__ void moe_gather_h(const uint4* xh, const int* perm, const int* cnt, const int* off, int n_exp,
                                        int in_div, int pieces, uint4* xs) {
    PDL_ENTRY();
    const i64 total = (i64)(off[n_exp - 1] + cnt[n_exp - 1]) * pieces;
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < total; idx += (i64)gridDim.x * blockDim.x) {
        const i64 j = idx / pieces, q = idx - j * pieces;
        xs[idx] = xh[(i64)(perm[j] / in_div) * pieces + q];
    }
}
