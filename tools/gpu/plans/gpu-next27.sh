#!/usr/bin/env bash
# Written in the twelfth session (2026-11-30), NOT yet run (the session's device time ran out):
# batched MLA decode of sm_count/2 .. sm_count rows with contexts from 64 positions on the
# tensor-core split kernel (CudaBackend::batch_mla_tc, TS_CUDA_MLA_BATCH_TC=1, off until this
# runs), after TS_CUDA_MLATC=1 (the tensor cores for every batch and token) gave the server
# 5,357 -> 5,813 in 10-s runs (gpu-next26). ops_vs_cpu's mla_split_tensor_cores (now with a
# 100-row case) and mla_attention_latent_cache, then the server at 64 clients for 15 s without
# and with the switch, twice. Turn it on if it wins (and delete the switch).
# Also TS_CUDA_MMQ_SPLIT_ROWS=1: dense products of several 64-token tiles split K by their row
# tiles alone (the server's 76-row steps ran their dense products at 21.5 us against 11.3 at 64
# rows: two token tiles halved the splits; ops_vs_cpu mmq_split_rows checks it against the default
# split); other split sums, so --parallel 128's hash changes
# with it (282e057fc6ee8e5f without). About 7 minutes.
#   tools/gpu/plans/gpu-next27.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 90 2 mla_split_tensor_cores mla_attention_latent_cache mmq_split_rows
for r in 1 2; do
  for e in "" TS_CUDA_MLA_BATCH_TC=1 TS_CUDA_MMQ_SPLIT_ROWS=1 "TS_CUDA_MLA_BATCH_TC=1 TS_CUDA_MMQ_SPLIT_ROWS=1"; do serve64 "$e" 15; done
done
for e in "" TS_CUDA_MMQ_SPLIT_ROWS=1; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash; done
