#!/usr/bin/env bash
# Fifty-sixth session, after gpu-next188 (~7 minutes with the file made), any card:
#  1. 64 sequences at -d 96, alternating, two rounds: the defaults (the down launch's first 128
#     blocks ask their tiles into L2 before their wait, MMQ_DN_PF=128), that off (MMQ_DN_PF=0),
#     and the same for the gate/up launch on top (MMQ_GU_PF=64 / 128);
#  2. the server with the defaults and with MMQ_DN_PF=0 (the H200's is issue 6's figure).
#   tools/gpu/plans/gpu-next189.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  p64_best ""
  p64_best "TS_CUDA_DEFINES=MMQ_DN_PF=0"
  for pf in 64 128; do p64_best "TS_CUDA_DEFINES=MMQ_GU_PF=$pf"; done
done
stamp "best: '$best' $bestv against the defaults' $base"
stamp "== server"
serve64 "" 45 "--row-multiple 4"
serve64 "TS_CUDA_DEFINES=MMQ_DN_PF=0" 45 "--row-multiple 4"
stamp "== done"
