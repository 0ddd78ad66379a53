#!/usr/bin/env bash
# First GPU run of branch gpu-next10 (written 2026-11-30, ninth session):
#  - mmq_q8_rows: the grouped expert products on 16-token tiles (the batched decode) read their
#    weights straight into the mma fragments, 8 bytes a thread a block, with no shared-memory
#    staging (the tile's activation rows whole in shared memory once). The same int32 per block
#    and the same summation order as mmq_q8_16: the same bits (ops_vs_cpu moe_rows_exact; the
#    --parallel 64 hash must stay 33948fa635fb0682). TS_CUDA_MOE_ROWS=0: mmq_q8_16; =6: the
#    variant bounded to 6 blocks an SM (79 registers against 102).
# Ran 2026-11-30 (parts a and b; then .dev's r3 run of TS_CUDA_MOE_ROWS=3/4, groups in flight):
# figures in docs/PERF.md and kernels/mmq.cu; the 6-block and 3/4-group variants were removed.
#   tools/gpu/plans/gpu-next10.sh BIN OPS_TEST BASE_BIN [a|b]
#   BASE_BIN: main's build (.dev/n8/turbospark).
set -u
B=$1; OPS=$2; M=$3; PART=${4:-a}
source "$(dirname "$0")/lib.sh"
if [ "$PART" = b ]; then
  [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  "$OPS" moe_rows_exact 2>&1 | grep -E "moe_rows:|test result|panicked" | head -12
  wait
  for e in "" TS_CUDA_MOE_ROWS=0; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash; done
  # Nsight on the new kernel at 64 sequences (the gate/up launch and the down launch).
  NCU_EXTRA='--section ComputeWorkloadAnalysis --section InstructionStats' NCU_SKIP=300 NCU_COUNT=2 NCU_LINES=70 tools/gpu/ncu.sh "$B" 'mmq_q8_rows' -p 0 -n 4 --parallel 64 -r 1
  # The server under 64 clients.
  for bin in "$M" "$B"; do
    echo "== server $bin"
    TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$bin" "$OPS" $O/pf serve 2>&1 | grep -E "tokens:|TTFT|requests:|failures"
  done
  exit 0
fi
ops_and_model
grep -E "moe_rows|worst" $O/ops.txt | grep -i rows | head -8
for r in 1 2; do
  b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  for e in "" TS_CUDA_MOE_ROWS=0 TS_CUDA_MOE_ROWS=6; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash; done
done
# Other batch sizes that take 16-token tiles (pairs <= 16 x experts).
for p in 16 32 128; do
  for e in TS_CUDA_MOE_ROWS=0 ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel $p -r 1 --hash; done
done
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/par64.csv "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 1 2>&1 | grep -E "cuda trace|tg"
python3 tools/gpu/trace.py $O/par64.csv 8 2>/dev/null | head -16
