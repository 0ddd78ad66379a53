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
// In an mmh8 tile of 64 or fewer pairs the idle second multiplying warpgroup turns rows into f16
// beside the producer's three warps (`help` in mmh_impl); MMH_HELP=0 leaves it idle. H100,
// sixty-ninth session: the output head's mmh8_dn200 launch 182 -> 160 us (Nsight, gpu-next222,
// 223); in a two-ring form of these kernels (measured, slower, not kept) prompts on mmh8 read
// pp512 27,869 against 26,808 and pp2048 37,895 against 37,629 with it.
#ifndef MMH_HELP
#define MMH_HELP 1
#endif
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
// The accumulator operands %0-%95 of a wgmma's output list (both tile widths have them first).
#define WG_R96 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "   \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "   \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
#define WG8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// d (this thread's share of a 64 x 256 f32 tile: n8 column c's four values at d[4c..4c+3], in
// mma.sync's m16n8 order) += A (64 x 16, descriptor da) B^T (256 x 16, descriptor db).
__device__ __forceinline__ void wgmma_ss_64x256(float (&d)[128], u64 da, u64 db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" WG_R96
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
        "wgmma.mma_async.sync.aligned.m64n200k16.f32.f16.f16 {" WG_R96
        "%96, %97, %98, %99}, "
        "%100, %101, 1, 1, 1, 0, 0;\n"
        : WG8(0), WG8(8), WG8(16), WG8(24), WG8(32), WG8(40), WG8(48), WG8(56), WG8(64), WG8(72), WG8(80), WG8(88),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
        : "l"(da), "l"(db)
        : "memory");
}
#undef WG8
#undef WG_R96
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

