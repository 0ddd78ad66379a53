#!/usr/bin/env bash
# Written in the thirty-eighth session after its device time was spent; not yet run.
# The tail halves' count per launch: TS_CUDA_ROWS_TAIL sets the gate/up pair's (22 blocks a
# tile) and, unless TS_CUDA_ROWS_TAIL_DN is set, the down's (16 blocks a tile). gpu-next123/124
# swept one count for both (12 / 16 / 20 within 0.3%). If the best is a number of blocks, the
# down wants ~22 tiles where the gate/up wants ~16. The same bits whatever the counts.
# 1. 64 sequences at -d 96: the default (16 / 16); DN 8, 22, 28; the gate/up's 12 and 22 with
#    DN 16; the default again. 2. The server with the best (edit S) and the default.
#   tools/gpu/plans/gpu-next127.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
S="TS_CUDA_ROWS_TAIL_DN=22"
q8_bg
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL_DN=8 TS_CUDA_ROWS_TAIL_DN=22 TS_CUDA_ROWS_TAIL_DN=28 \
  "TS_CUDA_ROWS_TAIL=12 TS_CUDA_ROWS_TAIL_DN=16" "TS_CUDA_ROWS_TAIL=22 TS_CUDA_ROWS_TAIL_DN=16" ""
stamp "== server, 64 clients"
serve64 "$S" 30
serve64 "" 30
rm -f $V
stamp "== done"
