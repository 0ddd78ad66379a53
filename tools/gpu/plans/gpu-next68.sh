#!/usr/bin/env bash
# Twenty-fourth session, main: TS_CUDA_BATCH_FILL now on by default (gpu-next67: tg128 706 against
# 697), and TS_CUDA_PRE_SHARED=1 (off until this plan measures it): the shared experts' gate/up
# in the routing's launch (rr_shared_gateup: blocks past its cluster, each normalising the row
# itself), the MoE's gate/up then the routed slots only. pre_routed_moe_exact checks its bits
# against the MoE's own (and the counters). Every hash must hold (tg128 db10d2fd9a926913, 16k
# efeed109b1480c9a, 64 sequences 33948fa635fb0682).
#   tools/gpu/plans/gpu-next68.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -50   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 120 4 ops.txt "pre-routed|chained|" "" pre_routed_moe_exact chained_argmax_tokens fused_moe_shared moe_one_launch_exact fused_mla_attention_out
wait
stamp "== tg128"
for r in 1 2 3; do
  for e in "" "TS_CUDA_PRE_SHARED=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
b "TS_CUDA_BATCH_FILL=0" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== tg64 at 16k, 64 sequences"
for e in "" "TS_CUDA_PRE_SHARED=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace (PRE_SHARED=1)"
TS_CUDA_PRE_SHARED=1 trace_tg 10
stamp "== done"
