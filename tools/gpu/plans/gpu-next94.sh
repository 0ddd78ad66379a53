#!/usr/bin/env bash
# Thirtieth session, written after its device time was spent (not yet run). Main's new
# defaults since the last full op-test run: the shared chunks' tiles first, the list offset
# beside the count (both the same bits), dense split K down to one group a split (other bits:
# the 64-sequence hash is now 6bbd3fa953f72f1b). Then:
# - TS_CUDA_NORM_Q8=1 (Path::NormQ8): a decode batch's two norms a layer each quantise their
#   rows in the same launch (add_rms_norm_q8): the first for q / kv_a, the FFN norm for the
#   grouped MoE, which then skips its own quantisation; 54 launches fewer a 64-row step. Same
#   bits (tests fused_add_rms_norm_matmul_many, norm_q8_batch_exact; the hash must hold).
# - TS_CUDA_SUM_Q8=1 (Path::SumQ8), with NORM_Q8: W_uv's split sum also writes W_o's quantised
#   input (mmq_sum_splits_q8), and the FFN norm's launch sums W_o's partials itself: 54 launches
#   fewer a 64-row step, same bits (norm_q8_batch_exact).
# - What each part of the 64-sequence MoE costs (MMQ_ROWS_KO, wrong results on purpose, so
#   other hashes): 1 no activation tile copy, 2 no token list, 4 no multiply (loads only), and
#   7. bwprobe's rk reads the kernel's load stream at 3.8-3.9 TB/s; the kernel reaches ~3.2.
# - TS_CUDA_ROWS_R=2 (two row sets a warp, 128 rows a block: each block's start paid once for
#   two row sets) at 64 sequences again: "the same" as one set before the shared chunks went
#   first; the tail it lengthened is shorter now.
#   tools/gpu/plans/gpu-next94.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== every op test"
op_log 240 4 ops.txt "" ""
wait
stamp "== 64 sequences"
ab64 2 "" "TS_CUDA_NORM_Q8=1" "TS_CUDA_NORM_Q8=1 TS_CUDA_SUM_Q8=1" "TS_CUDA_ROWS_R=2"
ab64 1 "TS_CUDA_DEFINES=MMQ_ROWS_KO=1" "TS_CUDA_DEFINES=MMQ_ROWS_KO=2" "TS_CUDA_DEFINES=MMQ_ROWS_KO=4" \
  "TS_CUDA_DEFINES=MMQ_ROWS_KO=7"
stamp "== tg128, 16k (unchanged paths: the hashes must hold)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
rm -f $V
stamp "== done"
