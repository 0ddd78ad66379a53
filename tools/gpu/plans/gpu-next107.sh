#!/usr/bin/env bash
# Thirty-third session. gpu-next106's server traces: the decode steps' batch attention
# (mla_split_18_16_h, SIMT) takes 51-56 us a layer, 1.4-1.5 ms of a ~8.8 ms step, against 20.9
# in the bench at 64 sequences: the server's contexts run 32..160 tokens, and below
# TS_CUDA_MLA_KEYS (256) keys a token gets one split, so 64 blocks (one token's 16 heads each)
# on 132 SMs. Server, 64 clients, 30 s each: default (router split on), 2 splits from 32 keys
# (MLA_KEYS=32), 4 splits (MLA_SPLITS=4), the tensor-core split kernel (MLATC=1).
#   tools/gpu/plans/gpu-next107.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
R="TS_CUDA_ROUTER_SPLIT=1"
stamp "== server, 64 clients: the batch attention's splits"
serve64 "$R" 30
serve64 "$R TS_CUDA_MLA_KEYS=32" 30
serve64 "$R TS_CUDA_MLA_SPLITS=4" 30
serve64 "$R TS_CUDA_MLATC=1" 30
rm -f $V
stamp "== done"
