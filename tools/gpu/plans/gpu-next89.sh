#!/usr/bin/env bash
# Twenty-ninth session, main. gpu-next88 found tg128's tokens differ with CUDA graphs off (hash
# 2a570916d2620a21, with or without BF1_LATE=1) from those with graphs on (db10d2fd9a926913).
# Which switch makes eager steps differ: PDL (kernels chained before their predecessor ends),
# the copy-free chained batch (batch_fill_1), or BF1_LATE's trigger. 32 tokens a run.
#   tools/gpu/plans/gpu-next89.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~3 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
wait
stamp "== tg32 hashes"
G="TS_CUDA_GRAPHS=0"
for e in "" "$G" "$G TS_CUDA_PDL=0" "$G TS_CUDA_BATCH_FILL=0" "$G TS_CUDA_BATCH_FILL=0 TS_CUDA_PDL=0" "TS_CUDA_PDL=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 --hash
done
rm -f $V
stamp "== done"
