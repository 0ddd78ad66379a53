#!/usr/bin/env bash
# For the fifty-ninth session (~5 minutes with the file made), any card: one token's attention
# output after a split kernel on `mla_out_q8g` (Path::OutWoReg, TS_CUDA_MO_WOG=1; off by default
# until measured): W_o's pieces in registers before the PDL wait, 86 KB of shared memory a block
# instead of 122, so that it fits beside a 136 KB split block; TS_CUDA_CARVE=1 also asks the
# largest shared-memory carveout for the split kernels and mla_out_q8g.
#  1. the attention-output op tests (mla_out_q8g against mla_out_q8 bit for bit);
#  2. alternating, defaults / WOG=1 / WOG=1 CARVE=1: tg64 at 16k twice; tg64 at 4k and tg128 once;
#  3. the 16k trace with WOG=1. On an H200, issue 6's server figure first (then the
#     16k runs once, not twice).
# TS_PLAN_SHORT=1: steps 1 and 2 without tg128 (~3.5 minutes).
#   OPS=.dev/ops tools/gpu/plans/gpu-next201.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
W0=""
W1="TS_CUDA_MO_WOG=1"
CV="TS_CUDA_MO_WOG=1 TS_CUDA_CARVE=1"
ops_tests 150 4 fused_mla_attention_out short_attention mla_split_early
q8_ready
issue6_server
stamp "== tg64 at 16k"
for r in 1 $(is_h200 || echo 2); do for e in "$W0" "$W1" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg64 at 4k"
for e in "$W0" "$W1" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
[ -n "${TS_PLAN_SHORT:-}" ] && { stamp "== done (short)"; exit 0; }
stamp "== tg128"
for e in "$W0" "$W1" "$CV"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== trace at 16k (WOG=1)"
TS_CUDA_MO_WOG=1 trace_tg 10 "" -d 16384
stamp "== done"
