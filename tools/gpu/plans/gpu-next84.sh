#!/usr/bin/env bash
# Twenty-eighth session, main, written after the session's device time was spent (not yet run).
# Three same-bits changes aimed at the 16k decode's attention (539.6 tok/s after gpu-next80..83):
# - TS_CUDA_DEFINES=MS_QLOAD=1: the split kernel's 18 float4 query loads a thread all in flight
#   after its PDL wait (the compiler's unroll by 4 left five trips to L2 on every block's path);
# - TS_CUDA_DEFINES=MO_MU=4: mla_out_q8's merge loads 4 splits a warp at once, not 2;
# - TS_CUDA_MO_CLUSTER=1 (Path::MergeCluster, mla_out_q8c): the head's 8 blocks one cluster, each
#   merging 64 columns and sending them to the others through distributed shared memory, so each
#   block reads an eighth of the 132 splits' rows from L2 (271 KB a block now; ~1.9 us a layer
#   at 16k over tg128's mla_out_q8); MO_MU_CL (8 by default) its splits in flight.
# All must keep the 16k hash efeed109b1480c9a; op tests first (merge_cluster_exact is new).
# Also MS_BULK=1 again on top of MS_ST2 (+0.2% in gpu-next82, noise or not), and two blocks an
# SM (a 2-tile ring, 98.5 KB; 256 splits of two 32-key tiles each at 16k) with the cluster merge,
# which the sweep of the twenty-seventh session (before all of this session's changes) did not
# try with 4 warps.
#   tools/gpu/plans/gpu-next84.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests"
op_log 150 2 ops.txt "" "" merge_cluster_exact fused_mla_attention_out mla_split_early_exact &
op_log 150 2 opsq.txt "" "TS_CUDA_DEFINES=MS_QLOAD=1,MO_MU=4,MO_MU_CL=4" merge_cluster_exact mla_split_early_exact mla_f16_latent_cache
wait
Q="TS_CUDA_DEFINES=MS_QLOAD=1"; M="TS_CUDA_DEFINES=MO_MU=4"; C="TS_CUDA_MO_CLUSTER=1"
stamp "== tg64 @16k"
W="TS_CUDA_MS_NB=2 TS_CUDA_MLA_SPLITS=256"
for e in "" "$Q" "$M" "$C" "$C TS_CUDA_DEFINES=MO_MU_CL=4" "$C $Q" "TS_CUDA_DEFINES=MS_BULK=1" "$C $W" "$C $W $Q" "" "$C $Q"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
rm -f $V
stamp "== done"
