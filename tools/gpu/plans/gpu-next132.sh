#!/usr/bin/env bash
# Thirty-ninth session: Path::DenseQ8H (decode batches' dense Q8_0 products on f16 tensor
# cores straight from Q8_0, q and kv_a in one launch). Run once on its first form (mmdh_<NT>,
# split K summed by each tile's last block from global memory): correct, 6,760 against 9,314.
# Since then mmdh_<NT>_<CS> (the splits as a thread-block cluster, summed through distributed
# shared memory), not yet run: its tests, then 64 sequences at -d 96 with it off / on.
#   tools/gpu/plans/gpu-next132.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=80
q8_bg
stamp "== ops_vs_cpu dense_blas_batch norm_q8_batch_exact"
op_log 120 2 ops.txt "mmdh|" "" dense_blas_batch norm_q8_batch_exact
wait
stamp "== 64 sequences at -d 96"
bpd 64 "-d 96" "" TS_CUDA_DENSE_Q8H=1
rm -f $V
stamp "== done"
