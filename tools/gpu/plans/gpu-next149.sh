#!/usr/bin/env bash
# Forty-fourth session, second call: gpu-next148 had TS_CUDA_ROWS_TAIL=8 at 9,884 against the
# default 16's 9,803 / 9,816 (0: 9,456, 32: 9,726), the same hash. The tail halves swept finer,
# the gate/up and the down apart (ROWS_TAIL_DN), and at 128 sequences.
#   tools/gpu/plans/gpu-next149.sh BIN 2>&1 | tee $OUT/log.txt | tail -80   (~5 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
wait
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL=8 TS_CUDA_ROWS_TAIL=4 TS_CUDA_ROWS_TAIL=6 TS_CUDA_ROWS_TAIL=10 \
  TS_CUDA_ROWS_TAIL=12 "TS_CUDA_ROWS_TAIL=8 TS_CUDA_ROWS_TAIL_DN=16" "TS_CUDA_ROWS_TAIL=16 TS_CUDA_ROWS_TAIL_DN=8" \
  "TS_CUDA_ROWS_TAIL=8 TS_CUDA_ROWS_TAIL_LATER=0" TS_CUDA_ROWS_TAIL=8
stamp "== 128 sequences"
bp 128 "" TS_CUDA_ROWS_TAIL=8
stamp "== done"
