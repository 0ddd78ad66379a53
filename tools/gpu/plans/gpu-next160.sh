#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run. ~7 minutes.
# One token, Q8_0: the decode MoE's down blocks wait ~9 us for the gate/up's end (twenty-ninth
# session's trace) with one round of their weights in registers; TS_CUDA_DEFINES=DN_PF=r asks
# L2 for their next r rounds too before the wait (no registers held). tg128 and tg64 at 16k,
# r = 1, 2, 4 against the defaults (each define its own CUBIN, ~60 s at its first run); the same
# hashes (db10d2fd9a926913 / efeed109b1480c9a).
#   tools/gpu/plans/gpu-next160.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
stamp "== tg128"
for e in "" "TS_CUDA_DEFINES=DN_PF=1" "TS_CUDA_DEFINES=DN_PF=2" "TS_CUDA_DEFINES=DN_PF=4" ""; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_DEFINES=DN_PF=2"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== done"
