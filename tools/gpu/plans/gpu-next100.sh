#!/usr/bin/env bash
# Thirty-first session, written after its device time was spent (not yet run), after
# gpu-next99: the rows' marginal cost, 80 and 96 sequences (the server's steps carry ~63 decode
# rows and ~16 prompt rows: bench 64 rows 7.8 ms a step, the server 9.6 ms), and the server
# with 64 clients on the defaults and on S (edit S to what gpu-next99 keeps).
#   tools/gpu/plans/gpu-next100.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
wait
S="TS_CUDA_DENSE_JOBS=1 TS_CUDA_SUM4=1"
stamp "== 80, 96 sequences"
for p in 80 96; do b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done
stamp "== server, 64 clients"
serve64 "" 40
serve64 "$S" 40
rm -f $V
stamp "== done"
