#!/usr/bin/env bash
# For the seventy-third session (after gpu-next233): the one-token routing launch
# (add_rms_norm_parts_router_route) at two blocks an SM (TS_CUDA_DEFINES=RR_MINB=2: 32 registers
# a thread, 40 bytes spilled), so that its cluster can be placed beside mla_out_q8's blocks and
# load its router rows before that launch ends. While the file is made, the down-pattern probe
# with its size sweep (tools/gpu/downprobe.cu); on an H200 then issue 6's figure (the server, 64
# clients, 45 s) and tg128. On any card: tg128 with RR_MINB 1 / 2, alternating, two traces, and
# tg64 at 16k each way (~6 minutes on an H100, ~9 on an H200).
#   tools/gpu/plans/gpu-next234.sh .dev/turbospark > $OUT/log.txt 2>&1
# (Ran once, from 48e928f, on an H100: RR_MINB=2 lost 4.9% and the define was removed, so this
# plan's second half runs only on that commit's binaries. docs/PERF.md, seventy-third session.)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== downprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/downprobe tools/gpu/downprobe.cu 2>&1 | grep -v "^$" | head -5
timeout 60 /tmp/downprobe
h200_first tg128
wait
stamp "== tg128: RR_MINB 1 / 2"
for r in 1 2; do
  young 450 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_DEFINES=RR_MINB=2" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== traces (tg32): RR_MINB 1, 2"
young 480 && trace_tg 8
young 500 && (export TS_CUDA_DEFINES=RR_MINB=2; trace_tg 8)
stamp "== tg64 at 16k: RR_MINB 1 / 2"
young 520 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
young 545 && b "TS_CUDA_DEFINES=RR_MINB=2" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
