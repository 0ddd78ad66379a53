#!/usr/bin/env bash
# For the sixtieth session (~5 minutes with the file made), any card, with Path::HalfParts on by
# default: whether the tensor-core split's threshold for one token (TS_CUDA_MLA_LONG, 2560) should
# come down now that its merge reads half the bytes, and the 16k figure against HALF_PARTS=0 on
# a second card.
#  0. On an H200, issue 6's server figure first, then the gate/up prefetch's block count at 64
#     sequences (MMQ_GU_PF 128, the H100's best, against 160 and 192 for the H200's 60 MB L2).
#  1. tg64 at 1k and 2k: the defaults (SIMT split below 2,560) against TS_CUDA_MLA_LONG=1;
#  2. tg64 at 16k: the defaults against TS_CUDA_HALF_PARTS=0, twice; tg128 at 0 once.
#   tools/gpu/plans/gpu-next204.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
if is_h200; then
  issue6_server
  stamp "== 64 sequences, MMQ_GU_PF"
  bpd 64 "-d 96" "" "TS_CUDA_DEFINES=MMQ_GU_PF=160" "TS_CUDA_DEFINES=MMQ_GU_PF=192" ""
fi
stamp "== tg64 at 1k and 2k: SIMT against tensor-core split"
for d in 1024 2048; do for e in "" "TS_CUDA_MLA_LONG=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d $d -r 1 --hash; done; done
stamp "== tg64 at 16k"
for r in 1 2; do for e in "" "TS_CUDA_HALF_PARTS=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
