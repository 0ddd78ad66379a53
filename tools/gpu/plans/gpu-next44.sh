#!/usr/bin/env bash
# Written in the seventeenth session (2026-12-01), NOT yet run (its device time was spent): the
# wgmma prompt MoE with the stage copies on a producer warpgroup (mmfw_ws_*, TS_CUDA_MMF_W=2),
# and the default f16-copies kernels with theirs on a producer warp (mmf16_ws_*, TS_CUDA_MMF=ws).
# gpu-next42's knockouts had the copies and the A conversion fast alone and slow together; in
# mmfw_ws the multiplying warps issue no copies. First the op test (mmfw_ws against mmfq8, its
# gate-up launch against its three: a hang there would be a barrier mistake, so it runs alone
# and under a limit), then pp512 / pp2048 on mmfq8 (TS_CUDA_F16=0), mmfw and mmfw_ws, twice,
# interleaved, with the copies' path (default) and its producer-warp twin beside them. If
# mmf16_ws wins, the same change is due in mmq_q8_64 (whose SASS shows the same hazard: the
# dense products of the 64-sequence step). If mmfw_ws wins by a clear margin: make it
# the default for Q8_0 prompt MoEs on sm_90a and stop making the f16 copies there (29 GB and
# ~14 ms of load on V2-Lite), then run every op test and the server.
#   tools/gpu/plans/gpu-next44.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op test: wgmma kernels (mmfw, mmfw_ws)"
op_log 180 1 ops_w.txt "mmfw|skipped|" "" moe_f16_prompt
stamp "== op test: the f16 copies' kernels on a producer warp (TS_CUDA_MMF=ws)"
op_log 180 1 ops_ws.txt "" "TS_CUDA_MMF=ws" moe_f16_prompt
wait
stamp "== prompts"
for r in 1 2; do
  for e in "" "TS_CUDA_MMF=ws" "TS_CUDA_F16=0" "TS_CUDA_F16=0 TS_CUDA_MMF_W=1" "TS_CUDA_F16=0 TS_CUDA_MMF_W=2"; do
    b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
    [ $r = 1 ] && b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
  done
done
stamp "== done"
