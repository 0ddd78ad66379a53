#!/usr/bin/env bash
# Forty-third session, second call (after gpu-next145: the shared FFN forked on cuBLAS won,
# +1.9% at 64 sequences and +1.6% in the server; the rows form lost 3.9%; BlasTune changed
# nothing; the fork with stream-K lost 9%). Last session's switches, never run before:
# stream-K rows (K) and the split merge in the split launch (M), alone and with the cuBLAS fork
# (FB), after their op tests (the stream-K test in a process of its own: a trap ends the
# process's CUDA context). Then the server without the prompt cache and with fresh prompts
# (the three ways to report; the cached figure is gpu-next145's), and with M + FB.
#   tools/gpu/plans/gpu-next146.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
K=TS_CUDA_ROWS_SK=1
M=TS_CUDA_SPLIT_MERGE=1
FB="TS_CUDA_SHARED_FORK=1 TS_CUDA_SHARED_FORK_BLAS=1"
ops_tests 150 2 mla_split_merge_exact mla_combine_few_exact
op_log 100 1 ops_sk.txt "" "" moe_rows_exact
stamp "== 64 sequences -d 96 / -d 400"
bpd 64 "-d 96" "" $K $M "$FB" "$M $FB"
bpd 64 "-d 400" "" $M "$M $FB"
stamp "== server"
serve64 "" 30 "--row-multiple 1 --no-prompt-cache"
serve64 "" 30 "--row-multiple 1" --fresh-prompts
serve64 "$M $FB" 30
stamp "== done"
