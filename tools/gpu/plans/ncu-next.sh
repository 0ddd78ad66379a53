#!/usr/bin/env bash
# Written in the fifteenth session, NOT yet run: Nsight Compute on the new kernels of
# gpu-next35/36 once they have run, to say why they land where they do: the bulk-fed grouped
# expert product at 64 sequences (against mmq_q8_rows in the same shape), the prompt MoE from
# Q8_0 in both warp layouts on a 512-token prompt, and the one-launch decode MoE.
#   tools/gpu/plans/ncu-next.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
NCU_PICK=",130" prof '^mmq_q8_rows$' 30 2 rows64 -p 0 -n 4 --parallel 64 -r 1
TS_CUDA_ROWS_BULK=1x4 NCU_PICK=",130" prof '^mmq_q8_rows_b1x4$' 30 2 bulk64 -p 0 -n 4 --parallel 64 -r 1
TS_CUDA_MMF_Q8=1 TS_CUDA_F16=0 prof '^mmfq_gu' 8 2 mmfq_pp512 -p 512 -n 0 -r 1
TS_CUDA_MMF_Q8=2 TS_CUDA_F16=0 prof '^mmfq8_gu' 8 2 mmfq8_pp512 -p 512 -n 0 -r 1
TS_CUDA_MOE_FUSED=1 prof '^moe_fused_q8$' 60 2 fused_tg -p 0 -n 8 -r 1
