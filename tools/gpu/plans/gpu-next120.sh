#!/usr/bin/env bash
# Thirty-seventh session, fourth call. Path::MoeFlow, second form: the GLU rows quantised by
# 128-group (the last of the gate/up blocks on a group's gate and up rows does it, four tokens'
# loads a warp before any store), the flow in kernels of its own (mmq_q8_rows_f / _r2f: the
# first form's code made the default r2 kernel spill 16 B in its loop, which gpu-next119's
# default figures ran with). The same bits expected.
#   tools/gpu/plans/gpu-next120.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~6 minutes)
# (Path::MoeFlow was removed after this call, measured slower: its code is at commit 970bbc0.)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== moe_rows_exact"
op_log 100 2 ops.txt "" "" moe_rows_exact
wait
stamp "== 64 sequences"
bpd 64 "-d 96" "" "TS_CUDA_MOE_FLOW=1" "" "TS_CUDA_MOE_FLOW=1"
bpd 64 "-d 400" "" "TS_CUDA_MOE_FLOW=1"
bpd 128 "" "" "TS_CUDA_MOE_FLOW=1"
stamp "== server, 64 clients"
serve64 "TS_CUDA_MOE_FLOW=1" 30
serve64 "" 30
rm -f $V
stamp "== done"
