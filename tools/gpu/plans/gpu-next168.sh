#!/usr/bin/env bash
# Fiftieth session, third call: where the server's ~3.4% under the 64-sequence bench goes (H100:
# steady 7,476 against 7,740, gpu-next165). The server's sequences run from depth 32 to 160 and
# end together every 128 tokens (all 64 clients ask max_tokens 128 at once, so they stay in
# step), while the bench's run from 96 to 128. Runs: the bench at the server's depths (-d 32 -n
# 128), the usual bench (-d 96 -n 32), then the server twice for 45 s: max_tokens 128 (as
# always) and 512 (a quarter of the request ends and starts a step). ~6 minutes with the synth.
#   tools/gpu/plans/gpu-next168.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== synth"
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== bench"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 --parallel 64 -r 1 --hash -d 32
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96
for mt in 128 512; do
  stamp "== server, max_tokens $mt"
  "$B" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 --row-multiple 4 > $O/serve$mt.log 2>&1 &
  sp=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
  timeout 120 "$B" loadtest --url http://127.0.0.1:8089 --clients 64 --duration 45 --max-tokens $mt --prompt-ids 32 --temperature 0 | grep -E "^tokens:|^TTFT|^prompts:|^steady"
  curl -sf http://127.0.0.1:8089/metrics | grep -E "^turbospark_(steps_total|steps_chained_total|batch_tokens_total|step_seconds_total|forward_seconds_total|completion_tokens_total) " | tr '\n' ' '; echo
  kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
done
stamp "== done"
