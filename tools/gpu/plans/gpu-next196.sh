#!/usr/bin/env bash
# For the fifty-eighth session (~5 minutes with the file made), any card: the build with the MLA
# kernels' shared-space ldmatrix as the only path (gpu-next193 measured it as a define):
#  1. the MLA op tests;
#  2. the server, 64 clients, 45 s (on an H200: issue 6's figure; twice there);
#  3. 64 sequences at -d 96, tg128, tg64 at 16k (issue 5's figures on this card).
#   OPS=.dev/ops tools/gpu/plans/gpu-next196.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -50
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== op tests"
ops_tests 150 4 mla cache_write_and_attention
q8_ready
h200=0; is_h200 && h200=1
stamp "== server, 64 clients, 45 s"
serve64 "" 45 "--row-multiple 4"
[ $h200 = 1 ] && serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences, tg128, 16k"
p64_best ""
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
