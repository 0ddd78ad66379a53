#!/usr/bin/env bash
# Nineteenth session (2026-12-02): after deleting mmfw_* (superseded by mmh_*) and f16_rows'
# k-permuted mode: every op test, then the prompt figures (the same kernels as gpu-next53).
#   tools/gpu/plans/gpu-next54.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 150 6 ops_all.txt "NOPE|" ""
wait
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
stamp "== done"
