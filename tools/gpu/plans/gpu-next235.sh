#!/usr/bin/env bash
# For the seventy-fourth session: on an H200 only, issue 6's figure (the server, 64 clients,
# 45 s, the defaults) and issue 5's one-token figures (tg128 Q8_0, tg64 at 16k, tg128 bf16),
# ~6 minutes; on any other card it leaves at once (the card's name and uuid only).
#   tools/gpu/plans/gpu-next235.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
is_h200 || { stamp "== not an H200: nothing run"; exit 0; }
q8_bg
h200_first tg128
stamp "== tg64 at 16k"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== bf16 synthesised"
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1
stamp "== bf16 tg128"
b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
stamp "== done"
