// Attention. Hand-written because the scores must be masked per token from the device-resident
// batch (causal by position, sliding window, per-slot cache rows) and soft-capped, and because
// the absorbed MLA variant reads K and V from the same latent cache row; no library call does
// either without materialising the score matrix.
//
// One block of ATT_WARPS warps per (token, head). The query goes to shared memory; warp w takes
// keys start+w, start+w+ATT_WARPS, ...: lanes split the q.k dot (warp-reduced), and each warp keeps
// an online softmax (running max m, sum l, and its share of the weighted V sum, VPL values per
// lane). At the end the warps' partial results are merged through shared memory. f32 throughout.
// The same kernel serves GQA attention and MLA (K row = [c ; k_pe], V = its first kv_lora values).

#define ATT_WARPS 4

template <int VPL>
__device__ void attn_impl(const float* q, i64 qoff, i64 q_tok, i64 q_head, const float* K, i64 k_row, i64 k_head,
                          const float* V, i64 v_row, i64 v_head, float* out, i64 ooff, i64 o_tok, i64 o_head,
                          const int* pos, const int* slot, int slot_len, int nh, int group, int hd, int vd,
                          float scale, int window, float softcap) {
    extern __shared__ float sm[];
    float* qs = sm;                       // [hd]
    float* accs = sm + hd;                // [ATT_WARPS][vd]
    float* ml = accs + ATT_WARPS * vd;    // [ATT_WARPS][2]
    const int t = blockIdx.x / nh, h = blockIdx.x % nh;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = h / group;
    const float* qp = q + qoff + t * q_tok + h * q_head;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = qp[i];
    __syncthreads();
    const int p = pos[t];
    const i64 base = (i64)slot[t] * slot_len;
    const int end = p + 1;
    const int start = window > 0 ? max(0, end - window) : 0;
    float m = NEG_INF, l = 0.f;
    float acc[VPL];
#pragma unroll
    for (int v = 0; v < VPL; v++) acc[v] = 0.f;
    for (int j = start + warp; j < end; j += ATT_WARPS) {
        const float* kr = K + (base + j) * k_row + kvh * k_head;
        float s = 0.f;
        for (int i = lane; i < hd; i += 32) s += qs[i] * kr[i];
        s = warp_sum(s) * scale;
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        float mn = fmaxf(m, s);
        float corr = expf(m - mn), pw = expf(s - mn);
        l = l * corr + pw;
        m = mn;
        const float* vr = V + (base + j) * v_row + kvh * v_head;
#pragma unroll
        for (int v = 0; v < VPL; v++) {
            int i = lane + 32 * v;
            float vv = i < vd ? vr[i] : 0.f;
            acc[v] = acc[v] * corr + pw * vv;
        }
    }
#pragma unroll
    for (int v = 0; v < VPL; v++) {
        int i = lane + 32 * v;
        if (i < vd) accs[warp * vd + i] = acc[v];
    }
    if (lane == 0) { ml[2 * warp] = m; ml[2 * warp + 1] = l; }
    __syncthreads();
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, ml[2 * w]);
    float L = 0.f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = ml[2 * w + 1] > 0.f ? expf(ml[2 * w] - M) : 0.f;
        L += ml[2 * w + 1] * f[w];
    }
    const float inv = 1.0f / L;
    float* op = out + ooff + t * o_tok + h * o_head;
    for (int i = threadIdx.x; i < vd; i += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) s += accs[w * vd + i] * f[w];
        op[i] = s * inv;
    }
}

#define ATT_INST(VPL)                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attention_##VPL(                             \
        const float* q, i64 qoff, i64 q_tok, i64 q_head, const float* K, i64 k_row, i64 k_head, const float* V, \
        i64 v_row, i64 v_head, float* out, i64 ooff, i64 o_tok, i64 o_head, const int* pos, const int* slot,   \
        int slot_len, int nh, int group, int hd, int vd, float scale, int window, float softcap) { PDL_ENTRY();             \
        attn_impl<VPL>(q, qoff, q_tok, q_head, K, k_row, k_head, V, v_row, v_head, out, ooff, o_tok, o_head,   \
                       pos, slot, slot_len, nh, group, hd, vd, scale, window, softcap);                        \
    }
ATT_INST(4)
ATT_INST(8)
ATT_INST(16)
