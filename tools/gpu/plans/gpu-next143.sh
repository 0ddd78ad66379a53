#!/usr/bin/env bash
# Written in the forty-first and forty-second sessions (no device in the forty-second), for the
# next one. Two switches, both compiled, neither yet run on a GPU:
# - `TS_CUDA_ROWS_SK=1` (Path::RowsSk: the MoE's grouped rows launches in stream-K form, one wave
#   of blocks with equal shares of the (tile, 64 rows, group) steps; a unit split between two
#   blocks is finished by the second from the first one's sums, so the same bits as mmq_q8_rows).
# - `TS_CUDA_SPLIT_MERGE=1` (Path::SplitMerge: a batch's 1, 2 or 4 attention splits a token
#   merged inside the split launch, a thread-block cluster a token's head group, no
#   mla_combine_few launch; the same bits).
# 1. Every op test, theirs included (bit for bit against the default kernels).
# 2. 64 sequences at -d 96 (2 splits a token) and at -d 400 (4), 128 sequences: the hashes must
#    not move. 3. The server's prompt waves as a bench (`--parallel-prompt`, new): 64 prompts of
#    32 tokens in forwards of 1,024, with both switches and with the attention on tensor cores
#    (MLATC=1; the wave's short contexts take the SIMT split), then traced: where the ~6% of
#    the server's time in prompt steps goes. The server runs and a micro-benchmark follow in
#    gpu-next144 (a second call: this one takes ~5 minutes).
# A stream-K block that waits on a flag for a second traps (a failed run, not a hang);
# TS_RUN_LIMIT cuts any other hang off.
#   tools/gpu/plans/gpu-next143.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
K=TS_CUDA_ROWS_SK=1
M=TS_CUDA_SPLIT_MERGE=1
# (every op test, ~2 minutes: the split kernels' partial store and mla_combine_few's merge were
# refactored too, into shared helpers; the stream-K test on its own after them, since a trap
# would end its process's CUDA context and fail every test after it there)
ops_tests 300 2 --skip moe_rows_exact
op_log 120 1 ops_sk.txt "" "" moe_rows_exact
stamp "== 64 sequences -d 96 / -d 400, 128 sequences"
bpd 64 "-d 96" "" $K $M "$K $M" "$K TS_CUDA_ROWS_SK_PER_SM=4"
bpd 64 "-d 400" "" $K $M
bp 128 "" "$K $M"
stamp "== a wave of 64 prompts of 32 tokens in forwards of 1,024 (the server's prompt steps)"
bwave "" "$K $M" TS_CUDA_MLATC=1
trace_wave 40
stamp "== done (the server runs are gpu-next144's)"
