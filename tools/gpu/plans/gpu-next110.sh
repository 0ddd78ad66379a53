#!/usr/bin/env bash
# Thirty-third session, written after its device time was spent (not yet run), after
# gpu-next109. The server's mixed steps (128 prompt rows + ~60 decode rows: 188 rows, op by op
# on the prompt path, 13.6 ms each, ~19% of the server's time at 64 clients, gpu-next106: the
# MoE on the experts' f16 copies, mmh_gu 5.2 ms + mmh_dn 2.6 ms, reading twice Q8_0's bytes; the
# dense products on cuBLAS f16, ~2.4 ms with their f16_rows), 64 clients, 30 s each:
#  - TS_CUDA_MOE_T16=24: their MoE on the int8 16-token rows tiles;
#  - TS_CUDA_MMH=q8: on mmh straight from Q8_0 (half the bytes, converted in shared memory;
#    slower at pp512, which is compute-bound, than from the copies);
#  - TS_CUDA_DENSE_BLAS=0: their dense products on the int8 64-token tiles;
#  - TS_CUDA_GRAPH_MAX=256: recorded and replayed (their dense products call cuBLAS, which
#    no recording has held before: if its capture fails the backend reports the error and that
#    server run fails; the other runs are their own processes);
#  - T16 and GRAPH_MAX together.
# Add `--chain` / a prefill chunk to S if gpu-next109 keeps them.
#   tools/gpu/plans/gpu-next110.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
S="--row-multiple 1"
stamp "== server, 64 clients: the mixed steps' kernels"
serve64 "TS_CUDA_MOE_T16=24" 30 "$S"
serve64 "TS_CUDA_MMH=q8" 30 "$S"
serve64 "TS_CUDA_DENSE_BLAS=0" 30 "$S"
serve64 "TS_CUDA_GRAPH_MAX=256" 30 "$S"
serve64 "TS_CUDA_MOE_T16=24 TS_CUDA_GRAPH_MAX=256" 30 "$S"
rm -f $V
stamp "== done"
