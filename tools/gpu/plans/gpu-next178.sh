#!/usr/bin/env bash
# Fifty-third session, for a single short call when little device time is left (each failed
# start costs 90-180 s): the op test of the cache-row copy, the shared prefixes on CUDA (4 greedy
# choices over a 600-id prompt), the server with every default (issue 6) for 40 s, tg128. ~5
# minutes with the synthesis.
#   tools/gpu/plans/gpu-next178.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
stamp "== ops"
ops_tests 90 1 cache_copy_exact
grep -E "^cache_copy" $O/ops.txt
stamp "== shared prefixes on CUDA"
choices ""
stamp "== server"
serve64 "" 40 "--row-multiple 4"
stamp "== tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
