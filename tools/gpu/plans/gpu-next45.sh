#!/usr/bin/env bash
# Written in the seventeenth session (2026-12-01), NOT yet run: the 64-token int8 tiles with
# their stage copies on a producer warp (mmq_q8_64ws, TS_CUDA_MMQ_WS=1): the dense products of
# the 64-sequence step (139 launches, ~10 us each, 17% of the step) and of prompts. Every op
# test under it (the same bits as mmq_q8_64 are expected: the 64-sequence hash must stay
# 33948fa635fb0682), then 64 sequences twice each way, pp512, and the server both ways.
# Run after gpu-next44.sh (which says whether producer warps pay at all).
#   tools/gpu/plans/gpu-next45.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test with TS_CUDA_MMQ_WS=1"
op_log 200 4 ops_mmqws.txt "" "TS_CUDA_MMQ_WS=1"
wait
stamp "== 64 sequences"
ab64 2 "" "TS_CUDA_MMQ_WS=1"
stamp "== prompts"
for e in "" "TS_CUDA_MMQ_WS=1"; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
stamp "== server"
serve64 "" 15
serve64 "TS_CUDA_MMQ_WS=1" 15
stamp "== done"
