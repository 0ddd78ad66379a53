#!/usr/bin/env bash
# For the sixty-third session, any card: on an H200 issue 6's figure (the server, 64 clients,
# 45 s, the defaults), then tg128 (issue 5's figure) against Path::GuCluster, alternating, and
# tg64 at 16k (~8 minutes); on any other card gpu-next217 (Path::GuCluster's op test, A/B,
# Nsight and trace; ~6 minutes).
#   OPS=.dev/ops tools/gpu/plans/gpu-next218.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/gpu-next217.sh" "$B"
fi
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_ready
issue6_server
stamp "== tg128"
for e in "" "TS_CUDA_GU_CLUSTER=1" "" "TS_CUDA_GU_CLUSTER=1"; do
  young 420 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_GU_CLUSTER=1"; do young 490 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== done"
