#!/usr/bin/env bash
# Forty-fourth session, first call: main as it is (901d341, the shared FFN forked by default),
# the rows launches' knobs swept again now that the routed experts run without the shared
# chunks (the tail halves, one or two row sets, the tiled copy), the batches' attention always
# on the tensor cores; a trace of the 64-row step; then the server's leftovers from gpu-next144:
# `--chain`, `--row-multiple 4` (the CLI's default) and 8 against 1; then attn_out_mb.py.
#   tools/gpu/plans/gpu-next148.sh BIN 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
wait
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL=0 TS_CUDA_ROWS_TAIL=8 TS_CUDA_ROWS_TAIL=32 TS_CUDA_ROWS_R=1 \
  TS_CUDA_MOE_TILED=0 TS_CUDA_MLATC=1 TS_CUDA_FORK_AHEAD=0 ""
stamp "== trace"
trace_steps 64 96 70
stamp "== server"
serve64 "" 30 "--row-multiple 1 --chain"
serve64 "" 30 "--row-multiple 4"
serve64 "" 30 "--row-multiple 8"
serve64 "" 30
rm -f $V
python3 "$(dirname "$0")/../attn_out_mb.py" 2>&1 | tail -6
stamp "== done"
