#!/usr/bin/env bash
# For the fifty-ninth session (~5 minutes with the file made), any card: one token's splits
# merged in the split launch's own tail (Path::SplitTail, mla_split_tc_het, new default;
# TS_CUDA_MS_TAIL=0 is the old chain: mla_out_q8's blocks each merging all of a head's splits):
#  1. the split and attention-output op tests (mla_split_tail: against mla_combine, and 40
#     launches back to back for the same bits);
#  2. alternating, TS_CUDA_MS_TAIL=0 against the defaults: tg64 at 16k twice, at 4k once;
#  3. with the tail, a two-tile ring (TS_CUDA_MS_NB=2: 99 KB, so mla_out_q8's block fits
#     beside a split block and loads its weights during the split) at 16k;
#  4. the 16k trace with the tail; on an H200, issue 6's server figure.
#   OPS=.dev/ops tools/gpu/plans/gpu-next200.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
T0FF="TS_CUDA_MS_TAIL=0"
ops_tests 150 4 mla_split fused_mla_attention_out short_attention
q8_ready
stamp "== tg64 at 16k"
for r in 1 2; do for e in "$T0FF" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg64 at 4k"
for e in "$T0FF" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
stamp "== 16k, two-tile ring"
b "TS_CUDA_MS_NB=2" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== trace at 16k (tail)"
trace_tg 16 "" -d 16384
young 420 && issue6_server
stamp "== done"
