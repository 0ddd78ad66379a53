#!/usr/bin/env bash
# Seventeenth session (2026-12-01): the wgmma prompt MoE with tiles of up to 128 tokens
# (mmfw_256s3 / mmfw_gu_s3; a tile of 64 or fewer at half width). gpu-next40: the 64-token
# mmfw ran correctly and 3% behind mmfq8; Nsight (ncu-mmfw.sh) had both waiting on each stage's
# data, the hot experts' weights re-read from L2 by every 64-token tile. Its op test, then
# pp512 / pp2048 on mmfq8 (TS_CUDA_F16=0) and mmfw, twice, interleaved.
#   tools/gpu/plans/gpu-next41.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== wgmma op test"
timeout 240 "$OPS" --nocapture --test-threads 1 moe_f16_prompt > $O/ops_w.txt 2>&1; echo "exit $?"
grep -E "mmfw|FAIL|test result|panicked|skipped" $O/ops_w.txt | head -16
wait
stamp "== prompts"
for r in 1 2; do
  for e in "TS_CUDA_F16=0" "TS_CUDA_F16=0 TS_CUDA_MMF_W=1"; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
  done
done
stamp "== done"
