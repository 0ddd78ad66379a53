#!/usr/bin/env bash
# Fifty-seventh session: the merge's expert prefetch only for batches of up to 32 rows
# (TS_CUDA_XPF_ROWS, default 32; 128 is the old behaviour):
#  1. H200 only: the server with the defaults, 45 s (issue 6's figure);
#  2. 64 sequences at -d 96, alternating twice: the defaults against TS_CUDA_XPF_ROWS=128 and
#     MMQ_GU_PF=160 (now that the merge no longer asks for the same experts at 64 rows);
#  3. 16 sequences: the defaults against both MMQ prefetches off (do they cost at 16 rows?);
#  4. the server with the defaults (H100: after the benches).
#   tools/gpu/plans/gpu-next191.sh BIN 2>&1 | tee $OUT/log.txt | grep -vE "^tg32 @|tokens of tg32 @" | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
h200=0
is_h200 && h200=1
if [ $h200 = 1 ]; then
  stamp "== server, 64 clients, 45 s (H200: issue 6's figure)"
  serve64 "" 45 "--row-multiple 4"
fi
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  p64_best ""
  p64_best "TS_CUDA_XPF_ROWS=128"
  p64_best "TS_CUDA_DEFINES=MMQ_GU_PF=160"
done
stamp "== 16 sequences"
bpd 16 "-d 96" "" "TS_CUDA_DEFINES=MMQ_GU_PF=0,MMQ_DN_PF=0"
if [ $h200 = 0 ]; then
  stamp "== server, 64 clients, 45 s"
  serve64 "" 45 "--row-multiple 4"
fi
stamp "== done"
