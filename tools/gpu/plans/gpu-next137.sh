#!/usr/bin/env bash
# Fortieth session: Path::RouteAhead (the router's launch routes a decode batch's logits:
# gemv_f32_split_route) on top of gpu-next136's LatH / QnopeH; norm_q8_batch_exact now covers
# LatH (a 100-key history) and RouteAhead (gc against gd, bit for bit).
# 1. Every op test. 2. 64 sequences at -d 96: the defaults, ROUTE_AHEAD=0, all three new paths
#    off; -d 400; 32 sequences. 3. The server.
#   tools/gpu/plans/gpu-next137.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -100   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
stamp "== ops"
ops_and_model
grep -E "norm_q8 batch.*(LatH|RouteAhead|lat in f16)|failing" $O/ops.txt | head -8
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" "TS_CUDA_ROUTE_AHEAD=0" "TS_CUDA_LAT_H=0 TS_CUDA_QNOPE_H=0 TS_CUDA_ROUTE_AHEAD=0" ""
bpd 64 "-d 400" ""
bp 32 ""
stamp "== server"
serve64 "" 30
rm -f $V
stamp "== done"
