#!/usr/bin/env bash
# For the sixty-first session (~7 minutes), after gpu-next207 on an H200: how many of the gate/up
# launch's first blocks should ask their rows into L2 (MMQ_GU_PF, 128 since the fifty-sixth
# session, measured on H100s only; the H200 has 60 MB of L2 where the H100 has 50): the 64-sequence
# bench at -d 96 with 128 (the default), 192 and 256, twice, then the server again (issue 6's
# figure; short runs read +-5%, so a second 45-s run).
#   OPS=.dev/ops tools/gpu/plans/gpu-next208.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
stamp "== 64 sequences: MMQ_GU_PF"
for r in 1 2; do
  bpd 64 "-d 96" "" "TS_CUDA_DEFINES=MMQ_GU_PF=192" "TS_CUDA_DEFINES=MMQ_GU_PF=256"
done
if young 330; then
  stamp "== server, 64 clients, 45 s (again)"
  serve64 "" 45 "--row-multiple 4"
fi
stamp "== done"
