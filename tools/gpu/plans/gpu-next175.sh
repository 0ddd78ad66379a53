#!/usr/bin/env bash
# Fifty-second session, part 1 of 2 (part 2: gpu-next176.sh, right after, on the same warm
# machine: it reuses the synthesised model). An H200 (else an H100, whose figures compare only
# with each other). The CUDA twin of the new cache-row copy (op test cache_copy_exact), the
# server's shared prompt prefixes on CUDA (a request of 4 choices over a 600-id prompt: the
# texts of greedy choices equal one choice alone, the prompt copied 3 times, and the time
# against --no-prompt-cache), then the server with every default against the wait off (issue
# 6). ~8 minutes with the synthesis.
#   tools/gpu/plans/gpu-next175.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -70
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
serve64 "" 45 "--row-multiple 4 --gather-ms 0"
stamp "== done"
