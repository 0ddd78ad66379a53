#!/usr/bin/env bash
# The eleventh session's branch gpu-next14 (2026-11-30): the staged rows kernels
# (TS_CUDA_ROWS_ST=WxN, mmq_q8_rows_st<W>x<N>, commit d6e2013), one build against its own switches.
# Measured (part a, H200): every shape the same bits and slower than mmq_q8_rows (64 sequences
# 7,480 / 7,461 against 4x4 6,970 / 6,928, 8x4 7,147 / 7,142, 4x8 6,709 / 6,714, 8x3 7,207 /
# 7,239; 32 sequences 4,306 against 8x4 3,993), so the kernels were removed (docs/PERF.md).
#   tools/gpu/plans/gpu-next14.sh BIN OPS [a|b]
# a (~7 min): ops_vs_cpu's moe_rows_exact (every staged shape, tiled and row-major, bit for bit
#    against mmq_q8_16), then 64 sequences: the default (mmq_q8_rows) and each shape, twice,
#    interleaved; 32 sequences default and the best-guess shape.
# b: the server (64 clients) with the default and with a staged shape ($ST, default 8x4).
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 for every setting.
set -u
B=$1; OPS=$2; PART=${3:-a}
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
if [ "$PART" = a ]; then
  echo "== ops_vs_cpu moe_rows_exact"
  timeout 200 "$OPS" --test-threads 1 moe_rows_exact > $O/ops.txt 2>&1 || echo "ops_vs_cpu: exit $?"
  grep -E "FAIL|test result|panicked|differs|declined" $O/ops.txt | head -20
  wait
  ab64 2 "" TS_CUDA_ROWS_ST=4x4 TS_CUDA_ROWS_ST=8x4 TS_CUDA_ROWS_ST=4x8 TS_CUDA_ROWS_ST=8x3
  for e in "" TS_CUDA_ROWS_ST=${ST:-8x4}; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
  exit 0
fi
wait
for e in "" TS_CUDA_ROWS_ST=${ST:-8x4}; do
  echo "== server ${e:-default}"
  env $e TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" none $O/pf serve 2>&1 | grep -E "tokens:|TTFT|failures|steps_total|batch_tokens"
done
