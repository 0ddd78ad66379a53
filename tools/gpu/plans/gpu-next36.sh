#!/usr/bin/env bash
# Written in the fifteenth session (2026-12-01, no device time that session), NOT yet run: the
# second call after gpu-next35.sh (same machine if still warm: the model is synthesised only when
# missing). Each switch against the defaults in the same call:
#  - TS_CUDA_MOE_RGQ=1 and TS_CUDA_MMQ_PAIR=1 one at a time (routing, grouping and quantisation in
#    one launch; matmul_many's two Q8_0 jobs in one launch), 128 sequences and prompts with both;
#  - the bulk-fed experts at 128 sequences (1x4);
#  - mmq_q8_64 at two blocks an SM (TS_CUDA_DEFINES=MMQ64_MINB=2: no spill);
#  - single-stream decode with TS_CUDA_DEFINES=MOE_DOWN_EARLY=1 (the decode MoE's down kernel
#    loads its first weights before its wait, the gate/up kernel triggering it after its own
#    wait for the routing), and TS_CUDA_MOE_FUSED=1 (moe_fused_q8: the decode MoE's routing,
#    gate/up and down in one persistent launch around one grid barrier; fused_moe_shared in
#    gpu-next35's ops run checks its bits): the same hash as the default, twice each, alternating;
#  - then (a third call, ~2 minutes, once the winners are known) the server at 64 clients:
#    `serve64 "" 15; serve64 "WINNERS" 15` (lib.sh).
# The one-launch MoE and the bulk-fed kernels run only where gpu-next35's isolated check of
# them passed: FUSED=1 and BULK=1 in the environment say so.
#   [FUSED=1] [BULK=1] tools/gpu/plans/gpu-next36.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== decode"
for r in 1 2; do
  for e in "" "TS_CUDA_DEFINES=MOE_DOWN_EARLY=1" ${FUSED:+"TS_CUDA_MOE_FUSED=1"}; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== 64 sequences"
ab64 1 "" "TS_CUDA_MOE_RGQ=1" "TS_CUDA_MMQ_PAIR=1" "TS_CUDA_DEFINES=MMQ64_MINB=2"
stamp "== 128 sequences"
for e in "" "TS_CUDA_MOE_RGQ=1 TS_CUDA_MMQ_PAIR=1" ${BULK:+"TS_CUDA_ROWS_BULK=1x4"}; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash
done
stamp "== prompts"
for e in "" "TS_CUDA_MOE_RGQ=1 TS_CUDA_MMQ_PAIR=1" "TS_CUDA_DEFINES=MMQ64_MINB=2" "TS_CUDA_MMF_Q8=1 TS_CUDA_F16=0 TS_CUDA_MMF=s3"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
done
# A second round of the 64-sequence winners of gpu-next35 (one round there).
[ -n "${BULK:-}" ] && ab64 1 "" "TS_CUDA_ROWS_BULK=1x4"
stamp "== done"
