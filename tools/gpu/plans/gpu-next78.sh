#!/usr/bin/env bash
# Twenty-seventh session, main: TS_CUDA_MS_W8=1 (off until measured), the tensor-core split MLA
# decode with 8 warps a block (mla_split_tc_h8: a score's dims in four parts, 64 value columns a
# warp) where gpu-next77's Nsight found the 4-warp kernel issue-bound (one warp a scheduler, 80%
# of cycles with none eligible). Another order of a score's partial sums, so the 16k hash moves.
# Op tests (mla_split_w8_close; the f16-cache and tensor-core split tests also under the switch),
# then tg64 @16k both ways twice, the switch with 2- and 4-tile rings and with 264 splits (two
# blocks an SM fit with a 2-tile ring), and the trace at 16k with it.
#   tools/gpu/plans/gpu-next78.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests"
op_log 150 2 ops.txt "" "" mla_split_w8_close mla_split_tensor_cores mla_f16_latent_cache
op_log 150 2 ops8.txt "" "TS_CUDA_MS_W8=1" mla_split_tensor_cores mla_f16_latent_cache mla_attention_latent_cache
wait
stamp "== tg64 @16k"
for r in 1 2; do
  for e in "" "TS_CUDA_MS_W8=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
done
for e in "TS_CUDA_MS_W8=1 TS_CUDA_MS_NB=2" "TS_CUDA_MS_W8=1 TS_CUDA_MS_NB=4" "TS_CUDA_MS_W8=1 TS_CUDA_MS_NB=2 TS_CUDA_MLA_SPLITS=264"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== trace at 16k (MS_W8=1)"
TS_CUDA_MS_W8=1 trace_tg 8 $V -d 16384
stamp "== tg64 @4096 both ways"
for e in "" "TS_CUDA_MS_W8=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 4096 -r 1 --hash; done
rm -f $V
stamp "== done"
