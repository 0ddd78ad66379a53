#!/usr/bin/env bash
# Twenty-ninth session, main, written after the session's device time was spent (not yet run).
# Two switches for tg128's layer, both off until measured and both the same bits by
# construction (every hash must hold: tg128 db10d2fd9a926913 at -r 3, 16k efeed109b1480c9a):
# - TS_CUDA_RR512=1 (Path::Route512): the one-token routing launch at 512 threads a block, so
#   that its cluster of 8 fits beside mla_out_q8's blocks (1,024 threads x 56 registers did not:
#   the gpu-next88 trace had its blocks waiting 0.24 us at their release, the other kernels'
#   2-10 us). Test route512_exact.
# - TS_CUDA_GU_STAGE=1 (Path::GuStage): the MoE gate/up's warps copy their rows 2 and 3 into
#   shared memory (cp.async, 72 KB a block) with row 0's loads, so that a routed warp's four rows
#   are two trips to memory, not four. Test gu_stage_exact.
# Then a trace with both on, to see the routing's blocks arrive early and the gate/up's share.
# Keep each that is faster. Last, the 64-sequence figure and its trace (#6: where a step goes now).
#   tools/gpu/plans/gpu-next90.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests"
op_log 150 2 ops.txt "" "" route512_exact gu_stage_exact pre_routed_moe_exact
wait
R="TS_CUDA_RR512=1"; G="TS_CUDA_GU_STAGE=1"
stamp "== tg128"
for e in "" "$R" "$G" "$R $G" "" "$R" "$G" "$R $G"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== tg64 @16k"
for e in "" "$R $G"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== trace, tg32, both on"
(export TS_CUDA_RR512=1 TS_CUDA_GU_STAGE=1; trace_tg 10 $V)
stamp "== 64 sequences (#6): the figure, then where a step goes"
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
trace_tg 24 $V --parallel 64
ncu_stalls "mmq_q8_rows" -p 0 -n 8 --parallel 64
rm -f $V
stamp "== done"
