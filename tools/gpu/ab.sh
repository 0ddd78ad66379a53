#!/usr/bin/env bash
# A/B of two turbospark builds on a GPU machine, in one run (see docs/GPU.md): the same benchmarks,
# interleaved, with token hashes, so a change that must keep results bit-exact (a faster kernel with
# the same arithmetic) is checked and measured at once.
# Usage (on the GPU machine, from the repo root): tools/gpu/ab.sh BIN_A BIN_B [OPS_TEST_B]
# Prints, per test, both figures and whether the token hashes agree; runs OPS_TEST_B first if given.
# A_ENV / B_ENV (e.g. B_ENV="TS_CUDA_PDL=0"): environment for that side's runs, so one binary can be
# compared with itself under a switch (BIN_A = BIN_B).
set -u
A=$1; B=$2; OPS=${3:-}
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
fails=0
if [ -n "$OPS" ]; then
  echo "== ops_vs_cpu (B)"
  "$OPS" --test-threads 2 > /tmp/ab-ops.txt 2>&1
  grep -E "FAIL|test result|panicked" /tmp/ab-ops.txt | head -20
  grep -q "test result: ok" /tmp/ab-ops.txt || fails=$((fails+1))
fi
[ -f $V ] || "$A" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
run() {  # run BIN ARGS... -> "figure hash" lines of the bench table
  "$@" 2>/dev/null | grep -E "^\| |hash" | grep -vE "^\| (model|---)"
}
for args in "-p 512 -n 128 -r 3 --hash" "-p 2048 -n 0 -r 2" "-p 0 -n 64 --parallel 64 -r 3 --hash"; do
  for round in 1 2; do
    for bin in A B; do
      b=$A; e=${A_ENV:-}; [ $bin = B ] && { b=$B; e=${B_ENV:-}; }
      echo "-- $bin${e:+ ($e)} (round $round): bench $args"
      run env $e "$b" bench --backend cuda -m $V $args | tee /tmp/ab-$bin.txt
    done
    ha=$(grep hash /tmp/ab-A.txt); hb=$(grep hash /tmp/ab-B.txt)
    if [ "$ha" != "$hb" ]; then echo "FAIL: token hashes differ"; fails=$((fails+1)); fi
  done
done
echo "ab.sh failures: $fails"
exit $fails
