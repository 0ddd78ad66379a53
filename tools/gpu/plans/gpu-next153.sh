#!/usr/bin/env bash
# Forty-fifth session, second call: the op tests the prefetch's launches touch (the merge and
# the layer's first norm take 8 more arguments), then the expert prefetch from the FFN norm at
# 32 MB (the new default, TS_CUDA_XPF=0 off) against the merge's launch (TS_CUDA_XPF_AT=2) and
# both (21) at 64 sequences; 128 and 32 sequences; the server with and without it.
#   tools/gpu/plans/gpu-next153.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~7 minutes)
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
ops_tests 200 2 mla_combine_few_exact norm_q8_batch_exact qkv_joint_batch dense_blas_batch
bpd 64 "-d 96" "TS_CUDA_XPF=0" "" "TS_CUDA_XPF_AT=2" "TS_CUDA_XPF_AT=21" "TS_CUDA_XPF=48 TS_CUDA_XPF_AT=21" \
  "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF=0" ""
bp 128 "TS_CUDA_XPF=0" ""
bp 32 "TS_CUDA_XPF=0" ""
stamp "== server"
serve64 "TS_CUDA_XPF=0" 30 "--row-multiple 4"
serve64 "" 30 "--row-multiple 4"
stamp "== done"
