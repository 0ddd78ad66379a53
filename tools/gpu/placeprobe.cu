// When are a PDL secondary's blocks placed, cluster or not? (docs/PERF.md, seventy-fifth
// session.) In every decode trace the one-token routing launch (a cluster of 8 blocks) and
// Path::RaOut's output launch (clusters of 8) had their blocks placed only as they were released
// (0.05-0.74 µs before), while plain launches' blocks were placed 2-12 µs early and loaded their
// weights during the launch before. The seventy-third session's RR_MINB made the routing blocks
// fit beside mla_out_q8's and they were still placed late. This probe asks whether being a
// cluster is what holds them.
//   nvcc -O3 -arch=sm_90 -o /tmp/placeprobe tools/gpu/placeprobe.cu && /tmp/placeprobe   (with probe.cuh beside it)
// The primary is shaped like mla_out_q8: 128 blocks of 256 threads with 124 KB of dynamic shared
// memory (one a SM), which trigger their dependents at entry and then spin for SPIN_NS. The
// secondary (launched with programmatic stream serialisation) records each block's entry time,
// waits (griddepcontrol.wait), and records its release. Printed, in µs against the primary's
// last block's end: the secondary's first and last block entries (negative: placed while the
// primary ran) and its first release; medians of REPS runs.
// Written by hand: a micro-benchmark of the card's block scheduler, nothing a crate offers.
#include <algorithm>
#include <vector>
#include "probe.cuh"

constexpr int PRIM_BLOCKS = 128, PRIM_THREADS = 256, PRIM_SMEM = 124 * 1024, REPS = 9;
constexpr unsigned long long SPIN_NS = 20000;

__device__ __forceinline__ unsigned long long gtime() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// t[0..PRIM_BLOCKS): each primary block's end.
__global__ void __launch_bounds__(PRIM_THREADS, 1) primary(unsigned long long* t) {
    extern __shared__ float sm[];
    pdl_trigger();
    const unsigned long long t0 = gtime();
    sm[threadIdx.x] = (float)threadIdx.x;
    while (gtime() - t0 < SPIN_NS) {
    }
    __syncthreads();
    if (threadIdx.x == 0) t[blockIdx.x] = gtime() + (sm[5] > 1e30f ? 1 : 0);
}

// e[b]: block b's entry; r[b]: its release from the wait.
__global__ void secondary(unsigned long long* e, unsigned long long* r) {
    const unsigned long long t = gtime();
    pdl_wait();
    const unsigned long long t2 = gtime();
    const int b = blockIdx.x + gridDim.x * blockIdx.y;
    if (threadIdx.x == 0) {
        e[b] = t;
        r[b] = t2;
    }
}

struct Row {
    const char* name;
    int blocks, threads, cluster, smem;
};

int main() {
    int dev = 0;
    CK(cudaSetDevice(dev));
    cudaDeviceProp pr;
    CK(cudaGetDeviceProperties(&pr, dev));
    printf("placeprobe: %s, %d SMs; primary %d blocks x %d threads, %d KB shared, spin %.1f us\n", pr.name,
           pr.multiProcessorCount, PRIM_BLOCKS, PRIM_THREADS, PRIM_SMEM / 1024, SPIN_NS / 1000.0);
    CK(cudaFuncSetAttribute(primary, cudaFuncAttributeMaxDynamicSharedMemorySize, PRIM_SMEM));
    CK(cudaFuncSetAttribute(secondary, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024));
    CK(cudaFuncSetAttribute(secondary, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    unsigned long long *tp, *te, *tr;
    CK(cudaMalloc(&tp, PRIM_BLOCKS * 8));
    CK(cudaMalloc(&te, 4096 * 8));
    CK(cudaMalloc(&tr, 4096 * 8));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // (The non-portable cluster of 16 last: a card that refuses it ends the probe there.)
    const Row rows[] = {
        {"8 x 1024, no cluster", 8, 1024, 1, 0},
        {"8 x 1024, cluster 8", 8, 1024, 8, 0},
        {"8 x 256, no cluster", 8, 256, 1, 0},
        {"8 x 256, cluster 8", 8, 256, 8, 0},
        {"128 x 256, no cluster", 128, 256, 1, 0},
        {"128 x 256, cluster 8", 128, 256, 8, 0},
        {"128 x 256, cluster 2", 128, 256, 2, 0},
        {"128 x 256 +64KB, no cluster", 128, 256, 1, 65536},
        {"128 x 256 +64KB, cluster 8", 128, 256, 8, 65536},
        {"16 x 512, cluster 16", 16, 512, 16, 0},
    };
    printf("%-30s %12s %12s %12s\n", "secondary", "first entry", "last entry", "release");
    for (const Row& row : rows) {
        std::vector<double> fe, le, rl;
        for (int rep = 0; rep < REPS + 1; rep++) {
            primary<<<PRIM_BLOCKS, PRIM_THREADS, PRIM_SMEM, s>>>(tp);
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(row.blocks, 1, 1);
            cfg.blockDim = dim3(row.threads, 1, 1);
            cfg.dynamicSmemBytes = row.smem;
            cfg.stream = s;
            cudaLaunchAttribute at[2];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[0].val.programmaticStreamSerializationAllowed = 1;
            int na = 1;
            if (row.cluster > 1) {
                at[1].id = cudaLaunchAttributeClusterDimension;
                at[1].val.clusterDim.x = row.cluster;
                at[1].val.clusterDim.y = 1;
                at[1].val.clusterDim.z = 1;
                na = 2;
            }
            cfg.attrs = at;
            cfg.numAttrs = na;
            CK(cudaLaunchKernelEx(&cfg, secondary, te, tr));
            CK(cudaStreamSynchronize(s));
            if (rep == 0) continue;  // warm-up
            std::vector<unsigned long long> p(PRIM_BLOCKS), e(row.blocks), r(row.blocks);
            CK(cudaMemcpy(p.data(), tp, PRIM_BLOCKS * 8, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(e.data(), te, row.blocks * 8, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(r.data(), tr, row.blocks * 8, cudaMemcpyDeviceToHost));
            const double pend = (double)*std::max_element(p.begin(), p.end());
            fe.push_back(((double)*std::min_element(e.begin(), e.end()) - pend) / 1000.0);
            le.push_back(((double)*std::max_element(e.begin(), e.end()) - pend) / 1000.0);
            rl.push_back(((double)*std::min_element(r.begin(), r.end()) - pend) / 1000.0);
        }
        auto med = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        printf("%-30s %12.2f %12.2f %12.2f\n", row.name, med(fe), med(le), med(rl));
    }
    return 0;
}
