#!/usr/bin/env bash
# For the seventieth session (~6 minutes on an H100, ~7 on an H200). On an H200 first issue 6's
# figure (the server, 64 clients, 45 s, the defaults) and tg128. Then why the head's tiled copy
# (Path::HeadTiles) changed the 64-sequence tokens in gpu-next225 (hash 70613772… against
# 0a9cb67b… for the defaults and for the head on mmh8 from its row-major rows) while its op test
# held it bit for bit: the head is uploaded first, so on an H100, whose copy budget cannot hold
# every second layout, its 223 MB may drop one of the last layers' copies. Each run's load line
# ("GPU memory: … second layouts …") says what was made; then the same three runs with
# TS_CUDA_MOE_TILED=0 (no 16-row expert tiles: every other copy fits), like for like.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next226.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
wait
# `bm ENV`: the 64-sequence bench at -d 96 under ENV, its load line, figures and hashes.
bm() {
  echo "-- ${1:-default}"
  env $1 timeout $TS_RUN_LIMIT "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96 2>&1 |
    grep -E "GPU memory|^\| .*tg|hash|rror" | sed -E 's/.*\| (tg)/\1/; s/.*GPU memory: /mem: /'
}
stamp "== 64 sequences, -d 96: the load lines"
for e in "" "TS_CUDA_HEAD_MMH=1" "TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_TILES=0"; do bm "$e"; done
stamp "== the same without the 16-row expert tiles (every other copy fits)"
for r in 1 2; do
  young 420 || break
  for e in "TS_CUDA_MOE_TILED=0" "TS_CUDA_MOE_TILED=0 TS_CUDA_HEAD_MMH=1" "TS_CUDA_MOE_TILED=0 TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_TILES=0"; do
    bm "$e"
  done
done
stamp "== done"
