#!/usr/bin/env bash
# Twenty-fifth session, main, written after the device time was spent (not yet run; after
# gpu-next75): TS_CUDA_ROUTE_SLICE=1 (off until measured). One decode token's norm, router and
# routing launch by column slices (add_rms_norm_parts_router_route_s, docs/GPU.md's design): each
# of the cluster's 8 blocks loads its 256 columns of the 16 per-head parts (16 KB where the
# whole-row kernel loads 128 KB a block), the blocks' sums of squares and partial logits meet
# through distributed shared memory. Other orders of the sums: the hashes may move (the router
# has near-ties), so the op test's closeness is the check of correctness, the figure the gain.
# Op test route_slices_close (against the whole-row launch; Q8_0 and bf16 attention weights),
# then tg128 both ways (Q8_0 three rounds, bf16 two) and the Q8_0 trace with it.
# Twenty-seventh session adds where a 16k token goes (the figure furthest from #5's target, 484
# of 700): the trace at depth 16,384, and Nsight Compute on the split attention
# (mla_split_tc_h) and its merge inside mla_out_q8; and Nsight on the bf16 down kernel
# (moe_down_sh_bf16_w4, 53% of its bytes' time).
#   tools/gpu/plans/gpu-next76.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
models_bg
stamp "== op tests"
op_log 150 2 ops.txt "" "" route_slices_close pre_routed_moe_exact
wait
stamp "== Q8_0 tg128"
for r in 1 2 3; do
  for e in "" "TS_CUDA_ROUTE_SLICE=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== Q8_0 trace (ROUTE_SLICE=1)"
TS_CUDA_ROUTE_SLICE=1 trace_tg 10
stamp "== Q8_0 trace at 16k"
trace_tg 14 $V -d 16384
stamp "== ncu at 16k"
NCU_SKIP=8 NCU_COUNT=4 NCU_LINES=120 timeout 200 "$(dirname "$0")/../ncu.sh" "$B" 'mla_split_tc_h|mla_out_q8' -p 0 -n 8 -d 16384 -r 1
rm -f $V
stamp "== bf16 tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_ROUTE_SLICE=1"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
stamp "== ncu bf16 down"
NCU_MODEL=$BF NCU_SKIP=40 NCU_COUNT=2 NCU_LINES=50 timeout 150 "$(dirname "$0")/../ncu.sh" "$B" 'moe_down_sh_bf16_w4|moe_gateup_sh_bf16' -p 0 -n 8 -r 1
rm -f $BF
stamp "== done"
