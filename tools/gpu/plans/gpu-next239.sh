#!/usr/bin/env bash
# Written in the seventy-fifth session after gpu-next238 (where Path::RaOut's W_uv-split form
# lost 3.5% and the path was removed); no machine came after it, so it is the next plan. On
# an H200 first issue 6's figure (the server, 64 clients, 45 s, the defaults) and tg128. On any
# card: the placement probe (tools/gpu/placeprobe.cu: are a PDL secondary's blocks placed while
# the primary runs, cluster or not?), the gate/up probe (tools/gpu/gateprobe.cu: the one-token
# gate/up's read pattern against a plain stream, and its units claimed from a counter), the
# persistent-kernel probe (tools/gpu/megaprobe.cu, written in the seventy-sixth session: 26
# MoE layers in one cooperative launch, grid barriers between phases, with and without the
# attention's weights streamed into shared memory a layer ahead), op tests (gu_dyn_exact, and
# those around the output launch, which lost RaOut), then tg128 default / TS_CUDA_GU_DYN=1 at
# 2 and 1 blocks an SM alternating (the hashes must match: db10d2fd9a926913) and
# TS_CUDA_GU_TILE=1 (gate/up's routed rows from the tiled copies, written in the seventy-sixth
# session: another summation order, so another hash), and a trace with each on. ~6 minutes on
# an H100.
#   tools/gpu/plans/gpu-next239.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== placeprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/placeprobe tools/gpu/placeprobe.cu 2>&1 | grep -v "^$" | head -5
timeout 60 /tmp/placeprobe
stamp "== gateprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/gateprobe tools/gpu/gateprobe.cu 2>&1 | grep -v "^$" | head -5
timeout 90 /tmp/gateprobe
stamp "== megaprobe"
/usr/local/cuda/bin/nvcc -O3 -arch=sm_90a -o /tmp/megaprobe tools/gpu/megaprobe.cu 2>&1 | grep -v "^$" | grep -v "warning #\|Remark" | head -5
timeout 90 /tmp/megaprobe
if is_h200; then
  # The launch-size curve on the H200 (the seventy-third session measured it on an H100 only):
  # bf16's one-token down reads 46 MB in 18.2 us there (2.5 TB/s) where its gate/up reads 92 MB
  # at 4.2.
  stamp "== downprobe (H200)"
  /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -o /tmp/downprobe tools/gpu/downprobe.cu 2>&1 | grep -v "^$" | head -5
  timeout 60 /tmp/downprobe
fi
stamp "== op tests"
op_log 120 3 ops.txt "" "" gu_dyn_exact gu_tile_close fused_mla short_attention_in_mla_out
h200_first tg128
wait
GD="TS_CUDA_GU_DYN=1"
stamp "== tg128: default / GU_DYN (2 an SM) / GU_DYN (1 an SM) / GU_TILE"
for r in 1 2; do
  young 420 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$GD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$GD TS_CUDA_GU_DYN_PER_SM=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_GU_TILE=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== trace (tg32): GU_DYN"
young 500 && (export $GD; trace_tg 9)
stamp "== trace (tg32): GU_TILE"
young 520 && (export TS_CUDA_GU_TILE=1; trace_tg 9)
stamp "== done"
