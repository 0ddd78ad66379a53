#!/usr/bin/env bash
# Forty-fourth session, third call: main with RowsSk, SplitMerge and the fork's rows form
# removed, Path::RouteGroup new (on), the tail halves at 8, `serve` chaining by default. Every
# op test, then 64 sequences at -d 96 with RouteGroup on and off (two rounds), 128 sequences,
# and the server (its defaults now chain) with and without the prompt cache; the output head
# on the int8 rows kernel (HEAD_BLAS=0 with MMQ_ROWS=64) or the 64-token tiles (HEAD_BLAS=0).
#   tools/gpu/plans/gpu-next150.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
ops_tests 300 2
grep -E "route_group|path taken" $O/ops.txt | head -12
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" TS_CUDA_ROUTE_GROUP=0 "" TS_CUDA_ROUTE_GROUP=0
bp 128 ""
stamp "== the head on the int8 rows kernel"
bpd 64 "-d 96" "TS_CUDA_HEAD_BLAS=0 TS_CUDA_MMQ_ROWS=64" "TS_CUDA_HEAD_BLAS=0"
stamp "== server"
serve64 "" 30 "--row-multiple 4"
serve64 "" 30 "--row-multiple 4 --no-prompt-cache"
stamp "== done"
