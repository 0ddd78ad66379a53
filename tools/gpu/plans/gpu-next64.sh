#!/usr/bin/env bash
# Twenty-third session: TS_CUDA_PRE_ROUTE again, as one thread-block cluster
# (add_rms_norm_parts_router_route: 8 blocks of 1,024, logits into block 0's shared memory, one
# cluster barrier; block 0 quantises the normed row and routes: moe_route_quant's bodies, the
# same bits). Meant to keep every hash (tg128 db10d2fd9a926913, 16k efeed109b1480c9a, 64
# sequences 33948fa635fb0682). Also the op tests that last ran before the twenty-second
# session's last changes (short_attention_in_mla_out's final bars, the MoE kernels less their
# routing-inside branches).
#   tools/gpu/plans/gpu-next64.sh BIN OPS   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 170 4 ops.txt "" "" pre_routed_moe_exact fused_mla_attention_out fused_moe_shared moe_one_launch_exact short_attention_in_mla_out fused_recorded recorded_steps_replay moe_routing_and_experts
grep -E "worst|pos=1 " $O/ops.txt | head -12
wait
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_PRE_ROUTE=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k, 64 sequences"
for e in "" "TS_CUDA_PRE_ROUTE=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace"
trace_tg 16
stamp "== done"
