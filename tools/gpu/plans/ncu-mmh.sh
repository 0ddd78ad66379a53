#!/usr/bin/env bash
# Nineteenth session (2026-12-02): what holds mmh_gu / mmh_dn (kernels/mmh.cu, ~210 TFLOP/s at
# pp512 where cuBLAS runs the same shapes at ~470): Nsight Compute on two launches of each and
# on cuBLAS's GEMMs of the shared FFN in the same prompt (speed of light, memory, warp states).
#   tools/gpu/plans/ncu-mmh.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== ncu"
TS_CUDA_GRAPHS=0 timeout 300 "$NCU" --clock-control none --kernel-name "regex:${NCU_RE:-^mmh_|gemm|nvjet|xmma}" \
  --launch-skip ${NCU_SKIP:-6} --launch-count ${NCU_COUNT:-8} \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section Occupancy \
  --metrics lts__t_bytes.sum,dram__bytes_read.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read.sum \
  "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 > $O/ncu.txt 2>&1
grep -vE "^\s*$|----" $O/ncu.txt | grep -E "^  [a-zA-Z_0-9]+|Duration|Throughput|L2 Hit|Grid Size|Block Size|Cluster|Registers|Shared Memory Config|Waves Per SM|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issued Ipc|lts__|dram__|sm__pipe|ERR|error|==PROF==|WARN" | head -${NCU_LINES:-240}
stamp "== done"
