#!/usr/bin/env bash
# Second device call of this merge (docs/PERF.md): the merge with a warp per split and one wave
# of the 16-head split kernel, against main's build; then the server under 64 clients (#6).
#   tools/gpu/plans/gpu-next4b.sh BIN OPS_TEST MAIN_BIN
set -u
B=$1; OPS=$2; M=$3
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
O=${OUT:-/tmp}
b() { local e=$1; shift; echo "-- ${e:-default} $*"; env $e "$@" 2>&1 | grep -E "^\| .*(pp|tg)|hash|rror" | sed -E 's/.*\| (pp|tg)/\1/'; }
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
echo "== ops_vs_cpu"
"$OPS" --test-threads 2 > $O/ops.txt 2>&1
grep -E "FAIL|test result|panicked" $O/ops.txt | head -20
wait
b "" "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | tail -14
