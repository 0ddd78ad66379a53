#!/usr/bin/env bash
# Isolated duration of every kernel of a few decode tokens (Nsight Compute, one metric, so one
# pass per kernel): where a token's time goes kernel by kernel, without the launch overlap that
# programmatic dependent launch and graphs give (see docs/GPU.md).
# Usage (on the GPU machine, from the repo root): tools/gpu/ktime.sh BIN OUT.csv [bench args...]
# Default bench args: -p 0 -n 3 -r 1 (the first token's kernels are skipped via NCU_SKIP).
set -u
T=$1; OUT=$2; shift 2
ARGS=${*:--p 0 -n 3 -r 1}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
V=${V:-/tmp/v2lite-q8_0.gguf}
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
[ -f $V ] || "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
TS_CUDA_GRAPHS=0 "$NCU" --launch-skip ${NCU_SKIP:-0} --launch-count ${NCU_COUNT:-100000} --metrics gpu__time_duration.sum \
  --csv --page raw "$T" bench --backend cuda -m $V $ARGS > "$OUT" 2>/tmp/ktime.err
tail -3 /tmp/ktime.err
wc -l "$OUT"
