#!/usr/bin/env bash
# For the sixty-second session (~9 minutes), any card: Path::DownCopy (TS_CUDA_DOWN_COPY=1:
# the one-token down kernel copies all its weights into shared memory before its PDL wait,
# moe_down_sh_q8c / moe_down_sh_<t>_c; with it the gate/up and down kernels ask for the largest
# shared-memory carveout unless TS_CUDA_DC_CARVE=0) and Path::RouterPf (TS_CUDA_ROUTER_PF=1:
# mla_out_q8's blocks ask the routing cluster's router rows into L2). Op test down_copy_exact
# (both paths, Q8_0 / bf16 / f16, the same bits), then tg128 alternating with hashes, tg64 at
# 16k, and bf16 tg128 with time left (its file made in the background meanwhile).
#   OPS=.dev/ops tools/gpu/plans/gpu-next213.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
ops_tests 100 4 down_copy_exact
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== tg128"
for e in "" "TS_CUDA_DOWN_COPY=1" "TS_CUDA_DOWN_COPY=1 TS_CUDA_DC_CARVE=0" "TS_CUDA_ROUTER_PF=1" "" "TS_CUDA_DOWN_COPY=1"; do
  young 330 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_DOWN_COPY=1 TS_CUDA_ROUTER_PF=1"; do young 420 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
wait
stamp "== bf16 tg128"
for e in "" "TS_CUDA_DOWN_COPY=1"; do young 500 && b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
stamp "== done"
