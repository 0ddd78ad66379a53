// Read bandwidth of the access patterns our Q8_0 kernels use, on the card itself (docs/GPU.md):
// is the grouped expert product's 2.3 TB/s (mmq_q8_16 at 64 sequences) a property of how it
// reads the weights, or of the rest of the kernel? Each probe reads expert matrices laid out as
// the backend keeps them (rows of 16 groups x 144 bytes: K = 2048), 64 experts x 1408 rows (one
// MoE matrix of V2-Lite, 207 MB: four times the L2), and only sums what it read.
//   nvcc -O3 -arch=sm_90 -o /tmp/bwprobe tools/gpu/bwprobe.cu && /tmp/bwprobe
// Probes:
//   stream      every thread reads 16-byte words, 8 in flight, grid-stride (the ceiling);
//   tile NST/GPS  mmq_q8's weight stream: a 128-thread block takes 64 rows of one expert and
//               walks K in stages of GPS groups (GPS x 144 bytes of each row) through NST
//               cp.async buffers in shared memory, one barrier a stage (mmq_q8_16: GPS 2, NST 2,
//               4 blocks per SM);
//   rows NST    the same bytes per block and stage, but a stage is 8 whole rows (K-contiguous);
//   warp-rows   no shared memory: each warp reads whole rows into registers, 4 rows at a time
//               (the decode GEMVs' way);
//   frag16      mmq_q8_rows' loads (16 rows a warp, 8 bytes a thread a block, NB groups in
//               flight), from the row-major layout and from a 16-row tiled one;
//   bulk CH/NST/CW/PB  the Hopper bulk copy engine (cp.async.bulk, "TMA" without a tensor map):
//               one producer thread a block streams the block's PB contiguous bytes in chunks of
//               CH into NST shared buffers (full/empty mbarriers), CW consumer warps read every
//               word of each chunk (as a kernel fed this way would read its fragments).
//   rk NB/BPS/W/P  mmq_q8_rows' loads as the kernel issues them today (fifteenth session): the
//               2,176-byte groups of the 16-row tiled copy (one 16-byte scale load and four
//               512-byte block loads a lane), a warp a tile, 4 warps a block, grid (row tiles,
//               experts) as the kernel's; NB groups in flight a warp, at most BPS blocks an SM
//               (dynamic shared memory stands in for the tile's activation rows), W fused
//               multiply-adds a group on the loaded words (0: loads only; ~100: the kernel's
//               multiply), and P: one persistent wave whose warps stream their tiles one after
//               another without a gap (the kernel's ragged last wave removed).
// `bwprobe NAME...` runs only the probes whose names start with one of the NAMEs.
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

typedef unsigned char u8;
typedef unsigned long long u64;
constexpr int GB = 144, GROUPS = 16, ROW = GB * GROUPS, ROWS = 1408, EXPERTS = 64, BM = 64;

__device__ unsigned long long sink;

__device__ __forceinline__ void cp16(void* s, const void* g) {
    unsigned a = (unsigned)__cvta_generic_to_shared(s);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(g));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_n() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__global__ void stream(const uint4* p, u64 n) {
    uint32_t acc = 0;
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x, step = (u64)gridDim.x * blockDim.x;
    for (; i + 7 * step < n; i += 8 * step) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = __ldcs(p + i + u * step);
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += step) { uint4 v = p[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x12345678u) sink = acc;
}

// The cp.async pipeline both staged probes share: stage s (of nst) copied by load(s) into buffer
// s % NST, NST - 1 stages ahead, one barrier a stage, then every word of the stage read.
template <int NST, int STAGE, typename L>
__device__ __forceinline__ void staged(const u8* sm, int nst, L load) {
    uint32_t acc = 0;
    auto issue = [&](int s) {
        if (s < nst) load(s);
        commit();  // (empty groups keep the count uniform)
    };
#pragma unroll
    for (int s = 0; s < NST - 1; s++) issue(s);
    for (int s = 0; s < nst; s++) {
        wait_n<NST - 2>();
        __syncthreads();
        issue(s + NST - 1);
        const uint32_t* st = (const uint32_t*)(sm + (s % NST) * STAGE);
        for (int i = threadIdx.x; i < STAGE / 4; i += 128) acc ^= st[i];
    }
    if (acc == 0x12345678u) sink = acc;
}

