#!/usr/bin/env bash
# Written in the thirty-seventh session after its device time was spent; run in the thirty-eighth
# (-14%: MMQ_ROWS_HALF removed, docs/PERF.md "The MoE launches' last blocks in halves").
# MMQ_ROWS_HALF (a define): the grouped rows kernels' pipeline in 64-k half groups, so that
# with MMQ_ROWS_MINB=6 the r2 kernel needs 77 registers without a spill (sass_static.py) and
# 6 blocks (24 warps) fit an SM where the default's 96 registers fit 5; MINB=7 gives 72 (the
# down's 25 KB tiles let 7 blocks sit; the gate/up's 37.5 KB only 6). More instructions a
# group (469 against 315 in the r2 loop), more warps to issue them. The same bits expected.
# 1. The MoE op tests under HALF with MINB 6 (moe_rows_exact: one and two row sets).
# 2. 64 sequences at -d 96: defaults; HALF; HALF + MINB 6; HALF + MINB 7; HALF + MINB 6 with one
#    row set (TS_CUDA_ROWS_R=1); defaults again. 128 sequences: defaults, HALF + MINB 6.
# 3. The server with the best of 2 (edit S below).
#   tools/gpu/plans/gpu-next122.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
H6="TS_CUDA_DEFINES=MMQ_ROWS_HALF=1,MMQ_ROWS_MINB=6"
S=$H6
q8_bg
stamp "== moe tests under $H6"
op_log 150 3 ops.txt "" "$H6" moe
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" "TS_CUDA_DEFINES=MMQ_ROWS_HALF=1" "$H6" "TS_CUDA_DEFINES=MMQ_ROWS_HALF=1,MMQ_ROWS_MINB=7" \
  "$H6 TS_CUDA_ROWS_R=1" ""
bpd 128 "" "" "$H6"
stamp "== server, 64 clients"
serve64 "$S" 30
serve64 "" 30
rm -f $V
stamp "== done"
