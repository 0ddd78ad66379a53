#!/usr/bin/env bash
# Fortieth session: why mmdh_<NT>_<CS> (Path::DenseQ8H) loses. gpu-next133 measured it at 8,770
# against cuBLAS's 9,349 (64 sequences, -d 96): q+kv_a's mmdh_8_8 19.6 us at 9% of DRAM, W_uv's
# mmdh_8_4 8.9 us, W_uk's mmdh_8_1 5.9 us. Nsight's full set on one launch of each, and on the
# first nvjet (cuBLAS) launches of the default path, for stall reasons and the memory chart.
#   tools/gpu/plans/gpu-next134.sh BIN 2>&1 | tee $OUT/log.txt | tail -150   (~4 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
stamp "== Nsight full: mmdh"
TS_CUDA_DENSE_Q8H=1 TS_CUDA_GRAPHS=0 timeout 200 "$ncu" --kernel-name "regex:mmdh" --launch-skip 200 --launch-count 4 \
  --set full "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 -d 96 > $O/ncu_mmdh.txt 2>&1
stamp "== Nsight full: nvjet"
TS_CUDA_GRAPHS=0 timeout 200 "$ncu" --kernel-name "regex:nvjet" --launch-skip 200 --launch-count 5 \
  --set full "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 -d 96 > $O/ncu_blas.txt 2>&1
grep -E "^  [a-z]|Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|DRAM Throughput" $O/ncu_mmdh.txt $O/ncu_blas.txt | head -80
rm -f $V
stamp "== done"
