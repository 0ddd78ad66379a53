#!/usr/bin/env bash
# Forty-third session, third call: the tree with the shared FFN forked on cuBLAS as the default
# (Path::SharedFork on, its cuBLAS form; gpu-next145/146 measured it +1.8% at 64 sequences and
# +1.6% in the server). Every op test (the stream-K one in a process of its own), then 64
# sequences at -d 96 (the default against TS_CUDA_SHARED_FORK=0) and 128 sequences, then the
# server three ways: with the prompt cache (the default), without it, and with fresh prompts.
#   tools/gpu/plans/gpu-next147.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
ops_tests 240 2 --skip moe_rows_exact
op_log 100 1 ops_sk.txt "" "" moe_rows_exact
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" TS_CUDA_SHARED_FORK=0
bp 128 ""
stamp "== server"
serve64 "" 30
serve64 "" 30 "--row-multiple 1 --no-prompt-cache"
serve64 "" 30 "--row-multiple 1" --fresh-prompts
stamp "== done"
