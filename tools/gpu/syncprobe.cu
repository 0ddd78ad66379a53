// What one dependent step costs on the card itself (docs/GPU.md, twenty-eighth session): a tg128
// layer is six dependent launches, and about 29 us of its ~52 go to dependent steps rather than
// bytes. Before writing a persistent decode kernel (blocks that wait on flags instead of on the
// whole previous grid), this measures the step each way with the same trivial work. Each step
// reads what the previous step's blocks wrote (past L1), reduces it in the block, and writes one
// value a block.
//   nvcc -O3 -arch=sm_90 -o /tmp/syncprobe tools/gpu/syncprobe.cu && /tmp/syncprobe   (with probe.cuh beside it)
// Probes (microseconds a step, the median of 5 replays of 256 steps):
//   graph B        256 launches of a B-block kernel in a CUDA graph, plain stream order;
//   pdl B          the same launches with programmatic dependent launch (each kernel triggers
//                  its dependents at entry, then waits: how turbospark's kernels chain);
//   grid B         one persistent kernel of B blocks (at most one wave), a grid-wide barrier a
//                  step: a counter each block adds to (release) and spins on (acquire);
//   flags8 B       the same kernel, but each block waits only for the 8 blocks whose values it
//                  reads (a flag a block, the step number, release / acquire): a dataflow edge;
//   cluster        a kernel of 16 clusters of 8 blocks, a cluster barrier a step (the
//                  barrier.cluster arrive.release / wait.acquire our routing launch uses), each
//                  block reading a value from the next block's shared memory.
// Written by hand: a micro-benchmark of the card's synchronisation, nothing a crate offers.
#include <algorithm>
#include <vector>
#include "probe.cuh"

constexpr int THREADS = 256, STEPS = 256, REPS = 5, FAN = 8;

// The block's sum of v (every thread's), in thread 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float red[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    if (threadIdx.x == 0)
        for (int w = 0; w < THREADS / 32; w++) s += red[w];
    __syncthreads();
    return s;
}

// One step as a kernel: the previous step's nb values in, this block's value out.
__global__ void __launch_bounds__(THREADS) step_kernel(const float* in, float* out, int nb, int pdl) {
    if (pdl) {
        pdl_trigger();
        pdl_wait();
    }
    float v = 0.f;
    for (int i = threadIdx.x; i < nb; i += THREADS) v += __ldcg(in + i);
    const float s = block_sum(v);
    if (threadIdx.x == 0) out[blockIdx.x] = s * 0.5f / nb + 1.f;
}

// All steps in one kernel of gridDim.x blocks (one wave), a grid-wide barrier each step.
__global__ void __launch_bounds__(THREADS) grid_kernel(float* buf, unsigned* cnt, int steps) {
    const int nb = gridDim.x;
    for (int s = 0; s < steps; s++) {
        const float* in = buf + (s & 1) * nb;
        float* out = buf + ((s + 1) & 1) * nb;
        float v = 0.f;
        for (int i = threadIdx.x; i < nb; i += THREADS) v += __ldcg(in + i);
        const float t = block_sum(v);
        if (threadIdx.x == 0) {
            __stcg(out + blockIdx.x, t * 0.5f / nb + 1.f);
            red_release(cnt, 1u);
            const unsigned want = (unsigned)(s + 1) * nb;
            while (ld_acquire(cnt) < want) {
            }
        }
        __syncthreads();
    }
}

