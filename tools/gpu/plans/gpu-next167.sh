#!/usr/bin/env bash
# (Run once, fiftieth session; the code it measured, TS_CUDA_XP1 and route_predict_picks, was removed
# after: commit 1385276 has it. docs/PERF.md, "The routing predicted from a layer's input".)
# Fiftieth session, second call: the routing prediction's prefetch moved to the next launch's
# blocks (xp1_fetch in mla_rope_absorb_1: gpu-next166's one-block prefetch held every layer
# ~140 us), and the base build (eabb231, BASE) beside it: gpu-next166's default tg128 read 569
# on its H100 against 619 on the morning's, so the same machine must say whether the new
# default lost anything. ~6 minutes.
#   tools/gpu/plans/gpu-next167.sh BIN OPS BASE 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
BASE=$3
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
ops_tests 200 4 route_predict_picks fused_add_rms_norm_matmul_many
stamp "== tg128"
for r in 1 2; do
  b "" "$BASE" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  for e in "" "TS_CUDA_XP1=40" "TS_CUDA_XP1=24" "TS_CUDA_XP1=12"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== 16k"
b "" "$BASE" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
for e in "" "TS_CUDA_XP1=24"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== done"
