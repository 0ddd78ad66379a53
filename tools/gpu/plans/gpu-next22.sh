#!/usr/bin/env bash
# RUN (twelfth session): same bits, all slower (64 seq: 7,648 off, 2x3 7,180, 4x2 6,652, 2x4 6,326,
# 1x6 6,146; 128: 13,355 vs 11,310 / 10,107; 32: 4,310 vs 3,570). The bulk-fed kernels were then
# removed (TS_CUDA_ROWS_BULK no longer exists); the rows_mul/rows_store refactor stayed (+0.5%).
# Twelfth session (2026-11-30): the grouped expert products fed by the bulk copy engine
# (mmq_q8_rows_b<G>x<NST>, TS_CUDA_ROWS_BULK=GxNST), after bwprobe's bulk probes streamed the
# expert matrices at 4.05-4.22 TB/s against 3.3-3.4 for mmq_q8_rows' register-fed loads
# (gpu-next21). Also checks that factoring mmq_q8_rows' multiply and store into functions
# (rows_mul, rows_store: 92 -> 94 registers, loop 481 -> 453 instructions) costs nothing: BASE is
# the build before it, BIN the build with it.
#   tools/gpu/plans/gpu-next22.sh BASE BIN OPS
set -u
BASE=$1; B=$2; OPS=$3
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100   # a hung bulk pipeline costs 100 s, not 240
ops_tests 150 2 moe_rows_exact mmq_rows_dense_exact
for r in 1 2; do
  b "" "$BASE" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  for e in "" TS_CUDA_ROWS_BULK=2x4 TS_CUDA_ROWS_BULK=2x3 TS_CUDA_ROWS_BULK=1x6 TS_CUDA_ROWS_BULK=4x2; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  done
done
for e in "" "TS_CUDA_ROWS_R=1 TS_CUDA_ROWS_BULK=2x4" "TS_CUDA_ROWS_R=1 TS_CUDA_ROWS_BULK=2x3"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash
done
for e in "" TS_CUDA_ROWS_BULK=2x4; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1 --hash; done
