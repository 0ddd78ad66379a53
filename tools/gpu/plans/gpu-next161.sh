#!/usr/bin/env bash
# Forty-seventh session: what gpu-next156 ran (never run; removed) and the first half of
# gpu-next157, in one call of ~10 minutes, for a session whose device time was cut by refused
# starts (the call's limit cuts the last lines). In order of worth: the op tests of every path
# written without a device (two of them, GU_SH_EARLY and RS_EARLY, are on by default), tg128
# with and without GU_SH_EARLY twice (hash db10d2fd9a926913 both), one round at 64 sequences
# -d 96 of every switch (hash 7a3b5e11379cb707 for the same-bits ones), then tg64 at 16k both
# ways (efeed109b1480c9a). If an op test fails for GU_SH_EARLY or RS_EARLY, turn that define off
# first. Then gpu-next157 (its reverse round, 128 / 32), gpu-next158, 159, 160.
#   tools/gpu/plans/gpu-next161.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
ops_tests 300 4 combine_norm_exact combine_uv_close qkv_joint_batch fused_moe_shared moe_residual_exact \
  pre_routed_moe_exact router_split_exact norm_q8_batch_exact moe_shared_fork recorded_steps_replay
stamp "== tg128: the gate/up's shared slots before the wait"
OLD="TS_CUDA_DEFINES=GU_SH_EARLY=0"
for r in 1 2; do
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== 64 sequences"
ALL="TS_CUDA_COMBINE_NORM=1 TS_CUDA_COMBINE_UV=1 TS_CUDA_ABSORB_MMA=1 TS_CUDA_DENSE_MMA=1"
bpd 64 "-d 96" "" "TS_CUDA_COMBINE_NORM=1" "TS_CUDA_COMBINE_UV=1" "TS_CUDA_ABSORB_MMA=1" "TS_CUDA_DENSE_MMA=1" \
  "TS_CUDA_APF=1" "$ALL" "$ALL TS_CUDA_APF=1" ""
stamp "== tg64 at 16k"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
