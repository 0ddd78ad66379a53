#!/usr/bin/env python3
"""Where a decode token goes, from a TS_CUDA_TRACE=1 run (docs/GPU.md).

Usage: python3 tools/gpu/trace.py /tmp/ts-trace.csv [tokens]

Each CSV line is one kernel launch: when its first block reached the wait for the previous kernel
(wait_ns) and when that wait returned (release_ns: the previous kernel had ended). A kernel's share
of the critical path is the time from its release to the next kernel's release. Tokens end at
`argmax_final`; the last `tokens` (default 16) complete tokens are summarised, per kernel name:
launches per token, critical-path µs per token and per launch, and how long its first block had
been waiting when released (0: it arrived after the previous kernel ended, so its launch or its
SMs were late).
"""
import csv
import statistics
import sys
from collections import defaultdict


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ts-trace.csv"
    want = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    rows = list(csv.DictReader(open(path)))
    if not rows:
        sys.exit(f"{path}: no records")
    names = [r["name"] for r in rows]
    rel = [int(r["release_ns"]) for r in rows]
    wait = [int(r["wait_ns"]) for r in rows]
    ends = [i for i, n in enumerate(names) if n == "argmax_final"]
    if len(ends) < 2:
        sys.exit(f"{path}: fewer than two decode tokens (no argmax_final pairs)")
    ends = ends[-(want + 1):]
    per_tok = []
    agg = defaultdict(lambda: [0, 0.0, 0.0])  # launches, critical ns, waited ns
    for a, b in zip(ends, ends[1:]):
        per_tok.append((rel[b] - rel[a]) / 1e3)
        for i in range(a + 1, b + 1):
            crit = rel[i + 1] - rel[i] if i + 1 < len(rel) else 0
            e = agg[names[i]]
            e[0] += 1
            e[1] += crit
            e[2] += max(0, rel[i] - wait[i])
    ntok = len(per_tok)
    med = statistics.median(per_tok)
    print(f"{ntok} tokens: median {med:.1f} us per token ({1e6 / med:.1f} tok/s); argmax_final's share includes the host's turn between tokens")
    print(f"{'kernel':<28} {'per tok':>8} {'us/tok':>9} {'us each':>8} {'waited us':>10} {'share':>6}")
    total = sum(e[1] for e in agg.values()) / ntok / 1e3
    for name, (n, crit, waited) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        us = crit / ntok / 1e3
        print(f"{name:<28} {n / ntok:>8.1f} {us:>9.1f} {us / (n / ntok):>8.2f} {waited / n / 1e3:>10.2f} {100 * us / total:>5.1f}%")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        # Piped into `head`: the reader has what it wanted.
        sys.stderr.close()
