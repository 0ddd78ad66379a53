#!/usr/bin/env bash
# Sixty-ninth session, third plan: where the mmh8 head launch's time goes, and the MoE's mmh8
# launches back on three stages of each ring. gpu-next223 had the output head's mmh8_dn200 at
# ~157 us for 237 MB on an H100 (~1.5 TB/s) with four copy stages; more copies in flight gained
# little, so something per SM holds it. Probes (TS_CUDA_DEFINES=MMH8_PROBE=N, wrong results):
# 1 no group headers copied, 2 no conversion, 4 no wgmma, 7 none of them: the head launch's
# time under Nsight Compute with each. Then prompts on mmh8 (TS_CUDA_MMH=q8) with OLD (the
# shared three stages, gpu-next222's build) and this build (MoE: three and three, the idle
# warpgroup converting), twice; and 64 sequences with the head on mmh8 against the defaults.
# On an H200 first issue 6's figure (the server with the defaults). ~5 minutes on an H100.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next224.sh .dev/turbospark .dev/turbospark.old > $OUT/log.txt 2>&1
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
export NCU_LAST=2
ncu_head "$B"
for p in 1 2 4 7; do young 260 && ncu_head "$B" TS_CUDA_DEFINES=MMH8_PROBE=$p; done
stamp "== prompts, the MoE on mmh8"
for r in 1 2; do
  for bin in "$OLD" "$B"; do
    young 420 || break
    b "TS_CUDA_MMH=q8" "$bin" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "TS_CUDA_MMH=q8" "$bin" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  done
done
stamp "== 64 sequences, -d 96"
if young 470; then
  b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "TS_CUDA_HEAD_MMH=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
fi
stamp "== done"
