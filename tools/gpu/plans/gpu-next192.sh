#!/usr/bin/env bash
# Issue 6's figure on an H200 only (any other card: nothing run, so the call costs only its
# start): the server with the defaults, 45 s; then 64 sequences at -d 96 if the call is young.
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
[ $(( $(date +%s) - T0 )) -lt 120 ] && p64_best ""
stamp "== done"
