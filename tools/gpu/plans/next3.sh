#!/usr/bin/env bash
# Final check of what branch gpu-next2 kept (fused f16/bf16 decode MoE, moe_route_quant,
# moe_gateup_sh_q8q, the kernel helpers) against main, one device call:
#   tools/gpu/plans/next3.sh MAIN_BIN BRANCH_BIN BRANCH_OPS_TEST
# The Q8_0 changes are meant bit-exact: the branch's tg128 and --parallel 64 hashes must equal main's.
set -u
M=$1; B=$2; OPS=$3
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf; VB=/tmp/v2lite-bf16.gguf
b() { echo "-- $*"; "$@" 2>/dev/null | grep -E "^\| .*(pp|tg)|hash" | sed -E 's/.*\| (pp|tg)/\1/'; }
"$M" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
echo "== ops_vs_cpu (branch)"
"$OPS" --test-threads 2 > ${OUT:-/tmp}/ops.txt 2>&1
grep -E "FAIL|test result|panicked" ${OUT:-/tmp}/ops.txt | head -20
wait
for r in 1 2; do
  b "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
b "$M" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
rm -f $V
"$M" synth --preset deepseek-v2-lite --quant bf16 -o $VB >/dev/null 2>&1
b "$M" bench --backend cuda -m $VB -p 0 -n 128 -r 3 --hash
b "$B" bench --backend cuda -m $VB -p 0 -n 128 -r 3 --hash
b "$B" bench --backend cuda -m $VB -p 0 -n 32 --parallel 64 -r 1 --hash
