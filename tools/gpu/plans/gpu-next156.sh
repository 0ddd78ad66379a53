#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run. ~9 minutes. It takes over
# gpu-next155 (never run): the op tests of every path written without a device, then the one
# change that is on by default and untested on a GPU.
# 1. Op tests: combine_norm_exact (Path::CombineNorm, the same bits), combine_uv_close
#    (Path::CombineUv, the merge and W_uv in one launch; with Path::DenseMma, W_o on
#    dense_h16c_8), qkv_joint_batch (Path::AbsorbMma; Path::DenseMma on the joint q / kv_a
#    product), fused_moe_shared / moe_residual_exact / pre_routed_moe_exact (the decode MoE
#    gate/up, whose shared slots now load before the PDL wait: GU_SH_EARLY), router_split_exact (the batch router's
#    weights before its wait), norm_q8_batch_exact, moe_shared_fork, recorded_steps_replay.
# 2. One token: tg128 and tg64 at 16k with GU_SH_EARLY (the default now) against
#    TS_CUDA_DEFINES=GU_SH_EARLY=0 (the old SASS, the wait before the shared slots' loads), twice;
#    the same hashes (db10d2fd9a926913 / efeed109b1480c9a) both ways.
# Then gpu-next157.sh (64 sequences), gpu-next158.sh (server, knobs), gpu-next159.sh (bf16).
#   tools/gpu/plans/gpu-next156.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
ops_tests 330 2 combine_norm_exact combine_uv_close qkv_joint_batch fused_moe_shared moe_residual_exact \
  pre_routed_moe_exact router_split_exact norm_q8_batch_exact moe_shared_fork recorded_steps_replay
stamp "== one token: the gate/up's shared slots before the wait"
OLD="TS_CUDA_DEFINES=GU_SH_EARLY=0"
for r in 1 2; do
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
