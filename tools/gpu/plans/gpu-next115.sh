#!/usr/bin/env bash
# Thirty-fifth session, after gpu-next114 (MMQ_ROWS_NA +1.0% at 64 sequences, -d 96; MMQ_ROWS_STAGE
# -4%, removed). With MMQ_ROWS_NA now the default:
# 1. The MoE op tests.
# 2. 64 sequences at -d 96: defaults and MMQ_ROWS_NA=0, twice.
# 3. The server, 64 clients, 30 s.
#   tools/gpu/plans/gpu-next115.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== moe tests"
op_log 150 3 ops.txt "" "" moe_
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" "TS_CUDA_DEFINES=MMQ_ROWS_NA=0" "" "TS_CUDA_DEFINES=MMQ_ROWS_NA=0"
stamp "== server, 64 clients"
serve64 "" 30
rm -f $V
stamp "== done"
