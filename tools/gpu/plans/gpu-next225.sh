#!/usr/bin/env bash
# For the seventieth session (written in the sixty-ninth; ~6 minutes on an H200, ~4 on an H100).
# On an H200 first issue 6's figure (the server, 64 clients, 45 s, the defaults) and tg128. On
# any card: the prompt MoE on mmh8 (TS_CUDA_MMH=q8; the H100's default, where the f16 copies do
# not fit) with the idle warpgroup converting (MMH_HELP=1, the default since the sixty-ninth
# session, measured there only in a two-ring form of the kernels that was not kept) against
# MMH_HELP=0, pp512 and pp2048 alternating, twice; then 64 sequences with the output head on
# mmh8 (TS_CUDA_HEAD_MMH=1, 200-row tiles) against the defaults (cuBLAS on the f16 copy).
#   tools/gpu/plans/gpu-next225.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
wait
stamp "== prompts on mmh8, MMH_HELP 1 (default) against 0"
for r in 1 2; do
  young 420 || break
  for e in "TS_CUDA_MMH=q8" "TS_CUDA_MMH=q8 TS_CUDA_DEFINES=MMH_HELP=0"; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  done
done
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  young 480 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "TS_CUDA_HEAD_MMH=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
done
stamp "== done"
