#!/usr/bin/env bash
# For the seventy-third session (it replaces gpu-next229): on any card first the down-pattern
# probe (tools/gpu/downprobe.cu, compiled by the device's nvcc, while the model is made): do the
# one-token down kernels' reads (8 short runs a block) cap the bandwidth, would blocks by (row
# tile, slot) read faster, and what does a plain stream of 5.8-92 MB cost a launch? Then on an
# H200 issue 6's figure (the server, 64 clients, 45 s, the defaults) and tg128 (issue 5's), ~4
# minutes; on any other card the op test `pre_routed_moe_exact`, at most 120 s.
#   tools/gpu/plans/gpu-next232.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
is_h200 && q8_bg
stamp "== downprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/downprobe tools/gpu/downprobe.cu 2>&1 | grep -v "^$" | head -5
timeout 60 /tmp/downprobe
if ! is_h200; then
  stamp "== not an H200: the op test pre_routed_moe_exact"
  op_log 120 2 ops.txt "" "" pre_routed_moe_exact
  exit 0
fi
h200_first tg128
stamp "== done"
