#!/usr/bin/env bash
# Fifty-second session (no device came), for the next device time: an H200 (else an H100,
# whose figures compare only with each other). First the CUDA twin of the new cache-row copy
# (op test cache_copy_exact) and the server's shared prompt prefixes on CUDA (a request of 4
# choices over a 600-id prompt: the texts of greedy choices equal one choice alone, the
# prompt copied 3 times, and the time against --no-prompt-cache); then gpu-next174 (the
# server with every default against the wait off, 64 sequences at -d 96 and -d 32, tg128,
# tg64 at 16k, bf16 tg128). ~9 minutes with the two syntheses.
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
stamp "== synth"
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== server"
serve64 "" 45 "--row-multiple 4"
serve64 "" 45 "--row-multiple 4 --gather-ms 0"
serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences"
bpd 64 "-d 96" "" ""
bpd 64 "-d 32" "" "TS_CUDA_MLA_LONG_BATCH=64"
stamp "== one sequence"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
wait
b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
stamp "== done"
