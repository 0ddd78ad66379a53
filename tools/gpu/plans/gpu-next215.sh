#!/usr/bin/env bash
# For the sixty-second session's last device time (~6 minutes), on an H200 only: issue 6's
# figure (the server, 64 clients, 45 s, the defaults), then tg128 (issue 5's) and tg64 at 16k
# with time left. On any other card it stops at once.
#   OPS=.dev/ops tools/gpu/plans/gpu-next215.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader)"; exit 0
fi
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_ready
stamp "== synthesised"
issue6_server
stamp "== tg128"
young 330 && b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
young 380 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
