#!/usr/bin/env bash
# Thirty-first session, written after its device time was spent (not yet run): after gpu-next99
# and gpu-next100, where the 64-sequence step's time goes with the new switches (S below: edit
# to what those kept). The raw trace CSV and Nsight's isolated durations (graphs off) of a
# layer's dense products, sums, quantisations, norms, attention and the grouped expert launches,
# as gpu-next96 took them on the defaults, for a side-by-side read.
#   tools/gpu/plans/gpu-next101.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
S="TS_CUDA_DENSE_JOBS=1 TS_CUDA_SUM4=1 TS_CUDA_DENSE_EARLY=1 TS_CUDA_GLU_EPI=1"
stamp "== trace, 64 sequences, $S"
env $S TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr64s.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 1 >/dev/null 2>&1
python3 "$(dirname "$0")/../trace.py" $O/tr64s.csv 16 | head -30
gzip -f $O/tr64s.csv
stamp "== Nsight: one layer's kernels, 64 sequences, $S"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
env $S TS_CUDA_GRAPHS=0 timeout 200 "$NCU" --kernel-name "regex:mmq|quant_q8|add_rms|mla_split|norm_rope|moe_" \
  --launch-skip 1500 --launch-count 300 --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum \
  --csv --page raw "$B" bench --backend cuda -m $V -p 0 -n 3 --parallel 64 -r 1 > $O/ncu64s.csv 2>$O/ncu.err
tail -2 $O/ncu.err; wc -l $O/ncu64s.csv
rm -f $V
stamp "== done"
