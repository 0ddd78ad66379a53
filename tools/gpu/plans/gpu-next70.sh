#!/usr/bin/env bash
# Twenty-fourth session, main: warps a decode gate/up block (TS_CUDA_GU_WARPS=16 or 32: 2 or 1 of
# its 32 rows a warp instead of 4, so a shorter chain of row reads after the wait; the same bits,
# so the hash must hold: tg128 db10d2fd9a926913, 16k efeed109b1480c9a). gpu-next69 found
# bulk L2 prefetch of the MoE's rows slower (GU_RT_PF 661, DN_PF 694, both 650 against 705).
#   tools/gpu/plans/gpu-next70.sh BIN 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_GU_WARPS=16" "TS_CUDA_GU_WARPS=32"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_GU_WARPS=16"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== done"
