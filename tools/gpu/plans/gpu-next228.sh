#!/usr/bin/env bash
# For a session after the seventieth (~5 minutes on any Hopper card): what holds the mmh8
# pipeline. The output head on mmh8 read 1.54 TB/s even from its tiled copy (one bulk copy a
# stage; seventieth session), so the copies' shape was not all of it. Nsight's stall reasons for
# the head launch (`mmh8_dn200`, 64 sequences, TS_CUDA_HEAD_MMH=1) and for the prompt MoE's
# `mmh8_gu` / `mmh8_dn` (TS_CUDA_MMH=q8, the H100's default path), with MMH_HELP 1 and 0.
# On an H200 issue 6's server and tg128 come first.
#   tools/gpu/plans/gpu-next228.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
wait
stamp "== the head launch (64 sequences)"
TS_CUDA_HEAD_MMH=1 ncu_stalls mmh8_dn200 -p 0 -n 40 --parallel 64 -r 1 -d 96
TS_CUDA_HEAD_MMH=1 TS_CUDA_DEFINES=MMH_HELP=0 ncu_stalls mmh8_dn200 -p 0 -n 40 --parallel 64 -r 1 -d 96
stamp "== the prompt MoE on mmh8 (pp2048)"
TS_CUDA_MMH=q8 ncu_stalls "mmh8_gu" -p 2048 -n 0 -r 1
TS_CUDA_MMH=q8 ncu_stalls "mmh8_dn" -p 2048 -n 0 -r 1
stamp "== done"