// All steps in one kernel, each block waiting only for the FAN blocks it reads (flag[b] = the
// last step block b finished).
__global__ void __launch_bounds__(THREADS) flags_kernel(float* buf, unsigned* flag, int steps) {
    const int nb = gridDim.x, b = blockIdx.x;
    for (int s = 0; s < steps; s++) {
        const float* in = buf + (s & 1) * nb;
        float* out = buf + ((s + 1) & 1) * nb;
        float v = 0.f;
        if (threadIdx.x < FAN) {
            const int src = (b + 17 * threadIdx.x) % nb;
            if (s > 0)
                while (ld_acquire(flag + src) < (unsigned)s) {
                }
            v = __ldcg(in + src);
        }
        const float t = block_sum(v);
        if (threadIdx.x == 0) {
            __stcg(out + b, t * 0.5f / FAN + 1.f);
            st_release(flag + b, (unsigned)(s + 1));
        }
        // (A block may run at most one step ahead of a reader of its value: out is double
        // buffered, and its own reads of step s + 1 wait for step s + 1's producers, which wait
        // for theirs; at this fan-out and one wave, the lag stays under two steps.)
    }
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(THREADS) cluster_kernel(float* out, int steps) {
    __shared__ float slot[2];
    const unsigned rank = cluster_rank();
    float acc = 0.f;
    if (threadIdx.x == 0) slot[0] = slot[1] = 0.f;
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    for (int s = 0; s < steps; s++) {
        if (threadIdx.x == 0) {
            unsigned a = (unsigned)__cvta_generic_to_shared(&slot[s & 1]), ra;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"((rank + 1) & 7));
            asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(acc + 1.f) : "memory");
        }
        asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
        acc = acc * 0.5f + slot[s & 1];
    }
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Microseconds a step of a captured chain of STEPS step_kernel launches of nb blocks.
static float chain(int nb, bool pdl, float* a, float* b, cudaStream_t st) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int s = 0; s < STEPS; s++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(nb);
        cfg.blockDim = dim3(THREADS);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = pdl ? 1 : 0;
        const float* in = (s & 1) ? b : a;
        float* out = (s & 1) ? a : b;
        CK(cudaLaunchKernelEx(&cfg, step_kernel, in, out, nb, pdl ? 1 : 0));
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < REPS + 1; r++) {
        CK(cudaEventRecord(e0, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0) t.push_back(ms * 1000.f / STEPS);
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return median(t);
}

template <typename F>
static float timed(F launch, cudaStream_t st) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < REPS + 1; r++) {
        CK(cudaEventRecord(e0, st));
        launch();
        CK(cudaGetLastError());
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r > 0) t.push_back(ms * 1000.f / STEPS);
    }
    return median(t);
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    const int sms = p.multiProcessorCount;
    printf("%s, %d SMs; us a step (median of %d replays of %d steps)\n", p.name, sms, REPS, STEPS);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *a, *b, *buf;
    unsigned *cnt, *flag;
    const int maxb = 4 * sms;
    CK(cudaMalloc(&a, maxb * sizeof(float)));
    CK(cudaMalloc(&b, maxb * sizeof(float)));
    CK(cudaMalloc(&buf, 2 * maxb * sizeof(float)));
    CK(cudaMalloc(&cnt, sizeof(unsigned)));
    CK(cudaMalloc(&flag, maxb * sizeof(unsigned)));
    CK(cudaMemset(a, 0, maxb * sizeof(float)));
    CK(cudaMemset(b, 0, maxb * sizeof(float)));
    CK(cudaMemset(buf, 0, 2 * maxb * sizeof(float)));
    for (int nb : {sms, 4 * sms}) {
        printf("graph %4d  %6.2f\n", nb, chain(nb, false, a, b, st));
        printf("pdl   %4d  %6.2f\n", nb, chain(nb, true, a, b, st));
    }
    for (int nb : {sms / 2, sms}) {
        printf("grid  %4d  %6.2f\n", nb, timed([&] {
                   CK(cudaMemsetAsync(cnt, 0, sizeof(unsigned), st));
                   grid_kernel<<<nb, THREADS, 0, st>>>(buf, cnt, STEPS);
               }, st));
        printf("flags8 %3d  %6.2f\n", nb, timed([&] {
                   CK(cudaMemsetAsync(flag, 0, maxb * sizeof(unsigned), st));
                   flags_kernel<<<nb, THREADS, 0, st>>>(buf, flag, STEPS);
               }, st));
    }
    printf("cluster 128 %6.2f\n", timed([&] { cluster_kernel<<<128, THREADS, 0, st>>>(buf, STEPS); }, st));
    CK(cudaDeviceSynchronize());
    return 0;
}
