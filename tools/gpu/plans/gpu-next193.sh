#!/usr/bin/env bash
# For the fifty-eighth session (~9 minutes with the file made), any card:
#  1. op tests of the MLA kernels with MLA_LDSM_S=1 (new, written without a device: the MLA
#     tensor-core kernels' ldmatrix from shared-space addresses, the score loop's steps known at
#     compile time; static SASS: mla_split_tc_he's tile loop 1,168 -> 572 instructions);
#  2. H200 only: the server with the defaults, 45 s (issue 6's figure);
#  3. alternating, defaults against MLA_LDSM_S=1 (the same bits: the hashes must agree): tg64
#     at 16k (issue 5; also with two split blocks an SM, 264 splits: with half the instructions
#     the old verdict, -8% in the twenty-ninth session, may turn), 64 sequences at -d 96 twice
#     (the batch split kernel), pp2048;
#  4. while the call is young: 64 sequences with the merge asking for the gate/up experts after
#     the launch's own first blocks' (TS_CUDA_XPF_ROWS=128 TS_CUDA_XPF_SKIP=18, XPF 8 / 16 MB),
#     and Path::HeadMmh (-0.2% on an H100 in the fifty-fifth session, never run on an H200).
#   OPS=.dev/ops tools/gpu/plans/gpu-next193.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | grep -vE "^tg32 @|tokens of tg32 @" | tail -50
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
L="TS_CUDA_DEFINES=MLA_LDSM_S=1"
stamp "== op tests, MLA_LDSM_S=1"
TS_CUDA_DEFINES=MLA_LDSM_S=1 ops_tests 240 4 mla cache_write_and_attention
if grep -q "test result: ok" $O/ops.txt && ! grep -qE "FAIL|panicked" $O/ops.txt; then ok=1; else ok=0; fi
q8_ready
issue6_server
if [ $ok = 1 ]; then
  stamp "== tg64 at 16k"
  for e in "" "$L" "$L TS_CUDA_MS_NB=2 TS_CUDA_MLA_SPLITS=264"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
  stamp "== 64 sequences, -d 96"
  for r in 1 2; do p64_best ""; p64_best "$L"; done
  stamp "== pp2048"
  for e in "" "$L"; do b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3; done
else
  stamp "MLA_LDSM_S=1 failed its op tests: not timed"
fi
S="TS_CUDA_XPF_ROWS=128 TS_CUDA_XPF_SKIP=18"
if young 420; then
  stamp "== 64 sequences: XPF_SKIP, HeadMmh"
  p64_best ""
  for mb in 8 16; do p64_best "$S TS_CUDA_XPF=$mb"; done
  p64_best "TS_CUDA_HEAD_MMH=1"
fi
stamp "best: '$best' $bestv against the defaults' $base"
stamp "== done"
