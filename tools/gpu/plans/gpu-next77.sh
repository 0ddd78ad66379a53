#!/usr/bin/env bash
# Twenty-seventh session, main: where the 16k token's split attention goes. gpu-next76's trace at
# depth 16,384 put mla_split_tc_h at 23.3 us a layer on the critical path (18.9 MB of keys:
# 0.81 TB/s), 30% of the token. Nsight Compute on it alone (all lines of the speed-of-light,
# occupancy, warp-state and memory sections), then tg64 @16k at 66 / 132 / 264 splits and ring
# depths 2 / 4 (the tuning predates the merge's move into mla_out_q8).
#   tools/gpu/plans/gpu-next77.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -150   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== ncu mla_split_tc_h at 16k"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
TS_CUDA_GRAPHS=0 timeout 240 "$NCU" --kernel-name "regex:mla_split" --launch-skip 30 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section SchedulerStats --section ComputeWorkloadAnalysis \
  "$B" bench --backend cuda -m $V -p 0 -n 4 -d 16384 -r 1 2>&1 | grep -vE "^\s*$|----|^    (INF|OPT|WRN)|^          " | head -150
stamp "== tg64 @16k: splits and ring depth"
for e in "" "TS_CUDA_MLA_SPLITS=66" "TS_CUDA_MLA_SPLITS=264" "TS_CUDA_MS_NB=2" "TS_CUDA_MS_NB=4" ""; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
rm -f $V
stamp "== done"
