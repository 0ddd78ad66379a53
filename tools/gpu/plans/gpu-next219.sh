#!/usr/bin/env bash
# For the sixty-third session's last device time (~4-5 minutes), on an H200 only: issue 6's
# figure (the server, 64 clients, 45 s, the defaults), then tg128 (issue 5's) if time is left.
# On any other card it stops at once.
#   OPS=.dev/ops tools/gpu/plans/gpu-next219.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader)"; exit 0
fi
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_ready
stamp "== synthesised"
issue6_server
stamp "== tg128"
young 230 && b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
