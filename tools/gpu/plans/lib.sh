# Sourced by the plans in this folder (after `set -u; B=BIN; OPS=OPS_TEST`): the synthetic
# V2-Lite Q8_0 file at $V, $O for outputs ($OUT on the device machine), `b ENV CMD...` to run a
# benchmark under env settings and keep its figure and hash lines, and `ops_and_model`: the model
# synthesised in the background while ops_vs_cpu runs (summary lines only; the log in $O).
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
O=${OUT:-/tmp}
b() { local e=$1; shift; echo "-- ${e:-default} $*"; env $e "$@" 2>&1 | grep -E "^\| .*(pp|tg)|hash|rror" | sed -E 's/.*\| (pp|tg)/\1/'; }
ops_and_model() {
  "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  echo "== ops_vs_cpu"
  "$OPS" --test-threads 2 > $O/ops.txt 2>&1
  grep -E "FAIL|test result|panicked" $O/ops.txt | head -20
  wait
}
