#!/usr/bin/env bash
# Thirty-ninth session: Path::DenseBlasBatch as the default (decode batches' dense products on
# cuBLAS in f16), with Path::DenseBlasFused (the norm writing q / kv_a's f16 input in its launch,
# add_rms_norm_h; W_uv's product writing W_o's input in f16).
# 1. Every op test (new: dense_blas_batch; norm_q8_batch_exact with a cuBLAS chain).
# 2. 64 sequences at -d 96: default, DENSE_BLAS_FUSED=0, DENSE_BLAS_BATCH=0. 3. The server.
#   tools/gpu/plans/gpu-next130.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== ops_vs_cpu"
op_log 300 2 ops.txt "XXXX" ""
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" TS_CUDA_DENSE_BLAS_FUSED=0 TS_CUDA_DENSE_BLAS_BATCH=0
stamp "== server, 64 clients"
serve64 "" 30
rm -f $V
stamp "== done"
