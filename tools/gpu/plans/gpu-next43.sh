#!/usr/bin/env bash
# Seventeenth session (2026-12-01): the f16 prompt kernels' copy pointers advanced in place
# (gpu-next42's knockouts: without the stage loads, or without the A conversion, the wgmma
# kernel ran pp512 at 42,101 / 36,830 against 21,433; Nsight's SASS had the stage's first
# ldmatrix waiting a memory latency on a register that was the address of a copy just issued).
# The op test, then pp512 on the copies (default), mmfq8 (TS_CUDA_F16=0) and mmfw.
#   tools/gpu/plans/gpu-next43.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
timeout 120 "$OPS" --test-threads 1 moe_f16_prompt > $O/ops_w.txt 2>&1; echo "op test exit $?"
grep -E "FAIL|test result|panicked" $O/ops_w.txt | head -8
wait
for e in "" "TS_CUDA_F16=0" "TS_CUDA_F16=0 TS_CUDA_MMF_W=1"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 2
done
b "TS_CUDA_F16=0 TS_CUDA_MMF_W=1" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
stamp "== done"
