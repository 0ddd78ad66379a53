#!/usr/bin/env bash
# Written in the fourteenth session (2026-12-01), NOT yet run (the device time ran out). Two
# switches that cut dependent launches from the 64-sequence step, each off until measured:
# 1. TS_CUDA_MOE_RGQ=1: the batched MoE's routing, grouping and input quantisation in one launch
#    (moe_route_group_quant, the same bits: moe_rows_exact checks it): two launches fewer a
#    layer (~3 us each in the trace), ~0.15 ms a step.
# 2. TS_CUDA_MMQ_PAIR=1: matmul_many's two Q8_0 jobs (q and kv_a; layer 0's gate and up) in one mmq_q8_64 launch and
# one split-K sum (TS_CUDA_MMQ_PAIR=1, `mmq_dense_pair`): two dependent launches where there were
# four. The trace of the 64-sequence step has a dense product at ~10 us after its input is ready
# whatever its loop costs, and a sum at 2.2 us; estimate ~10 us a layer, ~0.27 ms of the 8.4-ms
# step (+3%). The whole ops_vs_cpu (its mmq_dense_pair checks the pair against the CPU and
# against the two launches), then 64 sequences twice, 128, prompts, and the server at 64
# clients, each without and with. If they win, make them the defaults and delete the switches.
# The default's hashes must stay 33948fa635fb0682 at 64 sequences and 3092e559ddb510ec for tg32: the
# routing launches' arguments were refactored (route_lead) after the last device run.
# Then prompt MoEs straight from the Q8_0 weights (TS_CUDA_MMF_Q8=1 TS_CUDA_F16=0) and mmq_q8_64 at
# two blocks an SM (TS_CUDA_DEFINES=MMQ64_MINB=2: no spill). About 10 minutes.
# Added in the fifteenth session (which had no device time): first, bwprobe's `rk` probes (~30 s):
# mmq_q8_rows' loads as the kernel issues them today, at its occupancy and multiply, against more
# warps, more groups a warp and a persistent grid (is its ~2.9 TB/s the load pattern, the
# occupancy or the ragged last wave?); and the prompt MoE from Q8_0 at four stages and three.
# Also new (fifteenth session): the tiled expert copy word-interleaved (DEFAULT now: moe_rows_exact
# and its tile16 check must pass and the 64-sequence hash stay 33948fa635fb0682; if not, revert
# commit 0e9849b), and the bulk-fed grouped expert kernels TS_CUDA_ROWS_BULK=1x4|2x2|1x3
# (mmq_q8_rows_b*: 8 consumer warps + a bulk-copy producer a block, 2 blocks an SM; moe_rows_exact
# checks them against mmq_q8_rows bit for bit).
# Split in the fifteenth session into two calls of < 10 minutes: this one (the probes, every op
# test, the two biggest prospects: bulk-fed experts at 64 sequences, prompt MoEs from Q8_0) and
# gpu-next36.sh (the rest). Each line of output is stamped with the seconds since the start.
#   tools/gpu/plans/gpu-next35.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
stamp "== bwprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/bwprobe tools/gpu/bwprobe.cu 2>/dev/null && timeout 120 /tmp/bwprobe stream warp-rows frag16 rk
# The kernels with barriers of their own (bulk-fed experts' mbarrier rings, moe_fused_q8's grid
# barrier) in a process of their own first: a hang or a trap there must not take the whole op
# run with it (TS_OPS_NEW=1; the main run below leaves them out). Their benchmarks run only if
# this passed. (This run pays the NVRTC compile, ~1 minute; the runs after it read the disk cache.)
stamp "== the new barrier kernels, alone"
TS_OPS_NEW=1 timeout 180 "$OPS" --test-threads 2 moe_rows_exact fused_moe_shared > $O/ops_new.txt 2>&1; NEW_RC=$?
grep -E "FAIL|test result|panicked|differs" $O/ops_new.txt | head -12; echo "new kernels: exit $NEW_RC (124: cut off)"
stamp "== ops"
TS_OPS_LIMIT=150 TS_OPS_THREADS=4 ops_and_model
stamp "== 64 sequences"
if [ $NEW_RC = 0 ]; then
  ab64 1 "" "TS_CUDA_ROWS_BULK=1x4" "TS_CUDA_ROWS_BULK=2x2" "TS_CUDA_MOE_RGQ=1 TS_CUDA_MMQ_PAIR=1"
else
  ab64 1 "" "TS_CUDA_MOE_RGQ=1 TS_CUDA_MMQ_PAIR=1"
fi
stamp "== prompts"
# Prompt MoEs straight from the Q8_0 weights on the f16 tensor cores (TS_CUDA_MMF_Q8=1, mmfq_*:
# half the bytes a launch, no f16 copies; moe_f16_prompt checks it against the copies' path).
# Four stages (216 KB, the default where it fits).
# And the 8 x 1 warp layout (TS_CUDA_MMF_Q8=2, mmfq8_*: each weight fragment converted once).
# (Three stages, TS_CUDA_MMF=s3, in gpu-next36.)
for e in "" "TS_CUDA_MMF_Q8=1 TS_CUDA_F16=0" "TS_CUDA_MMF_Q8=2 TS_CUDA_F16=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
stamp "== done"
