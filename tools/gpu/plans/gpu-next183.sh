#!/usr/bin/env bash
# Fifty-fifth session: the shared FFN's side stream on the int8 64-token tiles from its Q8_0
# weights (Path::SharedQ8, TS_CUDA_SHARED_Q8=1; 18 MB a layer read where the cuBLAS form reads
# 35 MB of f16 copies, beside the routed experts' stream). First its op test (moe_shared_fork:
# both forms against the CPU and f64, recorded steps bit for bit), then 64 sequences at -d 96
# alternating, then the server for it if it gains 0.8% or more. ~4-6 minutes with the file made.
# Ran once (H100): correct, but -6.7%; Path::SharedQ8 was removed (docs/PERF.md, fifty-fifth
# session); the plan needs commit 7f5155a's build.
#   tools/gpu/plans/gpu-next183.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_bg
stamp "== op test"
op_log 200 2 ops.txt "int8 fork|" "" moe_shared_fork
wait
stamp "== 64 sequences, -d 96"
for r in 1 2; do p64_best ""; p64_best "TS_CUDA_SHARED_Q8=1"; done
p64_best "TS_CUDA_SHARED_Q8=1 TS_CUDA_FORK_AHEAD=0"
serve_best
stamp "== done"
