#!/usr/bin/env bash
# Seventeenth session (2026-12-01): what the prompt MoE straight from Q8_0 waits on, on mma.sync
# (mmfq8_*) and on wgmma (mmfw_*, TS_CUDA_MMF_W=1; 3% slower in gpu-next40): the per-kernel
# profile of a 512-token prompt each way (TS_CUDA_PROFILE=1, eager), then Nsight Compute on
# two gate-up launches and two down launches each, and the SASS source view of one mmfw_gu_s4.
#   tools/gpu/plans/ncu-mmfw.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
for e in "TS_CUDA_F16=0" "TS_CUDA_F16=0 TS_CUDA_MMF_W=1"; do
  stamp "== profile $e"
  env $e TS_CUDA_PROFILE=1 timeout 200 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 2>&1 | grep -A 16 "cuda profile" | head -18
done
export TS_CUDA_F16=0
stamp "== ncu mmfq8"
prof '^mmfq8_(gu_s4|256s4)$' 2 4 mmfq8-pp512 -p 512 -n 0 -r 1 2>&1 | head -30
export TS_CUDA_MMF_W=1
stamp "== ncu mmfw"
prof '^mmfw_(gu_s4|256s4)$' 2 4 mmfw-pp512 -p 512 -n 0 -r 1 2>&1 | head -30
stamp "== done"
