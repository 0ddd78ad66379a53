#!/usr/bin/env bash
# Twenty-seventh session, main, written after the device time was spent (not yet run; after
# gpu-next80): the re-measure of the 16-bit down kernels at 4 blocks an SM (default since
# gpu-next79 on one comparison; TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=3 is the old setting, the
# same bits), Q8_0 tg128 once (unchanged kernels: 709-710, hash db10d2fd9a926913), Nsight's warp
# stall reasons for the split kernel at 16k, and the server with 64 clients (#6; last measured in
# the twenty-first session, 6,340 tok/s). Twenty-eighth session, before it ran: gpu-next80 made
# MS_SLD=40, MLA_SM_BRANCHLESS=1 and MS_QK_U=18 the split kernel's defaults, so the Nsight run
# sees them, and the last part runs 16k once with them and once with the old settings.
#   tools/gpu/plans/gpu-next81.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
models_bg
wait
stamp "== bf16 tg128: down kernels at 3 / 4 blocks an SM"
for r in 1 2; do
  for e in "TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=3" ""; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
rm -f $BF
stamp "== Q8_0 tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== ncu mla_split_tc_he stalls at 16k"
ncu_stalls mla_split -p 0 -n 4 -d 16384 -r 1
stamp "== server, 64 clients, 60 s"
serve64 "" 60
stamp "== tg64 @16k: new split defaults / old"
for e in "" "TS_CUDA_DEFINES=MS_SLD=32,MLA_SM_BRANCHLESS=0,MS_QK_U=2"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
rm -f $V
stamp "== done"
