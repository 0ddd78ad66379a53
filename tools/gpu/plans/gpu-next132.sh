#!/usr/bin/env bash
# Thirty-ninth session, the last ~5 device minutes: Path::DenseQ8H (mmdh_<NT>: decode batches'
# dense Q8_0 products on f16 tensor cores straight from Q8_0, q and kv_a in one launch, split K
# summed by each tile's last block). Its tests, then 64 sequences at -d 96 with it off / on.
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
