#!/usr/bin/env bash
# For the sixtieth session (~4 minutes), any card, with TS_CUDA_MLA_LONG's default now 192
# (2560 before): the op tests whose tolerances or cases follow the threshold, the new default
# against the old at 1k (Q8_0 tg64), then whether the attention inside mla_out_q8
# (TS_CUDA_MO_ATT, 192) should end elsewhere now that the tensor-core split after it is cheaper:
# from 128 the default against MO_ATT=MLA_LONG=128, from 192 against MO_ATT=MLA_LONG=256, and
# tg128 from 0 against MO_ATT=0 MLA_LONG=1 (the split from position 1; with time left).
#   OPS=.dev/ops tools/gpu/plans/gpu-next206.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
ops_tests 200 4 fused_mla_attention_out mla_out_half_parts mla_attention_latent_cache short_attention_in_mla_out
stamp "== tg64 at 1k: the new default against 2560"
for e in "" "TS_CUDA_MLA_LONG=2560"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 1024 -r 1 --hash; done
stamp "== where mla_out_q8's own attention should end"
for e in "" "TS_CUDA_MO_ATT=128 TS_CUDA_MLA_LONG=128"; do young 200 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 128 -r 1 --hash; done
for e in "" "TS_CUDA_MO_ATT=256 TS_CUDA_MLA_LONG=256"; do young 230 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 192 -r 1 --hash; done
for e in "" "TS_CUDA_MO_ATT=0 TS_CUDA_MLA_LONG=1"; do young 260 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash; done
stamp "== done"
