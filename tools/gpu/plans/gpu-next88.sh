#!/usr/bin/env bash
# Twenty-ninth session, main, after gpu-next87. The rest of gpu-next84/85: BF1_LATE=1
# (batch_fill_1 lets its dependents launch only after its writes and a fence; should cost nothing
# with graphs, where the graph's launch already waits for it) at tg128 with graphs on and off and
# at 16k; MS_QLOAD=1 (+1.2% in gpu-next87) alone, with MS_BULK=1, and with two split blocks an SM; then traces at 16k
# and at short contexts of the defaults. Hashes: tg128 db10d2fd9a926913, 16k efeed109b1480c9a (32-key tiles).
#   tools/gpu/plans/gpu-next88.sh BIN OPS [EXTRA_16K_ENV] 2>&1 | tee $OUT/log.txt | tail -60
# EXTRA_16K_ENV (optional): settings gpu-next87 found faster, tried beside the defaults at 16k.
set -u
B=$1; OPS=$2; X=${3:-}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== op tests (chained steps, BF1_LATE=1)"
op_log 150 2 ops.txt "" "TS_CUDA_DEFINES=BF1_LATE=1" fused_recorded_steps_replay chained
wait
L="TS_CUDA_DEFINES=BF1_LATE=1"
stamp "== tg128"
for e in "" "$L" "" "$L"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== tg128, graphs off"
for e in "TS_CUDA_GRAPHS=0" "TS_CUDA_GRAPHS=0 $L"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 1 --hash; done
stamp "== tg64 @16k"
Q="TS_CUDA_DEFINES=MS_QLOAD=1"; W="TS_CUDA_MS_NB=2 TS_CUDA_MLA_SPLITS=256"
for e in "" "$L" "$Q" "TS_CUDA_DEFINES=MS_QLOAD=1,MS_BULK=1" "$W $Q" ${X:+"$X"}; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
stamp "== trace at 16k (defaults)"
trace_tg 14 $V -d 16384
stamp "== trace, tg32 (defaults)"
trace_tg 14 $V
rm -f $V
stamp "== done"
