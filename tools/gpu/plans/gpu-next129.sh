#!/usr/bin/env bash
# Thirty-ninth session, after gpu-next128 (TS_CUDA_DENSE_BLAS_MIN=9: 64 sequences 8,547 -> 9,183,
# 128 14,203 -> 15,551, 32 4,789 -> 4,975, the server 8,055 -> 8,517).
# 1. Every op test with TS_CUDA_DENSE_BLAS_MIN=9. 2. Small batches (9, 12, 16 sequences): the
# default, MIN=9. 3. The traced 64-row step with MIN=9 (seq.txt: the launch order, cuBLAS's
# kernels unrecorded: their time lands on the launch before them).
#   tools/gpu/plans/gpu-next129.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
M=TS_CUDA_DENSE_BLAS_MIN=9
q8_bg
stamp "== ops_vs_cpu, $M"
op_log 300 2 ops.txt "XXXX" "$M"
wait
stamp "== small batches"
for p in 9 12 16; do bp $p "" $M; done
stamp "== trace, 64 at -d 96, $M"
export $M
trace_steps 64 96 40
rm -f $V
stamp "== done"
