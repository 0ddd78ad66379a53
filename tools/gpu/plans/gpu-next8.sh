#!/usr/bin/env bash
# First GPU run of branch gpu-next8 (main + the two gpu-next7 pieces that measured well, written
# 2026-11-30, eighth session):
#  - the 16-head SIMT split MLA decode of a batch takes no more splits than runs of 256 keys in
#    its longest context (TS_CUDA_MLA_KEYS=0: one wave as on main), and with one split the kernel
#    writes the output itself (no mla_combine): gpu-next7 measured 6,171 vs 6,069 at 64 sequences;
#  - the grouped MoE's gate and up in one launch for decode-size batches only (gpu-next7: +1% at
#    64 sequences, -2% on prompts, which now keep two launches).
#   tools/gpu/plans/gpu-next8.sh BIN OPS_TEST MAIN_BIN   (about 6 minutes)
# Expect: ops_vs_cpu all pass (mla_attention_latent_cache's long histories now stay below
# TS_CUDA_MLA_LONG); tg128 hash 756941f1d106faec as main (one token: unchanged); --parallel 64
# another hash than main's c28e46212041fc1e (one split: another summation), TS_CUDA_MLA_KEYS=0
# with TS_CUDA_MOE_GU=0 gives main's hash back; prompts as main.
set -u
B=$1; OPS=$2; M=$3
source "$(dirname "$0")/lib.sh"
ops_and_model
echo "== mla with TS_CUDA_MLA_SPLITS=1"
TS_CUDA_MLA_SPLITS=1 "$OPS" --test-threads 2 mla 2>&1 | grep -E "FAIL|test result|panicked" | head -6
b "" "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
for r in 1 2; do
  b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  for e in "" TS_CUDA_MLA_KEYS=0 "TS_CUDA_MLA_KEYS=0 TS_CUDA_MOE_GU=0"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  done
done
for bin in "$M" "$B"; do
  b "" "$bin" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "" "$bin" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | grep -vE "^turbospark: (GPU|serving)" | grep -E "tokens:|TTFT|requests:|failures"
