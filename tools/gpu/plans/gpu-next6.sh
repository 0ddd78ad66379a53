#!/usr/bin/env bash
# First GPU run of branch gpu-next6 (written 2026-11-30, seventh session, without a GPU): the
# grouped MoE's gate and up products in one mmq_q8 launch (TS_CUDA_MOE_GU=0: two, as on main) and
# 16-token tiles for dense Q8_0 products of up to TS_CUDA_MMQ_BN16 tokens (default 16 as on main;
# the 64-token batched step's q, kv_a, absorbed and output products take 64-token tiles and
# split-K today: 217 launches of 11.4 us a step in the trace, docs/PERF.md).
#   tools/gpu/plans/gpu-next6.sh BIN OPS_TEST        (about 6 minutes)
# Expect: ops_vs_cpu all pass, also its matmul and moe tests under TS_CUDA_MMQ_BN16=64; gate+up
# in one launch gives the same tokens as two (--parallel 64 hash c28e46212041fc1e on main, -r 2).
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_and_model
echo "== ops_vs_cpu matmul|moe with TS_CUDA_MMQ_BN16=64"
TS_CUDA_MMQ_BN16=64 "$OPS" --test-threads 2 matmul moe 2>&1 | grep -E "FAIL|test result|panicked" | head
for r in 1 2; do
  for e in "" TS_CUDA_MOE_GU=0 TS_CUDA_MMQ_BN16=32 TS_CUDA_MMQ_BN16=64; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  done
done
for e in "" TS_CUDA_MOE_GU=0; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | grep -vE "^turbospark: (GPU|serving)" | tail -14
