#!/usr/bin/env python3
"""Where a server's steps go, from a TS_CUDA_TRACE=1 run of `turbospark serve` (docs/GPU.md).

Usage: python3 tools/gpu/steps.py /tmp/ts-trace.csv [top [SEQ_FILE]]

A step starts at its `embed_*` launch. Each step's length runs from its first release to the
next step's (so it includes the host's turn after it). Steps are grouped by their launch
signature (the kernel names in order: a decode-only step and a step with prompt rows launch
different kernels or different counts); per group: steps, median length, and the `top` kernels
by critical-path time a step (release to the next release), with launches a step. With SEQ_FILE,
the largest group's launches in order go there, a line each: index, name, µs from its release to
the next launch's, µs its first block had waited at its release (0: it arrived late), each the
median over the group's steps.
"""
import csv
import statistics
import sys
from collections import defaultdict


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    seq_file = sys.argv[3] if len(sys.argv) > 3 else None
    rows = list(csv.DictReader(open(path)))
    names = [r["name"] for r in rows]
    rel = [int(r["release_ns"]) for r in rows]
    wait = [int(r["wait_ns"]) for r in rows]
    starts = [i for i, n in enumerate(names) if n.startswith("embed")]
    groups = defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        groups[tuple(names[a:b])].append((a, b))
    total = sum(rel[b] - rel[a] for a, b in zip(starts, starts[1:]))
    print(f"{len(starts) - 1} steps, {total / 1e9:.3f} s from the first to the last step start")
    ordered = sorted(groups.items(), key=lambda kv: -sum(rel[b] - rel[a] for a, b in kv[1]))
    if seq_file and ordered:
        sig, steps = ordered[0]
        with open(seq_file, "w") as f:
            for k, name in enumerate(sig):
                crit = statistics.median((rel[a + k + 1] - rel[a + k]) / 1e3 for a, _ in steps)
                waited = statistics.median(max(rel[a + k] - wait[a + k], 0) / 1e3 for a, _ in steps)
                f.write(f"{k:4d} {name:<32} {crit:8.2f} {waited:8.2f}\n")
    for sig, steps in ordered:
        lens = [(rel[b] - rel[a]) / 1e3 for a, b in steps]
        share = sum(lens) * 1e3 / total
        print(f"\n== {len(steps)} steps, {len(sig)} launches each, median {statistics.median(lens):.0f} us "
              f"(min {min(lens):.0f}, max {max(lens):.0f}), {100 * share:.1f}% of the time")
        agg = defaultdict(lambda: [0, 0.0])
        for a, b in steps:
            for i in range(a, b):
                e = agg[names[i]]
                e[0] += 1
                e[1] += rel[i + 1] - rel[i]
        n = len(steps)
        for name, (cnt, ns) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"   {name:<30} {cnt / n:>6.1f} a step {ns / n / 1e3:>9.1f} us a step")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        sys.stderr.close()
