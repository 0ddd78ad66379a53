#!/usr/bin/env bash
# Twenty-third session, after gpu-next65: two row-prefetch changes meant to keep every hash
# (tg128 db10d2fd9a926913, 16k efeed109b1480c9a, 64 sequences 33948fa635fb0682):
# `gemv_q8_1p` (one token, rows of 512-2,048: the output head; a warp's next row in flight;
# TS_CUDA_GEMV_PF=0 for gemv_q8_1) and the MoE gate/up asking for a warp's next row before
# reducing the current one (GU_EARLY; TS_CUDA_DEFINES=GU_EARLY=0 for after).
# Run once (twenty-third session): every op test passed (gemv_q8_1p bit for bit) and every hash
# held, but both were slower: tg128 689.1 / 689.4 with both, 691.0 / 691.3 without gemv_q8_1p,
# 692.5 / 692.4 without GU_EARLY. The trace: the head on gemv_q8_1p 70.5 us against 63.7 on
# gemv_q8_1 (3.2 against 3.5 TB/s), the gate/up 16.7 against 16.2 us. Both were reverted (commit
# 9b7ab00 holds them); this plan is their record.
#   tools/gpu/plans/gpu-next66.sh BIN OPS   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 150 4 ops.txt "" "" row_prefetch_exact fused_moe_shared moe_one_launch_exact moe_routing_and_experts fused_recorded
grep -E "gemv_q8_1p.*worst" $O/ops.txt | head -4
wait
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_GEMV_PF=0" "TS_CUDA_DEFINES=GU_EARLY=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k, 64 sequences"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 120 "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 >/dev/null 2>&1
python3 tools/gpu/trace.py $O/tr.csv 16 | head -12; rm -f $O/tr.csv
stamp "== done"
