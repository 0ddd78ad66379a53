#!/usr/bin/env bash
# Fifty-first session, second call: where the server's 64-row step loses ~1.7% against the
# bench's at the same depths. gpu-next169 ruled out the routing: the server's steps reach the
# same experts (63.86 of 64, 63.87 16-token tiles, the busiest 12.3 pairs) as the bench's (63.88,
# 63.88, 12.21). Now both traced (TS_CUDA_TRACE=1, the shared FFN's fork off so that the trace
# names launches right), steps grouped by tools/gpu/steps.py, the largest group's launches in
# order with their critical-path µs into seq_bench.txt and seq_server.txt, to be compared launch
# by launch. First the two untraced on this machine. ~4 minutes.
#   tools/gpu/plans/gpu-next170.sh BIN 2>&1 | tee $OUT/log.txt | tail -80
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
S="$(dirname "$0")/../steps.py"
stamp "== synth"
q8_ready
stamp "== untraced"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 --parallel 64 -r 1 --hash -d 32
serve64 "" 30 "--row-multiple 4"
F="TS_CUDA_SHARED_FORK=0"
stamp "== traced bench -d 32 -n 64"
env $F TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tb.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 1 -d 32 >/dev/null 2>&1
python3 "$S" $O/tb.csv 40 $O/seq_bench.txt | head -60
rm -f $O/tb.csv
stamp "== traced server, 12 s"
serve64 "$F TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/ts.csv" 12 "--row-multiple 4"
sleep 3
python3 "$S" $O/ts.csv 40 $O/seq_server.txt | head -80
rm -f $O/ts.csv
stamp "== done"
