#!/usr/bin/env bash
# For the sixtieth session (~4 minutes with the file made; written in the fifty-ninth without a
# device), any card: one token's split leaving f16 partial rows divided by l (Path::HalfParts,
# TS_CUDA_HALF_PARTS=1: mla_split_tc_hep, merged by mla_out_q8p; half of mla_out_q8's 34.7 MB
# of L2 reads a layer at 16k; the rows rounded to f16, so other hashes).
#  0. On an H200, issue 6's server figure first.
#  1. the op tests (mla_out_half_parts: against the f32 rows within 5e-3 of the rms);
#  2. alternating, the defaults against HALF_PARTS=1: tg64 at 16k twice, at 4k once;
#  3. the 16k trace with HALF_PARTS=1 (mla_out_q8p's share against the ~9.0 us of mla_out_q8).
#   OPS=.dev/ops tools/gpu/plans/gpu-next202.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
HP="TS_CUDA_HALF_PARTS=1"
ops_tests 150 4 mla_out_half_parts fused_mla_attention_out mla_split
q8_ready
issue6_server
stamp "== tg64 at 16k"
for r in 1 2; do for e in "" "$HP"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg64 at 4k"
for e in "" "$HP"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
stamp "== trace at 16k (HALF_PARTS=1)"
TS_CUDA_HALF_PARTS=1 trace_tg 10 "" -d 16384
stamp "== done"
