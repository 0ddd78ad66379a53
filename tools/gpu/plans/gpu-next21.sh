#!/usr/bin/env bash
# RUN (twelfth session): bulk 4.16-4.22 TB/s with 18-37 KB chunks (frag16 tiled 3.32-3.42, stream
# 4.12); pp512 18,089, pp2048 16,812; the profile in docs/PERF.md.
# Twelfth session (2026-11-30). Three questions, one binary:
#  1. bwprobe's new `bulk` probes: does the Hopper bulk copy engine (cp.async.bulk into a shared
#     ring, one producer thread a block) read the expert matrices nearer the 4.13 TB/s stream
#     than mmq_q8_rows' register-fed loads (frag16 tiled 3.34-3.43)? If so, the grouped expert
#     products (63% of the 64-sequence step at ~2.7 TB/s) should be fed that way.
#  2. The defaults after gpu-next20 (mla_prefill_ha + shared-space ldmatrix together): pp512,
#     pp2048.
#  3. Where the dense 64-token chain goes, by grid shape: TS_CUDA_PROFILE=1 at --parallel 64
#     (eager, event-timed: inflated, but the split between products is the point).
#   tools/gpu/plans/gpu-next21.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/bwprobe tools/gpu/bwprobe.cu && /tmp/bwprobe
wait
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
TS_CUDA_PROFILE=1 timeout 200 "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 > $O/prof64.txt 2>&1
grep -E "tg8|^cuda profile" -A42 $O/prof64.txt | cut -c1-110
