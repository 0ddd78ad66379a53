#!/usr/bin/env bash
# Twenty-second session, main after gpu-next60's merge: TS_CUDA_PRE_ROUTE, one token's MoE
# routing made ahead in the router's launch (add_rms_norm_parts_router with routing: block 0
# quantises the normed row, the last block to write its logits routes them; moe_shared then skips
# moe_route_quant): one dependent launch fewer a layer, meant to keep every hash (tg128
# 0b6c3741dd283d38, tg64 at 16k efeed109b1480c9a, 64 sequences 33948fa635fb0682).
# Run once (twenty-second session): every op test passed (pre_routed_moe_exact bit for bit) and
# every hash held, but slower: tg128 642.6 / 638.8 against 657.4 / 656.2 with it off, 16k 468.0
# against 473.9. The trace: the router's launch 4.9 -> 8.9 us a layer, more than the 3.2 of the
# launch it saved (its tail is four dependent L2 round trips: the logits' fence, the counter,
# the copy past L1, the routing's stores). The change was reverted; this plan is its record.
#   tools/gpu/plans/gpu-next61.sh BIN OPS   (op tests, tg128 both ways twice, 16k both ways,
#                                            64 sequences, trace: ~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 150 4 ops.txt "" "" pre_routed_moe_exact fused_mla_attention_out fused_moe_shared moe_route_in_exact fused_recorded recorded_steps_replay moe_routing_and_experts
wait
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_PRE_ROUTE=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_PRE_ROUTE=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 120 "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 >/dev/null 2>&1
python3 tools/gpu/trace.py $O/tr.csv 16 | head -14; rm -f $O/tr.csv
stamp "== done"
