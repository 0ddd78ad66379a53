#!/usr/bin/env bash
# Fifty-second session, part 1 of 2 (part 2: gpu-next176.sh, right after, on the same warm
# machine: it reuses the synthesised model). An H200 (else an H100, whose figures compare only
# with each other). The CUDA twin of the new cache-row copy (op test cache_copy_exact), the
# server's shared prompt prefixes on CUDA (a request of 4 choices over a 600-id prompt: the
# texts of greedy choices equal one choice alone, the prompt copied 3 times, and the time
# against --no-prompt-cache), then the server with every default against the wait off (issue
# 6). ~8 minutes with the synthesis.
#   tools/gpu/plans/gpu-next175.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -70
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== ops"
ops_tests 120 1 cache_copy_exact
grep -E "^cache_copy" $O/ops.txt
stamp "== shared prefixes on CUDA"
choices() {
  "$B" serve --backend cuda -m $V --max-seqs 8 -c 1024 --port 8090 $1 > $O/serve_n.log 2>&1 &
  local sp=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8090/health >/dev/null && break; sleep 1; done
  local ids; ids=$(python3 -c "print(','.join(str(1 + (i * 7) % 1000) for i in range(600)))")
  for n in 1 4 4; do
    curl -s -o $O/n$n.json -w "n=$n %{time_total} s\n" http://127.0.0.1:8090/v1/completions -H 'Content-Type: application/json' \
      -d "{\"prompt\": [$ids], \"max_tokens\": 16, \"temperature\": 0, \"n\": $n}"
    python3 -c "import json,sys; d=json.load(open('$O/n$n.json')); print(' usage', d.get('usage'), 'texts equal:', len(set(c['text'] for c in d['choices'])) == 1, 'md5', __import__('hashlib').md5(d['choices'][0]['text'].encode()).hexdigest()[:12])"
  done
  curl -sf http://127.0.0.1:8090/metrics | grep -E "^turbospark_prompt_tokens_(copied|cached)_total " | tr '\n' ' '; echo
  kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
}
choices ""
choices "--no-prompt-cache"
stamp "== server"
serve64 "" 45 "--row-multiple 4"
serve64 "" 45 "--row-multiple 4 --gather-ms 0"
stamp "== done"
