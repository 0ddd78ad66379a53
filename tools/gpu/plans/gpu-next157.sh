#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run; after gpu-next161.sh
# (it synthesises the model when $V is missing). ~9 minutes.
# 64 sequences at -d 96, two rounds in opposite orders: the defaults; each new switch alone
# (CombineNorm, CombineUv, AbsorbMma, DenseMma, APF=1, APF=2); all four paths together, and with
# APF=1. CombineNorm and APF keep the hash 7a3b5e11379cb707; CombineUv, AbsorbMma and DenseMma
# change it (cuBLAS's values in another summation order). Then 128 and 32 sequences.
# Make the winners the defaults (docs/PERF.md, docs/GPU.md's switch table, ARCHITECTURE.md, the
# Path docs), the three new kernels' paths only if their tests passed in gpu-next161.
#   tools/gpu/plans/gpu-next157.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
ALL="TS_CUDA_COMBINE_NORM=1 TS_CUDA_COMBINE_UV=1 TS_CUDA_ABSORB_MMA=1 TS_CUDA_DENSE_MMA=1"
SET=("" "TS_CUDA_COMBINE_NORM=1" "TS_CUDA_COMBINE_UV=1" "TS_CUDA_ABSORB_MMA=1" "TS_CUDA_DENSE_MMA=1" "TS_CUDA_APF=1" \
  "TS_CUDA_APF=2" "$ALL" "$ALL TS_CUDA_APF=1")
stamp "== 64 sequences"
bpd 64 "-d 96" "${SET[@]}"
REV=(); for ((i=${#SET[@]}-1; i>=0; i--)); do REV+=("${SET[$i]}"); done
bpd 64 "-d 96" "${REV[@]}"
stamp "== 128 / 32 sequences"
bp 128 "" "$ALL" "$ALL TS_CUDA_APF=1"
bp 32 "" "$ALL TS_CUDA_APF=1"
stamp "== done"
