#!/usr/bin/env bash
# Thirty-seventh session. Measurements for the 64-sequence step (#6), no default changed:
# - TS_CUDA_L2PF_B=1: the batch's split attention asks the MoE's router and shared experts into
#   L2 (cp.async.bulk.prefetch.L2, before its wait); =2: the layer's first norm asks for the
#   attention's weights; =3 both.
# - MMQ_ROWS_EF=1 (define): the rows kernels' weight stream marked first to go in L2.
# - The batch split count at -d 96 / 200 / 400 (TS_CUDA_MLA_SPLITS 1, 2, 3 against the default 4).
# 1. The MLA op tests (the tensor-core split kernels now take the hint's 8 arguments).
#   tools/gpu/plans/gpu-next117.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
# (After this call the TS_CUDA_L2PF_B and MMQ_ROWS_EF code was removed, both measured slower or
# equal: docs/PERF.md, thirty-seventh session. Rerun only on a build that has them.)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== mla tests"
op_log 120 3 ops.txt "" "" mla_
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" "TS_CUDA_L2PF_B=1" "TS_CUDA_L2PF_B=3" "TS_CUDA_DEFINES=MMQ_ROWS_EF=1" \
  "TS_CUDA_L2PF_B=1 TS_CUDA_DEFINES=MMQ_ROWS_EF=1" "TS_CUDA_MLA_SPLITS=2" "TS_CUDA_MLA_SPLITS=1" \
  "TS_CUDA_MLA_SPLITS=3" ""
stamp "== 64 sequences at depth 200"
bpd 64 "-d 200" "" "TS_CUDA_MLA_SPLITS=2" "TS_CUDA_MLA_SPLITS=3"
stamp "== 64 sequences at depth 400"
bpd 64 "-d 400" "" "TS_CUDA_MLA_SPLITS=2"
rm -f $V
stamp "== done"
