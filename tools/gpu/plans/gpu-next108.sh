#!/usr/bin/env bash
# Thirty-third session. New defaults: Path::RouterSplit on; batches (n > 1) take the
# tensor-core split attention from position TS_CUDA_MLA_LONG_BATCH (default 64; 0 never, 1
# always). `bench --parallel` now takes -d (every sequence's first d positions filled first),
# so the bench can sit at the server's contexts. Where SIMT and tensor cores cross at 64
# sequences: -d 32 (positions 32-63: SIMT by default), -d 64 and -d 128 (tensor cores by
# default), each against the other kernel; -d 0 must give gpu-next103's R figure and hash
# (8,583, 25c57a7459151b2c).
#   tools/gpu/plans/gpu-next108.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~3 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
wait
p() { echo "-- ${1:-default} $2"; env $1 "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash $2 2>&1 | grep -E "x64|hash of tg32 x"; }
stamp "== 64 sequences at depth"
p "" ""
p "" "-d 32"
p "TS_CUDA_MLA_LONG_BATCH=1" "-d 32"
p "" "-d 64"
p "TS_CUDA_MLA_LONG_BATCH=0" "-d 64"
p "" "-d 128"
p "TS_CUDA_MLA_LONG_BATCH=0" "-d 128"
rm -f $V
stamp "== done"
