#!/usr/bin/env python3
"""How far several float32 .npy logit files [rows, vocab] sit from one reference, for files too
large for compare_npy.py's pure-Python reading (numpy, memory-mapped; the GPU machine has it).
Per file: the worst and the mean of each row's max|d| / max|ref|, the mean KL(ref || got) of the
rows' softmax in nats, and in how many rows the argmax differs. Reports only; the caller judges.
Usage: logit_drift.py REF GOT [GOT...] [--label L]"""
import argparse

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("ref")
ap.add_argument("got", nargs="+")
ap.add_argument("--label", default="")
a = ap.parse_args()
R = np.load(a.ref, mmap_mode="r")


def logsoftmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


for path in a.got:
    G = np.load(path, mmap_mode="r")
    assert R.shape == G.shape, (a.ref, R.shape, path, G.shape)
    rel, kl, arg = [], [], 0
    for s in range(0, R.shape[0], 64):
        r = np.asarray(R[s:s + 64], dtype=np.float64)
        g = np.asarray(G[s:s + 64], dtype=np.float64)
        scale = np.maximum(np.abs(r).max(axis=1), 1e-30)
        rel.extend((np.abs(r - g).max(axis=1) / scale).tolist())
        lr, lg = logsoftmax(r), logsoftmax(g)
        kl.extend((np.exp(lr) * (lr - lg)).sum(axis=1).tolist())
        arg += int((r.argmax(axis=1) != g.argmax(axis=1)).sum())
    rel = np.array(rel)
    print(f"{a.label} {path}: rows {R.shape[0]} rel err max {rel.max():.3e} mean {rel.mean():.3e}; "
          f"KL mean {np.mean(kl):.3e} nats; argmax differs in {arg} rows")
