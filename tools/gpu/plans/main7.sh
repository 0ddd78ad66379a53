#!/usr/bin/env bash
# Seventh session, after the gpu-next5 merge: main's build as one binary (op tests, tg128 twice,
# prompts, 64 sequences, the server) and mla_split_tc_h's cp.async ring depth at 16k
# (TS_CUDA_MS_NB=2/3/4, with one wave of splits and with half a wave).
#   tools/gpu/plans/main7.sh BIN OPS_TEST      (about 6 minutes)
# Expect: ops_vs_cpu all pass; tg128 hash 756941f1d106faec (the branch's default in part a of
# gpu-next5.sh: the f16 cache; the ring depth does not change the arithmetic).
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_and_model
for r in 1 2; do b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
for e in "" TS_CUDA_MS_NB=3 TS_CUDA_MS_NB=4 "TS_CUDA_MS_NB=3 TS_CUDA_MLA_SPLITS=66" "TS_CUDA_MS_NB=4 TS_CUDA_MLA_SPLITS=66"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
done
b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
b "" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 3
for e in "" TS_CUDA_MLATC=1; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
done
TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" "$OPS" $O/pf serve 2>&1 | grep -vE "^\s*$" | grep -vE "^turbospark: (GPU|serving)" | tail -14
