#!/usr/bin/env bash
# Fifty-sixth session. Any card (~7 minutes with the file made):
#  1. op test argmax_rows_exact (the arg-max's float4 form, Path::ArgmaxVec, against the CPU);
#  2. 64 sequences at -d 96, alternating, up to two rounds (the second only while the call is
#     young): the defaults (ArgmaxVec on), the scalar arg-max (TS_CUDA_ARGMAX_VEC=0), the MoE
#     down launch's first B blocks asking their tiles into L2 during gate/up's tail
#     (MMQ_DN_PF=B, B = 128 / 256), and the GLU launch asking 24 MB of the down stack
#     (TS_CUDA_XPF_GLU=24; 12 measured -0.1% on an H100);
#  3. on an H200 only: the server with the defaults (issue 6's figure), and with the best
#     setting if it beat the defaults by 0.5% or more (while time is left).
#   tools/gpu/plans/gpu-next188.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
ops_tests 120 1 argmax_rows_exact
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  [ $r = 2 ] && ! young 260 && break
  p64_best ""
  p64_best "TS_CUDA_ARGMAX_VEC=0"
  for pf in 128 256; do p64_best "TS_CUDA_DEFINES=MMQ_DN_PF=$pf"; done
  p64_best "TS_CUDA_XPF_GLU=24"
done
stamp "best: '$best' $bestv against the defaults' $base"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  serve64 "" 45 "--row-multiple 4"
  if young 470 && python3 -c "import sys; sys.exit(0 if $bestv > 1.005 * $base else 1)"; then
    serve64 "$best" 45 "--row-multiple 4"
  fi
fi
stamp "== done"
