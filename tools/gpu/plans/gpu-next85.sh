#!/usr/bin/env bash
# Twenty-eighth session, main, written after the device time was spent (not yet run; after
# gpu-next84). TS_CUDA_DEFINES=BF1_LATE=1: batch_fill_1 (the chained one-token batch) lets the
# next kernel launch only after its writes and a fence, so no kernel that reads the position
# before its PDL wait (mla_out_q8, mla_out_<t>, mla_split_tc_he) can see the last step's. With
# graphs on, the graph's launch waits for batch_fill_1 anyway, so it should cost nothing there;
# eager steps (TS_CUDA_GRAPHS=0, and each graph key's first step) lose a little overlap. Hashes:
# tg128 db10d2fd9a926913, bf16 fc4c0eeac361bb3a, 16k efeed109b1480c9a. If it costs nothing,
# make it the default (elementwise.cu) and drop the open question in ARCHITECTURE.md.
# First, tools/gpu/syncprobe.cu: what one dependent step costs as a graph launch, a PDL launch,
# a persistent kernel's grid barrier, a flag wait on 8 producer blocks, and a cluster barrier
# (the question before a persistent decode kernel; docs/GPU.md).
#   tools/gpu/plans/gpu-next85.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== syncprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/syncprobe "$(dirname "$0")/../syncprobe.cu" && timeout 60 /tmp/syncprobe
stamp "== op tests (chained steps, BF1_LATE=1)"
op_log 150 2 ops.txt "" "TS_CUDA_DEFINES=BF1_LATE=1" fused_recorded_steps_replay chained
wait
L="TS_CUDA_DEFINES=BF1_LATE=1"
stamp "== tg128"
for e in "" "$L" "" "$L"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== tg128, graphs off"
for e in "TS_CUDA_GRAPHS=0" "TS_CUDA_GRAPHS=0 $L"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 1 --hash; done
stamp "== tg64 @16k"
for e in "" "$L"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== trace at 16k (this session's defaults)"
trace_tg 14 $V -d 16384
rm -f $V
stamp "== done"
