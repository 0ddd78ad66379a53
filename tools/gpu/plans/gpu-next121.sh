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
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 16 \
  --parallel 64 -r 1 -d 96 >/dev/null 2>&1
python3 "$(dirname "$0")/../steps.py" $O/tr.csv 16 $O/seq.txt | head -30
rm -f $O/tr.csv $V
stamp "== done"
