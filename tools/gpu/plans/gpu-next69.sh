#!/usr/bin/env bash
# Twenty-fourth session, main: the decode MoE's weight rows asked into L2 in bulk before the warps
# read them row by row (measurement defines): GU_RT_PF=1 (each routed gate/up block, once its
# expert is known after the wait: its 32 rows of both matrices) and DN_PF=1 (each down block,
# before its wait: its rows of every slot). Prefetches only: the same bits, so the hash must
# hold (tg128 db10d2fd9a926913). gpu-next68 found TS_CUDA_PRE_SHARED=1 slower (677 against 705:
# the gate/up's time did not fall with two slots fewer, the routing launch grew by 2 us).
#   tools/gpu/plans/gpu-next69.sh BIN 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_DEFINES=GU_RT_PF=1" "TS_CUDA_DEFINES=DN_PF=1" "TS_CUDA_DEFINES=GU_RT_PF=1,DN_PF=1"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== trace GU_RT_PF=1,DN_PF=1"
TS_CUDA_DEFINES=GU_RT_PF=1,DN_PF=1 trace_tg 8
stamp "== done"
