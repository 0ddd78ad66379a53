#!/usr/bin/env bash
# Fifty-second session, for a single call when too little device time is left for
# gpu-next175 + 176: the op test of the cache-row copy, the shared prefixes on CUDA (4
# choices over a 600-id prompt, with and without the prompt cache), the server with every
# default (issue 6), 64 sequences at -d 96, tg128. ~7 minutes with the synthesis.
#   tools/gpu/plans/gpu-next177.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== ops"
ops_tests 120 1 cache_copy_exact
grep -E "^cache_copy" $O/ops.txt
stamp "== shared prefixes on CUDA"
choices ""
choices "--no-prompt-cache"
stamp "== server"
serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences, one sequence"
bpd 64 "-d 96" ""
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
