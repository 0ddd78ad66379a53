#!/usr/bin/env bash
# One device call for the merge of gpu-next3's winners plus this session's long-context and MoE
# changes (docs/PERF.md): op tests, then tg128 against main's build, the down-weight prefetch
# modes, the split MLA decode at 16k context (SIMT / tensor cores, split counts) and a trace.
#   tools/gpu/plans/gpu-next4.sh BIN OPS_TEST MAIN_BIN
# Run once on 2026-11-30 (docs/PERF.md); the TS_CUDA_DPF modes it compares were dropped after it.
set -u
B=$1; OPS=$2; M=$3
source "$(dirname "$0")/lib.sh"
ops_and_model
for r in 1 2; do
  b "" "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  for e in "" TS_CUDA_DPF=0 TS_CUDA_DPF=2 TS_CUDA_DPF=3; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
for e in "" TS_CUDA_MLA_SPLITS=132 TS_CUDA_MLATC=1 "TS_CUDA_MLATC=1 TS_CUDA_MLA_SPLITS=132"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
done
b "" "$M" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "TS_CUDA_DPF=3" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/trace16k.csv "$B" bench --backend cuda -m $V -p 0 -n 32 -d 16384 -r 1 2>&1 | grep -E "cuda trace|tg"
python3 tools/gpu/trace.py $O/trace16k.csv 16 2>/dev/null | head -14
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/trace.csv "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 2>&1 | grep -E "cuda trace|tg"
python3 tools/gpu/trace.py $O/trace.csv 16 2>/dev/null | head -14
