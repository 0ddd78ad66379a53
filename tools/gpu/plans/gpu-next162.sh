#!/usr/bin/env bash
# Forty-eighth session: on an H200, what gpu-next161 measured on an H100 (PERF.md, "The
# forty-sixth session's paths on an H100") and what its limit cut. Supersedes gpu-next157
# (never run; removed). ~7.5 minutes.
# 1. 64 sequences -d 96: the switches that were slower on the H100 (CombineNorm -4.9%, AbsorbMma
#    -1.5%, CombineUv -0.9%, APF=1 -0.3%) and APF's modes 2 and 3, between two default runs.
#    Remove the losers (Path, kernel, test, docs) if the H200 agrees. DenseMma is left out
#    (-3.5% on the H100, the most after CombineNorm; remove it).
# 2. tg128 and tg64 at 16k with and without GU_SH_EARLY (+0.1% at tg128 on the H100; hashes
#    db10d2fd9a926913 and efeed109b1480c9a).
# Then gpu-next158 (the server, the prefetch knobs), 159 (bf16), 160 (DN_PF).
#   tools/gpu/plans/gpu-next162.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
stamp "== 64 sequences"
bpd 64 "-d 96" "" "TS_CUDA_COMBINE_NORM=1" "TS_CUDA_COMBINE_UV=1" "TS_CUDA_ABSORB_MMA=1" "TS_CUDA_APF=1" \
  "TS_CUDA_APF=2" "TS_CUDA_APF=3" ""
OLD="TS_CUDA_DEFINES=GU_SH_EARLY=0"
stamp "== tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== tg64 at 16k"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
