#!/usr/bin/env bash
# Written in the thirty-eighth session after its device time was spent; not yet run.
# The tail halves' count per launch: TS_CUDA_ROWS_TAIL sets the gate/up pair's (22 blocks a
# tile) and, unless TS_CUDA_ROWS_TAIL_DN is set, the down's (16 blocks a tile). gpu-next123/124
# swept one count for both (12 / 16 / 20 within 0.3%). If the best is a number of blocks, the
# down wants ~22 tiles where the gate/up wants ~16. The same bits whatever the counts.
# 1. 64 sequences at -d 96: the default (16 / 16); DN 8, 22, 28; the gate/up's 12 and 22 with
#    DN 16; the default again. 2. The server with the best (edit S) and the default.
# 3. Nsight on one layer's two rows launches with the halves and without (TS_CUDA_ROWS_TAIL=0):
#    did the SMs' active share (88.7% / 85% in gpu-next118) rise, and how far from 100%?
#   tools/gpu/plans/gpu-next127.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -120   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
S="TS_CUDA_ROWS_TAIL_DN=22"
q8_bg
wait
stamp "== 64 sequences at depth 96"
bpd 64 "-d 96" "" TS_CUDA_ROWS_TAIL_DN=8 TS_CUDA_ROWS_TAIL_DN=22 TS_CUDA_ROWS_TAIL_DN=28 \
  "TS_CUDA_ROWS_TAIL=12 TS_CUDA_ROWS_TAIL_DN=16" "TS_CUDA_ROWS_TAIL=22 TS_CUDA_ROWS_TAIL_DN=16" ""
stamp "== server, 64 clients"
serve64 "$S" 30
serve64 "" 30
stamp "== Nsight: the rows launches of one layer, halves on / off"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for e in "" TS_CUDA_ROWS_TAIL=0; do
  echo "-- ${e:-default}"
  env $e TS_CUDA_GRAPHS=0 timeout 150 "$ncu" --kernel-name "regex:mmq_q8_rows" --launch-skip 40 --launch-count 2 \
    --section SpeedOfLight --section LaunchStats \
    --metrics sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,gpc__cycles_elapsed.max,dram__bytes_read.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
    "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 -d 96 > $O/ncu.txt 2>&1
  grep -E "mmq_q8_rows|Duration|Grid Size|cycles_active|elapsed|dram__|issue_active|DRAM|rror" $O/ncu.txt | head -30
done
rm -f $V
stamp "== done"
