#!/usr/bin/env bash
# Written at the end of the fortieth session (device time spent), for the next one: the output
# head of decode batches on the int8 tiles again (`TS_CUDA_HEAD_BLAS=0`, Path::HeadBlas off)
# against cuBLAS from its f16 copy (the default since the thirty-ninth session). The head reads
# 419 MB of f16 a step on cuBLAS, 223 MB of Q8_0 on the int8 tiles: at ~3.3 TB/s ~60 us of a
# ~6.8 ms 64-row step, if the int8 tiles stream it as fast. Tokens may change (other logits
# bits), so the hashes may differ.
# 1. 64 sequences at -d 96 (twice each), 128 sequences. 2. The server, both ways.
#   tools/gpu/plans/gpu-next139.sh BIN 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
H=TS_CUDA_HEAD_BLAS=0
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" $H "" $H
bp 128 "" $H
stamp "== server"
serve64 "" 30
serve64 "$H" 30
rm -f $V
stamp "== done"
