#!/usr/bin/env bash
# Thirty-eighth session: tail halves on by default (16 tiles while the routed experts average
# at most 8 pairs). 1. Every op test. 2. 64 sequences at -d 96: the default, TS_CUDA_ROWS_TAIL
# 0 / 12 / 20; at -d 400 the default and 0; 128 sequences (the rule keeps them without halves:
# the 65b3a6afa210f71a hash and ~14,030 expected). 3. The server, the default and 0.
#   tools/gpu/plans/gpu-next124.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== every op test"
op_log 240 8 ops.txt "" ""
wait
stamp "== 64 sequences"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL=0 TS_CUDA_ROWS_TAIL=12 TS_CUDA_ROWS_TAIL=20
bpd 64 "-d 400" "" TS_CUDA_ROWS_TAIL=0
bpd 128 "" ""
stamp "== server, 64 clients"
serve64 "" 30
serve64 "TS_CUDA_ROWS_TAIL=0" 30
rm -f $V
stamp "== done"
