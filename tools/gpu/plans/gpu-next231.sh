#!/usr/bin/env bash
# For the seventy-second session, after gpu-next230 (H100: Path::MoeSplitK correct but tg128
# 506 against 629.5, moe_sh_q8_sk 46.4 us a layer against 20.6 + 11.0 for the two launches):
# where its time goes, by knockouts (wrong values, so other routings: times only). A tg32 trace
# with the path off, on, on without the reds (MSK_KO=1), and on without the down share at all
# (MSK_KO=2: the gate/up units alone); then tg128 of the knockouts while time allows. ~3 minutes.
#   tools/gpu/plans/gpu-next231.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_ready
stamp "== synthesised"
for e in "" "TS_CUDA_MOE_SPLITK=1" "TS_CUDA_MOE_SPLITK=1 TS_CUDA_DEFINES=MSK_KO=1" "TS_CUDA_MOE_SPLITK=1 TS_CUDA_DEFINES=MSK_KO=2"; do
  echo "-- trace ${e:-default}"
  (if [ -n "$e" ]; then export $e; fi; trace_tg 4)
done
for e in "TS_CUDA_MOE_SPLITK=1 TS_CUDA_DEFINES=MSK_KO=1" "TS_CUDA_MOE_SPLITK=1 TS_CUDA_DEFINES=MSK_KO=2"; do
  young 160 || break
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== done"
