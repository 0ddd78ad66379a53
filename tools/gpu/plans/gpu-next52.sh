#!/usr/bin/env bash
# Nineteenth session (2026-12-02): the defaults after gpu-next51: prompt MoEs on mmh_* from the
# f16 copies where they were made (else mmh8_* from Q8_0), dense prompt products on cuBLAS, and
# on a GPU prompts in chunks of 2,048 (`-b`). Every op test, the prompt figures (pp2048 also in
# chunks of 512, the previous default), the decode hashes, the server at 64 clients.
#   tools/gpu/plans/gpu-next52.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 220 4 ops_all.txt "mmh8|" ""
wait
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2 -b 512
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== server"
serve64 "" 15
stamp "== done"
