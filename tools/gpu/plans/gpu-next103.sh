#!/usr/bin/env bash
# Thirty-second session, written after its device time was spent (not yet run):
# - gpu-next102 measured TS_CUDA_DENSE128=1 (64 x 128 tiles for 65-128-token dense products)
#   slower: 80 sequences 8,529 -> 8,379, 96 10,363 -> 10,331, 128 13,916 -> 13,362. Its split
#   K rounded up, so V2-Lite's q made 288 blocks for the 264 places two blocks an SM give: a
#   second wave. The plan now takes the most splits that fit one wave (dense_plan). Measure it
#   again at 80 / 96 / 128.
# - Path::Sum4 and Path::GluEpi are removed (measured slower in gpu-next99): every op test again.
# - Nsight on a 64-row add_rms_norm (7.6 us each on the step's critical path for 512 KB; 5% of
#   the step) and on the grouped rows kernel (62%): speed of light and stalls.
# - The server with forwards padded to 8 rows (fewer shapes to record; lib.sh's serve64 now
#   takes ARGS in place of --row-multiple 1).
#   tools/gpu/plans/gpu-next103.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -90   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "dense128: .*tokens=(80|128)|" ""
wait
D="TS_CUDA_DENSE128=1"
stamp "== 80, 96, 128 sequences"
for p in 80 96 128; do for e in "" "$D"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done; done
stamp "== Nsight: a 64-row add_rms_norm, the rows kernel"
ncu_stalls "^add_rms_norm$" -p 0 -n 3 --parallel 64 -r 1
ncu_stalls "mmq_q8_rows_r2" -p 0 -n 3 --parallel 64 -r 1
stamp "== server, 64 clients: default, padded to 8 rows"
serve64 "" 30
serve64 "" 30 "--row-multiple 8"
rm -f $V
stamp "== done"
