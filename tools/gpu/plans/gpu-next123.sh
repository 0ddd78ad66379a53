#!/usr/bin/env bash
# Thirty-eighth session. Tail halves (TS_CUDA_ROWS_TAIL=N): the grouped r2 launches' last N
# first tiles (their last wave in block order) each as two one-row-set blocks, so the launch's
# last blocks take half as long and its ragged tail (Nsight: SMs active 88.7% / 85% of the
# gate/up / down launches) shrinks. The same bits expected (moe_rows_exact has the cases).
# 1. The MoE op tests. 2. 64 sequences at -d 96: N = 0 (default), 8, 16, 32, 48, 72 (all), 0.
# 3. 128 sequences: 0 and 32. 4. The server with S (edit) and without.
#   tools/gpu/plans/gpu-next123.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
S="TS_CUDA_ROWS_TAIL=32"
q8_bg
stamp "== moe tests"
op_log 200 3 ops.txt "" "" moe
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL=8 TS_CUDA_ROWS_TAIL=16 TS_CUDA_ROWS_TAIL=32 TS_CUDA_ROWS_TAIL=48 \
  TS_CUDA_ROWS_TAIL=72 ""
bpd 128 "" "" TS_CUDA_ROWS_TAIL=32
stamp "== server, 64 clients"
serve64 "$S" 30
serve64 "" 30
rm -f $V
stamp "== done"
