#!/usr/bin/env bash
# Written in the eleventh session (2026-11-30), NOT yet run on a GPU. Two switches, off by
# default until this runs, one binary against itself:
#  - TS_CUDA_MLA_PFA=1: the one-sequence prompt attention's f16 key tiles through two cp.async
#    buffers (mla_prefill_ha) instead of loads and stores between two barriers (mla_prefill_h was
#    11.5% of a 512-token prompt, ~20% at 2048).
#  - TS_CUDA_COMBINE4=1: the MoE's final sums four columns a thread, one block row a token,
#    every slot's load issued first (moe_combine4; moe_combine was 20.9 us a layer at pp512,
#    1.6 TB/s, and 1.4% of the 64-sequence step).
#   tools/gpu/plans/gpu-next20.sh BIN OPS      (about 5 minutes)
# ops_vs_cpu checks both bit for bit (mla_f16_latent_cache, moe_rows_exact). Expect the
# 64-sequence hash 33948fa635fb0682 both ways. Worth running after: tools/gpu/plans/ncu-rows.sh
# (the prompt expert product's instruction mix after the shared-space stage addresses).
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 2 mla_f16_latent_cache moe_rows_exact
for r in 1 2; do
  for e in "" TS_CUDA_MLA_PFA=1 TS_CUDA_COMBINE4=1; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
done
for e in "" TS_CUDA_MLA_PFA=1; do b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2; done
ab64 2 "" TS_CUDA_COMBINE4=1
