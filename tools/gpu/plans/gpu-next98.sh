#!/usr/bin/env bash
# (Run in gpu-next98: the I2F-free sums lost and were reverted after it; I2F_CVT is gone.)
# Thirty-first session: int8 dot products' sums to float without I2F (i2f_biased: the mma / dp4a
# sums start at 0x4B400000, one FADD gives the value; the same bits). I2F_CVT=1 measures the
# conversion instruction. ROWS_R's automatic choice now takes 2 row sets from 5 pairs an expert
# (48 and 64 sequences). Every op test; tg128 / 64 sequences / pp512 against I2F_CVT=1; the 16k
# hash.
#   tools/gpu/plans/gpu-next98.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 150 4 ops.txt "" ""
wait
C="TS_CUDA_DEFINES=I2F_CVT=1"
stamp "== tg128, 64 sequences, pp512: i2f_biased vs I2F_CVT=1"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "$C" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
ab64 1 "" "$C"
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "$C" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
stamp "== 16k"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
rm -f $V
stamp "== done"
