#!/usr/bin/env bash
# Thirty-second session, written after its device time was spent (not yet run), after
# gpu-next103:
# - Nsight on a 64-row add_rms_norm (the trace gave it 7.6 us on average, but half its
#   launches hide the router's cuBLAS product: its own duration, graphs off) and on the
#   grouped rows kernel (62% of the step) and the batch attention (mla_split_18_16_h, 20.9 us
#   a layer in the trace): speed of light and stalls.
# - The server at 64 clients: default, with TS_CUDA_DENSE_SKIP=1 (its steps carry ~79 rows: a
#   partly padded second token tile), with TS_CUDA_ROUTER_SPLIT=1 too, and with forwards
#   padded to 8 rows (fewer shapes to record; lib.sh's serve64 now takes ARGS in place of
#   --row-multiple 1).
#   tools/gpu/plans/gpu-next104.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
wait
K="TS_CUDA_DENSE_SKIP=1"; R="TS_CUDA_ROUTER_SPLIT=1"
stamp "== Nsight: a 64-row add_rms_norm, the rows kernel"
ncu_stalls "^add_rms_norm$" -p 0 -n 3 --parallel 64 -r 1
ncu_stalls "mmq_q8_rows_r2" -p 0 -n 3 --parallel 64 -r 1
ncu_stalls "mla_split_18_16_h" -p 0 -n 3 --parallel 64 -r 1
stamp "== server, 64 clients: default, DENSE_SKIP, padded to 8 rows"
serve64 "" 30
serve64 "$K" 30
serve64 "$R $K" 30
serve64 "" 30 "--row-multiple 8"
rm -f $V
stamp "== done"