// Block (x: row tile, y: expert): 64 rows, stages of GPS groups.
template <int NST, int GPS>
__global__ void __launch_bounds__(128) tile(const u8* w) {
    extern __shared__ __align__(16) u8 sm[];
    constexpr int RS = GPS * GB + 16, STAGE = BM * RS, PIECES = 9 * GPS, PER = (BM * PIECES + 127) / 128;
    const int tid = threadIdx.x;
    const u8* base = w + ((u64)blockIdx.y * ROWS + blockIdx.x * BM) * ROW;
    const int nst = GROUPS / GPS;
    auto load = [&](int s) {
        u8* st = sm + (s % NST) * STAGE;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = tid + i * 128;
            if (c < BM * PIECES) {
                const int r = c / PIECES, q = c - r * PIECES;
                const int row = min(blockIdx.x * BM + r, ROWS - 1) - blockIdx.x * BM;
                cp16(st + r * RS + q * 16, base + (u64)row * ROW + s * GPS * GB + q * 16);
            }
        }
    };
    staged<NST, STAGE>(sm, nst, load);
}

// The same bytes per stage, but a stage is BM / (GROUPS / GPS) whole rows.
template <int NST, int GPS>
__global__ void __launch_bounds__(128) rows(const u8* w) {
    extern __shared__ __align__(16) u8 sm[];
    constexpr int RPS = BM * GPS / GROUPS, STAGE = RPS * ROW, PIECES = ROW / 16, PER = (RPS * PIECES + 127) / 128;
    const int tid = threadIdx.x;
    const u8* base = w + ((u64)blockIdx.y * ROWS + blockIdx.x * BM) * ROW;
    const int nst = GROUPS / GPS;
    auto load = [&](int s) {
        u8* st = sm + (s % NST) * STAGE;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = tid + i * 128;
            if (c < RPS * PIECES) {
                const int r = s * RPS + c / PIECES, q = c % PIECES;
                const int row = min(blockIdx.x * BM + r, ROWS - 1) - blockIdx.x * BM;
                cp16(st + (c / PIECES) * ROW + q * 16, base + (u64)row * ROW + q * 16);
            }
        }
    };
    staged<NST, STAGE>(sm, nst, load);
}

// Each warp: RW rows at a time, whole rows in 16-byte words straight to registers.
template <int RW>
__global__ void warp_rows(const u8* w, int rows_per_warp) {
    const int lane = threadIdx.x & 31;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;
    const u64 total = (u64)EXPERTS * ROWS;
    uint32_t acc = 0;
    for (u64 r0 = warp * rows_per_warp; r0 < min(total, (warp + 1) * rows_per_warp); r0 += RW) {
        uint4 v[RW][5];
#pragma unroll
        for (int k = 0; k < RW; k++)
#pragma unroll
            for (int u = 0; u < 5; u++) {
                const int word = lane + 32 * u;  // 144 words of 16 bytes a row
                v[k][u] = (r0 + k < total && word < ROW / 16) ? __ldcs((const uint4*)(w + (r0 + k) * ROW) + word) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int k = 0; k < RW; k++)
#pragma unroll
            for (int u = 0; u < 5; u++) acc ^= v[k][u].x ^ v[k][u].y ^ v[k][u].z ^ v[k][u].w;
    }
    if (acc == 0x12345678u) sink = acc;
}

