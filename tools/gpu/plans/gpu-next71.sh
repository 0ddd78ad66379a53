#!/usr/bin/env bash
# Twenty-fourth session, main, written after the device time was spent (not yet run):
# TS_CUDA_MOE_RESIDUAL=1 (off until measured). The one-token Q8_0 MoE adds its output into the
# residual x in its down kernel (Backend::moe_shared_residual; each output row read and written
# by the thread that sums it), and the next layer's first norm runs without a delta
# (Backend::rms_norm_matmul_many: gemv_q8_multi_norm_1 with d null, no block counter, x not
# written). NM_RACY priced that counter at 0.4 us a layer (+5 tok/s). The same adds in the same
# order, so every hash must hold (tg128 db10d2fd9a926913, 16k efeed109b1480c9a, 64 sequences
# 33948fa635fb0682: batches decline and keep the old path). Op tests first: moe_residual_exact, fused_add_rms_norm_matmul_many
# (now also the norm without the add) and pre_routed_moe_exact (now also with the
# MoE into x after the clustered routing); fused_add_rms_norm_matmul_many also covers
# TS_CUDA_NORM_MM16's kernel (gemv_h16_multi_norm_<t>_1).
#   tools/gpu/plans/gpu-next71.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -50   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 150 4 ops.txt "pre-routed|moe_shared_residual|rms_norm_matmul_many|" "" moe_residual_exact pre_routed_moe_exact fused_add_rms_norm_matmul_many fused_moe_shared fused_recorded_steps_replay
wait
stamp "== tg128"
for r in 1 2 3; do
  for e in "" "TS_CUDA_MOE_RESIDUAL=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k, 64 sequences"
for e in "" "TS_CUDA_MOE_RESIDUAL=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
b "TS_CUDA_MOE_RESIDUAL=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== trace (MOE_RESIDUAL=1)"
TS_CUDA_MOE_RESIDUAL=1 trace_tg 8
# bf16 weights (#5's third decode target, 600; 441-445 last measured): its figure both ways
# under TS_CUDA_NORM_MM16=1 (a layer's first norm inside its bf16 q / kv_a products, one launch
# instead of three; the same bits, so the same hash both ways), and where its token goes.
stamp "== bf16"
rm -f $V
"$B" synth --preset deepseek-v2-lite --quant bf16 -o /tmp/v2lite-bf16.gguf >/dev/null 2>&1
for r in 1 2; do
  for e in "" "TS_CUDA_NORM_MM16=1"; do b "$e" "$B" bench --backend cuda -m /tmp/v2lite-bf16.gguf -p 0 -n 128 -r 3 --hash; done
done
TS_CUDA_NORM_MM16=1 trace_tg 16 /tmp/v2lite-bf16.gguf
rm -f /tmp/v2lite-bf16.gguf
stamp "== done"
