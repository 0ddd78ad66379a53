#!/usr/bin/env bash
# Written in the eleventh session (2026-11-30); RUN in the twelfth (docs/PERF.md, "Prompt key tiles
# through cp.async"): MLA_PFA pp512 +2.9%, pp2048 +8.1% (now the default); MMQ_LDSM_S pp512 +3.0%,
# pp2048 +2.9%, 64 seq +0.7% (now the only path; the define is gone, so this script's last two
# settings measure the defaults); COMBINE4 +0.3% (dropped). Three switches, off by
# default until this runs, one binary against itself:
#  - TS_CUDA_MLA_PFA=1: the one-sequence prompt attention's f16 key tiles through two cp.async
#    buffers (mla_prefill_ha) instead of loads and stores between two barriers (mla_prefill_h was
#    11.5% of a 512-token prompt, ~20% at 2048).
#  - TS_CUDA_COMBINE4=1: the MoE's final sums four columns a thread, one block row a token,
#    every slot's load issued first (moe_combine4; moe_combine was 20.9 us a layer at pp512,
#    1.6 TB/s, and 1.4% of the 64-sequence step).
#  - TS_CUDA_DEFINES=MMQ_LDSM_S=1: mmq_q8's ldmatrix from shared-space addresses (32-bit address
#    arithmetic). Static SASS (nvdisasm of the NVRTC cubin): mmq_q8_64's stage loop 624 -> 559
#    instructions, but 20 bytes of spills instead of 12, two STL and two LDL a stage in the loop;
#    mmq_q8_16 122 -> 108 registers. Only the GPU can say which way that goes.
#   tools/gpu/plans/gpu-next20.sh BIN OPS      (about 6 minutes)
# ops_vs_cpu checks the first two bit for bit (mla_f16_latent_cache, moe_rows_exact); the third
# moves no bits (the hash at 64 sequences, 33948fa635fb0682, must hold under all three). Worth running after: tools/gpu/plans/ncu-rows.sh
# (the prompt expert product's instruction mix after the shared-space stage addresses).
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 2 mla_f16_latent_cache moe_rows_exact
for r in 1 2; do
  for e in "" TS_CUDA_MLA_PFA=1 TS_CUDA_COMBINE4=1 TS_CUDA_DEFINES=MMQ_LDSM_S=1; do b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3; done
done
for e in "" TS_CUDA_MLA_PFA=1 TS_CUDA_DEFINES=MMQ_LDSM_S=1; do b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2; done
ab64 2 "" TS_CUDA_COMBINE4=1 TS_CUDA_DEFINES=MMQ_LDSM_S=1
