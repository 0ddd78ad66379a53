#!/usr/bin/env bash
# Thirty-fourth session, after gpu-next109 (server, 64 clients, 30 s: defaults 7,253; --chain
# 7,368; --prefill-chunk 256 7,493; 512 7,610, the eager mixed steps 461 -> 127).
# 1. mla_attention_latent_cache split in two (SIMT forced on a backend of its own at f32
#    tolerance; the defaults at f16 tolerance, since batches take the tensor cores from 64).
# 2. The server on chunks of 512 with and without --chain, 1024 chained, and the mixed steps'
#    switches (gpu-next110's) and 2 splits a token (gpu-next109: -d 96 8,171 vs 8,090) on top.
#   tools/gpu/plans/gpu-next111.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
q8_bg
stamp "== mla_attention_latent_cache"
op_log 100 1 ops.txt "" "" mla_attention_latent_cache
wait
S="--row-multiple 1 --prefill-chunk 512"
stamp "== server, 64 clients"
serve64 "" 30 "$S"
serve64 "" 30 "$S --chain"
serve64 "" 30 "--row-multiple 1 --prefill-chunk 1024 --chain"
serve64 "TS_CUDA_MLA_SPLITS=2" 30 "$S --chain"
serve64 "TS_CUDA_MOE_T16=24" 30 "$S --chain"
serve64 "TS_CUDA_MMH=q8" 30 "$S --chain"
serve64 "TS_CUDA_DENSE_BLAS=0" 30 "$S --chain"
rm -f $V
stamp "== done"
