#!/usr/bin/env bash
# For the seventieth session's last device time (~4 minutes on an H200), on an H200 only: issue
# 6's figure (the server, 64 clients, 45 s, the defaults), then tg128 (issue 5's). On any other
# card it stops at once (nothing to measure there that gpu-next225 / 226 did not).
#   tools/gpu/plans/gpu-next227.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
if ! is_h200; then
  stamp "== not an H200: nothing to measure here"
  exit 0
fi
q8_ready
stamp "== synthesised"
issue6_server
stamp "== tg128"
young 300 && b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
