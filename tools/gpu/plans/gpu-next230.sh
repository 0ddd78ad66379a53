#!/usr/bin/env bash
# For the seventy-second session: Path::MoeSplitK (moe_sh_q8_sk, written without a device: one
# token's Q8_0 MoE in one launch, the down product by split K inside the gate/up blocks, summed
# by integer reds into a fixed-point row). On an H200 first issue 6's figure (the server, 64
# clients, 45 s) and tg128. On any card: the op tests moe_split_k and moe_residual_exact while
# the file is made, then tg128 with the path off / on / on with MSK_PF=1 (the down rows asked
# into L2 first), alternating, and a trace of each form (~7 minutes on an H100).
#   tools/gpu/plans/gpu-next230.sh .dev/turbospark > $OUT/log.txt 2>&1
# (Ran once, from 030dda0, on an H100: the path lost 20% and was removed; commit b8e1a00 has it,
# so this plan runs only on that commit's binaries. docs/PERF.md, seventy-second session.)
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
stamp "== op tests"
op_log 150 2 ops.txt "split K|" "" moe_split_k moe_residual_exact
wait
stamp "== tg128: split K off / on / on with MSK_PF=1"
for r in 1 2; do
  young 400 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_MOE_SPLITK=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "TS_CUDA_MOE_SPLITK=1 TS_CUDA_DEFINES=MSK_PF=1" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== traces (tg32): off, on"
young 470 && trace_tg 12
young 500 && (export TS_CUDA_MOE_SPLITK=1; trace_tg 12)
stamp "== done"
