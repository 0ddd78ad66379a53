#!/usr/bin/env bash
# Fifty-fourth session, gpu-next180 cut to ~4 minutes for a short budget: the forty-fifth
# session's build (OLD, fd32527) against this one (BIN), alternating, at `--parallel 64 -n 32
# -r 2 -d 96`, then this build with the expert prefetch as the forty-fifth session left it and
# with the router's loads after the PDL wait; then, if time is left, 4 choices of one prompt
# without the prompt cache (they share it since 708c5a1: texts equal, 1,797 tokens copied).
#   tools/gpu/plans/gpu-next181.sh BIN OLD 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OLD=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
stamp "== old against new, -d 96"
p64_best ""
p64_best "" "$OLD"
p64_best ""
p64_best "" "$OLD"
stamp "== this build's knobs"
p64_best "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1"
p64_best "TS_CUDA_DEFINES=RS_EARLY=0"
p64_best ""
# (time left: a request's 4 choices without the prompt cache, which now share their prompt)
if [ $(( $(date +%s) - T0 )) -lt 230 ]; then stamp "== choices without the prompt cache"; choices "--no-prompt-cache"; fi
stamp "== done"
