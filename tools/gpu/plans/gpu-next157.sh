#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run; after gpu-next156.sh
# (the model file at $V must exist: it synthesises it when it does not). ~9 minutes.
# 1. 64 sequences at -d 96, a second round of gpu-next156's settings in another order.
# 2. 128 and 32 sequences with the switches off and on.
# 3. The server (64 clients, 30 s) with the defaults and with every switch on; its steady line
#    is the server's own token count from 3 s in to the deadline (all 64 clients running).
# Then gpu-next158.sh (the knobs). Make the winners the defaults (docs/PERF.md, docs/GPU.md's switch table, ARCHITECTURE.md, the
# Path docs); CombineUv and AbsorbMma only if their tests passed.
#   tools/gpu/plans/gpu-next157.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
[ -f $V ] || q8_bg
wait
ALL="TS_CUDA_COMBINE_NORM=1 TS_CUDA_COMBINE_UV=1 TS_CUDA_ABSORB_MMA=1"
stamp "== 64 sequences"
bpd 64 "-d 96" "$ALL TS_CUDA_APF=1" "$ALL" "TS_CUDA_APF=1" "TS_CUDA_ABSORB_MMA=1" "TS_CUDA_COMBINE_UV=1" "TS_CUDA_COMBINE_NORM=1" ""
stamp "== 128 / 32 sequences"
bp 128 "" "$ALL" "$ALL TS_CUDA_APF=1"
bp 32 "" "$ALL TS_CUDA_APF=1"
stamp "== server"
serve64 "" 30 "--row-multiple 4"
serve64 "$ALL TS_CUDA_APF=1" 30 "--row-multiple 4"
stamp "== done"
