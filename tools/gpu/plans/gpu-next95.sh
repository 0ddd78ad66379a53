#!/usr/bin/env bash
# Thirtieth session, written after its device time was spent (not yet run): the server and
# the prompt figures on main's new defaults (gpu-next92/93: shared chunks first, split K down
# to one group), with TS_CUDA_NORM_Q8 and TS_CUDA_SUM_Q8 (edit S below to what gpu-next94 keeps).
#   tools/gpu/plans/gpu-next95.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
S="TS_CUDA_NORM_Q8=1 TS_CUDA_SUM_Q8=1"
stamp "== server, 64 clients"
serve64 "" 60
serve64 "$S" 60
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
stamp "== 128 sequences"
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 128 -r 2 --hash
rm -f $V
stamp "== done"
