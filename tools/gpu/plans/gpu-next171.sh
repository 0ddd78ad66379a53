#!/usr/bin/env bash
# Fifty-first session, third call. gpu-next170's traces: the server's 64-row steps are the
# bench's (the same experts, the same launches); what differs is the context mix. Steps whose
# longest context is under 64 keys take the SIMT attention (`mla_split_18_16_h`, then an
# `f16_rows` launch a layer for the products after it) and were ~3% slower than the tensor-core
# steps in both (bench 8,711 against 8,416 µs, server 8,767 against 8,514; 22% of the server's
# steps). The threshold (TS_CUDA_MLA_LONG_BATCH=64) was set in the thirty-third session, before
# the tensor-core path's f16 fusions (LatH, QnopeH) and its batch kernel. Now: the tensor cores
# from the first key (TS_CUDA_MLA_LONG_BATCH=1) against the default, at contexts 32-64
# (-d 32 -n 32), 0-32 (-n 32), and in the server (64 clients, 30 s). ~6 minutes.
#   tools/gpu/plans/gpu-next171.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== synth"
q8_ready
TC="TS_CUDA_MLA_LONG_BATCH=1"
stamp "== 64 sequences, contexts 32-64"
bpd 64 "-d 32" "" "$TC" "" "$TC"
stamp "== 64 sequences, contexts 0-32"
bpd 64 "" "" "$TC"
stamp "== server"
serve64 "" 30 "--row-multiple 4"
serve64 "$TC" 30 "--row-multiple 4"
stamp "== done"
