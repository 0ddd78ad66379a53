#!/usr/bin/env bash
# Thirty-third session. The server's steps (gpu-next104, /metrics): the 64 clients run in
# lockstep groups (32-token prompts, 128 tokens each, prefill chunks of 128), so a cycle of
# ~130 steps holds ~114 decode-only steps of ~62 rows (replayed from a CUDA graph, ~7.5 ms
# each) and 16 mixed steps of 128 prompt + ~60 decode rows: 188 rows, past GRAPH_MAX_TOKENS
# (128), run op by op, ~20 ms each by subtraction. Smaller prefill chunks keep the mixed steps
# at or under 128 rows (recorded and replayed): chunk 64 (32 mixed steps of ~126 rows),
# chunk 32 (64 mixed steps of ~95 rows).
#   tools/gpu/plans/gpu-next105.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~3 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
R="TS_CUDA_ROUTER_SPLIT=1"
stamp "== server, 64 clients: prefill chunks of 64, 32, 128"
serve64 "$R" 30 "--row-multiple 1 --prefill-chunk 64"
serve64 "$R" 30 "--row-multiple 1 --prefill-chunk 32"
serve64 "$R" 30 "--row-multiple 1 --prefill-chunk 128"
rm -f $V
stamp "== done"
