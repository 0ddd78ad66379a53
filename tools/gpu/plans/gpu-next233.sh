#!/usr/bin/env bash
# For the seventy-third session: Path::DownSlot (moe_down_slot_q8, written without a device: one
# token's Q8_0 down product by (row tile, slot), a block reading one run of 8 or 16 rows of one
# slot's matrix, each tile's last block adding the slots' partial rows). While the file is made,
# the down-pattern probe (tools/gpu/downprobe.cu: do the down kernels' reads cap the bandwidth?);
# on an H200 then issue 6's figure (the server, 64 clients, 45 s) and tg128. On any card: the op
# tests moe_down_slot and moe_residual_exact, then tg128 with the path off / on / on with 2 rows
# a warp, alternating, and a trace of off and on (~7 minutes on an H100, ~10 on an H200).
#   tools/gpu/plans/gpu-next233.sh .dev/turbospark > $OUT/log.txt 2>&1
# (Ran once, from 6415321, on an H100: the path lost 6.2% (1.4% with 2 rows a warp) and was
# removed, so this plan runs only on that commit's binaries. docs/PERF.md, seventy-third session.)
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== downprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/downprobe tools/gpu/downprobe.cu 2>&1 | grep -v "^$" | head -5
timeout 60 /tmp/downprobe
h200_first tg128
stamp "== op tests"
op_log 150 2 ops.txt "by slot|" "" moe_down_slot moe_residual_exact
wait
stamp "== tg128: by slot off / on / on with 2 rows a warp"
for r in 1 2; do
  young 470 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_DOWN_SLOT=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_DOWN_SLOT=1 TS_CUDA_DOWN_SLOT_RW=2" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== traces (tg32): off, on"
young 520 && trace_tg 12
young 550 && (export TS_CUDA_DOWN_SLOT=1; trace_tg 12)
stamp "== done"