// mmq_q8_rows' weight stream: each warp takes 16 rows of one expert and walks K a group at a
// time, thread (g, t) loading rows g and g+8: the 8-byte scale header and bytes 8t..8t+7 of each
// of the 4 blocks (10 loads of 8 bytes a group), NB groups in flight. TILED: the same loads from
// a layout where a 16-row tile's group is one contiguous 2304-byte piece (tile-major, then
// group, then row), as a re-laid-out weight copy would have it: does DRAM locality hold the
// kernel to 2.3 TB/s?
template <int NB, bool TILED>
__global__ void frag16(const u8* w) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u64 warp = (blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5;  // one 16-row tile each
    const u64 tiles = (u64)EXPERTS * (ROWS / 16);
    if (warp >= tiles) return;
    auto at = [&](int row, int gi) -> const u8* {  // row 0..15 of this tile, group gi
        return TILED ? w + warp * (u64)(16 * ROW) + (u64)gi * (16 * GB) + row * GB
                     : w + (warp * 16 + row) * (u64)ROW + (u64)gi * GB;
    };
    uint32_t acc = 0;
    uint2 v[NB][10];
    auto load = [&](uint2* d, int gi) {
        const u8* a = at(g, gi);
        const u8* b = at(g + 8, gi);
        d[0] = __ldg((const uint2*)a);
        d[1] = __ldg((const uint2*)b);
#pragma unroll
        for (int bl = 0; bl < 4; bl++) {
            d[2 + bl] = __ldg((const uint2*)(a + 16 + 32 * bl + 8 * t));
            d[6 + bl] = __ldg((const uint2*)(b + 16 + 32 * bl + 8 * t));
        }
    };
#pragma unroll
    for (int i = 0; i < NB; i++) load(v[i], i);
    for (int gi = 0; gi < GROUPS; gi += NB) {
#pragma unroll
        for (int i = 0; i < NB; i++) {
            if (gi + i < GROUPS) {
#pragma unroll
                for (int u = 0; u < 10; u++) acc ^= v[i][u].x + v[i][u].y;
                if (gi + i + NB < GROUPS) load(v[i], gi + i + NB);
            }
        }
    }
    if (acc == 0x12345678u) sink = acc;
}

__device__ __forceinline__ void mbar_init(uint32_t a, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(n)); }
__device__ __forceinline__ void mbar_expect(uint32_t a, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t a) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nLAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra LAB_WAIT;\n}\n" ::"r"(a),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t mbar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src), "r"(bytes),
                 "r"(mbar)
                 : "memory");
}

