#!/usr/bin/env bash
# Nineteenth session (2026-12-02): the benchmark's prompts spread over all 64 experts (~48 pairs
# each, gpu-next50), so the prompt MoE streams every expert's weights: mmh8_* (kernels/mmh.cu)
# reads them as Q8_0 and makes the f16 tiles in shared memory (half the bytes of the f16
# copies, no copies). Dense Q8_0 prompt products on cuBLAS in f16 (TS_CUDA_DENSE_BLAS). Every op
# test first, then prompts under each setting, pp2048 in one 2,048-token chunk (-b 2048), the
# decode hashes (must not move), and where a pp512 goes.
#   tools/gpu/plans/gpu-next51.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 220 4 ops_all.txt "mmh|" ""
wait
stamp "== prompts"
for e in "" "TS_CUDA_MMH=f16" "TS_CUDA_DENSE_BLAS=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
done
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2 -b 2048
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== profile pp512"
TS_CUDA_PROFILE=1 timeout 120 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 > $O/prof.txt 2>&1
grep -vE "^\s*$" $O/prof.txt | grep -A 30 "cuda profile"
stamp "== done"
