#!/usr/bin/env bash
# Twenty-fifth session, main, written after the device time was spent (not yet run):
# TS_CUDA_DOWN16S=1 (off until measured). The bf16 / f16 decode MoE's down products with every
# weight piece of a lane in flight at once (11 at V2-Lite's shapes) and the token's activation
# rows staged in shared memory by cp.async (moe_down_sh_<t>_s): after the wait one round trip for
# the expert ids, one for the weights and activations, where _w4 has the ids then three batches
# one after another. The bf16 trace put down at 18.2 us a layer against 9.6 us of bytes (53%),
# the largest gap left for #5's bf16 figure (516 of 600). The same bits as _w4, so bf16 tg128's
# hash must stay fc4c0eeac361bb3a. Op test moe_down_staged_exact (bit for bit against _w4,
# asserts the staged kernel ran), then bf16 tg128 both ways, two rounds, and the trace.
#   tools/gpu/plans/gpu-next75.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -40   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=60
BF=/tmp/v2lite-bf16.gguf
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== op tests"
op_log 90 2 ops.txt "" "" moe_down_staged_exact
wait
stamp "== bf16 tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_DOWN16S=1"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
stamp "== bf16 trace (DOWN16S=1)"
TS_CUDA_DOWN16S=1 trace_tg 10 $BF
rm -f $BF
stamp "== done"
