#!/usr/bin/env bash
# For the fifty-eighth session (~6 minutes with the file made), any card:
#  1. op tests of the split kernels, with the defaults and with MS_EARLY_ALL=1 (the early split
#     issues all 3 ring tiles before its wait; the same bits) — the two-group split now issues
#     both of a group's tiles before its wait (at 16k: the split's 4 tiles in flight at once);
#  2. alternating: tg64 at 16k, defaults / TS_CUDA_MS_G2=1 / MS_EARLY_ALL=1, twice;
#  3. H200 only: the server with the defaults, 45 s (issue 6's figure).
#   OPS=.dev/ops tools/gpu/plans/gpu-next195.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -50
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
G="TS_CUDA_MS_G2=1"
E="TS_CUDA_DEFINES=MS_EARLY_ALL=1"
stamp "== op tests"
ops_tests 240 4 mla_split
ok=1; grep -q "test result: ok" $O/ops.txt && ! grep -qE "FAIL|panicked" $O/ops.txt || ok=0
TS_CUDA_DEFINES=MS_EARLY_ALL=1 timeout 120 "$OPS" --test-threads 4 mla_split_early > $O/ops_e.txt 2>&1
grep -E "FAIL|test result|panicked" $O/ops_e.txt | head -5
okE=1; grep -q "test result: ok" $O/ops_e.txt && ! grep -qE "FAIL|panicked" $O/ops_e.txt || okE=0
q8_ready
L=(""); [ $ok = 1 ] && L+=("$G"); [ $okE = 1 ] && L+=("$E")
stamp "== tg64 at 16k"
for r in 1 2; do for e in "${L[@]}"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
issue6_server
stamp "== done"
