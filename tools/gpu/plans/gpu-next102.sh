#!/usr/bin/env bash
# Thirty-second session: DenseJobs and DenseEarly are now on by default (gpu-next99/100), and
# TS_CUDA_DENSE128=1 (Path::Dense128) puts the dense int8 products of 65-128-token decode batches
# on 64 x 128 tiles (mmq_q8_128*: the weights read once, not twice, and split K as at 64 tokens;
# gpu-next101's traces had the 80-sequence step spend 2.6 ms in dense products against 0.96 at
# 64). Every op test on the new defaults (dense128_exact among them), then 80 / 96 / 128
# sequences with and without it, the 64-sequence hash on the new defaults, and the server.
#   tools/gpu/plans/gpu-next102.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "dense128|" ""
wait
D="TS_CUDA_DENSE128=1"
stamp "== 80, 96, 128 sequences"
for p in 80 96 128; do for e in "" "$D"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done; done
stamp "== 64 sequences on the new defaults (hash 6bbd3fa953f72f1b)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== server, 64 clients"
serve64 "" 30
serve64 "$D" 30
rm -f $V
stamp "== done"
