#!/usr/bin/env bash
# Fifty-second session, for a single call when too little device time is left for
# gpu-next175 + 176: the op test of the cache-row copy, the shared prefixes on CUDA (4
# choices over a 600-id prompt, with and without the prompt cache), the server with every
# default (issue 6), 64 sequences at -d 96, tg128. ~7 minutes with the synthesis.
#   tools/gpu/plans/gpu-next177.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
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
  "$B" serve --backend cuda -m $V --max-seqs 8 -c 1024 --port 8090 --no-warmup $1 > $O/serve_n.log 2>&1 &
  local sp=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8090/health >/dev/null && break; sleep 1; done
  local ids; ids=$(python3 -c "print(','.join(str(1 + (i * 7) % 1000) for i in range(600)))")
  for n in 4 4; do
    curl -s -o $O/n$n.json -w "n=$n %{time_total} s\n" http://127.0.0.1:8090/v1/completions -H 'Content-Type: application/json' \
      -d "{\"prompt\": [$ids], \"max_tokens\": 16, \"temperature\": 0, \"n\": $n}"
    python3 -c "import json; d=json.load(open('$O/n$n.json')); print(' usage', d.get('usage'), 'texts equal:', len(set(c['text'] for c in d['choices'])) == 1)"
  done
  curl -sf http://127.0.0.1:8090/metrics | grep -E "^turbospark_prompt_tokens_(copied|cached)_total " | tr '\n' ' '; echo
  kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
}
choices ""
choices "--no-prompt-cache"
stamp "== server"
serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences, one sequence"
bpd 64 "-d 96" ""
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
