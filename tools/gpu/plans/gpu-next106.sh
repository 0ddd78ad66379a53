#!/usr/bin/env bash
# Thirty-third session. gpu-next105: prefill chunks of 64 keep the server's mixed steps at
# ~126 rows, replayed from graphs (98% of steps), yet 6,714 tok/s against 6,855 with chunks of
# 128 (188-row mixed steps, op by op): by subtraction a mixed step costs ~5 ms more than a
# decode-only step of its rows. Traces of the server (8 s of load, chunks 64 and 128), steps
# grouped by their launches (tools/gpu/steps.py).
#   tools/gpu/plans/gpu-next106.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -150   (~3 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
R="TS_CUDA_ROUTER_SPLIT=1"
for c in 64 128; do
  stamp "== traced server, 64 clients, prefill chunks of $c"
  serve64 "$R TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/st.csv" 8 "--row-multiple 1 --prefill-chunk $c"
  sleep 2
  python3 "$(dirname "$0")/../steps.py" $O/st.csv 14 | head -70
  rm -f $O/st.csv
done
rm -f $V
stamp "== done"
