#!/usr/bin/env bash
# Thirty-eighth session: tail halves on the experts' later tiles too (TS_CUDA_ROWS_TAIL_LATER=1:
# every block past the first tiles' range as two one-row-set blocks, at any number of pairs),
# for 128 and 96 sequences, whose launches end on later tiles, and 64. moe_rows_exact under it.
#   tools/gpu/plans/gpu-next125.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
L=TS_CUDA_ROWS_TAIL_LATER=1
q8_bg
stamp "== moe_rows_exact under $L"
op_log 150 3 ops.txt "" "$L" moe_rows_exact
wait
bpd 128 "" "" $L
bpd 96 "" "" $L
bpd 64 "-d 96" "" $L
rm -f $V
stamp "== done"
