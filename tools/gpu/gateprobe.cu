// How far is the one-token MoE gate/up launch from a plain stream of its bytes? (docs/PERF.md,
// seventy-fifth session.) The seventy-third session's downprobe put the down launches within
// 10% (Q8_0) and 1% (bf16) of a plain stream. The gate/up (`moe_gateup_sh_q8q`) takes 20.6 µs
// from its release on an H100 where a plain launch of all its bytes would take ~19.2 and of its
// routed slots' alone ~15.0 (its shared slots load before its PDL wait), and Nsight (sixty-second
// session) found its SMs uneven: 88 run 3 of its blocks and 44 run 2. This probe reads the
// gate and up stacks as the kernel lays them out (64 experts of 1,408 rows of K = 2,048 in Q8_0:
// rows of 16 groups of 144 bytes, a group being 16 bytes of scales then 4 x 32 quants), 8 slots
// a launch (6 routed, 2 "shared"), other experts each launch (64 launches cycle through 415 MB,
// far more than L2), with the kernel's own loads, activations and multiply-adds:
//   cur        the kernel's shape: a block 32 rows of one slot (gate and up), 8 warps of 4 rows
//              one after another (the first row's pieces loaded first, as after its wait), 3
//              blocks an SM, the routed slots' expert read from memory first; 352 blocks.
//   cur6       the same for the 6 routed slots only (264 blocks): what is left after the wait
//              when the shared slots' rows were loaded before it.
//   dyn N      N blocks an SM, each claiming the 352 units (slot, 32 rows) one at a time from a
//              counter (atomicAdd, the next claimed while the current is read): the units go
//              to whichever blocks are free, however the blocks were placed.
//   stream     the same 16 (12) matrices read by plain 16-byte loads, 8 in flight (the ceiling);
//   tile       the same units from the 16-row tiled copy (`tile16`: per tile of 16 rows and
//              group of 128 values, 8 chunks of scales then 128 of quants, no pad bytes: 5.6%
//              fewer bytes than the 144-byte groups), as a one-token kernel could read it: a
//              warp takes 8 groups of one tile of gate or up, a lane 4 quant chunks a group
//              (rows g and g + 8 of block u), lanes 0-7 a scale chunk each, dp4a on the
//              words; the two halves of K summed through shared memory. tile6: routed only.
// It also prints how `cur`'s blocks were spread over the SMs when launched alone.
//   nvcc -O3 -arch=sm_90 -o /tmp/gateprobe tools/gpu/gateprobe.cu && /tmp/gateprobe   (with probe.cuh beside it)
// Written by hand: a micro-benchmark of one kernel's read pattern, nothing a crate offers.
#include <algorithm>
#include <cstdint>
#include <vector>
#include "probe.cuh"

constexpr int M = 1408, K = 2048, E = 64, S = 8, SR = 6, NIT = 64, UNITS = M / 32;
constexpr i64 Q_ROW = (K / 128) * 144, Q_MAT = (i64)M * Q_ROW;
constexpr int TG = 2176, NG = K / 128;                  // a tile's group: 16 rows x 136 bytes
constexpr i64 T_MAT = (i64)(M / 16) * NG * TG;          // a matrix in the tiled copy

__device__ __forceinline__ unsigned smid() {
    unsigned r;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
    return r;
}

// Pieces lane + 32u (u < 4) of a row: 16 quants and the block's scale (the kernel's load_q8_4w).
__device__ __forceinline__ void load4(const u8* wr, int lane, uint4* q, float* d, bool weights) {
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const int p = lane + 32 * u, b = p >> 1;
        const u8* gp = wr + (i64)(b >> 2) * 144;
        const u8* qp = gp + 16 + 32 * (b & 3) + 16 * (p & 1);
        q[u] = weights ? ldw16(qp) : *(const uint4*)qp;
        d[u] = h2f(weights ? ldw_u16(gp + 2 * (b & 3)) : ((const unsigned short*)gp)[b & 3]);
    }
}

