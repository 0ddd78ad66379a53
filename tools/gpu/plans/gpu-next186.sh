#!/usr/bin/env bash
# Fifty-fifth session: the output head of a decode batch on the prompt MoE's Hopper kernel
# (Path::HeadMmh, TS_CUDA_HEAD_MMH=1: mmh8_dn reads the head's Q8_0 rows, 223 MB for V2-Lite,
# where cuBLAS reads the 419 MB f16 copy; ~121 us of the H200's 6.5-ms 64-row step). Its op test,
# then 64 sequences at -d 96 alternating. ~2 minutes with the file made.
#   tools/gpu/plans/gpu-next186.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== op test"
op_log 90 2 ops.txt "HeadMmh|" "" head_mmh
wait
stamp "== 64 sequences, -d 96"
for r in 1 2; do p64_best ""; p64_best "TS_CUDA_HEAD_MMH=1"; done
stamp "== done"
