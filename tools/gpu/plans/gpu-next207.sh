#!/usr/bin/env bash
# For the sixty-first session (~8 minutes on an H200, ~4 elsewhere), any card. On an H200, the
# figures issues 5 and 6 name, with the sixtieth session's defaults (f16 partial rows, one token
# on the tensor-core split from 192): the server (64 clients, 45 s), tg128, tg64 at 16k,
# pp2048, then bf16 tg128 with time left. On another card: gpu-next206.sh (the op tests that
# follow the new threshold, and where mla_out_q8's own attention should end).
#   OPS=.dev/ops tools/gpu/plans/gpu-next207.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/gpu-next206.sh" "$B"
fi
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
issue6_server
stamp "== issue 5's figures (Q8_0)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
if young 330; then
  stamp "== bf16 tg128"
  "$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1
  b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
fi
stamp "== done"
