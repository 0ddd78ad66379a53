#!/usr/bin/env bash
# The eleventh session's third measurement (2026-11-30): row sets a warp in the grouped rows kernel
# (TS_CUDA_ROWS_R=2|4: mmq_q8_rows_r2 / _r4, 128 / 256 rows a block, one block start for R sets),
# one binary against its default (R = 1):
#   tools/gpu/plans/gpu-next16.sh BIN OPS
# ops_vs_cpu's rows tests (bit for bit), 64 sequences interleaved twice, 32 sequences, 128
# sequences, the server with the best guess (R=$RR, default 2).
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 for every setting.
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 1 rows_
ab64 2 "" TS_CUDA_ROWS_R=2 TS_CUDA_ROWS_R=4
for e in "" TS_CUDA_ROWS_R=2 TS_CUDA_ROWS_R=4; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
for e in "" TS_CUDA_ROWS_R=2 TS_CUDA_ROWS_R=4; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1; done
echo "== server TS_CUDA_ROWS_R=${RR:-2}"
TS_CUDA_ROWS_R=${RR:-2} TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" none $O/pf serve 2>&1 | grep -E "tokens:|TTFT|failures|steps_total|batch_tokens|seconds"
