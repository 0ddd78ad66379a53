# What the attention's output side of a decode batch costs on cuBLAS (f16, torch in a CUDA graph,
# 8 weight sets rotated so that L2 does not hold them), at V2-Lite's shapes: W_uv per head (16 x
# [n, 512] x [512, 128], batched) then W_o ([n, 2048] x [2048, 2048]), against one product with
# W_uv folded into W_o ([n, 16 * 512] x [8192, 2048]: W_uvo[h] = W_uv[h] . W_o[h], 4x W_o's
# bytes). Also W_uk per head alone (16 x [n, 128] x [128, 512]) for scale.
# (tools/gpu/plans/gpu-next144.sh; the idea of the forty-first session's notes, docs/PERF.md.)
import time
import torch

dev = 'cuda'


def bench(fn, iters=25):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) / iters * 1e6)
    return sorted(ts)[2]


L = 8
for n in (64, 80):
    lat = torch.randn(16, n, 512, device=dev, dtype=torch.half)
    q = torch.randn(16, n, 128, device=dev, dtype=torch.half)
    wuv = [torch.randn(16, 512, 128, device=dev, dtype=torch.half) for _ in range(L)]
    wo = [torch.randn(2048, 2048, device=dev, dtype=torch.half) for _ in range(L)]
    wuvo = [torch.randn(8192, 2048, device=dev, dtype=torch.half) for _ in range(L)]
    wuk = [torch.randn(16, 128, 512, device=dev, dtype=torch.half) for _ in range(L)]
    av = torch.empty(16, n, 128, device=dev, dtype=torch.half)
    y = torch.empty(n, 2048, device=dev, dtype=torch.half)
    qa = torch.empty(16, n, 512, device=dev, dtype=torch.half)
    latf = lat.transpose(0, 1).reshape(n, 8192).contiguous()
    avf = torch.randn(n, 2048, device=dev, dtype=torch.half)  # (W_o's input: timing only)

    def two():
        for i in range(L):
            torch.bmm(lat, wuv[i], out=av)
            torch.matmul(avf, wo[i], out=y)

    def one():
        for i in range(L):
            torch.matmul(latf, wuvo[i], out=y)

    def uk():
        for i in range(L):
            torch.bmm(q, wuk[i], out=qa)

    print(n, "W_uv then W_o %.2f us" % (bench(two) / L), "folded %.2f" % (bench(one) / L), "W_uk %.2f" % (bench(uk) / L), flush=True)
