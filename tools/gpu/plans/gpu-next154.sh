#!/usr/bin/env bash
# Forty-fifth session, third call: the expert prefetch's site and size again on another machine
# (gpu-next152 had 32 MB from the FFN norm +1.0%, gpu-next153 +0.0% there but 24 MB from the
# attention's merge +0.76%): sizes from the merge, with L2::evict_last, split between the merge
# and the FFN norm; the down stack's first experts from the GLU's quantisation (TS_CUDA_XPF_GLU,
# MB); the server with both off and with 24 MB from the merge and 12 from the GLU's launch.
#   tools/gpu/plans/gpu-next154.sh BIN 2>&1 | tee $OUT/log.txt | tail -60   (~7 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
bpd 64 "-d 96" "TS_CUDA_XPF=0" "" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2 TS_CUDA_XPF_GLU=12" \
  "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2 TS_CUDA_XPF_GLU=24" "TS_CUDA_XPF=0 TS_CUDA_XPF_GLU=16" "TS_CUDA_XPF=0" \
  "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" ""
stamp "== server"
serve64 "TS_CUDA_XPF=0" 30 "--row-multiple 4"
serve64 "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2 TS_CUDA_XPF_GLU=12" 30 "--row-multiple 4"
stamp "== done"