// One unit: slot s's rows [32 bx, 32 bx + 32) of gate and up, 4 rows a warp one after another,
// act(g) * u into glu, warp 0 stores the 32 values. Routed slots read their expert first.
__device__ __forceinline__ void unit(int bx, int s, const u8* Wg, const u8* Wu, const int* sel, const u8* xq,
                                     float* glu, float* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = sel[s];
    const u8* g0 = Wg + (i64)e * Q_MAT;
    const u8* u0 = Wu + (i64)e * Q_MAT;
    const int row0 = bx * 32 + warp * 4;
    uint4 qg[4], qu[4], xv[4];
    float dg[4], du[4], dx[4];
    load4(g0 + (i64)row0 * Q_ROW, lane, qg, dg, true);
    load4(u0 + (i64)row0 * Q_ROW, lane, qu, du, true);
    for (int i = 0; i < 4; i++) {
        if (i > 0) {
            load4(g0 + (i64)(row0 + i) * Q_ROW, lane, qg, dg, true);
            load4(u0 + (i64)(row0 + i) * Q_ROW, lane, qu, du, true);
        }
        load4(xq, lane, xv, dx, false);
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int v = 0; v < 4; v++) {
            g += (float)dot16(qg[v], xv[v]) * (dg[v] * dx[v]);
            u += (float)dot16(qu[v], xv[v]) * (du[v] * dx[v]);
        }
        g = warp_sum(g);
        u = warp_sum(u);
        if (lane == 0) glu[warp * 4 + i] = g / (1.f + __expf(-g)) * u;
    }
    __syncthreads();
    if (warp == 0) out[s * M + bx * 32 + lane] = glu[lane];
    __syncthreads();
}

// cur / cur6: block b is unit (b % 44) of slot b / 44 + first; the "shared" slots first in the
// grid, as the kernel orders them. sm: where each block ran (null: not recorded).
__global__ void __launch_bounds__(256, 3) cur(const u8* Wg, const u8* Wu, const int* sel, const u8* xq, float* out,
                                              int first, unsigned* sm) {
    __shared__ float glu[32];
    const int s = (S - 1 - (blockIdx.x / UNITS + first) + S) % S;  // slots 7, 6 ("shared") first
    if (sm && threadIdx.x == 0) sm[blockIdx.x] = smid();
    unit(blockIdx.x % UNITS, s, Wg, Wu, sel, xq, glu, out);
}

// dyn: units claimed from *ctr in the same order (shared slots first).
__global__ void __launch_bounds__(256, 3) dyn(const u8* Wg, const u8* Wu, const int* sel, const u8* xq, float* out,
                                              unsigned* ctr) {
    __shared__ float glu[32];
    __shared__ unsigned next;
    if (threadIdx.x == 0) next = atomicAdd(ctr, 1u);
    __syncthreads();
    for (;;) {
        const unsigned c = next;
        if (c >= (unsigned)(S * UNITS)) break;
        __syncthreads();
        if (threadIdx.x == 0) next = atomicAdd(ctr, 1u);  // the next, asked for before this one's reads
        const int s = (S - 1 - (int)(c / UNITS) + S) % S;
        unit(c % UNITS, s, Wg, Wu, sel, xq, glu, out);
    }
}

