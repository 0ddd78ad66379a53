#!/usr/bin/env bash
# Where a decode-size dense product's ~10 us go (written in the fourteenth session, not yet run):
# Nsight Compute's full set on six consecutive launches (q 48 x 6, kv_a 9 x 8, ...) of
# mmq_q8_64 in the 64-sequence step: launch and occupancy statistics, the scheduler's eligible
# warps, warp states, memory workload (DRAM and L2 bytes and throughput) and the source view. The
# trace has them at ~10 us after their input is ready for 1.5-7 MB; a stream would take 0.4-1.8.
# Reports under $OUT (open with ncu-ui, or `ncu --import X.ncu-rep --page details`).
#   tools/gpu/plans/ncu-dense.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
# Six consecutive launches of the step (q, kv_a, the two per-head products, o, and the next q).
TS_CUDA_GRAPHS=0 timeout 300 "$NCU" --kernel-name 'regex:^mmq_q8_64$' --launch-skip 150 --launch-count 6 \
  --set full --import-source yes -o $O/dense64 -f \
  "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 >/dev/null 2>&1 || echo "ncu failed"
"$NCU" --import $O/dense64.ncu-rep --page details 2>/dev/null |
  grep -E "mmq_q8_64|Grid Size|Duration|DRAM Throughput|Achieved Occupancy|Eligible Warps|Issued Warp|No Eligible|Registers Per|Waves Per SM|L2 Hit Rate|Theoretical Occ"
