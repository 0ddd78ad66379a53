#!/usr/bin/env bash
# Sixty-ninth session: the output head's launch in whole waves. Path::HeadMmh (TS_CUDA_HEAD_MMH=1,
# off) ran V2-Lite's head as 400 tiles of 256 rows at one block an SM, 4 waves on 132 SMs for
# 3.03 waves of work; it now picks tiles of 200 rows there (mmh8_dn200, 512 tiles: 3.88 waves;
# TS_CUDA_HEAD_BN=256 the old tiles); and with TS_CUDA_DEFINES=MMH_HELP=1 the idle second
# multiplying warpgroup of a tile of <= 64 pairs turns rows into f16 too (7 warps, not 3). On an
# H200 first issue 6's figure (the server with the defaults) and tg128; on any card the op
# tests head_mmh (both tile sizes) and moe_f16_prompt (mmh8_*), each without and with
# MMH_HELP, the head launch's isolated time under Nsight Compute (tile sizes x MMH_HELP), then
# 64 sequences at -d 96 alternating, and with time left the server with the best of them.
# ~5 minutes on an H100 with the file made, ~7 on an H200.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next222.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
stamp "== op tests"
op_log 100 2 ops.txt "HeadMmh|" "" head_mmh moe_f16_prompt
stamp "== op tests, MMH_HELP=1"
op_log 100 2 ops-help.txt "HeadMmh|" "TS_CUDA_DEFINES=MMH_HELP=1" head_mmh moe_f16_prompt
wait
stamp "== the head launch alone (Nsight Compute, graphs off, 64 sequences)"
for e in "TS_CUDA_HEAD_BN=256" "TS_CUDA_HEAD_BN=200" "TS_CUDA_HEAD_BN=200 TS_CUDA_DEFINES=MMH_HELP=1"; do
  young 330 && ncu_head "$B" $e
done
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  [ $r = 2 ] && ! young 450 && break
  p64_best ""
  p64_best "TS_CUDA_HEAD_MMH=1"
  p64_best "TS_CUDA_HEAD_MMH=1 TS_CUDA_DEFINES=MMH_HELP=1"
  p64_best "TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_BN=256"
done
if young 420; then serve_best; fi
stamp "== done"
