#!/usr/bin/env bash
# Written at the end of the thirty-ninth session (device time spent), for the next one: the
# cluster form of Path::DenseQ8H (mmdh_<NT>_<CS>: decode batches' dense Q8_0 products on f16 MMA
# straight from Q8_0, q and kv_a in one launch, K split across a thread-block cluster and summed
# through distributed shared memory; the output head stays on cuBLAS).
# 1. Its op tests (dense_blas_batch: every shape within 1e-4 of cuBLAS, the path counted;
#    norm_q8_batch_exact: the chain with W_uv / W_o on it). 2. 64 sequences at -d 96 and -d 400,
#    32 sequences: off / on (128 sequences take cuBLAS either way). 3. The server with it, if it
#    won. 4. Nsight of one layer's mmdh launches (duration, DRAM share) against the nvjet kernels
#    of gpu-next132's short call (q 10.0 us, kv_a 8.5, W_o 9.2, W_uk 6.1, W_uv 6.1 at Nsight's clocks).
#   tools/gpu/plans/gpu-next133.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
Q=TS_CUDA_DENSE_Q8H=1
q8_bg
stamp "== ops_vs_cpu dense_blas_batch norm_q8_batch_exact"
op_log 200 2 ops.txt "mmdh|" "" dense_blas_batch norm_q8_batch_exact
wait
stamp "== 64 sequences at -d 96 / -d 400, 32 sequences"
bpd 64 "-d 96" "" $Q "" $Q
bpd 64 "-d 400" "" $Q
bp 32 "" $Q
stamp "== server, 64 clients"
serve64 "$Q" 30
serve64 "" 30
stamp "== Nsight: one layer's mmdh launches"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
env $Q TS_CUDA_GRAPHS=0 timeout 150 "$ncu" --kernel-name "regex:mmdh" --launch-skip 200 --launch-count 8 \
  --section SpeedOfLight --section LaunchStats \
  "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 -d 96 > $O/ncu.txt 2>&1
grep -E "^  mmdh|Duration|Grid Size|Cluster Size|DRAM Throughput|rror" $O/ncu.txt | head -50
rm -f $V
stamp "== done"
