#!/usr/bin/env bash
# Thirty-fourth session, after gpu-next111 (prefill chunks of 512: 7,694 tok/s; 1024 chained
# 7,780; --chain, 2 splits a token, MOE_T16=24, MMH=q8, DENSE_BLAS=0 no gain). A trace of the
# server at 64 clients, chunks of 512 (8 s of load), steps grouped by their launches
# (tools/gpu/steps.py): where a decode-only step's ~8 ms goes now that batches attend on the
# tensor cores past 64 keys.
#   tools/gpu/plans/gpu-next112.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~2 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
stamp "== traced server, 64 clients, prefill chunks of 512"
serve64 "TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/st.csv" 8 "--row-multiple 1 --prefill-chunk 512"
sleep 2
python3 "$(dirname "$0")/../steps.py" $O/st.csv 14 | head -110
rm -f $O/st.csv $V
stamp "== done"