// One unit from the tiled copy: slot s's tiles 2 bx and 2 bx + 1 of gate and up. Warp w reads
// matrix w / 4 (gate, up), tile 2 bx + (w / 2) % 2, groups [8 (w % 2), 8 (w % 2) + 8).
__device__ __forceinline__ void unit_tiled(int bx, int s, const u8* Tg, const u8* Tu, const int* sel, const u8* xq,
                                           float* part, float* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int e = sel[s], mat = warp >> 2, tile = 2 * bx + ((warp >> 1) & 1), g0 = 8 * (warp & 1);
    const u8* tp = (mat ? Tu : Tg) + (i64)e * T_MAT + ((i64)tile * NG + g0) * TG;
    float a0 = 0.f, a1 = 0.f;
#pragma unroll 2
    for (int gi = 0; gi < 8; gi++) {
        const u8* gp = tp + (i64)gi * TG;
        uint4 q[4], sc = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < 4; u++) q[u] = ldw16(gp + 16 * (8 + 32 * u + lane));
        if (lane < 8) sc = ldw16(gp + 16 * lane);
        // row g's 4 scales (words x, y of lane g's chunk) and row g + 8's (z, w)
        const unsigned s0 = __shfl_sync(0xffffffffu, sc.x, g), s1 = __shfl_sync(0xffffffffu, sc.y, g);
        const unsigned s2 = __shfl_sync(0xffffffffu, sc.z, g), s3 = __shfl_sync(0xffffffffu, sc.w, g);
        const u8* xg = xq + (g0 + gi) * 144;
        float dx[4];
#pragma unroll
        for (int u = 0; u < 4; u++) dx[u] = h2f(((const unsigned short*)xg)[u]);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const uint2 xv = *(const uint2*)(xg + 16 + 32 * u + 8 * t);
            const int ia = __dp4a((int)q[u].x, (int)xv.x, __dp4a((int)q[u].z, (int)xv.y, 0));
            const int ib = __dp4a((int)q[u].y, (int)xv.x, __dp4a((int)q[u].w, (int)xv.y, 0));
            const unsigned wa = u < 2 ? s0 : s1, wb = u < 2 ? s2 : s3;
            const float da = h2f((unsigned short)((u & 1) ? wa >> 16 : wa & 0xffff));
            const float db = h2f((unsigned short)((u & 1) ? wb >> 16 : wb & 0xffff));
            a0 += (float)ia * (da * dx[u]);
            a1 += (float)ib * (db * dx[u]);
        }
    }
    for (int o = 1; o < 4; o <<= 1) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
    // part[mat][row 0..31][half]
    const int row = 16 * ((warp >> 1) & 1) + g;
    if (t == 0) {
        part[(mat * 32 + row) * 2 + (warp & 1)] = a0;
        part[(mat * 32 + row + 8) * 2 + (warp & 1)] = a1;
    }
    __syncthreads();
    if (warp == 0) {
        const float gv = part[lane * 2] + part[lane * 2 + 1], uv = part[(32 + lane) * 2] + part[(32 + lane) * 2 + 1];
        out[s * M + bx * 32 + lane] = gv / (1.f + __expf(-gv)) * uv;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(256, 3) tiled(const u8* Tg, const u8* Tu, const int* sel, const u8* xq, float* out,
                                                int first) {
    __shared__ float part[128];
    const int s = (S - 1 - (blockIdx.x / UNITS + first) + S) % S;
    unit_tiled(blockIdx.x % UNITS, s, Tg, Tu, sel, xq, part, out);
}

// The ceiling: ns slots' gate and up matrices, plain 16-byte loads, 8 in flight a thread.
__global__ void __launch_bounds__(256) stream(const u8* Wg, const u8* Wu, const int* sel, float* out, int ns) {
    const unsigned words = (unsigned)(Q_MAT / 16), n = 2 * ns * words, step = gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 8 * step) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const unsigned j = i + u * step, m = j / words, s = m >> 1;
            const u8* W = (m & 1) ? Wu : Wg;
            v[u] = j < n ? ldw16(W + sel[s] * Q_MAT + (i64)(j - m * words) * 16) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; u++) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678u) out[0] = 1.f;
}

