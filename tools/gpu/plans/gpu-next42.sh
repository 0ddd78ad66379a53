#!/usr/bin/env bash
# Seventeenth session (2026-12-01): where the wgmma prompt MoE's time goes (MMFW_KO knockouts:
# 1 no wgmma, 2 no A conversion, 3 no stage loads past the first; wrong results on purpose),
# pp512 each, against the unchanged kernel; then the server at 64 clients (defaults).
#   tools/gpu/plans/gpu-next42.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== knockouts"
for d in 0 1 2 3; do
  b "TS_CUDA_F16=0 TS_CUDA_MMF_W=1 TS_CUDA_DEFINES=MMFW_KO=$d" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 2
done
b "TS_CUDA_F16=0" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 2
stamp "== server"
serve64 "" 15
stamp "== done"
