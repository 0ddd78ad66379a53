#!/usr/bin/env bash
# Run in the twenty-sixth session (H200): both switches kept the hashes and were slower (Q8_0
# tg128 671.9 against 709.5, bf16 492.4 against 515.5); their kernels and moe_down_staged_exact
# were removed in the twenty-seventh, so this plan is the record and no longer runs as written.
# Twenty-fifth session, main, written after the device time was spent. Two
# switches, off until measured, each with the same bits as the kernel it replaces (so every hash
# must hold: Q8_0 tg128 db10d2fd9a926913, 16k efeed109b1480c9a; bf16 tg128 fc4c0eeac361bb3a):
# - TS_CUDA_DOWN_Q8S=1: the Q8_0 decode MoE's down kernel with two rounds of a lane's weight
#   pieces (8 of V2-Lite's 11, with their scales) loaded before the wait where moe_down_sh_q8
#   loads one, and the activations staged in shared memory by cp.async after it
#   (moe_down_sh_q8s): two round trips after the gate/up kernel ends instead of three.
# - TS_CUDA_DOWN16S=1: the bf16 / f16 one with every weight piece of a lane in flight at once
#   (11) after the wait and the activations staged the same way (moe_down_sh_<t>_s): the bf16
#   trace put down at 18.2 us a layer against 9.6 us of bytes (53%), the largest gap left for
#   #5's bf16 figure (516 of 600).
# The default down kernels (moe_down_unit, moe_down_sh_<t>(_w4)) now share their row placement
# and their end (down_share, down_row_finish) with the staged ones: the same operations (ptxas
# gives the same registers), so the defaults' hashes and figures must hold too.
# Op test moe_down_staged_exact (bit for bit against the plain kernels, Q8_0 also into the
# residual; asserts the staged kernels ran), then tg128 both ways (three rounds Q8_0, two bf16),
# Q8_0 16k both ways, and the trace of each model with its switch.
#   tools/gpu/plans/gpu-next75.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -50   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
models_bg
stamp "== op tests"
op_log 200 2 ops.txt "" "" moe_down_staged_exact pre_routed_moe_exact moe_residual_exact fused_moe_shared
wait
stamp "== Q8_0 tg128"
for r in 1 2 3; do
  for e in "" "TS_CUDA_DOWN_Q8S=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
done
stamp "== Q8_0 tg64 at 16k"
for e in "" "TS_CUDA_DOWN_Q8S=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== Q8_0 trace (DOWN_Q8S=1)"
TS_CUDA_DOWN_Q8S=1 trace_tg 10
rm -f $V
stamp "== bf16 tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_DOWN16S=1"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
stamp "== bf16 trace (DOWN16S=1)"
TS_CUDA_DOWN16S=1 trace_tg 10 $BF
rm -f $BF
stamp "== done"
