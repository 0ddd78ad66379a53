#!/usr/bin/env bash
# The eleventh session's last measurement (2026-11-30): mmq_q8's stage copies to shared-space
# addresses computed once (MMQ_SADDR=1, default) against generic shared pointers (MMQ_SADDR=0: two
# S2R and a 64-bit add a copy, Nsight's SASS of the prompt expert product), one binary:
#   tools/gpu/plans/gpu-next19.sh BIN OPS
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 both ways (the dense 64-token
# products run on mmq_q8_64).
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 70 2 matmul_all_types mmq_rows_dense_exact
for e in "" TS_CUDA_DEFINES=MMQ_SADDR=0; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
for e in "" TS_CUDA_DEFINES=MMQ_SADDR=0; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash; done
