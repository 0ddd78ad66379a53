#!/usr/bin/env bash
# Written in the eleventh session (2026-11-30), NOT yet run on a GPU: the prompt attention's key
# tiles through two cp.async buffers (TS_CUDA_MLA_PFA=1: mla_prefill_ha) against mla_prefill_h
# (loads and stores between two barriers, nothing overlapped), one binary:
#   tools/gpu/plans/gpu-next20.sh BIN OPS      (about 4 minutes)
# ops_vs_cpu's mla_f16_latent_cache checks mla_prefill_ha bit for bit; then pp512 and pp2048
# interleaved twice (mla_prefill_h was 11.5% of a 512-token prompt, ~20% at 2048). Worth running
# after it: tools/gpu/plans/ncu-rows.sh, for the prompt expert product's instruction mix after the
# shared-space stage addresses.
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
timeout 120 "$OPS" --test-threads 1 mla_f16_latent_cache > $O/ops.txt 2>&1 || echo "ops_vs_cpu: exit $?"
grep -E "FAIL|test result|panicked|cp.async" $O/ops.txt | head -10
wait
for r in 1 2; do
  for e in "" TS_CUDA_MLA_PFA=1; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
  done
done
