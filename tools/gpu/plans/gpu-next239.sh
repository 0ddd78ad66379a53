#!/usr/bin/env bash
# Written in the seventy-fifth session after gpu-next238 (where Path::RaOut's W_uv-split form
# lost 3.5% and the path was removed); no machine came after it, so it is the next plan. On
# an H200 first issue 6's figure (the server, 64 clients, 45 s, the defaults) and tg128. On any
# card: the placement probe (tools/gpu/placeprobe.cu: are a PDL secondary's blocks placed while
# the primary runs, cluster or not?), the gate/up probe (tools/gpu/gateprobe.cu: the one-token
# gate/up's read pattern against a plain stream, and its units claimed from a counter), then
# the build without RaOut: the op tests around the output launch and tg128 (hash
# db10d2fd9a926913). ~3 minutes on an H100.
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
stamp "== op tests"
op_log 100 3 ops.txt "" "" fused_mla short_attention_in_mla_out
h200_first tg128
wait
stamp "== tg128"
is_h200 || b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
