#!/usr/bin/env bash
# Thirty-first session, written after its device time was spent (not yet run), after
# gpu-next99: the rows' marginal cost, 80 and 96 sequences (the server's steps carry ~63 decode
# rows and ~16 prompt rows: bench 64 rows 7.8 ms a step, the server 9.6 ms), and the server
# with 64 clients on the defaults and on S (edit S to what gpu-next99 keeps); between them the
# rows kernel's knockouts (MMQ_ROWS_KO: 1 no activation tile copy, 2 no token list, 4 no
# multiply) with the routing pinned (MOE_PIN_ROUTE=1: each token's experts fixed by its index,
# spread evenly), so that wrong values no longer change the experts' spread and the bytes read.
# The server's metrics now count forwards replayed from a CUDA graph, recorded, and run op by op
# (each batch shape, output count and attention split count has its own recording): the last
# run pads forwards to multiples of 8 rows, fewer shapes.
#   tools/gpu/plans/gpu-next100.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
wait
# gpu-next99 kept DENSE_EARLY (+3.2%) and DENSE_JOBS (+2.0%); SUM4 -0.4%, GLU_EPI -6.3%.
S="TS_CUDA_DENSE_JOBS=1 TS_CUDA_DENSE_EARLY=1"
stamp "== 64 sequences: DENSE_JOBS with DENSE_EARLY"
ab64 2 "" "$S"
stamp "== 32, 48, 80, 96 sequences, pp512"
for p in 32 48 80 96; do for e in "" "$S"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done; done
for e in "" "$S"; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
stamp "== the rows kernel's knockouts with the routing pinned (MOE_PIN_ROUTE: the same spread)"
P="TS_CUDA_DEFINES=MOE_PIN_ROUTE=1"
ab64 1 "$P" "$P,MMQ_ROWS_KO=1" "$P,MMQ_ROWS_KO=2" "$P,MMQ_ROWS_KO=4"
stamp "== server, 64 clients"
serve64 "" 40
serve64 "$S" 40
serve64 "$S" 40 "--row-multiple 8"
rm -f $V
stamp "== done"
