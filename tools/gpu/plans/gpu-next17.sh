#!/usr/bin/env bash
# The eleventh session's fourth measurement (2026-11-30): two row sets a warp by default from 12
# pairs an expert (mmq_q8_rows_r2), against TS_CUDA_ROWS_R=1, one binary; then where a 512-token
# prompt goes (TS_CUDA_PROFILE=1) and the server at 128 clients:
#   tools/gpu/plans/gpu-next17.sh BIN OPS
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2; the 128-sequence hash the same both ways.
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 1 rows_
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
for r in 1 2; do
  for e in "" TS_CUDA_ROWS_R=1; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash; done
done
echo "== profile pp512"
TS_CUDA_PROFILE=1 timeout 200 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 2>&1 | grep -A40 "cuda profile" | head -42
echo "== server: 128 clients, token-id prompts of 32, 128 tokens each"
"$B" serve --backend cuda -m $V --max-seqs 128 --max-queue 512 -c 1024 --port 8089 > $O/serve128.log 2>&1 &
SP=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
"$B" loadtest --url http://127.0.0.1:8089 --clients 128 --duration 20 --max-tokens 128 --prompt-ids 32 --temperature 0
curl -s http://127.0.0.1:8089/metrics | grep -E "^turbospark_(batch_tokens_total|steps_total|step_seconds|forward_seconds)"
kill $SP; wait $SP 2>/dev/null
