#!/usr/bin/env bash
# Thirty-seventh session, last call: the final tree (the batch split rule; the flow removed).
# 1. Every op test. 2. A traced 64-row step at -d 96 (the launch sequence into seq.txt).
#   tools/gpu/plans/gpu-next121.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
stamp "== every op test"
op_log 240 8 ops.txt "" ""
wait
stamp "== traced 64 sequences at depth 96"
trace_steps 64 96 30
rm -f $V
stamp "== done"
