#!/usr/bin/env bash
# Forty-first session: Path::QkvJoint (q and kv_a as one cuBLAS product of their f16 copies side
# by side, read by norm_rope_cache from the op's own rows; TS_CUDA_QKV_JOINT=0 is the old
# chain). 1. Op tests: qkv_joint_batch (joint against two products), and the tests whose paths
# it touches. 2. 64 sequences at -d 96, 128 sequences. 3. The server (chunks of
# 512, and of 1,024).
#   tools/gpu/plans/gpu-next141.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
J=TS_CUDA_QKV_JOINT=0
ops_tests 200 2 qkv_joint_batch fused_mla_rope_absorb fused_norm_rope_cache_write dense_blas_batch recorded_steps_replay
grep -E "qkv_joint|worst" $O/ops.txt | head -12
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" $J
bp 128 "" $J
stamp "== server"
serve64 "" 30
serve64 "$J" 30
serve64 "" 30 "--row-multiple 1 --prefill-chunk 1024"
rm -f $V
stamp "== done"
