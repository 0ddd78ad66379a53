#!/usr/bin/env bash
# For the fifty-eighth session (~8 minutes with the file made), any card; on an H200 the
# server's issue-6 figure first (9,621-9,630 in the fifty-fourth session; since then +2.7% and
# +0.74% on H100s):
#  1. H200 only: the server with the defaults, 45 s;
#  2. 64 sequences at -d 96, alternating, one round (two while the call is young): the
#     defaults; the merge asking for the gate/up experts after those the gate/up launch's own
#     first blocks ask for (TS_CUDA_XPF_ROWS=128 TS_CUDA_XPF_SKIP=18, TS_CUDA_XPF = 8 / 16 / 24
#     MB: half of it from each stack); Path::HeadMmh (the output head on mmh8_dn from its Q8_0
#     rows: -0.2% on an H100 in the fifty-fifth session, never run on an H200);
#  3. the server with the best if it beat the defaults by 0.3% or more.
#   tools/gpu/plans/gpu-next193.sh BIN 2>&1 | tee $OUT/log.txt | grep -vE "^tg32 @|tokens of tg32 @" | tail -40
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
young() { [ $(( $(date +%s) - T0 )) -lt $1 ]; }
q8_ready
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  stamp "== server, 64 clients, 45 s (H200: issue 6's figure)"
  serve64 "" 45 "--row-multiple 4"
fi
stamp "== 64 sequences, -d 96"
S="TS_CUDA_XPF_ROWS=128 TS_CUDA_XPF_SKIP=18"
for r in 1 2; do
  [ $r = 2 ] && ! young 200 && break
  p64_best ""
  for mb in 8 16 24; do p64_best "$S TS_CUDA_XPF=$mb"; done
  p64_best "TS_CUDA_HEAD_MMH=1"
done
stamp "best: '$best' $bestv against the defaults' $base"
if young 480 && python3 -c "import sys; sys.exit(0 if $bestv > 1.003 * $base else 1)"; then
  serve64 "$best" 45 "--row-multiple 4"
fi
stamp "== done"
