#!/usr/bin/env bash
# Twenty-seventh session, main, written after the device time was spent (not yet run). The split
# MLA decode at 16k (23 us a layer, 30% of a token; one warp a scheduler, no warp eligible 80% of
# cycles), two same-bits changes as measurement defines, and the re-measure of the early key
# tiles (TS_CUDA_MS_EARLY, default since gpu-next79 on one comparison):
# - TS_CUDA_DEFINES=MS_SLD=40: the score rows padded to 40 floats (2-way bank conflicts on the
#   score stores and reads instead of 8-way);
# - TS_CUDA_DEFINES=MLA_SM_BRANCHLESS=1: the online softmax without a branch around each exp
#   (static SASS of mla_split_tc_h's tile loop: 755 -> 665 instructions, 23 -> 5 branches); it
#   is shared with the prompt kernels, so pp512 / pp2048 too;
# - TS_CUDA_DEFINES=MS_QK_U=6 or 18: the score loop's dim steps unrolled further (2 now), so the
#   fragment loads can run ahead of the multiplies at one warp a scheduler.
# Both must keep every hash (16k efeed109b1480c9a). Op tests under each define first.
#   tools/gpu/plans/gpu-next80.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~10 minutes: near the 600-s limit of a call; move the prompt runs to gpu-next81 if it bites)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests"
T="mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores mla_attention_latent_cache"
op_log 120 2 ops.txt "" "" $T
op_log 120 2 ops40.txt "" "TS_CUDA_DEFINES=MS_SLD=40" $T
op_log 120 2 opsbl.txt "" "TS_CUDA_DEFINES=MLA_SM_BRANCHLESS=1,MS_QK_U=18" $T
wait
S="TS_CUDA_DEFINES=MS_SLD=40"; L="TS_CUDA_DEFINES=MLA_SM_BRANCHLESS=1"; SL="TS_CUDA_DEFINES=MS_SLD=40,MLA_SM_BRANCHLESS=1"
stamp "== tg64 @16k"
for e in "" "$S" "$L" "$SL" "$SL,MS_QK_U=6" "$SL,MS_QK_U=18" "TS_CUDA_MS_EARLY=0" "" "$SL" "TS_CUDA_MS_EARLY=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== pp512 / pp2048 (branchless softmax)"
for e in "" "$L"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
rm -f $V
stamp "== done"
