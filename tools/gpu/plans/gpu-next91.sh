#!/usr/bin/env bash
# Thirtieth session: what holds the 64-sequence MoE (mmq_q8_rows, 62% of the step, ~2.9 TB/s)?
# Three earlier answers were "not bytes in flight" and "not DRAM page locality"; this call asks
# the card three more questions, no code change:
# 1. bwprobe's rk probes (written in the fifteenth session, their results lost): the kernel's
#    exact load stream with no multiply, with ~100 multiply instructions a group, and as one
#    persistent wave (the ragged last wave removed); at 5, 8, 16 blocks an SM.
# 2. How the bench's 64 sequences spread over the experts (TS_CUDA_MOE_COUNTS=1): an expert
#    with more than 16 (token, slot) pairs takes two tiles, and its later tiles run after every
#    first tile, when its weights have left the L2 (a second read from DRAM).
# 3. Nsight on one gate/up and one down launch: DRAM bytes read against the weights' bytes,
#    L2 traffic, duration.
#   tools/gpu/plans/gpu-next91.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
stamp "== bwprobe rk"
NVCC=/usr/local/cuda/bin/nvcc
$NVCC -O3 -arch=sm_90 -o /tmp/bwprobe "$(dirname "$0")/../bwprobe.cu" 2>&1 | grep -v Warn | head -5
/tmp/bwprobe stream rk 2>&1 | head -40
wait
stamp "== expert spread, 64 sequences"
TS_CUDA_GRAPHS=0 TS_CUDA_MOE_COUNTS=1 timeout 120 "$B" bench --backend cuda -m $V -p 0 -n 3 --parallel 64 -r 1 2>&1 | grep "moe counts" | tail -30
stamp "== Nsight, gate/up and down"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
TS_CUDA_GRAPHS=0 timeout 150 "$ncu" --kernel-name "regex:mmq_q8_rows" --launch-skip 40 --launch-count 2 \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__grid_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem \
  "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 2>&1 | grep -E "mmq_q8_rows|duration|bytes|throughput|hit_rate|warps_active|inst_executed|grid_size|occupancy|rror" | head -40
rm -f $V
stamp "== done"
