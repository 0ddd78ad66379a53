#!/usr/bin/env bash
# Nsight Compute on chosen kernels of a synthetic V2-Lite run (see docs/GPU.md): memory throughput,
# occupancy and warp stall reasons per kernel.
# Usage (on the GPU machine, from the repo root): tools/gpu/ncu.sh BIN 'regex' [bench args...]
# e.g. tools/gpu/ncu.sh .dev/turbospark 'moe_gateup_sh_q8|gemv_q8_1' -p 0 -n 8 -r 1
# (NCU_MODEL=FILE: another model than the synthetic Q8_0 V2-Lite, which is made if missing.)
set -u
T=${1:-.dev/turbospark}; RE=${2:-moe_gateup_sh_q8}; shift 2
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
V=${NCU_MODEL:-/tmp/v2lite-q8_0.gguf}
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
[ -f $V ] || "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
TS_CUDA_GRAPHS=0 "$NCU" --kernel-name "regex:$RE" --launch-skip ${NCU_SKIP:-40} --launch-count ${NCU_COUNT:-6} \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis ${NCU_EXTRA:-} \
  "$T" bench --backend cuda -m $V "$@" 2>&1 | grep -vE "^\s*$|----" | grep -E "^  [a-z_0-9]+|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Issued Ipc|Compute \(SM\)|L2 Hit|L1/TEX Hit|Grid Size|Waves Per SM|Issue Slots|SM Busy|Executed Ipc|Executed Instructions|One or More Eligible|ERR|error|==PROF==|WARN" | head -${NCU_LINES:-200}
