#!/usr/bin/env bash
# Fortieth session, the final tree: RouteAhead removed (gpu-next137: 9,298 with it against 9,407
# without), LatH and QnopeH on. 1. The three op tests this session changed (the rest passed in
# gpu-next137 on the same code). 2. 64 sequences at -d 96, the defaults against both paths off,
# twice. 3. The server.
#   tools/gpu/plans/gpu-next138.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
ops_tests 120 3 norm_q8_batch_exact fused_mla_rope_absorb dense_blas_batch
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" "TS_CUDA_LAT_H=0 TS_CUDA_QNOPE_H=0" "" "TS_CUDA_LAT_H=0 TS_CUDA_QNOPE_H=0"
stamp "== server"
serve64 "" 30
rm -f $V
stamp "== done"
