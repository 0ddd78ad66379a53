#!/usr/bin/env bash
# Twenty-eighth session, main, the last of the session's device time (~5 minutes). gpu-next82
# made MS_ST2 (the split kernels' partial rows stored as float2) the default: 16k once with it.
# The same for the prompt kernels' output rows, MP_ST2 (a measurement define, off; the same
# values where the rows are 8-byte aligned): op tests, then pp512 / pp2048 both ways.
#   tools/gpu/plans/gpu-next83.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests (defaults; MP_ST2=1)"
T="mla_f16_latent_cache mla_attention_latent_cache mla_split_early_exact"
op_log 150 2 ops.txt "" "" $T &
op_log 150 2 opsmp.txt "" "TS_CUDA_DEFINES=MP_ST2=1" $T
wait
stamp "== tg64 @16k (MS_ST2 now default)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== pp512 / pp2048: MP_ST2"
for e in "" "TS_CUDA_DEFINES=MP_ST2=1"; do
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
done
rm -f $V
stamp "== done"
