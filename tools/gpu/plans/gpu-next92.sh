#!/usr/bin/env bash
# Thirtieth session, after gpu-next91 (the bench's 64 sequences give each routed expert 9-15
# pairs, one 16-token tile each, and each shared-FFN chunk 64 pairs, four full tiles; the
# rows kernel reads each weight byte from DRAM once; bwprobe's rk: its load stream alone
# reaches 3.8-3.9 TB/s at its occupancy, the kernel ~3.1):
# - TS_CUDA_ROWS_SH_FIRST=1: the shared chunks' tiles at the first block indices instead of
#   after every routed first tile. Their six later tiles (264 blocks of the gate/up launch,
#   the longest: 16 tokens, both n8 tiles) were the launch's last wave, two blocks an SM.
#   Same bits (moe_rows_exact: both row-set counts, tiled and row-major).
# - Nsight on the 64-sequence step's dense products (mmq_q8_64, ~10 us each whatever their
#   size, 17% of the step): stall reasons.
#   tools/gpu/plans/gpu-next92.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== op tests"
op_log 150 2 ops.txt "" "" moe_rows_exact
wait
S="TS_CUDA_ROWS_SH_FIRST=1"
stamp "== 64 sequences"
ab64 2 "" "$S"
stamp "== server, 64 clients"
serve64 "" 40
serve64 "$S" 40
stamp "== trace, 64 sequences, shared first"
(export $S; trace_tg 8 $V --parallel 64)
stamp "== Nsight, mmq_q8_64 at 64 sequences"
ncu_stalls "mmq_q8_64" -p 0 -n 8 --parallel 64
rm -f $V
stamp "== done"
