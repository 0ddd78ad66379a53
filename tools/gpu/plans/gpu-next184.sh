#!/usr/bin/env bash
# Fifty-fifth session: the server's issue-6 figure again, on an H200 only (two cards of one
# kind have read 2% apart at 64 sequences: the fifty-fourth session's H200 read 9,735 where the
# forty-fifth's read 9,926-9,946 with a build 1.9% slower). On any other card it prints the card
# and stops at once, so a call that lands on an H100 costs only its start.
#   tools/gpu/plans/gpu-next184.sh BIN 2>&1 | tee $OUT/log.txt | tail -40
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
stamp "== 64 sequences, -d 96"
p64_best ""
stamp "== server again"
serve64 "" 45 "--row-multiple 4"
stamp "== done"
