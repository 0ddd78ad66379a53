#!/usr/bin/env bash
# For the fifty-eighth session (~3 minutes with the file made), any card: Nsight Compute on the
# one-token split kernel at 16k (mla_split_tc_he, 14.9 us a layer in the trace for 18.9 MB of
# keys: 1.3 TB/s; neither halving its tile chain, SplitG2, nor issuing its copies earlier moved
# it): the stall reasons per issued instruction and the speed-of-light section, with Nsight's
# defaults (locked clocks, caches flushed) and with the clocks and caches as they run.
#   tools/gpu/plans/gpu-next197.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -80
set -u
B=$1
source "$(dirname "$0")/lib.sh"
q8_ready
stamp "== ncu, defaults"
ncu_stalls mla_split_tc_he -p 0 -n 4 -d 16384 -r 1
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
stamp "== ncu, clocks and caches as they run"
TS_CUDA_GRAPHS=0 timeout 150 "$ncu" --clock-control none --cache-control none --kernel-name "regex:mla_split_tc_he|mla_out_q8" \
  --launch-skip 60 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg,dram__bytes_read.sum" \
  "$B" bench --backend cuda -m $V -p 0 -n 4 -d 16384 -r 1 2>&1 | grep -E "mla_|Duration|Elapsed|Throughput|stalled|inst_executed|cycles_active|dram__|Achieved|Theoretical Occ|Block Limit|ERR|rror" | grep -vE " 0$| 0\.0?0?$" | head -80
stamp "== done"
