#!/usr/bin/env bash
# Twenty-fifth session, main: the 16-bit decode MoE's down kernel starts early, as the Q8_0 one
# has since gpu-next38 (+3.3% there): moe_gateup_sh_<t> triggers its dependents only after its
# wait for the routing, so moe_down_sh_<t>(_w4) reads the expert ids past L1 and loads its first
# round of weights before its own wait. The same loads and sums: bf16 tg128's hash must stay
# fc4c0eeac361bb3a. No switch: BASE is the build before the change.
#   tools/gpu/plans/gpu-next74.sh BASE BIN OPS 2>&1 | tee $OUT/log.txt | tail -30   (~3 minutes)
set -u
BASE=$1; B=$2; OPS=$3
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=60
BF=/tmp/v2lite-bf16.gguf
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
stamp "== op tests"
op_log 60 2 ops.txt "" "" fused_moe_shared
wait
stamp "== bf16 tg128"
for r in 1 2; do
  b "" "$BASE" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
  b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
done
rm -f $BF
stamp "== done"
