#!/usr/bin/env bash
# RUN (twelfth session): 7,467 with graphs, 7,123 without, 6,859 without graphs and PDL.
# Twelfth session (2026-11-30): is the server's step (76 batch tokens, 10.9 ms) bound by the host's
# launches? The bench's 64-sequence steps replay CUDA graphs; the server's mixed steps (decode
# rows + a new request's prompt) mostly run eagerly. --parallel 64 with and without graphs, with
# the host's CPU time beside each.
#   tools/gpu/plans/gpu-next24.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
for e in "" TS_CUDA_GRAPHS=0 "TS_CUDA_GRAPHS=0 TS_CUDA_PDL=0"; do
  echo "-- ${e:-default}"
  env $e /usr/bin/time -f "host: %U s user, %S s sys, %e s wall" "$B" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 2 --hash 2>&1 | grep -E "x64|host:" | sed -E 's/.*\| (tg)/\1/'
done