// Block b streams bytes [b*pb, (b+1)*pb) of w: warp CW's lane 0 issues the chunks, warps 0..CW-1
// read them. full[s]: the chunk in buffer s has landed (1 arrival + CH transaction bytes);
// empty[s]: the CW consumer warps are done with it.
template <int CH, int NST, int CW>
__global__ void bulk(const u8* w, u64 pb) {
    extern __shared__ __align__(128) u8 sm[];
    __shared__ __align__(8) u64 bar[2 * NST];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u8* src = w + blockIdx.x * pb;
    const int nch = (int)(pb / CH);
    const uint32_t s0 = (uint32_t)__cvta_generic_to_shared(sm), b0 = (uint32_t)__cvta_generic_to_shared(bar);
    if (threadIdx.x == 0)
        for (int s = 0; s < NST; s++) {
            mbar_init(b0 + 8 * s, 1);
            mbar_init(b0 + 8 * (NST + s), CW);
        }
    __syncthreads();
    if (warp == CW) {
        if (lane == 0)
            for (int c = 0; c < nch; c++) {
                const int s = c % NST;
                if (c >= NST) mbar_wait(b0 + 8 * (NST + s), ((c / NST) - 1) & 1);
                mbar_expect(b0 + 8 * s, CH);
                bulk_copy(s0 + s * CH, src + (u64)c * CH, CH, b0 + 8 * s);
            }
        return;
    }
    uint32_t acc = 0;
    for (int c = 0; c < nch; c++) {
        const int s = c % NST;
        mbar_wait(b0 + 8 * s, (c / NST) & 1);
        const uint4* p = (const uint4*)(sm + s * CH);
        for (int i = threadIdx.x; i < CH / 16; i += CW * 32) {
            const uint4 v = p[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(b0 + 8 * (NST + s));
    }
    if (acc == 0x12345678u) sink = acc;
}

// mmq_q8_rows' weight stream (see the header, "rk"). Tile t of the matrix: 16 groups of TG bytes
// at w + t * 16 * TG; block (x, y) takes tiles (y * 88 + 4x + warp) (88 16-row tiles an expert).
constexpr int TG = 2176, TILES_PER_EXPERT = ROWS / 16;
// The load's cache operators: 0 __ldg (ld.global.nc, the kernel's), 1 ld.global.cg (L2 only),
// 2 ld.global.nc.L1::no_allocate.L2::256B (no L1 line, 256-byte L2 fetches), 3 ld.global.cs
// (streaming, evict first).
template <int C>
__device__ __forceinline__ uint4 ldc(const u8* p) {
    uint4 v;
    if constexpr (C == 0) {
        v = __ldg((const uint4*)p);
    } else if constexpr (C == 1) {
        asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (C == 2) {
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    } else {
        asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}
template <int NB, int W, bool P, int C = 0>
__global__ void __launch_bounds__(128) rk(const u8* w, int items) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    // The warp's stream: item i of the block is work item blockIdx.x + i * gridDim.x (P) or the
    // block's own (x, y); an item is one tile of 16 groups.
    const int per = P ? (items - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 1;
    const int total = per * GROUPS;
    auto src = [&](int gi) -> const u8* {
        const int it = gi / GROUPS, grp = gi - it * GROUPS;
        const int item = P ? blockIdx.x + it * gridDim.x : blockIdx.y * (TILES_PER_EXPERT / 4) + blockIdx.x;
        const u64 tile = (u64)item * 4 + warp;
        return w + (tile * GROUPS + grp) * TG;
    };
    uint4 v[NB][5];
    auto load = [&](uint4* d, int gi) {
        const u8* p = src(min(gi, total - 1));
        d[0] = ldc<C>(p + 16 * g);
#pragma unroll
        for (int bl = 0; bl < 4; bl++) d[1 + bl] = ldc<C>(p + 128 + 512 * bl + 16 * lane);
    };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < NB; i++) load(v[i], i);
    for (int gi = 0; gi < total; gi += NB) {
#pragma unroll
        for (int i = 0; i < NB; i++) {
            if (gi + i < total) {
                uint32_t x = 0;
#pragma unroll
                for (int u = 0; u < 5; u++) x ^= v[i][u].x ^ v[i][u].y ^ v[i][u].z ^ v[i][u].w;
                float f = __int_as_float((x & 0x007fffffu) | 0x3f800000u);
#pragma unroll
                for (int r = 0; r < W; r++) acc[r & 3] = fmaf(acc[r & 3], f, 1e-7f * r);
                acc[0] += f;
                if (gi + i + NB < total) load(v[i], gi + i + NB);
            }
        }
    }
    if (acc[0] + acc[1] + acc[2] + acc[3] == 1.2345f) sink = 1;
}
template <typename F>
float timed(F launch, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    launch();  // warm-up
    cudaEventRecord(a);
    for (int i = 0; i < reps; i++) launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms / reps;
}

static int g_argc;
static char** g_argv;
static bool want(const char* name) {
    if (g_argc < 2) return true;
    for (int i = 1; i < g_argc; i++)
        if (strncmp(name, g_argv[i], strlen(g_argv[i])) == 0) return true;
    return false;
}
int main(int argc, char** argv) {
    g_argc = argc;
    g_argv = argv;
    const size_t mat = (size_t)EXPERTS * ROWS * ROW;  // 207.6 MB
    const int copies = 8;                              // launches rotate over 8 copies (1.66 GB): nothing stays in L2
    u8* w;
    CK(cudaMalloc(&w, mat * copies));
    CK(cudaMemset(w, 1, mat * copies));
    int sms = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    printf("bwprobe: %d SMs; one launch reads %.1f MB (64 experts x %d rows x %d bytes)\n", sms, mat / 1e6, ROWS, ROW);
    int it = 0;
    auto report = [&](const char* name, float ms, int occ) {
        printf("%-22s %8.1f us  %6.2f TB/s  (blocks/SM %d)\n", name, ms * 1e3, mat / (ms * 1e-3) / 1e12, occ);
    };
    if (want("stream")) {
        float ms = timed([&] { stream<<<sms * 8, 256>>>((const uint4*)(w + (it++ % copies) * mat), mat / 16); }, 20);
        report("stream", ms, 8);
    }
    dim3 grid(ROWS / BM + (ROWS % BM != 0), EXPERTS);
#define TILE(NST, GPS)                                                                                         \
    if (want("tile")) {                                                                                                          \
        const int smem = NST * BM * (GPS * GB + 16);                                                           \
        cudaFuncSetAttribute(tile<NST, GPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);               \
        int occ = 0;                                                                                           \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, tile<NST, GPS>, 128, smem);                        \
        float ms = timed([&] { tile<NST, GPS><<<grid, 128, smem>>>(w + (it++ % copies) * mat); }, 20);        \
        report("tile NST=" #NST " GPS=" #GPS, ms, occ);                                                        \
    }
    TILE(2, 2) TILE(3, 2) TILE(4, 2) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(6, 1) TILE(2, 4) TILE(3, 4)
#define ROWS_(NST, GPS)                                                                                        \
    if (want("rows")) {                                                                                                          \
        const int smem = NST * (BM * GPS / GROUPS) * ROW;                                                      \
        cudaFuncSetAttribute(rows<NST, GPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);               \
        int occ = 0;                                                                                           \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, rows<NST, GPS>, 128, smem);                        \
        float ms = timed([&] { rows<NST, GPS><<<grid, 128, smem>>>(w + (it++ % copies) * mat); }, 20);        \
        report("rows NST=" #NST " GPS=" #GPS, ms, occ);                                                        \
    }
    ROWS_(2, 2) ROWS_(3, 2) ROWS_(4, 2)
#define WARPS(RW, RPW)                                                                                         \
    if (want("warp-rows")) {                                                                                                          \
        const size_t warps = ((size_t)EXPERTS * ROWS + RPW - 1) / RPW;                                         \
        float ms = timed([&] { warp_rows<RW><<<(warps + 7) / 8, 256>>>(w + (it++ % copies) * mat, RPW); }, 20); \
        report("warp-rows RW=" #RW " rows/warp=" #RPW, ms, 0);                                                 \
    }
    WARPS(1, 8) WARPS(2, 8) WARPS(4, 8) WARPS(4, 32) WARPS(8, 32)
#define FRAG(NB, TILED, TPB)                                                                                   \
    if (want("frag16")) {                                                                                                          \
        const size_t warps = (size_t)EXPERTS * (ROWS / 16), per = TPB / 32;                                    \
        int occ = 0;                                                                                           \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, frag16<NB, TILED>, TPB, 0);                        \
        float ms = timed([&] { frag16<NB, TILED><<<(warps + per - 1) / per, TPB>>>(w + (it++ % copies) * mat); }, 20); \
        report(TILED ? "frag16 tiled NB=" #NB " TPB=" #TPB : "frag16 rows NB=" #NB " TPB=" #TPB, ms, occ);   \
    }
    FRAG(2, false, 128) FRAG(4, false, 128) FRAG(2, true, 128) FRAG(4, true, 128) FRAG(2, false, 256) FRAG(2, true, 256)
#define BULK(CH, NST, CW, PBR)                                                                                 \
    if (want("bulk")) {                                                                                                          \
        const int smem = NST * CH;                                                                             \
        const u64 pb = (u64)PBR * ROW;                                                                         \
        cudaFuncSetAttribute(bulk<CH, NST, CW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);            \
        int occ = 0;                                                                                           \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, bulk<CH, NST, CW>, 32 * (CW + 1), smem);           \
        float ms = timed([&] { bulk<CH, NST, CW><<<mat / pb, 32 * (CW + 1), smem>>>(w + (it++ % copies) * mat, pb); }, 20); \
        report("bulk CH=" #CH " NST=" #NST " CW=" #CW " rows=" #PBR, ms, occ);                              \
    }
    // Chunks of 2, 4, 8, 16 rows' worth (4,608 .. 36,864 bytes); 64- and 16-row blocks.
    BULK(4608, 4, 4, 64) BULK(4608, 8, 4, 64) BULK(9216, 4, 4, 64) BULK(9216, 8, 4, 64) BULK(18432, 4, 4, 64)
    BULK(18432, 2, 4, 64) BULK(36864, 2, 4, 64) BULK(9216, 4, 2, 64) BULK(9216, 4, 8, 64) BULK(4608, 4, 4, 16)
    BULK(9216, 4, 4, 16) BULK(2304, 8, 4, 16) BULK(2304, 16, 4, 64) BULK(1152, 16, 4, 64)
    // mmq_q8_rows' loads (rk): the grid of one gate matrix (22 row tiles x 64 experts, 196 MB).
    const size_t rk_bytes = (size_t)EXPERTS * TILES_PER_EXPERT * GROUPS * TG;
    auto rk_report = [&](const char* name, float ms, int occ) {
        printf("%-22s %8.1f us  %6.2f TB/s  (blocks/SM %d)\n", name, ms * 1e3, rk_bytes / (ms * 1e-3) / 1e12, occ);
    };
#define RKC(NB, BPS, W, P, C)                                                                                  \
    if (want("rk")) {                                                                                          \
        const int smem = BPS >= 16 ? 0 : (228 * 1024) / (BPS + 1) + 1024;                                      \
        cudaFuncSetAttribute(rk<NB, W, P, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);              \
        int occ = 0;                                                                                           \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, rk<NB, W, P, C>, 128, smem);                       \
        const int items = EXPERTS * (TILES_PER_EXPERT / 4);                                                    \
        const dim3 grid = P ? dim3(sms * occ) : dim3(TILES_PER_EXPERT / 4, EXPERTS);                           \
        float ms = timed([&] { rk<NB, W, P, C><<<grid, 128, smem>>>(w + (it++ % copies) * mat, items); }, 20); \
        rk_report("rk NB=" #NB " BPS=" #BPS " W=" #W " P=" #P " C=" #C, ms, occ);                              \
    }
#define RK(NB, BPS, W, P) RKC(NB, BPS, W, P, 0)
    // The kernel today: 2 groups in flight, 5 blocks an SM, ~100 multiply instructions a group.
    RK(2, 5, 0, false) RK(2, 5, 96, false) RK(2, 5, 96, true)
    // More warps, or more groups a warp, at the same multiply.
    RK(2, 8, 96, false) RK(2, 16, 96, false) RK(3, 5, 96, false) RK(4, 5, 96, false) RK(1, 10, 96, false)
    // Loads only, more warps; persistent at the kernel's occupancy and at more.
    RK(2, 16, 0, false) RK(4, 5, 0, false) RK(2, 8, 96, true) RK(4, 5, 96, true) RK(2, 5, 0, true)
    // The kernel's shape under other cache operators (see ldc).
    RKC(2, 5, 96, false, 1) RKC(2, 5, 96, false, 2) RKC(2, 5, 96, false, 3) RKC(4, 5, 96, false, 2)
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
