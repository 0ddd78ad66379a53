#!/usr/bin/env bash
# RUN (twelfth session): 9.83 ms a step; mmq_q8_64 3.04 ms (21.5 us each), mla_split_18_16_h
# 1.36 ms (50.5 us each); the table in docs/PERF.md.
# Twelfth session (2026-11-30): where the server's steps go. At 64 clients a step (64 decode rows
# and ~12 prompt tokens on average) takes 10.9 ms, where the bench's pure 64-row steps take 8.4 ms
# and 128-row ones 9.6 (gpu-next23/24): about 2 ms a step unexplained, and eager launches explain
# at most 0.4 ms. TS_CUDA_TRACE=1 under `serve` (the kernels built with -DTS_TRACE), 64 clients
# for 8 s, Ctrl-C (the backend writes its trace on the way out), then tools/gpu/trace.py over the
# last 300 steps (each ends at argmax_final; its share includes the host's turn between steps).
#   tools/gpu/plans/gpu-next25.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/serve-trace.csv "$B" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 --row-multiple 1 > $O/serve.log 2>&1 &
SP=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
"$B" loadtest --url http://127.0.0.1:8089 --clients 64 --duration 8 --max-tokens 128 --prompt-ids 32 --temperature 0 | grep -E "tokens:|requests:"
curl -s http://127.0.0.1:8089/metrics | grep -E "^turbospark_(batch_tokens_total|steps_total|completion_tokens_total)"
kill -INT $SP; wait $SP 2>/dev/null
tail -2 $O/serve.log
python3 tools/gpu/trace.py $O/serve-trace.csv 300 | head -45
gzip -f $O/serve-trace.csv
