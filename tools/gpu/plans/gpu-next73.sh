#!/usr/bin/env bash
# Twenty-fifth session, main, after gpu-next72 (TS_CUDA_ABSORB16 and TS_CUDA_OUT16 now default):
# mla_out_<t> attends short contexts itself (mo_attend, as mla_out_q8 below TS_CUDA_MO_ATT=192
# positions), so bf16 tg128 has no split launch either. Op tests (short_attention_in_mla_out now
# also bf16, asserting mla_out_bf16 took it; fused_mla_attention_out_h16), then bf16 tg128 with
# the in-block attention and without it (TS_CUDA_MO_ATT=0), two rounds, and the Q8_0 figures
# whose hashes the session's default flips must keep: tg128 db10d2fd9a926913, 64 sequences
# 33948fa635fb0682.
#   tools/gpu/plans/gpu-next73.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
BF=/tmp/v2lite-bf16.gguf
("$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1; "$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1) &
stamp "== op tests"
op_log 200 4 ops.txt "" "" short_attention_in_mla_out fused_mla_attention_out_h16
wait
stamp "== Q8_0"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
rm -f $V
stamp "== bf16 tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_MO_ATT=0"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
stamp "== bf16 trace"
trace_tg 12 $BF
rm -f $BF
stamp "== done"
