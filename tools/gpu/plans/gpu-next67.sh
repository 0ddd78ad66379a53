#!/usr/bin/env bash
# Twenty-third session, main: chained greedy steps and the clustered pre-routing (both default;
# the routing measured both ways three times, its first call being within noise), and two
# switches off until this plan measures them: GU_SH_PF (TS_CUDA_DEFINES=GU_SH_PF=1: the
# gate/up's shared-slot blocks ask their 32 rows into L2 before their PDL wait, while the
# latency-bound routing kernel leaves the memory idle) and TS_CUDA_BATCH_FILL=1 (between chained
# steps, argmax_final writes the ids into mapped host memory and batch_fill_1 writes the
# one-token batch: no copies on the stream). Every hash must hold (tg128 db10d2fd9a926913, 16k
# efeed109b1480c9a, 64 sequences 33948fa635fb0682).
# Its one call so far (twenty-third session, both switches then on by default) ran out of device
# time after its op tests, which all passed (chained_argmax_tokens with batch_fill_1 included);
# the benchmark lines were lost (run it as `... 2>&1 | tee $OUT/log.txt | tail`). Also NM_RACY=1 once (a measurement define: the norm inside the q / kv_a product without its
# block counter, racy): what that counter costs.
#   tools/gpu/plans/gpu-next67.sh BIN OPS   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 120 4 ops.txt "chained|" "" chained_argmax_tokens pre_routed_moe_exact fused_moe_shared moe_one_launch_exact fused_mla_attention_out
wait
stamp "== tg128"
for r in 1 2 3; do
  for e in "" "TS_CUDA_PRE_ROUTE=0" "TS_CUDA_DEFINES=GU_SH_PF=1" "TS_CUDA_BATCH_FILL=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
# What the norm's block counter in gemv_q8_multi_norm_1 costs (racy, measurement only: the
# hash may change).
b "TS_CUDA_DEFINES=NM_RACY=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== tg64 at 16k, 64 sequences"
for e in "" "TS_CUDA_DEFINES=GU_SH_PF=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace"
trace_tg 10
stamp "== done"
