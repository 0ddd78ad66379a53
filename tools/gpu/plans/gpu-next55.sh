#!/usr/bin/env bash
# Twentieth session (2026-12-02): the MLA decode's output side in one kernel (mla_out_q8: the
# merge of the context splits, W_uv and W_o; add_rms_norm_parts adds the heads' rows). Every op
# test (also confirms the nineteenth session's last, unrun review mends), then tg128 with the
# plain chain (TS_CUDA_MLA_OUT=0) against 256 and 128 W_o rows a block, interleaved, with
# hashes; tg64 at 16k both ways; pp512 (prompts take the plain chain).
#   tools/gpu/plans/gpu-next55.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== every op test"
op_log 170 6 ops_all.txt "mla_attention_out|" ""
wait
stamp "== tg128"
for r in 1 2; do
  for e in "TS_CUDA_MLA_OUT=0" "" "TS_CUDA_MLA_OUT=128"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k"
for e in "TS_CUDA_MLA_OUT=0" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== prompts"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
stamp "== done"
