#!/usr/bin/env bash
# Thirty-third session, written after its device time was spent (not yet run).
# New defaults since gpu-next108: batches take the tensor-core split attention from position
# 64 (TS_CUDA_MLA_LONG_BATCH); Path::RouterSplit on; GluPair, DenseSkip and Dense128 removed.
# 1. Every op test (after the removals).
# 2. The bench at the server's contexts: 64 sequences at -d 0 / 64 / 96 (gpu-next108: d0
#    8,575 hash 25c57a7459151b2c; d64 8,128; d128 8,064), and at -d 96 the tensor-core batch
#    attention with 2 and 8 splits a token instead of 2 x 132 / 64 = 4 (TS_CUDA_MLA_SPLITS; at
#    ~100 keys each split of 4 walks ~25 keys after loading the token's 16 query heads); and
#    the grouped rows kernels at 6 blocks an SM (MMQ_ROWS_MINB=6: 792 places, so gate/up's
#    1,584 blocks take 2.0 waves instead of 2.4, down's 1,152 1.45 instead of 1.75; the
#    register cap falls from 96 to 80: sass_static.py -D MMQ_ROWS_MINB=6 shows 66 B spilled,
#    20 LDL in the loop).
# 3. The server, 64 clients, 30 s: the new defaults (expected near gpu-next107's 7,240 with
#    MLATC forced); `serve --chain` (new, server-side, off until measured: when every running
#    sequence is greedy and no request waits, the next step is enqueued from the picks on the
#    GPU before they reach the host; the trace put the host's turn at ~280 us of a ~8.8 ms
#    step); prefill chunks of 256 and 512 (fewer, wider mixed steps: the 188-row mixed steps
#    ran op by op on the prompt path, 13.6 ms each, ~19% of the server's time, gpu-next106).
# The mixed steps' kernel switches follow in gpu-next110.
#   tools/gpu/plans/gpu-next109.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "" ""
wait
stamp "== 64 sequences at depth 0 / 64 / 96"
bpd 64 "" "" "TS_CUDA_DEFINES=MMQ_ROWS_MINB=6"
bpd 64 "-d 64" ""
bpd 64 "-d 96" "" "TS_CUDA_MLA_SPLITS=2" "TS_CUDA_MLA_SPLITS=8"
stamp "== server, 64 clients: the new defaults, chained steps, wider prefill chunks"
serve64 "" 30
serve64 "" 30 "--row-multiple 1 --chain"
serve64 "" 30 "--row-multiple 1 --prefill-chunk 256"
serve64 "" 30 "--row-multiple 1 --prefill-chunk 512"
rm -f $V
stamp "== done"
