#!/usr/bin/env bash
# For the next session with an H200 (written in the sixty-fifth; ~6 minutes), on an H200 only:
# issue 6's figure (the server, 64 clients, 45 s, the defaults), then tg128 (issue 5's) and tg64
# at 16k, then with time left the server again with 192 gate/up blocks asking their rows into L2
# before their wait, not 128 (`MMQ_GU_PF`, chosen on H100s' 50 MB of L2; the H200 has 60). On
# any other card it stops at once: gpu-next220.sh's other-card checks passed on an H100 in the
# sixty-fifth session (GPU.md).
#   tools/gpu/plans/gpu-next221.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
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
young 330 && b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
young 380 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
if young 380; then
  stamp "== server, MMQ_GU_PF=192"
  serve64 "TS_CUDA_DEFINES=MMQ_GU_PF=192" 45 "--row-multiple 4"
fi
stamp "== done"
