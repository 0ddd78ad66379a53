#!/usr/bin/env bash
# Twenty-seventh session, main, written after the device time was spent (not yet run). The
# re-measure of gpu-next79's two defaults (each from one comparison), then what that call could
# not reach:
# - op tests of the split decode (mla_split_early_exact, now with batches taking the plain
#   kernel; mla_f16_latent_cache, mla_split_tensor_cores) and the fused MoE's;
# - tg64 @16k with TS_CUDA_MS_EARLY=0 against the default, three rounds;
# - tg64 @16k with the split kernels' score rows padded (TS_CUDA_DEFINES=MS_SLD=36 or 40:
#   2-way bank conflicts on the score stores and reads instead of 8-way; the same bits, so the
#   hash must hold; its op tests first);
# - bf16 tg128 with TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=3 against the default (4), two rounds;
# - Q8_0 tg128 once (unchanged kernels: 709-710 expected, hash db10d2fd9a926913);
# - Nsight's warp stall reasons for the split kernel at 16k (the next lead for #5's 16k figure);
# - the server with 64 clients (#6; last measured in the twenty-first session, 6,340 tok/s).
#   tools/gpu/plans/gpu-next80.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~13 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
models_bg
stamp "== op tests"
op_log 200 2 ops.txt "" "" mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores fused_moe_shared moe_residual_exact
op_log 200 2 ops40.txt "" "TS_CUDA_DEFINES=MS_SLD=40" mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores
wait
stamp "== tg64 @16k: score rows of 32 / 36 / 40 floats"
for r in 1 2; do
  for e in "" "TS_CUDA_DEFINES=MS_SLD=36" "TS_CUDA_DEFINES=MS_SLD=40"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
done
stamp "== tg64 @16k: early key tiles off / on"
for r in 1 2 3; do
  for e in "TS_CUDA_MS_EARLY=0" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
done
stamp "== Q8_0 tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== bf16 tg128: down kernels at 3 / 4 blocks an SM"
for r in 1 2; do
  for e in "TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=3" ""; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
rm -f $BF
stamp "== ncu mla_split_tc_he stalls at 16k"
ncu_stalls mla_split -p 0 -n 4 -d 16384 -r 1
stamp "== server, 64 clients, 60 s"
serve64 "" 60
rm -f $V
stamp "== done"