// The tile loop of the four kernels (see the file's head). ta: the pairs' rows (k values each);
// f16 weights (Q8 false): tb the weight rows (tb2 the up rows for GLU); Q8_0 weights (Q8): tb /
// tb2 their quants (64-byte boxes), tbs / tb2s their group headers (16-byte boxes, the four f16
// scales first); m: weight rows an expert (ff for gate/up, hdim for down); out: hs (u16, GLU) or
// y (f32), row stride ostride.
// Q8: three stages of 16 KB of pair rows, 32 KB of f16 weight rows and the raw 16 + 4 KB they
// come from; warp 0 of the producer warpgroup issues the copies, warps 1-3 turn each landed
// stage's raw rows into f16 (the 128-byte swizzle by hand: 16-byte chunk c of row r at chunk
// c ^ (r % 8)), fence them to the async proxy and arrive on the stage's conv barrier, which the
// multiplying warpgroups wait for besides the copies' full barrier. In a tile of 64 or fewer
// pairs (`help`, MMH_HELP) the second multiplying warpgroup converts too: seven warps.
// (Copies in a ring of their own, four or three stages ahead of two or three of f16 rows, were
// measured in the sixty-ninth session and not kept: the output head's launch 160 -> 157 us, but
// like for like (both without MMH_HELP) prompts on mmh8 2.5-3.6% slower, gpu-next223, 224.
// Nsight on the head's launch with parts left out: 156 us whole, 147 without the group headers'
// copies, 146 without the conversion, 149 without the wgmma, 121 with only the pair rows' and
// quants' copies; 237 MB from DRAM in every form, so the TMA copies of 64- and 16-byte boxes
// over rows 2,304 bytes apart hold it: 1.5 TB/s whole, 2.0 with the copies alone. A tiled copy
// of the head made at upload, each stage's quants and scales one 13.6 KB bulk copy, was measured
// in the seventieth session and removed: the launch 159 -> 145 us, 224 MB at 1.54 TB/s, the same
// bits, but 64 sequences level like for like (gpu-next225, 226) for 223 MB more.)
// BN: weight rows a tile, 256 (every launch but one) or 200 (mmh8_dn200, the output head: Q8
// and not GLU only; its rows fill the first 200 of the 256-row stage layout).
template <bool GLU, bool Q8, int BN = 256>
__device__ __forceinline__ void mmh_impl(const TmaMap* ta, const TmaMap* tb, const TmaMap* tbs, const TmaMap* tb2,
                                         const TmaMap* tb2s, const int* cnt, const int* off, const int* perm, int n_exp,
                                         int m, int k, void* out, i64 ostride, int act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(BN == 256 || (BN == 200 && Q8 && !GLU), "200-row tiles only for mmh8_dn200");
    constexpr int NST = Q8 ? 3 : MMH_NST;
    constexpr int RAWQ = 256 * 64, RAWS = 256 * 16;  // the raw rows' room (BN <= 256 of them)
    constexpr int STAGE = MMH_STAGE + (Q8 ? RAWQ + RAWS : 0);
    constexpr u32 TX = MMH_A_BYTES + (Q8 ? BN * (64 + 16) : MMH_B_BYTES);
    extern __shared__ __align__(1024) u8 mmh_sm[];
    __shared__ __align__(8) u64 full_bar[NST], conv_bar[NST], empty_bar[NST];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    if (tid < 32) {
        mmq_find_tile<128>(cnt, n_exp, tid, tile_e, tile_start);
        if (Q8 && MMH_HELP) __syncwarp();  // (thread 0 reads the tile below)
    }
    if (tid == 0) {
        // Every converting thread (Q8): the producer's warps 1-3, and with MMH_HELP in a tile of
        // 64 or fewer pairs the second multiplying warpgroup too (`help` below).
        const int convs = (Q8 && MMH_HELP && tile_e >= 0 && cnt[tile_e] - tile_start <= 64) ? 224 : 96;
        for (int s = 0; s < NST; s++) {
            mbar_init(smem_addr(&full_bar[s]), 1);
            mbar_init(smem_addr(&conv_bar[s]), convs);
            mbar_init(smem_addr(&empty_bar[s]), 8);  // lane 0 of each consumer warp
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
    const int wg = tid >> 7, lane = tid & 31, warp = (tid & 127) >> 5;
    // (MMH_HELP: seven converting warps in a tile of 64 or fewer pairs; conv barrier count 224)
    const bool help = Q8 && MMH_HELP && nt <= 64;
    // Stage s's raw rows (once its copies have landed) into the stage's swizzled f16 tile: groups
    // of 8 rows first, first + step, ..., fenced to the async proxy; then the stage's conv
    // barrier arrived on (every converting thread).
    auto convert = [&](int s, int first, int step) {
        const int st = s % NST, q = lane & 3;
        mbar_wait(smem_addr(&full_bar[st]), (s / NST) & 1);
        const u32 sb = base + (u32)(st * STAGE) + MMH_A_BYTES, rq = sb + MMH_B_BYTES, rs = rq + RAWQ;
        const u32 hs = 2 * (2 * (s & 1) + (q >> 1));  // this lane's scale in the header
        for (int i = first; i < BN / 8; i += step) {
            const int r = i * 8 + (lane >> 2);
            uint4 w;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                         : "r"(rq + (u32)(r * 64 + q * 16)));
            u32 dd;
            asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(dd) : "r"(rs + (u32)(r * 16) + hs));
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
        mbar_arrive(smem_addr(&conv_bar[st]));
    };
    if (wg == 0) {
        if constexpr (Q8) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        else asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            for (int s = 0; s < nk; s++) {
                const int st = s % NST;
                const u32 fb = smem_addr(&full_bar[st]);
                if (s >= NST) mbar_wait(smem_addr(&empty_bar[st]), ((s / NST) - 1) & 1);
                mbar_expect_tx(fb, TX);
                const u32 sa = base + (u32)(st * STAGE), sb = sa + MMH_A_BYTES;
                tma_2d(sa, ta, fb, s * 64, row0);
                const int wr = e * m + n0;
                if constexpr (Q8) {
                    const int xq = (s >> 1) * 144 + 16 + (s & 1) * 64, xs = (s >> 1) * 144;
                    const u32 rq = sb + MMH_B_BYTES, rs = rq + RAWQ;
                    if constexpr (GLU) {
                        tma_2d(rq, tb, fb, xq, wr);
                        tma_2d(rq + RAWQ / 2, tb2, fb, xq, wr);
                        tma_2d(rs, tbs, fb, xs, wr);
                        tma_2d(rs + RAWS / 2, tb2s, fb, xs, wr);
                    } else {
                        tma_2d(rq, tb, fb, xq, wr);
                        tma_2d(rs, tbs, fb, xs, wr);
                    }
                } else if constexpr (GLU) {
                    tma_2d(sb, tb, fb, s * 64, wr);
                    tma_2d(sb + MMH_B_BYTES / 2, tb2, fb, s * 64, wr);
                } else {
                    tma_2d(sb, tb, fb, s * 64, wr);
                }
            }
        }
        if constexpr (Q8) {
            if (warp > 0)
                for (int s = 0; s < nk; s++) convert(s, warp - 1, help ? 7 : 3);
        }
        return;
    }
    if constexpr (Q8) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1;
    // Stage s is ready to multiply: its copies have landed and (Q8) its weights are f16.
    auto ready = [&](int s) {
        const int st = s % NST;
        if constexpr (Q8) mbar_wait(smem_addr(&conv_bar[st]), (s / NST) & 1);
        mbar_wait(smem_addr(&full_bar[st]), (s / NST) & 1);
    };
    if (c * 64 >= nt) {  // no pairs for this warpgroup: release the stages as they come
        if (help) {  // (after turning their share of the rows into f16)
            for (int s = 0; s < nk; s++) {
                convert(s, 3 + warp, 7);
                if (lane == 0) mbar_arrive(smem_addr(&empty_bar[s % NST]));
            }
            return;
        }
        for (int s = 0; s < nk; s++) {
            ready(s);
            if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % NST]));
        }
        return;
    }
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; i++) d[i] = 0.f;
    for (int s = 0; s < nk; s++) {
        const int st = s % NST;
        ready(s);
        const u32 sa = base + (u32)(st * STAGE) + (u32)(c * 64 * 128), sb = base + (u32)(st * STAGE) + MMH_A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if constexpr (BN == 256) wgmma_ss_64x256(d, mmh_desc(sa + kk * 32), mmh_desc(sb + kk * 32));
            else wgmma_ss_64x200(d, mmh_desc(sa + kk * 32), mmh_desc(sb + kk * 32));
        }
        wg_commit();
        wg_wait<1>();  // the previous stage's wgmma are done with its shared memory
        if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % NST]));
    }
    wg_wait<0>();
    // Thread (warp, lane) holds pair rows r = c*64 + warp*16 + lane/4 (+8) and weight rows
    // 8q + 2(lane%4) (+1) of n8 column q.
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
#endif
}
// f16 weights. Grid: (ff / 128, expert tiles' upper bound = pairs / 128 + experts), 384 threads,
// MMH_NST * MMH_STAGE + 1024 bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh_gu(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tg, const __grid_constant__ TmaMap tu,
           const int* cnt, const int* off, int n_exp, int ff, int hdim, u16* hs, int act) {
    PDL_ENTRY();
    mmh_impl<true, false>(&ta, &tg, nullptr, &tu, nullptr, cnt, off, nullptr, n_exp, ff, hdim, hs, ff, act);
}
// Grid: (hdim / 256, the same tiles).
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh_dn(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap td, const int* cnt, const int* off,
           const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh_impl<false, false>(&ta, &td, nullptr, &td, nullptr, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
}
// Q8_0 weights (the repacked rows: groups of 144 bytes), the same grids, 3 * (MMH_STAGE + 20 KB)
// + 1024 bytes of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_gu(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tgq, const __grid_constant__ TmaMap tgs,
            const __grid_constant__ TmaMap tuq, const __grid_constant__ TmaMap tus, const int* cnt, const int* off, int n_exp,
            int ff, int hdim, u16* hs, int act) {
    PDL_ENTRY();
    mmh_impl<true, true>(&ta, &tgq, &tgs, &tuq, &tus, cnt, off, nullptr, n_exp, ff, hdim, hs, ff, act);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_dn(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tdq, const __grid_constant__ TmaMap tds,
            const int* cnt, const int* off, const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh_impl<false, true>(&ta, &tdq, &tds, &tdq, &tds, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
}

// The same in tiles of 200 weight rows (grid: hdim / 200): the output head where 256-row tiles
// leave a ragged last wave (CudaBackend::head_mmh: V2-Lite's 102,400 rows are 400 tiles of 256 on
// 132 SMs, 4.00 waves' time for 3.03 waves' work; 512 tiles of 200 are 3.88).
extern "C" __global__ void __launch_bounds__(384, 1)
    mmh8_dn200(const __grid_constant__ TmaMap ta, const __grid_constant__ TmaMap tdq, const __grid_constant__ TmaMap tds,
               const int* cnt, const int* off, const int* perm, int n_exp, int hdim, int ff, float* y) {
    PDL_ENTRY();
    mmh_impl<false, true, 200>(&ta, &tdq, &tds, &tdq, &tds, cnt, off, perm, n_exp, hdim, ff, y, hdim, 0);
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
