#!/usr/bin/env bash
# Thirty-first session: the 64-sequence step's dense int8 products (Nsight in gpu-next96: q_proj
# 14.5 us for 7.3 MB, kv_a 9.4 us for 1.5 MB, the absorbed products 8.5-8.9 us for 1.4-1.8 MB:
# ~7 us fixed and ~1 TB/s marginal). Knobs that exist, on ROWS_R=2: the rows kernel for dense
# products of 64 tokens (TS_CUDA_MMQ_ROWS=64), two blocks an SM (MMQ64_MINB=2), the producer-warp
# tile (TS_CUDA_MMQ_WS=1), four blocks an SM for split K (TS_CUDA_MMQ_SPLIT_OCC=4); and Nsight's
# stall reasons on one q_proj launch.
#   tools/gpu/plans/gpu-next97.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
wait
R="TS_CUDA_ROWS_R=2"
ab64 1 "$R" "$R TS_CUDA_MMQ_ROWS=64" "$R TS_CUDA_DEFINES=MMQ64_MINB=2" "$R TS_CUDA_MMQ_WS=1" "$R TS_CUDA_MMQ_SPLIT_OCC=4"
stamp "== Nsight: mmq_q8_64 stalls (64 sequences)"
export TS_CUDA_ROWS_R=2
ncu_stalls "mmq_q8_64" -p 0 -n 3 --parallel 64 -r 1
rm -f $V
stamp "== done"
