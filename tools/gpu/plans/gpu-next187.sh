#!/usr/bin/env bash
# For the next session. On an H200: the server's issue-6 figure with this build
# (the card matters by ~2%: docs/PERF.md, fifty-fifth session), then Path::HeadMmh against the
# defaults at 64 sequences (H100: -0.2%, the same hash), and the server with it if it gains
# 0.5% or more. ~5 minutes with the file made. On any other card: Nsight on the head's mmh8_dn
# launch only (why it did not gain on the H100).
#   tools/gpu/plans/gpu-next187.sh BIN 2>&1 | tee $OUT/log.txt | tail -50
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  # Not an H200: only why the head on mmh8_dn did not gain on the H100 (Nsight: its time,
  # DRAM throughput and stall reasons; graphs off), ~2 minutes with the file made.
  q8_ready
  stamp "== Nsight: the head on mmh8_dn"
  TS_CUDA_HEAD_MMH=1 ncu_stalls "mmh8_dn" -p 0 -n 40 --parallel 64 -r 1
  stamp "== done"
  exit 0
fi
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
