// What the probes share (tools/gpu/downprobe.cu, gateprobe.cu, placeprobe.cu, syncprobe.cu,
// megaprobe.cu): an error check, weight loads past L1 as the kernels make them (common.cuh's
// ldw16), the int8 and warp sums, PDL and release / acquire primitives, and the timing of
// launches back to back. Included by those files only; they are compiled by
// nvcc on the device machine (each file's header says how).
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

#include <cstdlib>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));       \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef unsigned char u8;
typedef long long i64;

__device__ __forceinline__ uint4 ldw16(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned short ldw_u16(const u8* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ int dot16(uint4 q, uint4 x) {
    int s = __dp4a((int)q.x, (int)x.x, 0);
    s = __dp4a((int)q.y, (int)x.y, s);
    s = __dp4a((int)q.z, (int)x.z, s);
    return __dp4a((int)q.w, (int)x.w, s);
}
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ float h2f(unsigned short u) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
}

// µs a launch of launch(k), k = 0 .. 4 nit - 1: the first nit a warm-up, the other 3 nit timed
// back to back (launch k reads launch k % nit's weights).
template <typename L>
static float timeit(int nit, L launch) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int k = 0; k < nit; k++) launch(k);
    cudaEventRecord(a);
    for (int k = nit; k < 4 * nit; k++) launch(k);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, a, b);
    return ms * 1000.f / (3 * nit);
}
