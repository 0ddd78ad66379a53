#!/usr/bin/env bash
# Twenty-seventh session, main, two switches measured (off until then), both the same bits:
# (1) TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=4: the bf16 decode MoE's down kernels at 4 blocks an
#     SM (64 registers without spills, where 67 at 3 blocks put its 1,024 blocks in 2.6 waves;
#     Nsight, gpu-next76). Register allocation only, so the hash must hold.
# (2) TS_CUDA_MS_EARLY=1: the split MLA decode over the f16 cache issues its first key tiles
#     before its PDL wait (mla_split_tc_he; op test mla_split_early_exact, bit for bit).
# Then, if the call's device time lasts, Nsight's warp stall reasons for mla_split_tc_h at 16k.
#   tools/gpu/plans/gpu-next79.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
models_bg
stamp "== op test"
op_log 60 1 ops.txt "" "" mla_split_early_exact
wait
stamp "== bf16 tg128: down kernels at 4 blocks an SM"
for e in "" "TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=4"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
rm -f $BF
stamp "== tg64 @16k: early key tiles"
for e in "" "TS_CUDA_MS_EARLY=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== bf16 again; 16k again"
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
for e in "TS_CUDA_MS_EARLY=1" ""; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
wait
for e in "TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=4" ""; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
rm -f $BF
stamp "== ncu mla_split_tc_h stalls"
ncu_stalls mla_split -p 0 -n 4 -d 16384 -r 1
rm -f $V
stamp "== done"
