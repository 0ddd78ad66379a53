#!/usr/bin/env bash
# Forty-fifth session, first call: the routed experts' first bytes asked into L2 while a decode
# batch's attention leaves the memory bus idle (`TS_CUDA_XPF` MB of gate and up, `TS_CUDA_XPF_DN`
# MB of down; `TS_CUDA_XPF_AT` 0: from the layer's first norm, 1: from the FFN norm;
# `TS_CUDA_DEFINES=L2PF_LAST=1`: with L2::evict_last). The same bits (hash 7a3b5e11379cb707).
#   tools/gpu/plans/gpu-next152.sh BIN 2>&1 | tee $OUT/log.txt | tail -40   (~5 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=60
q8_bg
python3 -c "import torch; p=torch.cuda.get_device_properties(0); print('L2', p.L2_cache_size, 'SMs', p.multi_processor_count)" 2>&1 | tail -1
wait
L=TS_CUDA_DEFINES=L2PF_LAST=1
bpd 64 "-d 96" "" "TS_CUDA_XPF=32" "TS_CUDA_XPF=32 $L" "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1" \
  "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1 $L" "TS_CUDA_XPF=16 $L" "TS_CUDA_XPF=40 $L" \
  "TS_CUDA_XPF=24 TS_CUDA_XPF_DN=12 $L" ""
stamp "== done"
