#!/usr/bin/env bash
# RUN (twelfth session): PF=2 7,567/7,580, 4 7,274/7,273, 8 6,657/6,654 vs 7,635/7,660; 128 seq
# 12,891 vs 13,367. The define was removed. Server 5,617 tok/s (1,942 steps of 76.1 tokens).
# Twelfth session (2026-11-30): L2 bulk prefetch in the grouped rows kernel
# (TS_CUDA_DEFINES=MMQ_ROWS_PF=P: each warp keeps P groups of its tiled weights past its
# register buffers on their way into L2; no registers, the same bits), after the bulk-fed
# kernel (gpu-next22) lost for want of consumer warps. Then the server at 64 clients with the
# defaults (the first server figure after mla_prefill_ha and the shared-space ldmatrix).
#   tools/gpu/plans/gpu-next23.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
ab64 2 "" TS_CUDA_DEFINES=MMQ_ROWS_PF=2 TS_CUDA_DEFINES=MMQ_ROWS_PF=4 TS_CUDA_DEFINES=MMQ_ROWS_PF=8
for e in "" TS_CUDA_DEFINES=MMQ_ROWS_PF=4; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash; done
echo "== server: 64 streaming clients, token-id prompts of 32, 128 tokens each, 20 s"
"$B" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 --row-multiple 1 > $O/serve.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
"$B" loadtest --url http://127.0.0.1:8089 --clients 64 --duration 20 --max-tokens 128 --prompt-ids 32 --temperature 0
curl -s http://127.0.0.1:8089/metrics | grep -E "^turbospark_(batch_tokens_total|steps_total|forward_seconds_sum|completion_tokens_total)"
kill $SP; wait $SP 2>/dev/null
