#!/usr/bin/env bash
# For the seventieth session's last device time (~4 minutes on an H200), on an H200 only: issue
# 6's figure (the server, 64 clients, 45 s, the defaults), then tg128 (issue 5's). On any other
# card it stops at once (nothing to measure there that gpu-next225 / 226 did not).
#   tools/gpu/plans/gpu-next227.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
is_h200 || { stamp "== not an H200: nothing to measure here"; exit 0; }
q8_bg
h200_first tg128
stamp "== done"
