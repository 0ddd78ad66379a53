#!/usr/bin/env bash
# Thirtieth session, after gpu-next92 (shared chunks first: 64 sequences +4.0%, now the
# default). Nsight on the 64-sequence step's kv_a product (mmq_q8_64, grid 9 x 8 splits: 72
# blocks on 132 SMs, 9.9 us, ~2,100 instructions a warp at ~6 cycles each): the dense products
# are each warp's serial chain, and the split rule (at least 2 groups a split, aiming at 2
# blocks an SM) leaves SMs idle. Two knobs, same shapes otherwise (other summation splits, so
# other bits: each setting's own hash, checked by the exact op tests' split-K cases only):
# TS_CUDA_MMQ_SPLIT_MIN=1 (1 group a split: kv_a 16 splits), TS_CUDA_MMQ_SPLIT_OCC=3.
# And MMQ_OFF_EARLY (now the default; =0 is the build before): the rows kernel's blocks read
# their expert's list offset beside its count, one trip to L2 fewer before the token list
# (same bits: the hash must hold).
#   tools/gpu/plans/gpu-next93.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
wait
stamp "== 64 sequences"
ab64 2 "" "TS_CUDA_DEFINES=MMQ_OFF_EARLY=0" "TS_CUDA_MMQ_SPLIT_MIN=1" "TS_CUDA_MMQ_SPLIT_OCC=3" "TS_CUDA_MMQ_SPLIT_MIN=1 TS_CUDA_MMQ_SPLIT_OCC=3"
rm -f $V
stamp "== done"
