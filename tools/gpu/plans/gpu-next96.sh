#!/usr/bin/env bash
# Thirty-first session. gpu-next94 kept TS_CUDA_ROWS_R=2 at 64 sequences (8,222 / 8,221 against
# 8,143 / 8,142, the hash held) and dropped NORM_Q8 (8,127) and NORM_Q8 + SUM_Q8 (8,006). Here:
# - ROWS_R=2 at 32 and 48 sequences (where the automatic choice is 1), SUM_Q8 alone at 64;
# - the 64-sequence step's launches in order (raw trace CSV to $OUT) and the dense int8 tiles'
#   isolated durations and grids (Nsight, graphs off) to see what each of a layer's five dense
#   products costs against its bytes;
# - the server with 64 clients, defaults and ROWS_R=2.
#   tools/gpu/plans/gpu-next96.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
stamp "== 32, 48 sequences: ROWS_R 1 vs 2; SUM_Q8 alone at 64"
for p in 32 48; do
  for e in "TS_CUDA_ROWS_R=1" "TS_CUDA_ROWS_R=2"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash
  done
done
ab64 1 "TS_CUDA_ROWS_R=2" "TS_CUDA_ROWS_R=2 TS_CUDA_SUM_Q8=1"
stamp "== trace, 64 sequences, ROWS_R=2"
TS_CUDA_ROWS_R=2 TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr64.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 1 >/dev/null 2>&1
python3 "$(dirname "$0")/../trace.py" $O/tr64.csv 16 | head -30
gzip -f $O/tr64.csv
stamp "== Nsight: dense int8 tiles and split sums, 64 sequences"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
TS_CUDA_ROWS_R=2 TS_CUDA_GRAPHS=0 timeout 200 "$NCU" --kernel-name "regex:mmq_q8_64|mmq_sum_splits|quant_q8|add_rms|mla_split|norm_rope" \
  --launch-skip 1500 --launch-count 420 --metrics gpu__time_duration.sum,launch__grid_size,dram__bytes_read.sum \
  --csv --page raw "$B" bench --backend cuda -m $V -p 0 -n 3 --parallel 64 -r 1 > $O/ncu64.csv 2>$O/ncu.err
tail -2 $O/ncu.err; wc -l $O/ncu64.csv
stamp "== server, 64 clients"
serve64 "" 40
serve64 "TS_CUDA_ROWS_R=2" 40
rm -f $V
stamp "== done"
