#!/usr/bin/env bash
# Twenty-eighth session, main, written after the device time was spent (not yet run; after
# gpu-next84 and gpu-next85, or instead of 85 if time is short). TS_CUDA_MS_KT=64: the split MLA
# decode's key tiles of 64 keys (a ring of 2, 177 KB): half the tiles, barriers and softmax
# passes a key, four independent MMA chains a warp in the score loop; static SASS 1,878
# instructions a 64-key tile against 2 x 1,165 for two 32-key tiles, 139 registers, no spills.
# Other bits (the softmax's maxima and rescaling come every 64 keys): op tests against the CPU
# first, then the 16k figure, whose hash may move (efeed109b1480c9a with 32-key tiles).
#   tools/gpu/plans/gpu-next86.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests, 64-key tiles"
op_log 150 2 ops64.txt "" "TS_CUDA_MS_KT=64" mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores mla_attention_latent_cache
wait
K="TS_CUDA_MS_KT=64"
stamp "== tg64 @16k"
for e in "" "$K" "$K TS_CUDA_MO_CLUSTER=1" "" "$K"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== tg64 @4096"
for e in "" "$K"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
rm -f $V
stamp "== done"
