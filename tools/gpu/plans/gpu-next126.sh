#!/usr/bin/env bash
# Thirty-eighth session, last call: the final defaults (tail halves, later tiles too).
# moe_rows_exact (tail halves with and without the later tiles), then 128 sequences.
#   tools/gpu/plans/gpu-next126.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -30   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== moe_rows_exact"
op_log 200 3 ops.txt "" "" moe_rows_exact
wait
bpd 128 "" ""
rm -f $V
stamp "== done"
