#!/usr/bin/env bash
# Thirty-fifth session. The rows kernels' activation tile in two staged halves on mbarriers
# (MMQ_ROWS_STAGE=1: a warp multiplies its first groups while the second half lands) and the
# tiled weights loaded past L1 (MMQ_ROWS_NA=1), both measurement defines, the same bits.
# 1. The MoE op tests under each define.
# 2. 64 sequences at -d 96 (the server's contexts): defaults, each define, both, defaults again.
# 3. A traced 64-sequence bench at -d 96: the decode step's launches in order (steps.py SEQ_FILE).
#   tools/gpu/plans/gpu-next114.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== moe tests, MMQ_ROWS_STAGE=1 then MMQ_ROWS_NA=1"
op_log 150 3 ops1.txt "" "TS_CUDA_DEFINES=MMQ_ROWS_STAGE=1" moe_
op_log 100 3 ops2.txt "" "TS_CUDA_DEFINES=MMQ_ROWS_NA=1" moe_rows
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" "TS_CUDA_DEFINES=MMQ_ROWS_STAGE=1" "TS_CUDA_DEFINES=MMQ_ROWS_NA=1" \
  "TS_CUDA_DEFINES=MMQ_ROWS_STAGE=1,MMQ_ROWS_NA=1" ""
stamp "== traced 64 sequences at depth 96"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 16 \
  --parallel 64 -r 1 -d 96 >/dev/null 2>&1
python3 "$(dirname "$0")/../steps.py" $O/tr.csv 24 $O/seq.txt | head -40
rm -f $O/tr.csv $V
stamp "== done"
