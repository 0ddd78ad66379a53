#!/usr/bin/env bash
# RUN 2026-12-01 (fourteenth session): ops_vs_cpu 25/25, moe_f16_prompt passed on all tiles (GU
# exact). pp512 / pp2048: int8 18,070 / 16,842; 256 19,949 / 18,229; 256s4 20,206 / 18,423;
# 128s4 20,078 / 18,312; GU 21,538 / 19,454. Kept GU (default) and four stages (then 21,842 /
# 19,760); 128s4 deleted.
# Written in the thirteenth session (2026-12-01), NOT yet run (the device time ran out):
# 1. The f16 copies in 64 x 64 tiles as the only layout. gpu-next32 measured them +1.0% / +0.7%
#    over row-major, under a switch: 19,522 / 17,874 (int8 17,963 / 16,811). The fold into the
#    one layout compiles but has not run.
# 2. Four stages in flight for the f16 products (TS_CUDA_MMF=256s4: 184 KB of shared memory;
#    128s4: two blocks an SM). All tiles measured so far held ~100 KB a SM in flight and landed
#    within 2% of each other.
# 3. Gate, up and the GLU in one f16 launch (TS_CUDA_MMF_GU=1, mmf16_gu): no up launch, no f32
#    gate and up rows, no f16_rows launch; moe_f16_prompt checks it bit for bit against the three.
# The whole ops_vs_cpu (its moe_f16_prompt also checks GU bit for bit), moe_f16_prompt on the two
# other tiles, then pp512 / pp2048 on the int8 path, the three tiles and GU. Keep the best and
# delete the rest. About 6 minutes.
#   tools/gpu/plans/gpu-next33.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
TS_OPS_LIMIT=150 TS_OPS_THREADS=4 ops_and_model
grep -E "moe_f16: case 3" $O/ops.txt | head -3
for t in 256s4 128s4; do TS_CUDA_MMF=$t timeout 60 "$OPS" moe_f16_prompt 2>&1 | grep -E "test result|FAIL|differs"; done
for e in "TS_CUDA_F16=0" "" "TS_CUDA_MMF=256s4" "TS_CUDA_MMF=128s4" "TS_CUDA_MMF_GU=1"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
done
