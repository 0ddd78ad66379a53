#!/usr/bin/env bash
# Thirty-fourth session, after gpu-next112 (the traced server at chunks of 512: decode-only
# steps 8.0-8.1 ms; mla_combine 27 launches, 328 us a step; the first prompt step 113 ms and
# ~0.7 s of host time after the first decode step).
# 1. mla_combine_few (Path::CombineFew, new: a block per (token, head)): its exactness test and
#    the attention tests.
# 2. 64 sequences at -d 96 with it and without (TS_CUDA_COMBINE_FEW=0): the same hash.
# 3. The server, 64 clients, 30 s, its new defaults (prefill chunks of 512, the warm-up before
#    it answers, mla_combine_few), and without the warm-up.
#   tools/gpu/plans/gpu-next113.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== mla tests"
op_log 150 3 ops.txt "" "" mla_
wait
stamp "== 64 sequences at depth 96, mla_combine_few and without"
bpd 64 "-d 96" "" "TS_CUDA_COMBINE_FEW=0"
stamp "== server, 64 clients: new defaults; --no-warmup"
serve64 "" 30
grep -h "warmed" $O/serve.log
serve64 "" 30 "--row-multiple 1 --no-warmup"
rm -f $V
stamp "== done"
