#!/usr/bin/env bash
# Fifty-second session, part 2 of 2 (after gpu-next175.sh on the same machine, whose model it
# reuses, else makes): the server with every default once more, 64 sequences at -d 96 and at
# -d 32 against the old tensor-core threshold, tg128, tg64 at 16k, bf16 tg128 (the H200's last:
# 9,926 at -d 96 before the forty-ninth session, 709, 546, 520.6). ~7 minutes with the bf16
# synthesis.
#   tools/gpu/plans/gpu-next176.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== server"
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
