#!/usr/bin/env bash
# For the sixty-fourth session (~6 minutes), any card. On an H200: issue 6's figure (the
# server, 64 clients, 45 s, the defaults), then tg128 (issue 5's) and tg64 at 16k. On any other
# card: the op tests of the attention's output launches (a12b481 builds both launches'
# arguments from one 14-word head; the same order and values), then tg128 and tg64 at 16k with
# their hashes (the sixty-third session's H100: db10d2fd9a926913 / 5bc7ee0d5025dc6f). On an
# H200 with time left, the server again with 192 gate/up blocks asking their rows into L2 before
# their wait, not 128 (`MMQ_GU_PF`, chosen on H100s' 50 MB of L2; the H200 has 60).
#   OPS=.dev/ops tools/gpu/plans/gpu-next220.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
if is_h200; then
  q8_ready
  stamp "== synthesised"
  issue6_server
else
  ops_tests 120 4 mla_out attention_out
fi
stamp "== tg128"
young 330 && b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
young 380 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
if is_h200 && young 380; then
  stamp "== server, MMQ_GU_PF=192"
  serve64 "TS_CUDA_DEFINES=MMQ_GU_PF=192" 45 "--row-multiple 4"
fi
stamp "== done"
