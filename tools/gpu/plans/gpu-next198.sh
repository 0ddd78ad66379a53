#!/usr/bin/env bash
# For the fifty-eighth session (~3 minutes with the file made), any card:
#  1. H200 only: the server with the defaults, 45 s (issue 6's figure);
#  2. alternating, tg64 at 16k: defaults against TS_CUDA_MLA_OUT=512 (4 blocks a head instead of
#     8: at 16k each of a head's blocks merges all 132 splits, 271 KB from L2 a block, and
#     mla_out_q8 took 12.4 us under Nsight); tg128 once each (there it only halves the blocks).
#   tools/gpu/plans/gpu-next198.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
issue6_server
stamp "== tg64 at 16k"
for r in 1 2; do for e in "" "TS_CUDA_MLA_OUT=512"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done; done
stamp "== tg128"
for e in "" "TS_CUDA_MLA_OUT=512"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== done"
