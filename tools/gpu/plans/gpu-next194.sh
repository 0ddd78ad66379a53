#!/usr/bin/env bash
# For the fifty-eighth session (~7 minutes with the file made), any card:
#  1. op tests of the one-token split in two groups of four warps (Path::SplitG2,
#     mla_split_tc_he2, new: two warps a scheduler, each group every other key tile) and of the
#     early split it sits beside;
#  2. alternating, defaults against TS_CUDA_MS_G2=1: tg64 at 16k (issue 5), also with 66 splits
#     (8 tiles a split, half the partial rows to merge); tg64 at 4k (the split's first depths);
#  3. H200 only, while young: the server with the defaults, 45 s (issue 6's figure).
#   OPS=.dev/ops tools/gpu/plans/gpu-next194.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -50
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
G="TS_CUDA_MS_G2=1"
stamp "== op tests"
ops_tests 240 4 mla_split
if grep -q "test result: ok" $O/ops.txt && ! grep -qE "FAIL|panicked" $O/ops.txt; then ok=1; else ok=0; fi
q8_ready
if [ $ok = 1 ]; then
  stamp "== tg64 at 16k"
  for r in 1 2; do for e in "" "$G"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
  for e in "TS_CUDA_MLA_SPLITS=66" "$G TS_CUDA_MLA_SPLITS=66"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
  stamp "== tg64 at 4k"
  for e in "" "$G"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 2 --hash; done
else
  stamp "MS_G2 failed its op tests: not timed"
fi
young 400 && issue6_server
stamp "== done"
