#!/usr/bin/env bash
# RUN (twelfth session, 10-s runs): defaults 5,357, MLATC=1 5,813, MLA_SPLITS=2 5,647,
# MLATC=1 + MMQ_ROWS=128 5,480.
# Twelfth session (2026-11-30): the server trace (gpu-next25) put 1.36 ms of a 9.8 ms step in the
# batched MLA decode (mla_split_18_16_h, 50 us a layer against 6 in the bench's 64-row steps: the
# server's sequences are 32-160 positions long, and from TS_CUDA_MLA_KEYS=256 keys a split each
# token gets one split, 64-76 blocks) and 3.0 ms in the dense mmq_q8_64 (21.5 us against 11.3:
# 76 tokens make two 64-token tiles). The server at 64 clients, 10 s each, under the switches
# that exist for both (TS_CUDA_MLA_KEYS cannot help: above 66 rows sm_count / n already gives
# one split). TS_CUDA_MLATC=1: the batched MLA on the tensor-core split kernel (3 splits a token
# at 76 rows); TS_CUDA_MLA_SPLITS=2: two SIMT splits; TS_CUDA_MMQ_ROWS=128: dense products of up
# to 128 tokens on 16-token tiles (mmq_q8_rows_d).
#   tools/gpu/plans/gpu-next26.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
for e in "" TS_CUDA_MLATC=1 TS_CUDA_MLA_SPLITS=2 "TS_CUDA_MLATC=1 TS_CUDA_MMQ_ROWS=128"; do serve64 "$e" 10; done
