#!/usr/bin/env python3
"""What a prompt MoE layer of DeepSeek-V2-Lite's shape costs on cuBLAS (torch.mm, f16), one GEMM
per expert: the figure to beat with turbospark's grouped kernels (gate-up 352 us + down 189 us a
layer at pp512 on the synthetic model, whose routing puts ~440 tokens on each of ~7 experts).
Usage on the GPU machine: python3 tools/gpu/probe/moe_cublas.py"""
import torch, time
H, FF, NSH = 2048, 1408, 2
dev = 'cuda'
torch.manual_seed(0)
import os
EAGER = os.environ.get("EAGER") == "1"
def t(f, reps=20):
    # In a CUDA graph, so the figure is the GPU's and not Python's launch rate (EAGER=1: not).
    for _ in range(3): f()
    torch.cuda.synchronize()
    if not EAGER:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g): f()
        f = g.replay
    for _ in range(3): f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1000.0  # us
def layer(counts, n, fused_gu, dt=torch.float16):
    E = len(counts)
    wgu = [torch.randn(2 * FF, H, device=dev, dtype=dt) / H**0.5 for _ in range(E)]
    wd = [torch.randn(H, FF, device=dev, dtype=dt) / FF**0.5 for _ in range(E)]
    sgu = torch.randn(2 * NSH * FF, H, device=dev, dtype=dt) / H**0.5
    sd = torch.randn(H, NSH * FF, device=dev, dtype=dt) / FF**0.5
    xs = [torch.randn(c, H, device=dev, dtype=dt) for c in counts]
    x = torch.randn(n, H, device=dev, dtype=dt)
    def run_gu():
        outs = []
        for e in range(E):
            if counts[e] == 0: continue
            if fused_gu:
                outs.append(xs[e] @ wgu[e].t())
            else:
                outs.append(xs[e] @ wgu[e][:FF].t()); outs.append(xs[e] @ wgu[e][FF:].t())
        outs.append(x @ sgu.t())
        return outs
    hs = [torch.randn(c, FF, device=dev, dtype=dt) for c in counts]
    hsh = torch.randn(n, NSH * FF, device=dev, dtype=dt)
    def run_d():
        for e in range(E):
            if counts[e] == 0: continue
            hs[e] @ wd[e].t()
        hsh @ sd.t()
    gu, d = t(run_gu), t(run_d)
    flops_gu = 2 * (sum(counts) + NSH * n) * H * 2 * FF
    flops_d = 2 * (sum(counts) + NSH * n) * H * FF
    return gu, d, flops_gu / gu / 1e6, flops_d / d / 1e6
print(torch.cuda.get_device_name(), torch.__version__)
for name, n, counts in [
    ("synthetic pp512: 7 experts x ~440", 512, [439] * 6 + [438]),
    ("synthetic pp2048: 7 experts x ~1755", 2048, [1756] * 6 + [1752]),
    ("trained pp512: 64 x 48", 512, [48] * 64),
    ("trained pp2048: 64 x 192", 2048, [192] * 64),
]:
    for fused in (True, False):
        gu, d, tg, td = layer(counts, n, fused)
        print(f"{name:40s} gu {'one' if fused else 'two'}: gate-up {gu:7.1f} us ({tg:5.0f} TFLOP/s)  down {d:7.1f} us ({td:5.0f} TFLOP/s)  total {gu+d:7.1f} us")
# one big GEMM for scale
a = torch.randn(4096, H, device=dev, dtype=torch.float16); w = torch.randn(2 * FF, H, device=dev, dtype=torch.float16)
us = t(lambda: a @ w.t()); print(f"dense 4096x2048 @ 2048x2816: {us:.1f} us, {2*4096*H*2*FF/us/1e6:.0f} TFLOP/s")
