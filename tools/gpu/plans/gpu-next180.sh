#!/usr/bin/env bash
# Fifty-fourth session: is the H200's 64-sequence bench 2% slower than in the forty-fifth session
# (9,735 at -d 96 in gpu-next176 against 9,926-9,946) because of the code or the card? The
# forty-fifth session's last build (fd32527, OLD) against this one (BIN), alternating, at
# `--parallel 64 -n 32 -r 2 -d 96` (OLD also with this build's expert prefetch: 24 MB from the
# merge); then this build under the H100-chosen defaults' old values and the head on the int8
# rows kernel; the server with the best of those if it beats the defaults by 0.8%. ~5-7 minutes.
#   tools/gpu/plans/gpu-next180.sh BIN OLD 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OLD=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
q8_ready
best=""; bestv=0; base=0
# `p64 ENV BIN`: the bench, and for this build, the best setting so far (the defaults' best apart).
p64() {
  local out v
  out=$(b "$1" "$2" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash -d 96)
  echo "$out"
  [ "$2" = "$B" ] || return 0
  v=$(echo "$out" | grep -E "^tg32 x64" | sed -E 's/.*\| ([0-9.]+) .*/\1/')
  [ -z "$v" ] && return 0
  if [ -z "$1" ]; then base=$(python3 -c "print(max($base, $v))")
  elif python3 -c "import sys; sys.exit(0 if $v > $bestv else 1)"; then best=$1; bestv=$v; fi
}
stamp "== old against new, -d 96"
p64 "" "$B"
p64 "" "$OLD"
p64 "" "$B"
p64 "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "$OLD"
p64 "" "$OLD"
p64 "" "$B"
stamp "== this build's knobs"
for e in "TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1" "TS_CUDA_DEFINES=RS_EARLY=0" "TS_CUDA_XPF=0" "TS_CUDA_FORK_AHEAD=0" "TS_CUDA_HEAD_BLAS=0 TS_CUDA_MMQ_ROWS=64"; do p64 "$e" "$B"; done
p64 "" "$B"
stamp "best: '$best' $bestv against the defaults' $base"
if python3 -c "import sys; sys.exit(0 if $bestv > 1.008 * $base else 1)"; then
  stamp "== server"
  serve64 "" 40 "--row-multiple 4"
  serve64 "$best" 40 "--row-multiple 4"
fi
stamp "== done"
