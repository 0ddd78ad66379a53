#!/usr/bin/env bash
# For the fifty-eighth session (~3.5 minutes with the file made), any card: the split kernels'
# query copy by a constant-offset thread map (MS_QMAP, new default; the same bits: static SASS
# mla_split_tc_he 2,024 -> 1,696 instructions, the ~560 after its PDL wait -> ~220):
#  1. the split op tests (mla_split_early_exact compares the early kernel with the plain one
#     bit for bit);
#  2. alternating, MS_QMAP=0 (the old map) against the defaults: tg64 at 16k twice (the hash
#     must stay efeed109b1480c9a), 64 sequences once each (0a9cb67b57a58e7a).
#   OPS=.dev/ops tools/gpu/plans/gpu-next199.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -30
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
O0="TS_CUDA_DEFINES=MS_QMAP=0"
ops_tests 100 4 mla_split
q8_ready
stamp "== tg64 at 16k"
for r in 1 2; do for e in "$O0" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== 64 sequences"
for e in "$O0" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96; done
stamp "== done"
