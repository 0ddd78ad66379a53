#!/usr/bin/env bash
# The eleventh session's second measurement (2026-11-30): the rows kernels' activation scales as
# f32 in place (MMQ_XS32, default 1) against the f16 conversions in every warp (MMQ_XS32=0, the
# build before), one binary. Measured (H200): the same bits, slower (64 sequences 7,390 / 7,389
# against 7,503 / 7,494; 32 sequences 4,197 against 4,300), so MMQ_XS32 was removed again. The same
# call: server 5,534 tok/s (forward 20.36 of 20.72 s, 1,821 steps of 78.2 tokens), and the trace
# of the 64-sequence step (docs/PERF.md).
#   tools/gpu/plans/gpu-next15.sh BIN OPS
# ops_vs_cpu's rows tests (bit for bit against mmq_q8_16), 64 sequences interleaved twice, 32
# sequences, the server (64 clients, 20 s) with the default, and a trace of the 64-sequence step.
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 both ways.
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 1 rows_
ab64 2 "" TS_CUDA_DEFINES=MMQ_XS32=0
for e in "" TS_CUDA_DEFINES=MMQ_XS32=0; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
echo "== server default"
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" none $O/pf serve 2>&1 | grep -E "tokens:|TTFT|failures|steps_total|batch_tokens|seconds"
echo "== trace, 64 sequences"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/trace64.csv timeout 200 "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 2>&1 | grep -E "x64"
python3 tools/gpu/trace.py $O/trace64.csv 4 2>&1 | head -30
rm -f $O/trace64.csv
