#!/usr/bin/env bash
# Written in the seventy-fifth session after gpu-next238 (where Path::RaOut's W_uv-split form
# lost 3.5% and the path was removed), extended in the seventy-sixth; no machine has run it yet.
# Op tests first (gu_dyn_exact, gu_tile_close, and those around the output launch), the probes
# compiled meanwhile; on an H200 then issue 6's figure (the server, 64 clients, 45 s, the
# defaults) and tg128. On any card then the probes: placeprobe (are a PDL secondary's blocks
# placed while the primary runs, cluster or not?), gateprobe (the one-token gate/up's read
# pattern against a plain stream, its units claimed from a counter, and read from the tiled
# copies), megaprobe (a persistent decode kernel's skeleton: 27 layers and the head in one
# cooperative launch, grid barriers between phases, the attention's weights in shared memory
# a layer ahead or as the layer begins), and on an H200 downprobe (the launch-size curve).
# Then tg128 default / TS_CUDA_GU_DYN=1 (the hashes must match: db10d2fd9a926913) /
# TS_CUDA_F16=0 / TS_CUDA_F16=0 TS_CUDA_GU_TILE=1 (another summation order, so another hash),
# two rounds, and a trace with each path on. ~6-7 minutes on an H100.
#   tools/gpu/plans/gpu-next239.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
# The probes compiled while the op tests run (nvcc on the CPU; an H200 runs issue 6's server
# before them).
NV="/usr/local/cuda/bin/nvcc -O3"
($NV -arch=sm_90 -o /tmp/placeprobe tools/gpu/placeprobe.cu && $NV -arch=sm_90 -o /tmp/gateprobe tools/gpu/gateprobe.cu \
  && $NV -arch=sm_90a -o /tmp/megaprobe tools/gpu/megaprobe.cu && $NV -arch=sm_90 -o /tmp/downprobe tools/gpu/downprobe.cu) \
  > $O/nvcc.txt 2>&1 &
stamp "== op tests"
op_log 120 3 ops.txt "" "" gu_dyn_exact gu_tile_close fused_mla short_attention_in_mla_out
h200_first tg128
wait
grep -iE "error" $O/nvcc.txt | head -5
stamp "== placeprobe"
timeout 60 /tmp/placeprobe
stamp "== gateprobe"
timeout 90 /tmp/gateprobe
stamp "== megaprobe"
timeout 90 /tmp/megaprobe
if is_h200; then
  # The launch-size curve on the H200 (the seventy-third session measured it on an H100 only):
  # bf16's one-token down reads 46 MB in 18.2 us there (2.5 TB/s) where its gate/up reads 92 MB
  # at 4.2.
  stamp "== downprobe (H200)"
  timeout 60 /tmp/downprobe
fi
GD="TS_CUDA_GU_DYN=1"
# (GU_TILE against the defaults with no f16 copies on either side: on an H100 the prompt MoE's
# f16 copies leave the last layers without tiled copies, which GU_TILE reads; decode does not
# read the f16 copies, so the defaults' tokens stay the same.)
NF="TS_CUDA_F16=0"
stamp "== tg128: default / GU_DYN / no f16 copies / GU_TILE with none"
for r in 1 2; do
  young 300 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$GD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$NF" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$NF TS_CUDA_GU_TILE=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== trace (tg32): GU_DYN"
young 350 && (export $GD; trace_tg 9)
stamp "== trace (tg32): GU_TILE"
young 370 && (export $NF TS_CUDA_GU_TILE=1; trace_tg 9)
stamp "== done"
