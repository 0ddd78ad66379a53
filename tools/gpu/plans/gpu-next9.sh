#!/usr/bin/env bash
# First GPU run of branch gpu-next9 (written 2026-11-30, eighth session, without a GPU):
#  - split-K Q8_0 products reduced inside mmq_q8 by the tile's last block (tickets in a module
#    global that the last block puts back to zero) instead of an mmq_sum_splits launch: the same
#    bits (TS_CUDA_MMQ_FOLD=0 to compare; ops_vs_cpu mmq_split_k_fold_exact checks it against a
#    backend with it off). The 64-sequence step ran 187 mmq_sum_splits at 2.3 us (3.7%);
#  - matmul_many above the GEMV sizes quantises its input once for all jobs (q + kv_a, the dense
#    FFN's gate + up): the same bits, one quant_q8_groups fewer a layer;
#  - TS_CUDA_MLA_KEYS1=n (off by default): one decode token's SIMT split MLA takes no more splits
#    than runs of n keys (measured at 16, 32, 64 on tg128 and at depth 1024);
#  - TS_CUDA_GU_PF=1 (off by default): the decode MoE kernels (Q8_0 and f16/bf16) first ask L2
#    for the rest of each warp's weight rows (prefetch.global.L2), so a warp's rows or rounds
#    stream at once instead of one DRAM round trip each; the same bits (tg128 keeps its hash).
#   tools/gpu/plans/gpu-next9.sh BIN OPS_TEST BASE_BIN [a|b|p|c]   (about 6, 7, 4 and 5 minutes)
#   BASE_BIN: main's build before the branch (.dev/n8/turbospark).
# Expect: ops_vs_cpu all pass (23 with the new test); every hash equal to the base build's:
# tg128 756941f1d106faec, --parallel 64 -r 2 33948fa635fb0682.
# Part c: the llama and gemma3 families at their shipped shapes (synth smollm2-135m,
# gemma3-270m: the first CUDA figures for them) and V2-Lite bf16 with a decode trace.
set -u
B=$1; OPS=$2; M=$3; PART=${4:-a}
source "$(dirname "$0")/lib.sh"
if [ "$PART" = p ]; then
  # The read patterns alone (tools/gpu/bwprobe.cu): is 2.3 TB/s the way mmq_q8 reads weights?
  /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/bwprobe tools/gpu/bwprobe.cu && /tmp/bwprobe
  # Nsight Compute on the products that hold the prompts (mmq_q8_64: pp512, issue-bound at ~85
  # TOPS in the second session's profile) and the 64-sequence step (mmq_q8_16: 2.3 TB/s): stall
  # reasons, occupancy, instruction mix. About 3 minutes.
  [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
  NCU_EXTRA='--section ComputeWorkloadAnalysis --section InstructionStats' NCU_SKIP=60 NCU_COUNT=3 NCU_LINES=90 tools/gpu/ncu.sh "$B" 'mmq_q8_64$' -p 512 -n 0 -r 1
  NCU_EXTRA='--section ComputeWorkloadAnalysis --section InstructionStats' NCU_SKIP=300 NCU_COUNT=3 NCU_LINES=90 tools/gpu/ncu.sh "$B" 'mmq_q8_16$' -p 0 -n 4 --parallel 64 -r 1
  # The decode MoE (2.4 TB/s in the seventh session's trace: 31 us a layer for 73.5 MB).
  NCU_SKIP=60 NCU_COUNT=2 NCU_LINES=60 tools/gpu/ncu.sh "$B" 'moe_gateup_sh_q8q|moe_down_sh_q8' -p 0 -n 8 -r 1
  exit 0
fi
if [ "$PART" = c ]; then
  for pr in smollm2-135m gemma3-270m; do
    "$B" synth --preset $pr -o /tmp/$pr.gguf >/dev/null 2>&1
    b "" "$M" bench --backend cuda -m /tmp/$pr.gguf -p 512 -n 128 -r 3 --hash
    b "" "$B" bench --backend cuda -m /tmp/$pr.gguf -p 512 -n 128 -r 3 --hash
    b "" "$B" bench --backend cuda -m /tmp/$pr.gguf -p 0 -n 32 --parallel 64 -r 2
  done
  "$B" synth --preset deepseek-v2-lite --quant bf16 -o /tmp/v2lite-bf16.gguf >/dev/null 2>&1
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/bf16.csv "$B" bench --backend cuda -m /tmp/v2lite-bf16.gguf -p 0 -n 32 -r 1 2>&1 | grep -E "cuda trace|tg"
  python3 tools/gpu/trace.py $O/bf16.csv 16 2>/dev/null | head -16
  for e in "" TS_CUDA_GU_PF=1 "" TS_CUDA_GU_PF=1; do b "$e" "$B" bench --backend cuda -m /tmp/v2lite-bf16.gguf -p 0 -n 128 -r 3 --hash; done
  exit 0
fi
if [ "$PART" = b ]; then
  [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
  # One token on the SIMT split: no more splits than runs of TS_CUDA_MLA_KEYS1 keys (default 0:
  # 2 per SM, 264, however short the context; tg128's contexts are 0-128 keys). One split writes
  # the output itself (no mla_combine). Another summation order: other hashes.
  for e in TS_CUDA_MLA_KEYS1=16 TS_CUDA_MLA_KEYS1=32 TS_CUDA_MLA_KEYS1=64 ""; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3
  done
  for e in TS_CUDA_MLA_KEYS1=64 ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 1024 -r 1; done
  # Where the 64-sequence step goes now (the trace's per-kernel table).
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/par64.csv "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 1 2>&1 | grep -E "cuda trace|tg"
  python3 tools/gpu/trace.py $O/par64.csv 8 2>/dev/null | head -22
  # The server's steps vary in tokens and outputs (both in the graph key, at most 192 kept):
  # with recordings off, does it lose? (if not, its steps mostly run eagerly already)
  for e in "" TS_CUDA_GRAPHS=0; do
    for bin in "$M" "$B"; do
      echo "== server ${e:-default} $bin"
      env $e TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$bin" "$OPS" $O/pf serve 2>&1 | grep -E "tokens:|TTFT|requests:|failures|steps_total|batch_tokens"
    done
  done
  exit 0
fi
ops_and_model
echo "== ops_vs_cpu moe with TS_CUDA_GU_PF=1"
TS_CUDA_GU_PF=1 "$OPS" --test-threads 2 moe 2>&1 | grep -E "FAIL|test result|panicked" | head -6
ab_decode "$M" "$B" "" TS_CUDA_MMQ_FOLD=0
# The decode MoE kernels with the L2 prefetch of each warp's other rows (same tokens).
for r in 1 2; do
  for e in TS_CUDA_GU_PF=1 ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
ab_prompts "$M" "$B"
