#!/usr/bin/env bash
# Nineteenth session (2026-12-02): the prompt MoE's routed experts on mmh_* (kernels/mmh.cu:
# wgmma with both operands from shared memory, fed by TMA from a producer warpgroup; row-major
# f16 copies of the stacks). First its op test (moe_f16_prompt: mmh against mmfq8 and f64, the
# copies byte for byte), then pp512 / pp2048 with it and without (TS_CUDA_MMH=0, the previous
# default), tg128 with its hash (decode must not move), and where a pp512 goes now.
#   tools/gpu/plans/gpu-next49.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op test moe_f16_prompt"
op_log 150 1 ops_mmh.txt "mmh|" "" moe_f16_prompt
wait
stamp "== prompts"
for e in "" "TS_CUDA_MMH=0"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
done
stamp "== decode"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== profile pp512"
TS_CUDA_PROFILE=1 timeout 120 "$B" bench --backend cuda -m $V -p 512 -n 0 -r 1 > $O/prof.txt 2>&1
grep -vE "^\s*$" $O/prof.txt | tail -45
stamp "== done"
