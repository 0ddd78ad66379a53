#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run; after gpu-next156/157.
# ~8 minutes. Knobs at 64 sequences (-d 96), each against the defaults in the same call:
#  - the forty-fifth session's prefetch sites: 24 MB of gate / up from the attention's merge
#    (+0.76% on one machine), the down stack's first experts from the GLU's quantisation
#    (TS_CUDA_XPF_GLU, never run);
#  - APF's third mode (the first norm's regions only) and a cap of 8 MB a region;
#  - the grouped rows kernels asking L2 for their group gi + d as they load gi
#    (TS_CUDA_DEFINES=MMQ_ROWS_PF=d, d = 2, 3; each define compiles its own CUBIN, ~60 s on
#    its first run). The same hash (7a3b5e11379cb707) for every one.
#   tools/gpu/plans/gpu-next158.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
[ -f $V ] || q8_bg
wait
stamp "== 64 sequences, knobs"
bpd 64 "-d 96" "" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF_GLU=12" "TS_CUDA_XPF_GLU=24" "TS_CUDA_APF=3" \
  "TS_CUDA_APF=1 TS_CUDA_APF_MB=8"
stamp "== the rows kernels' L2 requests ahead"
bpd 64 "-d 96" "TS_CUDA_DEFINES=MMQ_ROWS_PF=2" "TS_CUDA_DEFINES=MMQ_ROWS_PF=3" ""
bp 128 "TS_CUDA_DEFINES=MMQ_ROWS_PF=2" ""
stamp "== done"
