#!/usr/bin/env bash
# Written in the forty-sixth session (no device was lent), not yet run. ~8 minutes (the bf16
# file is synthesised first, in the background, while the Q8_0 runs go).
# The bf16 decode's gate/up (moe_gateup_sh_bf16) had the same ptxas reordering as the Q8_0 one:
# its shared slots' loads now go out before the PDL wait (GU_SH_EARLY). bf16 tg128 (issue 5 asks
# 600; 520.6 in the twenty-eighth session, hash fc4c0eeac361bb3a) with and without, twice; then
# the Q8_0 tg128 once more each way if time is left.
#   tools/gpu/plans/gpu-next159.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
OLD="TS_CUDA_DEFINES=GU_SH_EARLY=0"
wait
stamp "== bf16 tg128"
for r in 1 2; do
  b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
  b "$OLD" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
done
stamp "== Q8_0 tg128"
b "$OLD" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
stamp "== done"
