#!/usr/bin/env bash
# Fifty-first session, for the next device time: an H200 (else an H100, whose figures compare
# only with each other). The server with every default of the forty-ninth to fifty-first
# sessions (24 MB of expert prefetch from the attention's merge, batches on the tensor-core
# attention from 32 keys, the wait for returning clients), against the wait off; issue 6 asks
# 10,000 on the H200 (9,601 with the forty-fifth session's defaults; ~9,870 expected). Then 64
# sequences at -d 96 and -d 32, tg128, tg64 at 16k, bf16 tg128 (the H200's last: 9,926 at -d
# 96, 709, 546, 520.6). ~8 minutes with the two syntheses.
#   tools/gpu/plans/gpu-next174.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== synth"
q8_ready
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== server"
serve64 "" 45 "--row-multiple 4"
serve64 "" 45 "--row-multiple 4 --gather-ms 0"
serve64 "" 45 "--row-multiple 4"
stamp "== 64 sequences"
bpd 64 "-d 96" "" ""
bpd 64 "-d 32" "" "TS_CUDA_MLA_LONG_BATCH=64"
stamp "== one sequence"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
wait
b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
stamp "== done"
