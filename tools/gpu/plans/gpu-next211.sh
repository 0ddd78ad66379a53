#!/usr/bin/env bash
# For the sixty-second session (~4 minutes), any card: Path::RouterPf (TS_CUDA_ROUTER_PF=1:
# mla_out_q8's blocks ask the routing cluster's f32 router rows into L2 before their PDL wait).
# The op tests through the routing made ahead with it on, then tg128 and tg64 at 16k against the
# defaults, alternating, with hashes (the same bits expected).
#   OPS=.dev/ops tools/gpu/plans/gpu-next211.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
TS_CUDA_ROUTER_PF=1 ops_tests 120 4 pre_routed_moe_exact fused_mla_attention_out
stamp "== tg128: defaults against ROUTER_PF=1"
for r in 1 2; do
  for e in "" "TS_CUDA_ROUTER_PF=1"; do young 330 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_ROUTER_PF=1"; do young 430 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== done"
