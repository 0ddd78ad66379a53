#!/usr/bin/env bash
# Sixty-ninth session, second plan: the mmh8 kernels' copies in a ring of their own. Nsight
# (gpu-next222) had the output head's mmh8_dn200 launch at ~160 us for 237 MB on an H100 (~1.5
# TB/s): its pair, raw and f16 rows shared three stages, so a stage's copies waited for the
# multiply two stages back. Now four stages of copies run ahead of two of f16 rows, and the idle
# second multiplying warpgroup converts in tiles of <= 64 pairs (MMH8_HELP=1). OLD is the build
# before (gpu-next222's). On an H200 first issue 6's figure (the server with the defaults); on
# any card the op tests head_mmh and moe_f16_prompt (mmh8_* included), the head launch's time
# under Nsight Compute (new 200 / 256-row tiles, old 200), 64 sequences at -d 96 alternating
# (old and new with the head on mmh8, new with the defaults), prompts (pp512, pp2048) old and
# new with the prompt MoE on mmh8 (TS_CUDA_MMH=q8). ~6 minutes on an H100 with the file made.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next223.sh .dev/turbospark .dev/turbospark.old > $OUT/log.txt 2>&1
set -u
B=$1
OLD=$2
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first
mmh_ops
stamp "== the head launch alone (Nsight Compute, graphs off, 64 sequences)"
ncu_head "$B" TS_CUDA_HEAD_BN=200
ncu_head "$OLD" TS_CUDA_HEAD_BN=200
ncu_head "$B" TS_CUDA_HEAD_BN=256
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  [ $r = 2 ] && ! young 420 && break
  b "TS_CUDA_HEAD_MMH=1" "$OLD" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "TS_CUDA_HEAD_MMH=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
done
stamp "== prompts, the MoE on mmh8"
for bin in "$OLD" "$B"; do
  young 480 || break
  b "TS_CUDA_MMH=q8" "$bin" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "TS_CUDA_MMH=q8" "$bin" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
stamp "== done"
