#!/usr/bin/env bash
# For the next session with an H200 (any other card: it prints the card and stops at once, so a
# call that lands elsewhere costs only its start): the server's issue-6 figure with this build
# (the card matters by ~2%: docs/PERF.md, fifty-fifth session), then Path::HeadMmh against the
# defaults at 64 sequences (H100: -0.2%, the same hash), and the server with it if it gains
# 0.5% or more. ~5 minutes with the file made.
#   tools/gpu/plans/gpu-next187.sh BIN 2>&1 | tee $OUT/log.txt | tail -50
set -u
B=$1
source "$(dirname "$0")/lib.sh"
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: nothing run"
  exit 0
fi
export TS_RUN_LIMIT=200
q8_ready
stamp "== server, 64 clients, 45 s"
serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences, -d 96: the head on mmh8_dn"
for r in 1 2; do p64_best ""; p64_best "TS_CUDA_HEAD_MMH=1"; done
stamp "best: '$best' $bestv against the defaults' $base"
if python3 -c "import sys; sys.exit(0 if $bestv > 1.005 * $base else 1)"; then
  serve64 "TS_CUDA_HEAD_MMH=1" 45 "--row-multiple 4"
fi
stamp "== done"
