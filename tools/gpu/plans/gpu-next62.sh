#!/usr/bin/env bash
# Twenty-second session: TS_CUDA_MO_ATT (default 192): one token of V2's shapes (f16 cache) below
# that position attends inside mla_out_q8's blocks (mo_attend) instead of the split kernel's
# launch before it: one dependent launch fewer a layer at short contexts. Other bits (the same
# sums in another order): tg128's hash changes; 16k and 64 sequences must keep theirs
# (efeed109b1480c9a, 33948fa635fb0682).
#   tools/gpu/plans/gpu-next62.sh BIN OPS [a]   (~6 minutes)
#   tools/gpu/plans/gpu-next62.sh BIN OPS b     (the test again, positions 192-255: ~2 minutes)
set -u
B=$1; OPS=$2; PART=${3:-a}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
if [ "$PART" = b ]; then
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
op_log 100 4 ops.txt "" "" short_attention_in_mla_out
wait
for e in "TS_CUDA_MO_ATT=256" "TS_CUDA_MO_ATT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 192 -r 2 --hash; done
exit 0
fi
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 120 4 ops.txt "" "" short_attention_in_mla_out fused_mla_attention_out fused_recorded recorded_steps_replay
grep -E "pos=|worst" $O/ops.txt | head -30
wait
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_MO_ATT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== positions 128-191, 256-319"
for e in "" "TS_CUDA_MO_ATT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 128 -r 2 --hash; done
for e in "TS_CUDA_MO_ATT=512" "TS_CUDA_MO_ATT=0"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 256 -r 2 --hash; done
stamp "== 16k, 64 sequences"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== done"
