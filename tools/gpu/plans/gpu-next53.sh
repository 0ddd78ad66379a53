#!/usr/bin/env bash
# Nineteenth session (2026-12-02): the prompt's q and kv_a (matmul_many, one input for both) on
# cuBLAS in f16 too (they stayed on the int8 tiles in gpu-next52: mmq_q8_64 48x8 and 9x8x4,
# ~61 us a layer at pp512). Every op test, the prompt figures, tg128's hash.
#   tools/gpu/plans/gpu-next53.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 200 4 ops_all.txt "NOPE|" ""
wait
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 5
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
