#!/usr/bin/env bash
# Thirty-second session, written after its device time was spent (not yet run), after
# gpu-next103 (see there for the switches K, R, G, D):
# - 56 sequences (one partly padded tile: DENSE_SKIP) and 128 (DENSE128).
# - Nsight, speed of light and stalls: a 64-row add_rms_norm (isolated, graphs off: the trace's
#   7.6 us average hides the router's cuBLAS product in half its launches), the grouped rows
#   kernel (62% of the step), the batch attention (mla_split_18_16_h, 20.9 us a layer).
# - The server at 64 clients: default, with K R G, and padded to 8 rows (fewer shapes to record;
#   lib.sh's serve64 now takes ARGS in place of --row-multiple 1). gpu-next103 kept R only
#   (K, G, D slower), so S=R and 56 / 128 compare R.
#   tools/gpu/plans/gpu-next104.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
wait
K="TS_CUDA_DENSE_SKIP=1"; R="TS_CUDA_ROUTER_SPLIT=1"; G="TS_CUDA_GLU_PAIR=1"; D="TS_CUDA_DENSE128=1"
S="$R"
stamp "== 56, 128 sequences"
bp 56 "" "$R"
bp 128 "" "$R"
stamp "== Nsight: a 64-row add_rms_norm, the rows kernel, the batch attention"
ncu_stalls "^add_rms_norm$" -p 0 -n 3 --parallel 64 -r 1
ncu_stalls "mmq_q8_rows_r2" -p 0 -n 3 --parallel 64 -r 1
ncu_stalls "mla_split_18_16_h" -p 0 -n 3 --parallel 64 -r 1
stamp "== server, 64 clients: default, S, padded to 8 rows"
serve64 "" 30
serve64 "$S" 30
serve64 "$S" 30 "--row-multiple 8"
rm -f $V
stamp "== done"
