#!/usr/bin/env bash
# Fifty-fifth session, the last call: on an H200, gpu-next184 (the server's figure again); on
# any other card, the one-token Q8_0 down kernel at four warps a row (TS_CUDA_DOWN_WPR=4, last
# measured in the tenth session: -2.5%, before its weights moved ahead of the PDL wait and its
# sum into the residual) against the default two, tg128 alternating. ~3 minutes.
#   tools/gpu/plans/gpu-next185.sh BIN 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/gpu-next184.sh" "$B"
fi
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
stamp "== Q8_0 tg128, down warps a row"
for e in "" "TS_CUDA_DOWN_WPR=4" "" "TS_CUDA_DOWN_WPR=4"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== done"
