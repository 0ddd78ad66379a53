#!/usr/bin/env bash
# For the fifty-seventh session (~9 minutes with the file made), any card; on an H200 the
# server figure first (issue 6: 9,621-9,630 in the fifty-fourth session, before MMQ_GU_PF /
# MMQ_DN_PF, which gained 2.7% on an H100 in the fifty-sixth):
#  1. H200 only: the server with the defaults, 45 s;
#  2. 64 sequences at -d 96, alternating, one round (two only if the call is young): the defaults
#     (GU 128, DN 128, the merge's expert prefetch on), gate/up blocks 96 / 160 / 192 (the
#     H200's L2 is 60 MB against the H100's 50), the merge's prefetch off (TS_CUDA_XPF=0: it
#     asks for the same first experts), and both prefetches off (the old step);
#  3. 32 and 128 sequences: the defaults against both off (the prefetch must not cost there);
#  4. the server with the best 64-sequence setting if it beat the defaults by 0.3% or more.
#   tools/gpu/plans/gpu-next190.sh BIN 2>&1 | tee $OUT/log.txt | grep -vE "^tg32 @|tokens of tg32 @" | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
issue6_server
stamp "== 64 sequences, -d 96"
OFF="TS_CUDA_DEFINES=MMQ_GU_PF=0,MMQ_DN_PF=0"
# (a 64-sequence run took ~48 s on an H100 in the fifty-sixth session, the model's load included:
# one round of six is ~5 minutes, so the second round, 32 / 128 and the last server run only
# while the call has time left under its 600-s limit)
for r in 1 2; do
  [ $r = 2 ] && ! young 200 && break
  p64_best ""
  for pf in 96 160 192; do p64_best "TS_CUDA_DEFINES=MMQ_GU_PF=$pf"; done
  p64_best "TS_CUDA_XPF=0"
  p64_best "$OFF"
done
stamp "best: '$best' $bestv against the defaults' $base"
if young 380; then
  stamp "== 32 and 128 sequences"
  bpd 32 "-d 96" "" "$OFF"
  bpd 128 "-d 96" "" "$OFF"
fi
if young 480 && python3 -c "import sys; sys.exit(0 if $bestv > 1.003 * $base else 1)"; then
  serve64 "$best" 45 "--row-multiple 4"
fi
stamp "== done"
