#!/usr/bin/env python3
"""Compare two float32 .npy logit files: max relative error (per row, relative to the row's max
|logit|), argmax agreement. Exit 1 when the relative error exceeds --tol or an argmax differs
(unless --allow-argmax N)."""
import argparse, struct, sys


def read_npy(path):
    with open(path, "rb") as f:
        b = f.read()
    assert b[:6] == b"\x93NUMPY", path
    hl = struct.unpack("<H", b[8:10])[0]
    header = b[10:10 + hl].decode()
    shape = tuple(int(x) for x in header.split("(")[1].split(")")[0].split(",") if x.strip())
    data = struct.unpack("<%df" % (len(b[10 + hl:]) // 4), b[10 + hl:])
    rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    return [list(data[r * cols:(r + 1) * cols]) for r in range(rows)]


ap = argparse.ArgumentParser()
ap.add_argument("ref")
ap.add_argument("got")
ap.add_argument("--tol", type=float, default=1e-4)
ap.add_argument("--allow-argmax", type=int, default=0)
ap.add_argument("--label", default="")
ap.add_argument("--alt-ref", help="a second reference (e.g. the CPU in the other activation mode); the closer one counts")
a = ap.parse_args()
R, G = read_npy(a.ref), read_npy(a.got)
if a.alt_ref:
    R2 = read_npy(a.alt_ref)
    def err(R):
        return max(max(abs(x - y) for x, y in zip(r, g)) / (max(abs(x) for x in r) or 1.0) for r, g in zip(R, G))
    e1, e2 = err(R), err(R2)
    if e2 < e1:
        R = R2
    a.label += f" (closer reference: {'alt' if e2 < e1 else 'main'}; errs {e1:.2e} / {e2:.2e})"
assert len(R) == len(G), (len(R), len(G))
worst, diff_argmax = 0.0, 0
for r, g in zip(R, G):
    scale = max(abs(x) for x in r) or 1.0
    worst = max(worst, max(abs(x - y) for x, y in zip(r, g)) / scale)
    if max(range(len(r)), key=r.__getitem__) != max(range(len(g)), key=g.__getitem__):
        diff_argmax += 1
ok = worst <= a.tol and diff_argmax <= a.allow_argmax
print(f"{a.label}: rows {len(R)} max rel err {worst:.3e} (tol {a.tol:g}), argmax differs in {diff_argmax} rows -> {'OK' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
