#!/usr/bin/env bash
# Fifty-fifth session: the one-token decode MoE's down kernels with the next round of weights
# asked for before the current round's sums (DN_PIPE, a define; the same bits), at the blocks an
# SM its registers need (3: 80 registers, no spill; at 4 it spills 100-128 B), against the
# defaults and against 3 blocks alone (the occupancy's own effect). Q8_0 tg128 and tg64 at 16k,
# bf16 tg128, the runs alternating; then the fused MoE op test under the define. ~6 minutes
# (the two files are made first: ~2 minutes on a fresh machine).
# Ran once (H100): DN_PIPE lost 12.8% at tg128 and was removed (docs/PERF.md, fifty-fifth session);
# the plan needs commit 9c50214's kernels.
#   tools/gpu/plans/gpu-next182.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=${2:-}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== the two files"
models_bg
wait
P="TS_CUDA_DEFINES=DN_PIPE=1,GQ_DOWN_MIN_BLOCKS=3,GQ_DOWN16_MIN_BLOCKS=3"
M3="TS_CUDA_DEFINES=GQ_DOWN_MIN_BLOCKS=3,GQ_DOWN16_MIN_BLOCKS=3"
P4="TS_CUDA_DEFINES=DN_PIPE=1"
stamp "== Q8_0 tg128"
for e in "" "$P" "" "$P" "$M3" "$P4"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== bf16 tg128"
for e in "" "$P" "" "$P" "$M3"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
stamp "== Q8_0 tg64 at 16k"
for e in "" "$P"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
if [ -n "$OPS" ]; then
  stamp "== op test under DN_PIPE"
  op_log 150 4 ops.txt "fused_moe|" "$P" fused_moe_shared
fi
stamp "== done"
