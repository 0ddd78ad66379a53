#!/usr/bin/env bash
# Thirty-second session, after gpu-next99 and gpu-next100 (which kept DENSE_JOBS and DENSE_EARLY):
# bench steps at 64, 80 and 96 sequences take 7.55, 9.37 and 9.24 ms (tok/s 8,470, 8,534,
# 10,386), so 64 -> 80 rows costs 1.8 ms and 80 -> 96 nothing; the server's steps carry ~79
# rows. The traces (kernel by kernel, critical path) of the three, S on, to find the cliff; the
# raw CSVs come back gzipped for a side-by-side read.
#   tools/gpu/plans/gpu-next101.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -90   (~3 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
S="TS_CUDA_DENSE_JOBS=1 TS_CUDA_DENSE_EARLY=1"
for p in 64 80 96; do
  stamp "== trace, $p sequences, $S"
  env $S TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr$p.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 1 >/dev/null 2>&1
  python3 "$(dirname "$0")/../trace.py" $O/tr$p.csv 16 | head -28
  gzip -f $O/tr$p.csv
done
rm -f $V
stamp "== done"
