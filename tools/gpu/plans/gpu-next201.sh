#!/usr/bin/env bash
# For the fifty-ninth session (~5 minutes with the file made), any card: one token's attention
# output after a split kernel on `mla_out_q8g` (Path::OutWoReg, new default; TS_CUDA_MO_WOG=0 is
# mla_out_q8): W_o's pieces in registers before the PDL wait, 86 KB of shared memory a block
# instead of 122, so that it fits beside a 136 KB split block; TS_CUDA_CARVE=1 also asks the
# largest shared-memory carveout for the split kernels and mla_out_q8g.
#  1. the attention-output op tests (mla_out_q8g against mla_out_q8 bit for bit);
#  2. alternating, WOG=0 / defaults / CARVE=1: tg64 at 16k twice; tg64 at 4k and tg128 once;
#  3. the 16k trace with the defaults; on an H200, issue 6's server figure.
#   OPS=.dev/ops tools/gpu/plans/gpu-next201.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
W0="TS_CUDA_MO_WOG=0"
CV="TS_CUDA_CARVE=1"
ops_tests 150 4 fused_mla_attention_out short_attention mla_split_early
q8_ready
stamp "== tg64 at 16k"
for r in 1 2; do for e in "$W0" "" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg64 at 4k"
for e in "$W0" "" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
stamp "== tg128"
for e in "$W0" "" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== trace at 16k"
trace_tg 10 "" -d 16384
young 420 && issue6_server
stamp "== done"
