#!/usr/bin/env bash
# Issue 6's figure on an H200 only (any other card: nothing run, so the call costs only its
# start): the server with the defaults, 45 s; then 64 sequences at -d 96, twice, the defaults
# against Path::HeadMmh (the batch's output head on mmh8_dn from its Q8_0 rows: -0.2% on an
# H100 in the fifty-fifth session, never run on an H200).
#   tools/gpu/plans/gpu-next192.sh BIN 2>&1 | tee $OUT/log.txt | grep -vE "^tg32 @|tokens of tg32 @" | tail -30
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name --format=csv,noheader)"; exit 0
fi
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
stamp "== server, 64 clients, 45 s (H200: issue 6's figure)"
serve64 "" 45 "--row-multiple 4"
for r in 1 2; do
  [ $(( $(date +%s) - T0 )) -lt 400 ] || break
  p64_best ""
  p64_best "TS_CUDA_HEAD_MMH=1"
done
stamp "== done"
