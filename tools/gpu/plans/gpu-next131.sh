#!/usr/bin/env bash
# Thirty-ninth session, the last call: the fixed dense_blas_batch test and norm_q8_batch_exact;
# the new defaults at -d 400, 128 sequences and tg128; the traced 64-row step (seq.txt).
#   tools/gpu/plans/gpu-next131.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~5 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
q8_bg
stamp "== ops_vs_cpu dense_blas_batch norm_q8_batch_exact"
op_log 200 2 ops.txt "XXXX" "" dense_blas_batch norm_q8_batch_exact
wait
stamp "== 64 at -d 400, 128, tg128"
bpd 64 "-d 400" ""
bp 128 ""
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== trace, 64 at -d 96"
trace_steps 64 96 30
cp $O/seq.txt $O/seq64.txt 2>/dev/null
rm -f $V
stamp "== done"
