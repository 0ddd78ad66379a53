#!/usr/bin/env bash
# Nineteenth session (2026-12-02): how the benchmark's prompts spread over the experts (the
# load-time warm-up forward is all token 0, so every token routes alike; Nsight runs that skip
# few launches see that forward, not the benchmark's), and where a 2,048-token prompt goes.
#   tools/gpu/plans/gpu-next50.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== counts pp512 (the bench's warm-up forward, after the load's)"
TS_CUDA_MOE_COUNTS=1 timeout 120 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 2>&1 | grep "moe counts" | awk 'NR==1 || NR==2 || (NR>26 && NR<=52)'
stamp "== counts pp2048"
TS_CUDA_MOE_COUNTS=1 timeout 120 "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 1 2>&1 | grep "moe counts" | awk 'NR==1 || (NR>26 && NR<=34)'
stamp "== profile pp2048"
TS_CUDA_PROFILE=1 timeout 150 "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 1 > $O/prof2048.txt 2>&1
grep -vE "^\s*$" $O/prof2048.txt | grep -A 24 "cuda profile"
stamp "== done"
