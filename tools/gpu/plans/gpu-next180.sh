#!/usr/bin/env bash
# Fifty-fourth session: is the H200's 64-sequence bench 2% slower than in the forty-fifth session
# (9,735 at -d 96 in gpu-next176 against 9,926-9,946) because of the code or the card? The
# forty-fifth session's last build (fd32527, OLD) against this one (BIN), alternating, at
# `--parallel 64 -n 32 -r 2 -d 96` (OLD also with this build's expert prefetch: 24 MB from the
# merge); then this build under the H100-chosen defaults' old values and the head on the int8
# rows kernel; the server with the best of those if it beats the defaults by 0.8%. ~5-7 minutes.
#   tools/gpu/plans/gpu-next180.sh BIN OLD 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OLD=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
stamp "== old against new, -d 96"
p64_best ""
p64_best "" "$OLD"
p64_best ""
p64_best "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "$OLD"
p64_best "" "$OLD"
p64_best ""
stamp "== this build's knobs"
for e in "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1" "TS_CUDA_DEFINES=RS_EARLY=0" "TS_CUDA_XPF=0" "TS_CUDA_FORK_AHEAD=0" "TS_CUDA_HEAD_BLAS=0 TS_CUDA_MMQ_ROWS=64"; do p64_best "$e"; done
p64_best ""
serve_best
stamp "== done"
