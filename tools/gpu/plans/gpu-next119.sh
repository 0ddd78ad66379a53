#!/usr/bin/env bash
# Thirty-seventh session, third call. Path::MoeFlow (TS_CUDA_MOE_FLOW=1): the grouped decode
# MoE's down launch waits on per-tile flags set by the gate/up launch's last block of each tile
# (which also quantises the tile's GLU rows: no quant launch between them), so the down starts
# in the gate/up's ragged tail. The same bits expected.
# 1. The MoE op tests (moe_rows_exact runs the flow, one and two row sets).
# 2. 64 sequences at -d 96, defaults and the flow, twice; -d 400 and 128 sequences each way.
# 3. The server with the flow.
#   tools/gpu/plans/gpu-next119.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
# (Path::MoeFlow was removed after gpu-next120, measured slower: its code is at commit 970bbc0.)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== moe tests"
op_log 150 3 ops.txt "" "" moe
wait
stamp "== 64 sequences"
bpd 64 "-d 96" "" "TS_CUDA_MOE_FLOW=1" "" "TS_CUDA_MOE_FLOW=1"
bpd 64 "-d 400" "" "TS_CUDA_MOE_FLOW=1"
bpd 128 "" "" "TS_CUDA_MOE_FLOW=1"
stamp "== server, 64 clients, the flow"
serve64 "TS_CUDA_MOE_FLOW=1" 30
rm -f $V
stamp "== done"
