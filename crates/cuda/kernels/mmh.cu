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
#undef WG8
#endif

// The tile loop of both kernels (see the file's head). ta: the pairs' rows (k values each), tb:
// the weight rows (tb2: the up rows for GLU); m: weight rows an expert (ff for gate/up, hdim for
// down); out: hs (u16, GLU) or y (f32), row stride ostride.
template <bool GLU>
__device__ __forceinline__ void mmh_impl(const TmaMap* ta, const TmaMap* tb, const TmaMap* tb2, const int* cnt, const int* off,
                                         const int* perm, int n_exp, int m, int k, void* out, i64 ostride, int act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) u8 mmh_sm[];
    __shared__ __align__(8) u64 full_bar[MMH_NST], empty_bar[MMH_NST];
    __shared__ int tile_e, tile_start;
    const int tid = threadIdx.x;
    if (tid < 32) mmq_find_tile<128>(cnt, n_exp, tid, tile_e, tile_start);
    if (tid == 0) {
        for (int s = 0; s < MMH_NST; s++) {
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
    const int wg = tid >> 7;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid == 0) {
            for (int s = 0; s < nk; s++) {
                const int st = s % MMH_NST;
                const u32 fb = smem_addr(&full_bar[st]);
                if (s >= MMH_NST) mbar_wait(smem_addr(&empty_bar[st]), ((s / MMH_NST) - 1) & 1);
                mbar_expect_tx(fb, MMH_STAGE);
                const u32 sa = base + (u32)(st * MMH_STAGE), sb = sa + MMH_A_BYTES;
                tma_2d(sa, ta, fb, s * 64, row0);
                if constexpr (GLU) {
                    tma_2d(sb, tb, fb, s * 64, e * m + n0);
                    tma_2d(sb + MMH_B_BYTES / 2, tb2, fb, s * 64, e * m + n0);
                } else {
                    tma_2d(sb, tb, fb, s * 64, e * m + n0);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int c = wg - 1, t = tid & 127, warp = t >> 5, lane = tid & 31;
    if (c * 64 >= nt) {  // no pairs for this warpgroup: release the stages as they come
        for (int s = 0; s < nk; s++) {
            mbar_wait(smem_addr(&full_bar[s % MMH_NST]), (s / MMH_NST) & 1);
            if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % MMH_NST]));
        }
        return;
    }
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.f;
    for (int s = 0; s < nk; s++) {
        const int st = s % MMH_NST;
        mbar_wait(smem_addr(&full_bar[st]), (s / MMH_NST) & 1);
        const u32 sa = base + (u32)(st * MMH_STAGE) + (u32)(c * 64 * 128), sb = base + (u32)(st * MMH_STAGE) + MMH_A_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_ss_64x256(d, mmh_desc(sa + kk * 32), mmh_desc(sb + kk * 32));
        wg_commit();
        wg_wait<1>();  // the previous stage's wgmma are done with its shared memory
        if (s > 0 && lane == 0) mbar_arrive(smem_addr(&empty_bar[(s - 1) % MMH_NST]));
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
            for (int q = 0; q < 32; q++) o[4 * q] = make_float2(d[4 * q + 2 * h], d[4 * q + 2 * h + 1]);
        }
    }
#endif
}
// Grid: (ff / 128, expert tiles' upper bound = pairs / 128 + experts), 384 threads,
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
