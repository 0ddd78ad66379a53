#!/usr/bin/env bash
# Twenty-eighth session, main. The split MLA decode at 16k after gpu-next80's three defaults
# (23.7 us under Nsight; stalls a warp per issued instruction: selected 1, load/store queue
# throttle 0.83, fixed-latency wait 0.81, long scoreboard 0.66, drain 0.28). Two same-bits
# measurement defines aimed at the queue throttle and the drain:
# - TS_CUDA_DEFINES=MS_BULK=1: each 32-key tile by 32 bulk copies (a row of 1,152 bytes a lane
#   of warp 0) completing on the ring slot's mbarrier, in place of 18 cp.async a thread a tile;
# - TS_CUDA_DEFINES=MS_ST2=1: the partial rows stored as float2.
# Both must keep the 16k hash efeed109b1480c9a. Op tests under both first, and the defaults'.
#   tools/gpu/plans/gpu-next82.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests"
T="mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores mla_attention_latent_cache"
op_log 150 2 ops.txt "" "" $T &
op_log 150 2 opsbulk.txt "" "TS_CUDA_DEFINES=MS_BULK=1,MS_ST2=1" $T
wait
K="TS_CUDA_DEFINES=MS_BULK=1"; S2="TS_CUDA_DEFINES=MS_ST2=1"; KS="TS_CUDA_DEFINES=MS_BULK=1,MS_ST2=1"
stamp "== tg64 @16k"
for e in "" "$K" "$S2" "$KS" "" "$KS"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== ncu mla_split_tc_he, both defines"
TS_CUDA_DEFINES=MS_BULK=1,MS_ST2=1 ncu_stalls mla_split -p 0 -n 4 -d 16384 -r 1
rm -f $V
stamp "== done"
