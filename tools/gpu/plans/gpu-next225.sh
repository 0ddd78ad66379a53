#!/usr/bin/env bash
# For the seventieth session (written in the sixty-ninth; ~7 minutes on an H200, ~5 on an H100).
# On an H200 first issue 6's figure (the server, 64 clients, 45 s, the defaults) and tg128. On
# any card, while the file is made: the op test head_mmh (the head's tiled copy, Path::HeadTiles,
# written without a device: its layout against the CPU's, its products against the row-major
# rows' bit for bit). Then Nsight on the head launch (mmh8_ht200 from the tiled copy against
# mmh8_dn200's TMA boxes: 156 us on an H100); prompts on mmh8 (TS_CUDA_MMH=q8; the H100's
# default) with MMH_HELP 1 (the default since the sixty-ninth session, measured there only in
# a two-ring form not kept) against 0; 64 sequences: the defaults (head on cuBLAS), the head on
# mmh8 from its tiles, and from the row-major rows.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next225.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
mmh_ops
stamp "== the head launch alone (Nsight Compute, graphs off, 64 sequences)"
ncu_head "$B"
ncu_head "$B" TS_CUDA_HEAD_TILES=0
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  young 400 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "TS_CUDA_HEAD_MMH=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
  b "TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_TILES=0" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
done
stamp "== prompts on mmh8, MMH_HELP 1 (default) against 0"
for r in 1 2; do
  young 480 || break
  for e in "TS_CUDA_MMH=q8" "TS_CUDA_MMH=q8 TS_CUDA_DEFINES=MMH_HELP=0"; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  done
done
stamp "== done"
