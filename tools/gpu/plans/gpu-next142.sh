#!/usr/bin/env bash
# Forty-first session, the final tree: every op test (BlasFork removed, the norm_rope_cache
# kernels' new token strides, qkv_joint_batch), then the server with its new defaults
# (Path::QkvJoint, prefill chunks of 1,024 on CUDA).
#   tools/gpu/plans/gpu-next142.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
TS_OPS_LIMIT=250 ops_and_model
grep -E "^test .*(FAIL|ok)$" $O/ops.txt | wc -l
stamp "== server"
serve64 "" 30
rm -f $V
stamp "== done"
