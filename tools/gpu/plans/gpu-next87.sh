#!/usr/bin/env bash
# Twenty-ninth session, main. The device budget (30 minutes, two refusals already paid) does not
# hold gpu-next84, 85 and 86 as written, so this call takes the parts of each that decide a
# direction: the sync probe (gpu-next85's first step: a graph launch, a PDL launch, a grid
# barrier, an 8-flag wait and a cluster barrier timed on the same trivial work), the op tests of
# the 64-key split tiles (gpu-next86) and of the cluster merge and in-flight query loads
# (gpu-next84), then 16k decode under each against the defaults, twice for the baseline.
#   tools/gpu/plans/gpu-next87.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== syncprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/syncprobe "$(dirname "$0")/../syncprobe.cu" && timeout 60 /tmp/syncprobe
stamp "== op tests"
op_log 150 1 ops64.txt "" "TS_CUDA_MS_KT=64" mla_split_early_exact mla_f16_latent_cache mla_split_tensor_cores mla_attention_latent_cache &
op_log 150 1 opsq.txt "" "TS_CUDA_DEFINES=MS_QLOAD=1,MO_MU=4,MO_MU_CL=4" merge_cluster_exact mla_split_early_exact fused_mla_attention_out
wait
K="TS_CUDA_MS_KT=64"; Q="TS_CUDA_DEFINES=MS_QLOAD=1"; M="TS_CUDA_DEFINES=MO_MU=4"; C="TS_CUDA_MO_CLUSTER=1"
stamp "== tg64 @16k"
for e in "" "$K" "$C" "$Q" "$M" "$K $C" "$K $C $Q" "" "$K"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
rm -f $V
stamp "== done"
