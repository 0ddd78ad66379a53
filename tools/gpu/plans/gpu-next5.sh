#!/usr/bin/env bash
# First GPU run of branch gpu-next5 (written 2026-11-30 without a GPU; ran in the seventh session,
# results in docs/PERF.md; the L2 prefetch it measures was removed after, so TS_CUDA_L2PF is now
# ignored): the f16 MLA latent cache
# (TS_CUDA_MLA_F16=0: f32 as on main), the tensor-core split decode from TS_CUDA_MLA_LONG
# positions on (0: never; it is in the graph key), the f16 split kernel's double-buffered
# cp.async tiles, and the L2 prefetch of the weights a decode step reads next from a side stream
# (TS_CUDA_L2PF=1, =2 evict_last; off by default until measured: the tokens must not change);
# against main's build in the same call.
#   tools/gpu/plans/gpu-next5.sh BIN OPS_TEST MAIN_BIN [a|b]
# Two device calls of about 6 and 4 minutes: a (the default) the op tests, the fixtures, tg128 and
# tg @16k; b prompts, 64 sequences, a 16k trace and the server (row multiples 1 and 16: padded
# steps repeat their shapes, so more of them replay a recorded graph).
# Expect: ops_vs_cpu all pass (new: mla_f16_latent_cache); TS_CUDA_MLA_F16=0 keeps main's tg128
# hash (e9b67e142c109494 at -p 0 -n 128 -r 3); the f16 cache has its own hash (keys rounded to
# f16 for the SIMT kernel too) and the fixtures stay within prefill.sh's 3e-2.
set -u
B=$1; OPS=$2; M=$3; PART=${4:-a}
source "$(dirname "$0")/lib.sh"
if [ "$PART" = b ]; then
  "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
  # After a: one long token now takes one wave of tensor-core splits; where does the tensor-core
  # kernel start to win (TS_CUDA_MLA_LONG), and is one wave the best split count?
  "$OPS" --test-threads 2 mla_f16 2>&1 | grep -E "FAIL|test result"
  for e in "" TS_CUDA_MLA_SPLITS=66 TS_CUDA_MLA_SPLITS=198; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
  done
  for d in 1024 2048 4096; do
    for e in TS_CUDA_MLA_LONG=0 TS_CUDA_MLA_LONG=1; do
      b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d $d -r 1
    done
  done
  for e in "" TS_CUDA_MLA_F16=0; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
  done
  b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
  TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/trace16k.csv "$B" bench --backend cuda -m $V -p 0 -n 32 -d 16384 -r 1 2>&1 | grep -E "cuda trace|tg"
  python3 tools/gpu/trace.py $O/trace16k.csv 16 2>/dev/null | head -14
  for rm in 1 16; do
    echo "== server, --row-multiple $rm"
    TS_ROW_MULTIPLE=$rm TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | tail -8
  done
  exit 0
fi
ops_and_model
echo "== fixtures: CUDA (f16 latent cache) vs CPU"
tools/gpu/prefill.sh "$B" "$OPS" $O/pf fix 2>&1 | grep -vE "^\s*$" | tail -6
for r in 1 2; do
  b "" "$M" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  for e in "" TS_CUDA_MLA_F16=0 TS_CUDA_L2PF=1 TS_CUDA_L2PF=2; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
for e in "" TS_CUDA_MLA_LONG=0 TS_CUDA_MLA_F16=0 "TS_CUDA_MLA_F16=0 TS_CUDA_MLA_LONG=0" TS_CUDA_MLA_SPLITS=132; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
done
b "" "$M" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
