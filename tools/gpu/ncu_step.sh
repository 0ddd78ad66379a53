#!/usr/bin/env bash
# Per-kernel durations of whole decode steps under Nsight Compute at the card's own clocks
# (`--clock-control none`), graphs off, summed per kernel name: where a decode step's time goes.
# Usage (GPU machine, repo root): tools/gpu/ncu_step.sh BIN SKIP COUNT [bench args...]
# Not yet seen to work: its one run (SKIP 3000 on the 16 GB V2-Lite) passed a 400-s limit with no
# output; ncu intercepts every skipped launch too, so keep SKIP small (or profile a smaller model).
set -u
T=${1:-.dev/turbospark}; SKIP=${2:-1500}; COUNT=${3:-400}; shift 3
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
V=/tmp/v2lite-q8_0.gguf
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
[ -f $V ] || "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
TS_CUDA_GRAPHS=0 "$NCU" --clock-control none --launch-skip "$SKIP" --launch-count "$COUNT" --section SpeedOfLight \
  --csv --print-units base --page raw --metrics gpu__time_duration.sum,dram__bytes.sum \
  "$T" bench --backend cuda -m $V "$@" 2>/dev/null > /tmp/ncu_step.csv
python3 - <<'PY'
import csv, collections
rows = list(csv.reader(open('/tmp/ncu_step.csv')))
hi = next(i for i, r in enumerate(rows) if 'Kernel Name' in r)
h = rows[hi]; data = rows[hi + 2:]
kn, du, by = h.index('Kernel Name'), h.index('gpu__time_duration.sum'), h.index('dram__bytes.sum')
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for r in data:
    try: d = float(r[du]); b = float(r[by])
    except: continue
    a = agg[r[kn]]; a[0] += 1; a[1] += d; a[2] += b
tot = sum(a[1] for a in agg.values())
print(f"total {tot/1e3:.1f} us in {sum(a[0] for a in agg.values())} kernels; units row: {rows[hi+1][du]} {rows[hi+1][by]}")
for k, a in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"  {k[:40]:<40} {a[0]:>5} x {a[1]/a[0]/1e3:8.2f} us = {a[1]/1e3:9.1f} us {100*a[1]/tot:5.1f}%  {a[2]/max(a[1],1):6.2f} GB/s*1e3")
PY
