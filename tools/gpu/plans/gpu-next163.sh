#!/usr/bin/env bash
# Forty-ninth session, on the warm H100 after gpu-next158 (XPF=24 XPF_AT=2 gave 7,757 against
# 7,660 / 7,663 at 64 sequences, +1.2%; +0.76% on an H200 in gpu-next153). ~5.5 minutes.
# 1. 64 sequences -d 96: 24 / 32 / 16 MB from the attention's merge, between two default runs.
# 2. The server (64 clients, 60 s) with 24 MB from the merge (defaults: 7,419 steady on this
#    machine in gpu-next158).
#   tools/gpu/plans/gpu-next163.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
stamp "== 64 sequences"
bpd 64 "-d 96" "" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=2" \
  "TS_CUDA_XPF=16 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=12" ""
stamp "== server"
serve64 "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" 60 "--row-multiple 4"
stamp "== done"
