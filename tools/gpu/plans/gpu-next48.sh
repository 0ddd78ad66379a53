#!/usr/bin/env bash
# Eighteenth session (2026-12-01), after gpu-next46/47 (busy routed experts on cuBLAS: one host
# sync a layer, slower): the shared FFN alone on cuBLAS (shared_blas, default; TS_CUDA_MOE_BLAS=0
# for the previous path), no sync, no f16 copies of the routed experts. Every op test, then
# pp512 / pp2048 both ways, tg128 and 64 sequences with their hashes.
#   tools/gpu/plans/gpu-next48.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 200 4 ops_all.txt "shared FFN on cuBLAS|" ""
wait
stamp "== prompts"
for e in "" "TS_CUDA_MOE_BLAS=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
done
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
ab64 1 ""
stamp "== done"
