#!/usr/bin/env bash
# Second device call of this merge (docs/PERF.md): the merge with a warp per split and one wave
# of the 16-head split kernel, against main's build; then the server under 64 clients (#6).
#   tools/gpu/plans/gpu-next4b.sh BIN OPS_TEST MAIN_BIN
set -u
B=$1; OPS=$2; M=$3
source "$(dirname "$0")/lib.sh"
ops_and_model
b "" "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | tail -14
