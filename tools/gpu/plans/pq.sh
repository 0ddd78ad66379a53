#!/usr/bin/env bash
# norm_q8 + gemv_q8_multi_pq_1 (the decode norm quantises the row once for q/kv_a) against
# TS_CUDA_PQ=0 (every gemv_q8_multi block quantises it), one binary, one device call:
#   tools/gpu/plans/pq.sh BIN OPS_TEST
# Meant bit-exact: both tg128 hashes must be equal.
set -u
B=$1; OPS=$2
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
b() { local e=$1; shift; echo "-- ${e:-default} $*"; env $e "$@" 2>&1 | grep -E "^\| .*(pp|tg)|hash|rror" | sed -E 's/.*\| (pp|tg)/\1/'; }
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
"$OPS" --test-threads 2 > ${OUT:-/tmp}/ops.txt 2>&1
grep -E "FAIL|test result|panicked|norm_matmul_many:" ${OUT:-/tmp}/ops.txt | head -20
wait
for r in 1 2; do
  b TS_CUDA_PQ=0 "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
