#!/usr/bin/env bash
# Fifty-fourth session: the H200's 64-sequence bench at -d 96 read 9,735 (gpu-next176) against
# 9,926-9,946 before the forty-ninth session, while tg128 / 16k / bf16 read as then: so look for a
# default that the H100 sessions (46-51) chose and the H200 does not like. Each setting at
# `--parallel 64 -n 32 -r 2 -d 96`, the defaults first and last; then the best setting (if it
# beats the defaults by 0.8% or more) and the defaults in the server (40 s each). ~6 minutes.
#   tools/gpu/plans/gpu-next179.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
stamp "== 64 sequences at -d 96"
ENVS=("" "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1" "TS_CUDA_XPF=0" "TS_CUDA_DEFINES=RS_EARLY=0"
  "TS_CUDA_XPF=40" "TS_CUDA_FORK_AHEAD=0" "TS_CUDA_ROWS_TAIL=6" "")
for e in "${ENVS[@]}"; do p64_best "$e"; done
serve_best
stamp "== done"
