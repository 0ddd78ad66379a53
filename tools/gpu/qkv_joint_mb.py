# What one cuBLAS f16 product of q and kv_a (3,648 rows) costs against the two (3,072 + 576) at
# 64 and 80 rows: torch.matmul in a CUDA graph, 8 weight sets rotated so L2 does not hold them
# (tools/gpu/plans/gpu-next140.sh; docs/PERF.md, forty-first session).
import torch, time
torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
dev = 'cuda'
def bench(fn, iters=200):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) / iters * 1e6)
    return sorted(ts)[2]
for n in (64, 80):
    x = torch.randn(n, 2048, device=dev, dtype=torch.half)
    # distinct weights per iteration set so L2 doesn't hold them: 8 copies rotated
    L = 8
    Wq = [torch.randn(3072, 2048, device=dev, dtype=torch.half) for _ in range(L)]
    Wk = [torch.randn(576, 2048, device=dev, dtype=torch.half) for _ in range(L)]
    Wj = [torch.randn(3648, 2048, device=dev, dtype=torch.half) for _ in range(L)]
    oq = torch.empty(n, 3072, device=dev, dtype=torch.half); ok = torch.empty(n, 576, device=dev, dtype=torch.half); oj = torch.empty(n, 3648, device=dev, dtype=torch.half)
    it = [0]
    def sep():
        for i in range(L):
            torch.matmul(x, Wq[i].t(), out=oq); torch.matmul(x, Wk[i].t(), out=ok)
    def qonly():
        for i in range(L):
            torch.matmul(x, Wq[i].t(), out=oq)
    def joint():
        for i in range(L):
            torch.matmul(x, Wj[i].t(), out=oj)
    print(n, "separate q+kv_a %.2f us" % (bench(sep, 25) / L), "q only %.2f" % (bench(qonly, 25) / L), "joint %.2f" % (bench(joint, 25) / L), flush=True)
