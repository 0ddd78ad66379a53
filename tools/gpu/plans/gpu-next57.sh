#!/usr/bin/env bash
# Twentieth session: gpu-next56 with add_rms_norm_parts on 1,024 threads, every load issued
# before any is used (at 256 threads it took 16 us a layer, the trace said). The op test of
# mla_attention_out, tg128 (plain chain vs 128 vs 256 W_o rows a block), tg64 at 16k, traces
# of both row counts.
#   tools/gpu/plans/gpu-next57.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 100 4 ops.txt "mla_attention_out: .*(pos=(0|130|3000)|rows=96)|" "" mla_attention_out
wait
stamp "== tg128"
for r in 1 2; do
  for e in "TS_CUDA_MLA_OUT=0" "" "TS_CUDA_MLA_OUT=256"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k"
for e in "TS_CUDA_MLA_OUT=0" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== traces"
for e in "TS_CUDA_MLA_OUT=128" "TS_CUDA_MLA_OUT=256"; do
  echo "-- trace $e"
  env $e TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 120 "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 >/dev/null 2>&1
  python3 tools/gpu/trace.py $O/tr.csv 16 | head -16; rm -f $O/tr.csv
done
stamp "== done"
