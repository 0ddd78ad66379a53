#!/usr/bin/env bash
# The second call after gpu-next143 (written in the forty-second session, no device then): the
# server with the two new switches, `TS_CUDA_ROWS_SK=1` (the MoE's rows launches in stream-K
# form) and `TS_CUDA_SPLIT_MERGE=1` (a batch's attention splits merged in their launch), against
# the defaults; with `--chain` on top (the host's turn under the device's work; measured neutral
# at 8 ms steps, thirty-fourth session); with the batches' attention always on the tensor cores
# (`TS_CUDA_MLATC=1`: under 64 keys a batch takes the SIMT split, whose one split writes its rows
# itself, and the merge in the launch may make the tensor cores the faster there too). Then
# tools/gpu/attn_out_mb.py: W_uv then W_o against one product with W_uv folded into W_o.
# The server's prompt cache is new and on by default (engine.rs, "Prompt cache"): the load
# test's clients repeat their prompts, so each wave's prefill shrinks to one token a request;
# `--no-prompt-cache` gives the figure without it, and `loadtest --fresh-prompts` (a new prompt
# every request) the cache's figure when it finds nothing (report all three). The `prompts:`
# line says how many prompt tokens came from the cache. With the cache a wave's requests join
# the steps as one token each, as they arrive, so steps take more row counts than before, each
# its own graph recording (the metrics line counts them); `--row-multiple 8` pads every step
# to a multiple of 8 rows (8 shapes at most, a few pad rows a step).
# Drop from the list what gpu-next143 showed broken or slower.
#   tools/gpu/plans/gpu-next144.sh BIN 2>&1 | tee $OUT/log.txt | tail -60   (~8 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
K=TS_CUDA_ROWS_SK=1
M=TS_CUDA_SPLIT_MERGE=1
q8_bg
wait
stamp "== server"
serve64 "" 30
serve64 "" 30 "--row-multiple 1 --no-prompt-cache"
serve64 "" 30 "--row-multiple 1" --fresh-prompts
serve64 "" 30 "--row-multiple 8"
serve64 "$K $M" 30
serve64 "$K $M" 30 "--row-multiple 1 --chain"
serve64 "$K $M TS_CUDA_MLATC=1" 30
rm -f $V
python3 "$(dirname "$0")/../attn_out_mb.py" 2>&1 | tail -3
stamp "== done"
