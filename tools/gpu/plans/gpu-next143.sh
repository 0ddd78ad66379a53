#!/usr/bin/env bash
# Written at the end of the forty-first session (device time spent), for the next one:
# `TS_CUDA_ROWS_SK=1` (Path::RowsSk: the MoE's grouped rows launches in stream-K form, one wave
# of blocks with equal shares of the (tile, 64 rows, group) steps; a unit split between two
# blocks is finished by the second from the first one's sums, so the same bits as mmq_q8_rows).
# Compiled (91 registers, no spill), never run. 1. moe_rows_exact (bit for bit against
# mmq_q8_16, tiled and row-major, V2-Lite's shapes) and recorded_steps_replay. 2. 64 sequences
# at -d 96 and at -d 400, 128 and 32 sequences: the hashes must not move. 3. The server.
# 4. tools/gpu/attn_out_mb.py: W_uv then W_o against one product with W_uv folded into W_o.
# If it hangs (a block waiting on a flag that never comes), TS_RUN_LIMIT cuts each run off.
#   tools/gpu/plans/gpu-next143.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
K=TS_CUDA_ROWS_SK=1
ops_tests 200 2 moe_rows_exact recorded_steps_replay
stamp "== 64 sequences -d 96 / -d 400, 128 and 32 sequences"
bpd 64 "-d 96" "" $K
bpd 64 "-d 400" "" $K
bp 128 "" $K
bp 32 "" $K
stamp "== server"
serve64 "" 30
serve64 "$K" 30
rm -f $V
python3 "$(dirname "$0")/../attn_out_mb.py" 2>&1 | tail -3
stamp "== done"
