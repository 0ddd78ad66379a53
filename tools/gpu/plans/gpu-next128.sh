#!/usr/bin/env bash
# Thirty-ninth session. Batched decode's dense products (q / kv_a, W_uk, W_uv, W_o, the dense
# lead FFN, lm_head) on cuBLAS in f16 from the prompts' row-major copies
# (TS_CUDA_DENSE_BLAS_MIN=9: products of 9+ rows; default 129) instead of the int8 tiles with
# split K, their quantisation and split-sum launches. Other bits (f16 activations).
# 1. 64 sequences at -d 96 / -d 400, 128 and 32 sequences: default vs MIN=9.
# 2. The server, both. 3. gpu-next127's down-tail counts (DN 8, 22) at 64 sequences.
#   tools/gpu/plans/gpu-next128.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
M=TS_CUDA_DENSE_BLAS_MIN=9
q8_bg
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" $M "" $M
stamp "== 64 sequences at depth 400"
bpd 64 "-d 400" "" $M
stamp "== 128 and 32 sequences"
bp 128 "" $M
bp 32 "" $M
stamp "== server, 64 clients"
serve64 "$M" 30
serve64 "" 30
stamp "== down tails"
bpd 64 "-d 96" TS_CUDA_ROWS_TAIL_DN=8 TS_CUDA_ROWS_TAIL_DN=22 ""
rm -f $V
stamp "== done"
