#!/usr/bin/env bash
# Tensor-core prompt paths on a GPU machine (see docs/GPU.md): the op tests against the CPU, the
# DeepSeek-V2 fixtures' Q8_0 prefill against the CPU, the synthetic V2-Lite benchmarks with a
# per-kernel profile of one prefill, and the server under 64 streaming clients.
# Usage (on the GPU machine, from the repo root): tools/gpu/prefill.sh BIN OPS_TEST OUTDIR [steps]
# steps: any of ops,fix,bench,prof,dec,ids,par,serve (default: all). TS_ROW_MULTIPLE=n serves with
# --row-multiple n (default 1): token and logits-row counts padded to multiples of n, so fewer
# distinct step shapes, each recorded once as a CUDA graph and replayed more often.
set -u
T=${1:-.dev/turbospark}; OPS=${2:-.dev/ops_vs_cpu}; O=${3:-/tmp/pf}; STEPS=${4:-ops,fix,bench,prof,dec,ids,par,serve}
mkdir -p "$O"; export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
fails=0
V=/tmp/v2lite-q8_0.gguf
if has ops; then
  echo "== ops_vs_cpu"
  "$OPS" --test-threads 1 2>&1 | grep -E "FAIL|worst max|test result|one slot|Q8_0.*n=(64|300)|panicked" | head -80
fi
if has fix; then
  echo "== deepseek2 fixtures, Q8_0 prefill: CUDA vs CPU (8-bit activations on both)"
  F=tests/fixtures/deepseek2
  for v in lite dense2 qlora; do
    toks=$(python3 -c "import json;print(','.join(map(str,json.load(open('$F/$v/tokens.json'))['input_ids'])))")
    m=$F/$v/model-q8_0-mla.gguf
    "$T" logits --backend cuda -m "$m" --tokens "$toks" -o "$O/$v-cuda.npy" 2>>"$O/log.txt"
    "$T" logits --backend cpu -m "$m" --tokens "$toks" -o "$O/$v-cpufast.npy" 2>>"$O/log.txt"
    python3 tools/gpu/compare_npy.py "$O/$v-cpufast.npy" "$O/$v-cuda.npy" --tol 3e-2 --allow-argmax 1 --label "$v q8_0 cuda (tensor cores) vs cpu (8-bit activations)" || fails=$((fails+1))
  done
fi
if has bench || has prof || has dec || has ids || has par || has serve; then
  [ -f $V ] || { /usr/bin/time -f "synth: %e s" "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V 2>&1 | tail -1; }
fi
if has bench; then
  echo "== bench (CUDA)"
  "$T" bench --backend cuda -m $V -p 512 -n 128 -r 5 2>>"$O/log.txt"
  "$T" bench --backend cuda -m $V -p 2048 -n 0 -r 3 2>>"$O/log.txt"
  TS_CUDA_TC=0 "$T" bench --backend cuda -m $V -p 512 -n 0 -r 2 2>>"$O/log.txt"
fi
if has prof; then
  echo "== profile of pp512 and pp2048 (eager, events around every launch)"
  TS_CUDA_PROFILE=1 "$T" bench --backend cuda -m $V -p 512 -n 0 -r 1 2>&1 | grep -A30 "cuda profile" | head -32
  TS_CUDA_PROFILE=1 "$T" bench --backend cuda -m $V -p 2048 -n 0 -r 1 2>&1 | grep -A14 "cuda profile" | head -16
fi
if has dec; then
  echo "== decode: programmatic dependent launch on and off (token hashes must agree), then a profile"
  "$T" bench --backend cuda -m $V -p 0 -n 128 -r 5 --hash 2>>"$O/log.txt" | tee "$O/dec-pdl.txt"
  TS_CUDA_PDL=0 "$T" bench --backend cuda -m $V -p 0 -n 128 -r 5 --hash 2>>"$O/log.txt" | tee "$O/dec-nopdl.txt"
  a=$(grep hash "$O/dec-pdl.txt"); b=$(grep hash "$O/dec-nopdl.txt")
  [ -n "$a" ] && [ "$a" == "$b" ] && echo "decode tokens: same with and without PDL" || { echo "FAIL: decode tokens differ with PDL"; fails=$((fails+1)); }
  TS_CUDA_PROFILE=1 "$T" bench --backend cuda -m $V -p 0 -n 32 -r 1 2>&1 | grep -A30 "cuda profile" | head -32
fi
if has ids; then
  echo "== greedy picks on the device vs all logits to the host (token hashes must agree)"
  "$T" bench --backend cuda -m $V -p 0 -n 128 -r 5 --hash 2>>"$O/log.txt" | tee "$O/ids-dev.txt"
  "$T" bench --backend cuda -m $V -p 0 -n 128 -r 5 --hash --host-argmax 2>>"$O/log.txt" | tee "$O/ids-host.txt"
  a=$(grep hash "$O/ids-dev.txt"); b=$(grep hash "$O/ids-host.txt")
  [ -n "$a" ] && [ "$a" == "$b" ] && echo "decode tokens: same picked on the device and on the host" || { echo "FAIL: device arg-max differs"; fails=$((fails+1)); }
  "$T" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 3 --hash 2>>"$O/log.txt" | tee "$O/idsp-dev.txt"
  "$T" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 3 --hash --host-argmax 2>>"$O/log.txt" | tee "$O/idsp-host.txt"
  a=$(grep "x64: hash" "$O/idsp-dev.txt"); b=$(grep "x64: hash" "$O/idsp-host.txt")
  [ -n "$a" ] && [ "$a" == "$b" ] && echo "batched decode tokens: same picked on the device and on the host" || { echo "FAIL: batched device arg-max differs"; fails=$((fails+1)); }
fi
if has par; then
  echo "== batched decode: 64 sequences at once (bench --parallel 64), graphs on and off, then its profile"
  "$T" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 2 --hash 2>>"$O/log.txt" | tee "$O/par.txt"
  TS_CUDA_GRAPHS=0 "$T" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 2 --hash 2>>"$O/log.txt" | tee "$O/par-nograph.txt"
  a=$(grep "hash" "$O/par.txt"); b=$(grep "hash" "$O/par-nograph.txt")
  [ -n "$a" ] && [ "$a" == "$b" ] && echo "batched decode tokens: same with and without graphs" || { echo "FAIL: batched decode tokens differ with graphs"; fails=$((fails+1)); }
  TS_CUDA_PROFILE=1 "$T" bench --backend cuda -m $V -p 0 -n 16 --parallel 64 -r 1 2>&1 | grep -A26 "cuda profile" | head -28
fi
if has serve; then
  echo "== server: 64 streaming clients, token-id prompts of 32, 128 tokens each"
  "$T" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 --row-multiple ${TS_ROW_MULTIPLE:-1} > "$O/serve.log" 2>&1 &
  SP=$!
  for i in $(seq 1 120); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
  "$T" loadtest --url http://127.0.0.1:8089 --clients 64 --duration ${TS_LOAD_SECONDS:-30} --max-tokens 128 --prompt-ids 32 --temperature 0 || fails=$((fails+1))
  curl -s http://127.0.0.1:8089/metrics | grep -E "^turbospark_(batch_tokens_total|steps_total|step_seconds|forward_seconds|completion_tokens_total|requests_(accepted|rejected))"
  kill $SP; wait $SP 2>/dev/null
  tail -3 "$O/serve.log"
fi
echo "prefill.sh failures: $fails"
exit $fails
