#!/usr/bin/env bash
# Twentieth session: the final build (mla_out_q8 with 256 W_o rows a block by default, after
# gpu-next57: tg128 622/614 vs the plain chain's 600/602). Every op test, tg128 both ways,
# tg64 at 16k both ways, pp512, 64 sequences.
#   tools/gpu/plans/gpu-next58.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 150 6 ops_all.txt "NOPE|" ""
wait
stamp "== decode"
for e in "" "TS_CUDA_MLA_OUT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
for e in "" "TS_CUDA_MLA_OUT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
stamp "== done"
