#!/usr/bin/env bash
# Thirty-first session, written after its device time was spent (not yet run):
# - TS_CUDA_DENSE_JOBS=1 (Path::DenseJobs): a decode batch's q and kv_a in one int8 launch
#   (mmq_q8_64_jobs) and their split sums in one (mmq_sum_splits_jobs); each block computes what
#   it does in its own job's launch: the same bits (test dense_jobs_exact; the hash must hold).
# - TS_CUDA_SUM4=1 (Path::Sum4): the dense split sums four values a thread (16-byte loads, four
#   splits in flight, 32-bit indices): the same bits.
# - TS_CUDA_DENSE_EARLY=1 (Path::DenseEarly): the dense 64-token tiles copy their first stages'
#   weight rows before the PDL wait (mmq_q8_64e, mmq_q8_64_jobse): the same bits.
# - TS_CUDA_GLU_EPI=1 (Path::GluEpi): the grouped gate/up launch writes the down product's
#   quantised input itself (mmq_q8_rows_glu: a block takes 64 rows of both matrices, the GLU and
#   quant_q8_groups' rounding in its epilogue): no gate / up floats, no GLU quant launch; the same
#   bits (moe_rows_exact).
# - TS_CUDA_SUM_Q8=1 alone again: its sum kernel now loads a 16-byte piece a split (it lost
#   0.6% in gpu-next96 with a 4-byte load a split and a value).
# gpu-next100 then: 80 / 96 sequences and the server with what this keeps.
#   tools/gpu/plans/gpu-next99.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "" ""
wait
stamp "== 64 sequences"
J="TS_CUDA_DENSE_JOBS=1"; S4="TS_CUDA_SUM4=1"; E="TS_CUDA_DENSE_EARLY=1"; G="TS_CUDA_GLU_EPI=1"
ab64 2 "" "$J $S4" "$E" "$G" "$J $S4 $E $G"
ab64 1 "$J" "$S4" "TS_CUDA_SUM_Q8=1"
stamp "== tg128 (the hash must hold)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
rm -f $V
stamp "== done"
