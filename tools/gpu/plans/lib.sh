# Sourced by the plans in this folder (after `set -u; B=BIN; OPS=OPS_TEST`): the synthetic
# V2-Lite Q8_0 file at $V, $O for outputs ($OUT on the device machine), `b ENV CMD...` to run a
# benchmark under env settings and keep its figure and hash lines, and `ops_and_model`: the model
# synthesised in the background while ops_vs_cpu runs (summary lines only; the log in $O).
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
BF=/tmp/v2lite-bf16.gguf
O=${OUT:-/tmp}
# Which card this is (the same kind of card has read ~2% apart at 64 sequences between
# sessions: the uuid says whether two calls' figures came from one card), once a call.
if [ -z "${TS_CARD_SHOWN:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
  export TS_CARD_SHOWN=1
  echo "card: $(nvidia-smi --query-gpu=name,uuid,clocks.max.sm,clocks.max.memory,clocks.sm,temperature.gpu,power.limit --format=csv,noheader 2>&1 | head -1)"
fi
# (Each run is cut off after $TS_RUN_LIMIT seconds, default 240, so that a hung kernel costs one
# run, not the whole device call.)
b() { local e=$1; shift; echo "-- ${e:-default} $*"; env $e timeout ${TS_RUN_LIMIT:-240} "$@" 2>&1 | grep -E "^\| .*(pp|tg)|hash|rror" | sed -E 's/.*\| (pp|tg)/\1/'; }
ops_and_model() {
  "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  echo "== ops_vs_cpu"
  timeout ${TS_OPS_LIMIT:-300} "$OPS" --test-threads ${TS_OPS_THREADS:-2} > $O/ops.txt 2>&1 || echo "ops_vs_cpu: exit $? (124: cut off)"
  grep -E "FAIL|test result|panicked" $O/ops.txt | head -20
  wait
}
# `ops_tests LIMIT THREADS FILTER...`: the model synthesised in the background while the named
# ops_vs_cpu tests run for at most LIMIT seconds (summary lines; the log in $O/ops.txt).
ops_tests() {
  local lim=$1 th=$2; shift 2
  "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  echo "== ops_vs_cpu $*"
  timeout $lim "$OPS" --test-threads $th "$@" > $O/ops.txt 2>&1 || echo "ops_vs_cpu: exit $?"
  grep -E "FAIL|test result|panicked|differs|declined" $O/ops.txt | head -20
  wait
}
# `bpd P ARGS ENV...`: `--parallel P -n 32 -r 2 --hash` and the bench arguments ARGS ("" = none,
# e.g. "-d 96") under each ENV setting ("" = the defaults).
bpd() { local p=$1 a=$2; shift 2; for e in "$@"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash $a; done; }
# `bp P ENV...`: `bpd P "" ENV...`.
bp() { local p=$1; shift; bpd $p "" "$@"; }
# `ab64 ROUNDS ENV...`: `bp 64 ENV...`, ROUNDS times.
ab64() {
  local n=$1; shift
  for r in $(seq $n); do bp 64 "$@"; done
}
# `ab_decode BASE BRANCH ENV...`: tg128 of each build with its token hash, then twice: the base
# build at `--parallel 64 -n 32` and the branch under each ENV setting ("" = its defaults).
ab_decode() {
  local base=$1 br=$2; shift 2
  b "" "$base" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "" "$br" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  for r in 1 2; do
    b "" "$base" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
    for e in "$@"; do b "$e" "$br" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash; done
  done
}
# `ab_prompts BIN...`: pp512 and pp2048 of each build in turn.
ab_prompts() {
  for bin in "$@"; do
    b "" "$bin" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "" "$bin" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  done
}
# `serve64 ENV SECONDS [SERVE_ARGS [LOADTEST_ARGS]]`: `serve` under ENV settings ("" = the
# defaults) and extra arguments with 64 slots, and `loadtest` with 64 streaming clients (token-id
# prompts of 32, each client repeating its own unless LOADTEST_ARGS has --fresh-prompts; 128
# tokens each) for SECONDS; the aggregate, latency and prompt-cache lines. The load test counts whole requests
# (128 tokens), so short runs are +-5%.
serve64() {
  echo "-- ${1:-default} ${3:-} ${4:-}"
  env $1 "$B" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 ${3:---row-multiple 1} > $O/serve.log 2>&1 &
  local sp=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
  timeout $(( $2 + 60 )) "$B" loadtest --url http://127.0.0.1:8089 --clients 64 --duration $2 --max-tokens 128 --prompt-ids 32 --temperature 0 ${4:-} | grep -E "^tokens:|^TTFT|^prompts:|^steady"
  # Where the server's time went: steps, rows, seconds in steps and in forward passes (the
  # wall time less the step seconds is the engine waiting for requests).
  curl -sf http://127.0.0.1:8089/metrics | grep -E "^turbospark_(steps_total|steps_replayed_total|steps_recorded_total|steps_eager_total|steps_chained_total|batch_tokens_total|step_seconds_total|forward_seconds_total|prompt_tokens_total|completion_tokens_total|gathers_total|gathers_timed_out_total|gather_seconds_total) " | tr '\n' ' '; echo
  kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
}
# `stamp MSG`: MSG with the seconds since lib.sh was sourced.
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
# `is_h200`: true on an H200 (the card issues 5 and 6 name).
is_h200() { nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; }
# `issue6_server`: on an H200 only, the server with the defaults, 64 clients for 45 s (issue 6's
# figure, as PERF.md records it).
issue6_server() {
  is_h200 || return 0
  stamp "== server, 64 clients, 45 s (H200: issue 6's figure)"
  serve64 "" 45 "--row-multiple 4"
}
# `young SECONDS`: true while fewer than SECONDS have passed since lib.sh was sourced.
young() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
# `op_log LIMIT THREADS LOG PATTERN ENV FILTER...`: ops_vs_cpu (with --nocapture) under ENV settings
# ("" = none) for at most LIMIT seconds, its output in $O/LOG, then its exit status and the lines
# matching PATTERN (besides failures and the summary).
op_log() {
  local lim=$1 th=$2 log=$3 pat=$4 e=$5; shift 5
  env $e timeout $lim "$OPS" --nocapture --test-threads $th "$@" > $O/$log 2>&1; echo "exit $? (124: cut off)"
  grep -E "${pat}FAIL|test result|panicked" $O/$log | head -24
}
# `trace_tg N [MODEL [BENCH_ARGS...]]`: a TS_CUDA_TRACE=1 run of tg32 (of $V, or MODEL; extra
# bench arguments such as `-d 16384` after it) and the first N lines of its per-kernel summary
# (tools/gpu/trace.py over the last 16 tokens).
trace_tg() {
  local n=$1 m=${2:-$V}; shift; [ $# -gt 0 ] && shift
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 150 "$B" bench --backend cuda -m $m -p 0 -n 32 -r 1 "$@" >/dev/null 2>&1
  python3 "$(dirname "${BASH_SOURCE[0]}")/../trace.py" $O/tr.csv 16 | head -$n; rm -f $O/tr.csv
}
# `q8_bg`: the synthetic V2-Lite Q8_0 file at $V, made in the background (`wait` for it).
q8_bg() { "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 & }
# `q8_ready`: the same file, made now unless an earlier plan on this machine left it.
q8_ready() { [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1; }
# `models_bg`: both synthetic V2-Lite files, $V (Q8_0) then $BF (bf16), made in the background
# (`wait` for them).
models_bg() {
  ("$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
   "$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1) &
}
# `ncu_path`: Nsight Compute's command line tool on this machine (empty where there is none).
ncu_path() { command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1; }
# `ncu_stalls REGEX BENCH_ARGS...`: Nsight Compute on the 31st launch of the kernels matching REGEX
# in a bench of $V (graphs off): its duration and, by reason, the cycles a warp spends stalled per
# issued instruction (the reasons that are not zero), with its instructions and active cycles.
ncu_stalls() {
  local re=$1; shift
  local ncu=$(ncu_path)
  TS_CUDA_GRAPHS=0 timeout 120 "$ncu" --kernel-name "regex:$re" --launch-skip 30 --launch-count 1 \
    --section SpeedOfLight --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg" \
    "$B" bench --backend cuda -m $V "$@" 2>&1 | grep -E "$re|Duration|Elapsed|stalled|inst_executed|cycles_active|ERR|rror" | grep -vE " 0$| 0\.0?0?$" | head -60
}
# `trace_steps P D LINES`: a TS_CUDA_TRACE=1 bench of P sequences at depth D (-n 16), grouped
# by tools/gpu/steps.py (its first LINES lines; the launch sequence into $O/seq.txt).
trace_steps() {
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 16 \
    --parallel $1 -r 1 -d $2 >/dev/null 2>&1
  python3 "$(dirname "${BASH_SOURCE[0]}")/../steps.py" $O/tr.csv 16 $O/seq.txt | head -$3
  rm -f $O/tr.csv
}
# `bwave ENV...`: a wave of 64 prompts of 32 tokens prefilled in forwards of 1,024 tokens (the
# server's prompt steps when 64 clients arrive at once; `bench --parallel-prompt`) under each ENV
# setting ("" = the defaults): its prompt tok/s and the picks' hash.
bwave() { for e in "$@"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 0 --parallel 64 --parallel-prompt 32 -b 1024 -r 3 --hash; done; }
# `trace_wave LINES`: the same wave traced (TS_CUDA_TRACE=1), grouped by tools/gpu/steps.py (its
# first LINES lines; the launch sequence into $O/seq_wave.txt).
trace_wave() {
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/trw.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 0 --parallel 64 \
    --parallel-prompt 32 -b 1024 -r 2 >/dev/null 2>&1
  python3 "$(dirname "${BASH_SOURCE[0]}")/../steps.py" $O/trw.csv 24 $O/seq_wave.txt | head -$1
  rm -f $O/trw.csv
}
# `choices ARGS`: a CUDA server of $V (8 sequences, serve ARGS) asked for 4 greedy choices of one
# 600-id prompt, twice: each answer's time, usage and whether the choices' texts agree, then
# the prompt-cache counters (a request's choices share their prompt: engine.rs, "Shared
# prefixes").
choices() {
  "$B" serve --backend cuda -m $V --max-seqs 8 -c 1024 --port 8090 --no-warmup $1 > $O/serve_n.log 2>&1 &
  local sp=$!
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:8090/health >/dev/null && break; sleep 1; done
  local ids; ids=$(python3 -c "print(','.join(str(1 + (i * 7) % 1000) for i in range(600)))")
  for k in 1 2; do
    curl -s -o $O/n4.json -w "n=4 %{time_total} s\n" http://127.0.0.1:8090/v1/completions -H 'Content-Type: application/json' \
      -d "{\"prompt\": [$ids], \"max_tokens\": 16, \"temperature\": 0, \"n\": 4}"
    python3 -c "import json; d=json.load(open('$O/n4.json')); print(' usage', d.get('usage'), 'texts equal:', len(set(c['text'] for c in d['choices'])) == 1)"
  done
  curl -sf http://127.0.0.1:8090/metrics | grep -E "^turbospark_prompt_tokens_(copied|cached)_total " | tr '\n' ' '; echo
  kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
}
# `p64_best ENV [BIN]`: `--parallel 64 -n 32 -r 2 --hash -d 96` of BIN (default $B) under ENV
# ("" = the defaults); for $B it keeps the best ENV so far in $best / $bestv and the defaults'
# best figure in $base. `serve_best`: those, then `serve64` with the defaults and with $best for
# 40 s each if $best beat the defaults by 0.8% or more.
best=""; bestv=0; base=0
p64_best() {
  local out v bin=${2:-$B}
  out=$(b "$1" "$bin" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96)
  echo "$out"
  [ "$bin" = "$B" ] || return 0
  v=$(echo "$out" | grep -E "^tg32 x64" | sed -E 's/.*\| ([0-9.]+) .*/\1/')
  [ -z "$v" ] && return 0
  if [ -z "$1" ]; then base=$(python3 -c "print(max($base, $v))")
  elif python3 -c "import sys; sys.exit(0 if $v > $bestv else 1)"; then best=$1; bestv=$v; fi
}
serve_best() {
  stamp "best: '$best' $bestv against the defaults' $base"
  if python3 -c "import sys; sys.exit(0 if $bestv > 1.008 * $base else 1)"; then
    stamp "== server"
    serve64 "" 40 "--row-multiple 4"
    serve64 "$best" 40 "--row-multiple 4"
  fi
}
# `h200_first [tg128]`: on an H200 only, after the file from `q8_bg` is made, issue 6's server
# figure (and with the word tg128 issue 5's one-token figure too); elsewhere nothing (the file
# may still be in the making: `wait` for it).
h200_first() {
  is_h200 || return 0
  wait
  stamp "== synthesised"
  issue6_server
  if [ "${1:-}" = tg128 ]; then
    stamp "== tg128"
    b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  fi
}
# `ncu_head BIN [ENV...]`: the output head's launch on mmh8 alone (`TS_CUDA_HEAD_MMH=1`, graphs
# off, under ENV settings): Nsight Compute's time and DRAM bytes of the `mmh8_dn*` launches of a
# 64-sequence bench at -d 96 (the first two: the prompt MoE's on mmh8 where no f16 copies were
# made; the last ${NCU_LAST:-3}: the decode steps' heads).
ncu_head() {
  local bin=$1; shift
  local ncu=$(ncu_path)
  [ -n "$ncu" ] || { echo "ncu not found"; return 0; }
  echo "-- $bin $*"
  env "$@" TS_CUDA_GRAPHS=0 TS_CUDA_HEAD_MMH=1 timeout 100 "$ncu" --kernel-name regex:mmh8_dn \
    --launch-count 100 --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --csv --page raw \
    "$bin" bench --backend cuda -m $V -p 0 -n 6 --parallel 64 -r 1 -d 96 2>/dev/null > $O/ncu.csv
  python3 - $O/ncu.csv ${NCU_LAST:-3} <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = next((r for r in rows if r and r[0] == "ID"), None)
got = [dict(zip(h, r)) for r in rows if h and len(r) == len(h) and r[0].isdigit()]
for d in got[:2] + got[-int(sys.argv[2]):]:
    print(d.get("Kernel Name"), d.get("Grid Size"), "ns", d.get("gpu__time_duration.sum"), "bytes", d.get("dram__bytes_read.sum"))
PY
}
# `mmh_ops`: the op tests of the Hopper MoE kernels and of the output head on them (head_mmh,
# moe_f16_prompt; at most 120 s, the log in $O/ops.txt) while the file from `q8_bg` is made;
# then waits for the file.
mmh_ops() {
  stamp "== op tests"
  op_log 120 2 ops.txt "HeadMmh|" "" head_mmh moe_f16_prompt
  wait
}
