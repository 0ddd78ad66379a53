#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run. ~9 minutes. It takes over
# gpu-next155 (never run) and adds the session's three switches.
# 1. The op tests of the new paths (and of the ops they touch):
#    combine_norm_exact (Path::CombineNorm, the same bits), combine_uv_close (Path::CombineUv:
#    the merge and W_uv in one launch, lat bit for bit, x / out close), qkv_joint_batch (with
#    Path::AbsorbMma: W_uk on mla_absorb_h), norm_q8_batch_exact, moe_shared_fork,
#    recorded_steps_replay.
# 2. 64 sequences at -d 96, one round: the defaults; each switch alone; the three together; and
#    the attention's weights asked into L2 (TS_CUDA_APF=1: q / kv_a and W_uk from the layer's
#    first norm, W_uv and W_o from the merge; =2: all from the first norm). CombineNorm and APF
#    keep the hash 7a3b5e11379cb707; CombineUv and AbsorbMma change it (another summation order).
# Then gpu-next157.sh: a second round, 128 and 32 sequences, the server.
#   tools/gpu/plans/gpu-next156.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
ops_tests 330 2 combine_norm_exact combine_uv_close qkv_joint_batch norm_q8_batch_exact moe_shared_fork recorded_steps_replay
stamp "== 64 sequences"
ALL="TS_CUDA_COMBINE_NORM=1 TS_CUDA_COMBINE_UV=1 TS_CUDA_ABSORB_MMA=1"
bpd 64 "-d 96" "" "TS_CUDA_COMBINE_NORM=1" "TS_CUDA_COMBINE_UV=1" "TS_CUDA_ABSORB_MMA=1" "TS_CUDA_APF=1" "TS_CUDA_APF=2" \
  "$ALL" "$ALL TS_CUDA_APF=1"
stamp "== done"