int main() {
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, 0));
    const int sms = pr.multiProcessorCount;
    printf("%s, %d SMs, L2 %d bytes\n", pr.name, sms, pr.l2CacheSize);
    u8 *Wg, *Wu, *xq;
    float* out;
    int* sel;
    unsigned *ctr, *sm;
    CK(cudaMalloc(&Wg, E * Q_MAT));
    CK(cudaMalloc(&Wu, E * Q_MAT));
    CK(cudaMemset(Wg, 0x11, E * Q_MAT));
    CK(cudaMemset(Wu, 0x13, E * Q_MAT));
    u8 *Tg, *Tu;
    CK(cudaMalloc(&Tg, E * T_MAT));
    CK(cudaMalloc(&Tu, E * T_MAT));
    CK(cudaMemset(Tg, 0x11, E * T_MAT));
    CK(cudaMemset(Tu, 0x13, E * T_MAT));
    CK(cudaMalloc(&xq, Q_ROW));
    CK(cudaMemset(xq, 0x01, Q_ROW));
    CK(cudaMalloc(&out, S * M * 4));
    CK(cudaMalloc(&ctr, 4 * NIT * 4));
    CK(cudaMalloc(&sm, S * UNITS * 4));
    // Launch it reads experts (8 (it % 8) + s + 3 (it / 8)) mod 64, as downprobe.
    std::vector<int> hs(NIT * S);
    for (int it = 0; it < NIT; it++)
        for (int s = 0; s < S; s++) hs[it * S + s] = (8 * (it % 8) + s + 3 * (it / 8)) % E;
    CK(cudaMalloc(&sel, NIT * S * 4));
    CK(cudaMemcpy(sel, hs.data(), NIT * S * 4, cudaMemcpyHostToDevice));
    auto rep = [&](const char* name, double bytes, float us) {
        printf("%-28s %8.2f us  %6.3f TB/s\n", name, us, bytes / us * 1e-6);
    };
    const double all = 2.0 * S * Q_MAT, routed = 2.0 * SR * Q_MAT;
    printf("a launch: %.1f MB (8 slots), %.1f MB (6 routed)\n", all / 1e6, routed / 1e6);
    rep("stream (8 slots)", all, timeit(NIT, [&](int k) { stream<<<sms * 8, 256>>>(Wg, Wu, sel + (k % NIT) * S, out, S); }));
    rep("stream (6 routed)", routed, timeit(NIT, [&](int k) { stream<<<sms * 8, 256>>>(Wg, Wu, sel + (k % NIT) * S, out, SR); }));
    rep("cur (352 blocks)", all,
        timeit(NIT, [&](int k) { cur<<<S * UNITS, 256>>>(Wg, Wu, sel + (k % NIT) * S, xq, out, 0, nullptr); }));
    rep("cur6 (264 blocks)", routed,
        timeit(NIT, [&](int k) { cur<<<SR * UNITS, 256>>>(Wg, Wu, sel + (k % NIT) * S, xq, out, S - SR, nullptr); }));
    const double tall = 2.0 * S * T_MAT, trouted = 2.0 * SR * T_MAT;
    rep("tile (352 blocks)", tall,
        timeit(NIT, [&](int k) { tiled<<<S * UNITS, 256>>>(Tg, Tu, sel + (k % NIT) * S, xq, out, 0); }));
    rep("tile6 (264 blocks)", trouted,
        timeit(NIT, [&](int k) { tiled<<<SR * UNITS, 256>>>(Tg, Tu, sel + (k % NIT) * S, xq, out, S - SR); }));
    for (int per : {1, 2, 3}) {
        CK(cudaMemset(ctr, 0, 4 * NIT * 4));
        char name[40];
        snprintf(name, sizeof name, "dyn %d an SM (%d blocks)", per, per * sms);
        rep(name, all, timeit(NIT, [&](int k) { dyn<<<per * sms, 256>>>(Wg, Wu, sel + (k % NIT) * S, xq, out, ctr + k); }));
    }
    // Where cur's blocks ran, launched alone.
    cur<<<S * UNITS, 256>>>(Wg, Wu, sel, xq, out, 0, sm);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned> hsm(S * UNITS);
    CK(cudaMemcpy(hsm.data(), sm, S * UNITS * 4, cudaMemcpyDeviceToHost));
    std::vector<int> per(sms, 0), routed_per(sms, 0);
    for (int b = 0; b < S * UNITS; b++) {
        per[hsm[b] % sms]++;
        if (b >= (S - SR) * UNITS) routed_per[hsm[b] % sms]++;
    }
    std::vector<int> hist(8, 0), rhist(8, 0);
    for (int i = 0; i < sms; i++) {
        hist[std::min(per[i], 7)]++;
        rhist[std::min(routed_per[i], 7)]++;
    }
    printf("cur alone, SMs by blocks run (0..7):");
    for (int v : hist) printf(" %d", v);
    printf("; by routed blocks:");
    for (int v : rhist) printf(" %d", v);
    printf("\n");
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    return 0;
}
