#!/usr/bin/env bash
# Forty-first session. 1. What one joint cuBLAS product of q and kv_a (3,648 rows) costs against
# the two (3,072 + 576) at 64 and 80 rows (torch's f16 matmul in a CUDA graph, 8 weight sets
# rotated so L2 does not hold them): is one launch for both worth the work? 2. The server with
# wider prefill chunks (the 64 clients' 2,048 prompt tokens of a wave in 2 or 1 steps).
#   tools/gpu/plans/gpu-next140.sh BIN 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=${2:-}
source "$(dirname "$0")/lib.sh"
[ -f $V ] || q8_bg
python3 "$(dirname "$0")/../qkv_joint_mb.py" 2>&1 | tail -4
wait
stamp "== server, prefill chunks"
serve64 "" 30 "--row-multiple 1 --prefill-chunk 1024"
serve64 "" 30 "--row-multiple 1 --prefill-chunk 2048"
serve64 "" 30
rm -f $V
stamp "== done"
