#!/usr/bin/env bash
# Eighteenth session (2026-12-01): the prompt MoE's busy experts on cuBLAS (moe_hybrid, default
# TS_CUDA_MOE_BLAS=128: experts with 128+ pairs take one GEMM a matrix from row-major f16
# copies, the rest the grouped mmfq8 kernels). First its op test (cuBLAS against mmfq8, all
# experts and some), then pp512 / pp2048 against TS_CUDA_MOE_BLAS=0 (the grouped kernels from
# tiled copies, the previous default) twice, thresholds 64 and 256 once, and a profile of pp512.
#   tools/gpu/plans/gpu-next46.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op test: moe_f16_prompt"
op_log 180 1 ops_blas.txt "cuBLAS|" "" moe_f16_prompt
wait
stamp "== prompts"
for r in 1 2; do
  for e in "" "TS_CUDA_MOE_BLAS=0"; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
  done
done
for e in "TS_CUDA_MOE_BLAS=64" "TS_CUDA_MOE_BLAS=256"; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
stamp "== profile pp512"
TS_CUDA_PROFILE=1 timeout 120 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 > $O/prof.txt 2>&1
grep -vE "^\s*$" $O/prof.txt | tail -32
stamp "== done"
