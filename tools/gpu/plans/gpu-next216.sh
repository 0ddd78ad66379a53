#!/usr/bin/env bash
# For the sixty-second session's last device time (~3 minutes), any card: how evenly the
# one-token gate/up and down launches load the SMs (GPU.md, sixty-second session: 352 gate/up
# blocks at 3 an SM leave 44 SMs with 2). Nsight Compute on the 31st launch of each (graphs off,
# so the launch runs alone): its time, the SMs' active cycles (min / avg / max) and blocks (min /
# max), registers and the occupancy limit, and DRAM throughput.
#   OPS=.dev/ops tools/gpu/plans/gpu-next216.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
q8_ready
stamp "== synthesised"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for k in moe_gateup_sh_q8q moe_down_sh_q8; do
  TS_CUDA_GRAPHS=0 timeout 100 "$ncu" --kernel-name "regex:^$k\$" --launch-skip 30 --launch-count 1 \
    --metrics gpu__time_duration.sum,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__ctas_launched.min,sm__ctas_launched.max,sm__ctas_launched.sum,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active \
    "$B" bench --backend cuda -m $V -p 0 -n 8 -r 1 2>&1 | grep -E "$k|duration|cycles_active|ctas_launched|registers|occupancy|dram__|warps_active|ERR|rror" | head -20
  stamp "== $k"
done
stamp "== done"
