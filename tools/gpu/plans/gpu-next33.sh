#!/usr/bin/env bash
# Thirteenth session (2026-12-01): the f16 copies in 64 x 64 tiles as the only layout (gpu-next32
# measured them +1.0% / +0.7% over row-major). moe_f16_prompt and fused_moe_shared, then pp512 /
# pp2048 (int8 in gpu-next32: 17,963 / 16,811; tiled copies there 19,522 / 17,874). ~2 minutes.
#   tools/gpu/plans/gpu-next33.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 80 2 moe_f16_prompt fused_moe_shared
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
