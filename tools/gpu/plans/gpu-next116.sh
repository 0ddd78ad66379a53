#!/usr/bin/env bash
# Thirty-sixth session. `mla_split_tc_hb` (Path::SplitBatch): a batch's split attention over the
# f16 cache on a two-tile ring (96 KB, two blocks an SM: 64 sequences x 4 splits in one wave
# where the three-tile kernel's 133 KB took two), its first tiles before the query's loads.
# 1. The MLA op tests (mla_split_batch_exact: the same bits as mla_split_tc_h).
# 2. 64 sequences at -d 96: defaults, TS_CUDA_MS_BATCH=0, MS_KFIRST=0, one-tile ring (3 an SM)
#    with 6 splits, 2 splits; defaults and off again; at -d 400 defaults and off.
# 3. A traced step (the launch sequence into seq.txt); the server, 64 clients, 30 s.
#   tools/gpu/plans/gpu-next116.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_bg
stamp "== mla tests"
op_log 150 3 ops.txt "" "" mla_
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" "TS_CUDA_MS_BATCH=0" "TS_CUDA_DEFINES=MS_KFIRST=0" "TS_CUDA_MS_NB_B=1 TS_CUDA_MLA_SPLITS=6" \
  "TS_CUDA_MLA_SPLITS=2" "" "TS_CUDA_MS_BATCH=0"
stamp "== 64 sequences at depth 400"
bpd 64 "-d 400" "" "TS_CUDA_MS_BATCH=0"
stamp "== traced 64 sequences at depth 96"
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/tr.csv timeout 150 "$B" bench --backend cuda -m $V -p 0 -n 16 \
  --parallel 64 -r 1 -d 96 >/dev/null 2>&1
python3 "$(dirname "$0")/../steps.py" $O/tr.csv 16 $O/seq.txt | head -24
rm -f $O/tr.csv
stamp "== server, 64 clients"
serve64 "" 30
rm -f $V
stamp "== done"
