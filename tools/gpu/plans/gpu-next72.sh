#!/usr/bin/env bash
# Twenty-fifth session, main: two bf16 decode switches, off until measured (#5's third decode
# figure, bf16 tg128 >= 600; ~400 on the H100 after TS_CUDA_NORM_MM16).
# - TS_CUDA_ABSORB16=1: the absorbed query's 16-bit W_uk product inside the rope's launch
#   (mla_rope_absorb_<t>_1: the same bits as norm_rope_cache then gemv_h16_<t>_1, so the same
#   hash), one dependent launch fewer a layer.
# - TS_CUDA_OUT16=1: the output side in clusters (mla_out_<t>: the merge, the W_uv rows, the
#   W_o per-head rows), then the norm, router and routing in one launch as Q8_0 has them:
#   seven launches become two. W_o's sum goes by head (other bits: the hash may move).
# Op tests first (fused_mla_rope_absorb now covers bf16 / f16 W_uk and asserts the one launch;
# fused_mla_attention_out_h16 is new; fused_mla_attention_out re-checks mla_out_q8 after its
# merge became mo_merge, shared with mla_out_<t>). Then tg128 of Q8_0 once (its hash must stay
# db10d2fd9a926913), and bf16 under each switch and both, two rounds, and the trace with both.
#   tools/gpu/plans/gpu-next72.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
BF=/tmp/v2lite-bf16.gguf
("$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1; "$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1) &
stamp "== op tests"
op_log 200 4 ops.txt "" "" fused_mla_rope_absorb fused_mla_attention_out fused_mla_attention_out_h16 moe_residual_exact
wait
stamp "== Q8_0 tg128"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
rm -f $V
stamp "== bf16 tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_ABSORB16=1" "TS_CUDA_OUT16=1" "TS_CUDA_ABSORB16=1 TS_CUDA_OUT16=1"; do
    b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
  done
done
stamp "== bf16 tg64 at 16k"
for e in "" "TS_CUDA_ABSORB16=1 TS_CUDA_OUT16=1"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== bf16 trace (both)"
TS_CUDA_ABSORB16=1 TS_CUDA_OUT16=1 trace_tg 18 $BF
rm -f $BF
stamp "== done"
