#!/usr/bin/env bash
# Fortieth session: two launches fewer a MoE layer in decode batches (Path::LatH: the attention's
# merge writes W_uv's f16 input; Path::QnopeH: norm_rope_cache's launch writes W_uk's), mmdh
# removed; NormQ8 for the FFN norm alone (the q / kv_a norm now keeps cuBLAS).
# 1. Every op test (the model synthesised beside them). 2. 64 sequences at -d 96: the defaults,
#    both new paths off, NORM_Q8=1; 32 sequences. 3. The server with the defaults and NORM_Q8=1.
#   tools/gpu/plans/gpu-next136.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -100   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
stamp "== ops"
ops_and_model
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" "TS_CUDA_LAT_H=0 TS_CUDA_QNOPE_H=0" "TS_CUDA_NORM_Q8=1" ""
bp 32 ""
stamp "== server"
serve64 "" 30
serve64 "TS_CUDA_NORM_Q8=1" 30
rm -f $V
stamp "== done"
