#!/usr/bin/env bash
# For the sixtieth session (~5 minutes with the files made), any card: where the one-token
# tensor-core split should start now that its merge reads f16 rows (gpu-next204 on an H100:
# TS_CUDA_MLA_LONG=1 against the default 2560, tg64 at 1k 565.8 vs 538.7, at 2k 550.9 vs 521.4).
#  1. Q8_0 tg64 at 192 (the first position past the attention inside mla_out_q8) and 512: the
#     defaults against TS_CUDA_MLA_LONG=1;
#  2. bf16 (mla_out_bf16 merges f32 rows: no f16 rows there) tg64 at 1k and 192, the same pair.
#   tools/gpu/plans/gpu-next205.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
stamp "== Q8_0 tg64: SIMT against tensor-core split"
for d in 192 512; do for e in "" "TS_CUDA_MLA_LONG=1"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d $d -r 1 --hash; done; done
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1
stamp "== bf16 tg64: SIMT against tensor-core split"
for d in 1024 192; do for e in "" "TS_CUDA_MLA_LONG=1"; do young 470 && b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 64 -d $d -r 1 --hash; done; done
stamp "== done"
