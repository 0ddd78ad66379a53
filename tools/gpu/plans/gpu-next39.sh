#!/usr/bin/env bash
# Seventeenth session (2026-12-01). The sixteenth session's try ran gpu-next35 and gpu-next38 and
# folded their results into the code but was cut off before it committed or ran the result:
# this call checks that state (every op test; the grouped expert tiles' first loads before the
# PDL wait, TS_CUDA_ROWS_EARLY, now the default, against the old order), measures the current
# figures, and traces where a decode token and a 64-sequence step go now.
#   tools/gpu/plans/gpu-next39.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp "== ops"
TS_OPS_LIMIT=240 TS_OPS_THREADS=4 ops_and_model
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
ab64 1 "" "TS_CUDA_ROWS_EARLY=0"
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
stamp "== trace, one sequence"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr1.csv timeout 200 "$B" bench --backend cuda -m $V -p 0 -n 40 -r 1 > $O/tr1.log 2>&1
python3 tools/gpu/trace.py $O/tr1.csv 24 | head -45
stamp "== trace, 64 sequences"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr64.csv timeout 200 "$B" bench --backend cuda -m $V -p 0 -n 12 --parallel 64 -r 1 > $O/tr64.log 2>&1
python3 tools/gpu/trace.py $O/tr64.csv 8 | head -40
gzip -f $O/tr1.csv $O/tr64.csv
stamp "== done"
