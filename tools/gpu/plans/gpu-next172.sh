#!/usr/bin/env bash
# Fifty-first session, fourth call: the new default TS_CUDA_MLA_LONG_BATCH=32 (batches on the
# tensor-core attention from 32 keys; gpu-next171 on an H100: +3.2% at contexts 32-64, -1.5%
# with all of them on it at 0-32). The op tests of the attention's batch paths; 64 sequences at
# contexts 32-64 against the old 64; at 16-48 with 64, 32 and 16 (where the crossover lies);
# the server (new, old, new; 30 s each). ~7 minutes.
#   tools/gpu/plans/gpu-next172.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
ops_tests 150 4 mla_attention_latent_cache norm_q8_batch_exact mla_split_batch_exact
OLD="TS_CUDA_MLA_LONG_BATCH=64"
stamp "== 64 sequences, contexts 32-64"
bpd 64 "-d 32" "" "$OLD" ""
stamp "== 64 sequences, contexts 16-48"
bpd 64 "-d 16" "$OLD" "" "TS_CUDA_MLA_LONG_BATCH=16"
stamp "== server"
serve64 "" 30 "--row-multiple 4"
serve64 "$OLD" 30 "--row-multiple 4"
serve64 "" 30 "--row-multiple 4"
stamp "== done"
