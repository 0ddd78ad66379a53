#!/usr/bin/env bash
# (Run once, fiftieth session; the code it measured, TS_CUDA_XP1 and route_predict_picks, was removed
# after: commit 1385276 has it. docs/PERF.md, "The routing predicted from a layer's input".)
# Fiftieth session: the one-token routing prediction (TS_CUDA_XP1, new, off by default):
# gemv_q8_multi_norm_1's route_predict blocks score the experts on the layer's input and ask
# L2 for the likely ones' gate / up while the attention runs. ~8 minutes.
# 1. Op tests: route_predict_picks (new: the same bits, the host's picks), the fused norm's
#    own test, the recorded steps.
# 2. tg128 with XP1 0 / 40 (whole matrices of 6 experts, ~39 MB) / 24 / 12 MB / 48 MB over 8
#    experts, twice round; hash db10d2fd9a926913 on every line (a hint: the same bits).
# 3. tg64 at 16k, 0 and 40.
#   tools/gpu/plans/gpu-next166.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
ops_tests 200 4 route_predict_picks fused_add_rms_norm_matmul_many recorded_steps_replay
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_XP1=40" "TS_CUDA_XP1=24" "TS_CUDA_XP1=12" "TS_CUDA_XP1=52 TS_CUDA_XP1_TOP=8"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== 16k"
for e in "" "TS_CUDA_XP1=40"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== done"
