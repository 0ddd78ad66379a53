#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run; after gpu-next162.
# ~8 minutes. (Forty-eighth session: the server run with every new path on and DenseMma's
# clusters of 8 dropped, those paths being slower on an H100; gpu-next162 checks on an H200.)
# 1. The server (64 clients, 60 s) with the defaults; its steady line is the server's own
#    token count from 6 s in to the deadline (all 64 clients running).
# 2. Knobs at 64 sequences (-d 96), against the defaults in the same call: 24 MB of gate / up
#    from the attention's merge (+0.76% on one machine in gpu-next153), the down stack's first
#    experts from the GLU's quantisation (TS_CUDA_XPF_GLU, never run), APF's third mode and a
#    cap of 8 MB a region, and the grouped rows kernels asking L2 for their group gi + d as they
#    load gi (TS_CUDA_DEFINES=MMQ_ROWS_PF=d, d = 2, 3: a CUBIN of its own each, ~60 s at its
#    first run), and the batch router's weights after its wait as before (RS_EARLY=0, against
#    the new default, before it). The same hash (7a3b5e11379cb707) for every one.
#   tools/gpu/plans/gpu-next158.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
stamp "== server"
serve64 "" 60 "--row-multiple 4"
stamp "== 64 sequences, knobs"
bpd 64 "-d 96" "" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "TS_CUDA_XPF_GLU=12" "TS_CUDA_APF=3" "TS_CUDA_APF=1 TS_CUDA_APF_MB=8"
bpd 64 "-d 96" "TS_CUDA_DEFINES=MMQ_ROWS_PF=2" "TS_CUDA_DEFINES=MMQ_ROWS_PF=3" "TS_CUDA_DEFINES=RS_EARLY=0" ""
stamp "== done"
