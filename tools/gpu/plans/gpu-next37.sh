#!/usr/bin/env bash
# Written in the fifteenth session (2026-12-01), NOT yet run: the third short call (~3 minutes),
# the server at 64 clients after gpu-next35/36 have picked the winners.
#  - The prompt chunk: a step takes at most --prefill-chunk prompt tokens (128 by default). When
#    64 requests of 32-token prompts arrive together, their 2,048 tokens go through 16 steps, so
#    the sequences start, and then finish, 16 steps apart. The steady state is steps of ~64
#    decode rows plus a few prompt tokens (the twelfth session saw 76 rows a step, and the dense
#    products take two 64-token tiles above 64 rows). With --prefill-chunk 2048 one step takes
#    the whole round's prompts, and the rounds stay in step: 64-row steps (8.4 ms in the bench,
#    against 10.9 for the mixed ones) and one efficient 2,048-token prefill. The metrics line
#    gives steps and batch tokens to check it.
#   tools/gpu/plans/gpu-next37.sh BIN [WINNERS_ENV]
set -u
B=$1; W=${2:-""}
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
stamp "== server"
serve64 "" 15
serve64 "" 15 "--prefill-chunk 2048"
[ -n "$W" ] && serve64 "$W" 15 "--prefill-chunk 2048"
stamp "== done"
