#!/usr/bin/env bash
# Forty-ninth session, on the warm H100 after gpu-next163 (24 MB of gate / up asked from the
# attention's merge: +1.25% at 64 sequences, +1.0% at the server). ~7 minutes.
# 1. tg128 (one sequence) with and without it, alternated: does one sequence lose?
# 2. bf16 tg128 (synthesised meanwhile): the defaults (GU_SH_EARLY on), GU_SH_EARLY=0,
#    DN16_EARLY=1 (gpu-next159's first round; its op test first).
#   tools/gpu/plans/gpu-next164.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
X="TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2"
stamp "== Q8_0 tg128"
for e in "" "$X" "" "$X"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== fused_moe_shared with DN16_EARLY=1"
op_log 200 2 ops_dn16.txt "" "TS_CUDA_DEFINES=DN16_EARLY=1" fused_moe_shared moe_residual_exact
wait
stamp "== bf16 tg128"
for e in "" "TS_CUDA_DEFINES=GU_SH_EARLY=0" "TS_CUDA_DEFINES=DN16_EARLY=1"; do
  b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
done
stamp "== done"
