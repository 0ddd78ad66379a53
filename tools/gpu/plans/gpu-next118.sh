#!/usr/bin/env bash
# Thirty-seventh session, second call. The batch split rule (tc_batch_splits: one block an SM
# while a split holds <= 128 keys of the longest context, else two; TS_CUDA_MLA_KPS_B=0 is the
# rule before) at 64 sequences, -d 96 and -d 400, and in the server; then Nsight on one layer's
# two grouped rows launches (occupancy over the launch: how much of it is a ragged tail).
#   tools/gpu/plans/gpu-next118.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== mla tests"
op_log 120 3 ops.txt "" "" mla_
wait
stamp "== 64 sequences"
bpd 64 "-d 96" "" "TS_CUDA_MLA_KPS_B=0" ""
bpd 64 "-d 400" ""
stamp "== server, 64 clients"
serve64 "" 30
serve64 "TS_CUDA_MLA_KPS_B=0" 30
stamp "== Nsight: the rows launches of one layer"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
TS_CUDA_GRAPHS=0 timeout 150 "$ncu" --kernel-name "regex:mmq_q8_rows" --launch-skip 40 --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  --metrics sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,gpc__cycles_elapsed.max,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
  "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 -d 96 > $O/ncu.txt 2>&1
grep -E "mmq_q8_rows|Duration|Elapsed Cycles|Occupancy|Block Limit|Waves|Grid Size|Registers|cycles_active|elapsed|warps_active|dram__|inst_executed|issue_active|Memory Throughput|DRAM|rror" $O/ncu.txt | head -70
rm -f $V
stamp "== done"
