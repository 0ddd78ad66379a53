#!/usr/bin/env bash
# Written in the forty-third session (no device then), for the next one: `TS_CUDA_SHARED_FORK=1`
# (Path::SharedFork), compiled, not yet run on a GPU. A decode batch's shared FFN on a second
# stream, forked when the MoE starts and joined before the combine, so that it runs beside the
# routing, grouping and quantisation launches (~12 us a layer in the last trace, the memory bus
# nearly idle), and the grouped rows launches carry the routed experts alone: at 64 sequences
# the shared chunks are 8 of the 72 16-token tiles, ~11% of the rows launches' ~176 us a layer.
# Two forms: the shared chunks on the int8 rows kernels alone (the default form: the same bits,
# so the hashes must not move), and on cuBLAS from the f16 copies (`TS_CUDA_SHARED_FORK_BLAS=1`:
# twice the bytes, other bits).
# 1. moe_shared_fork (the rows form bit for bit against no fork; the cuBLAS form against the
#    chain, the CPU and f64; both in recorded steps, eager, captured and replayed, bit for bit),
#    norm_q8_batch_exact (the attention's output side then the MoE, the fork from the point the
#    FFN norm records ahead: bit for bit against no fork) and recorded_steps_replay.
# 2. 64 sequences at -d 96: default, rows form, cuBLAS form; 128 sequences: default, rows
#    form. (The call's limit is 600 s: ops <= 240, benches ~100, servers ~190.)
# 3. The server: default, rows form, cuBLAS form (with the prompt cache, the default; see
#    gpu-next144 for the three ways to report).
# 4. `TS_CUDA_BLAS_TUNE=1` (Path::BlasTune): the decode batch's cuBLAS products (q and kv_a,
#    W_uk, W_uv, W_o, the head) each on the cuBLASLt algorithm that timed fastest for its shape
#    at its first eager sight (blas_tune: within f32 order of the untuned products, and bit for
#    bit in a recorded step); 64 sequences at -d 96 and the server. Other bits.
# If gpu-next143 made ROWS_SK or SPLIT_MERGE defaults, these runs include them.
#   tools/gpu/plans/gpu-next145.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8-9 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
F=TS_CUDA_SHARED_FORK=1
FB="TS_CUDA_SHARED_FORK=1 TS_CUDA_SHARED_FORK_BLAS=1"
ops_tests 240 2 moe_shared_fork norm_q8_batch_exact blas_tune recorded_steps_replay
grep -E "fork (taken|not taken)|recorded step|SharedFork|shapes timed" $O/ops.txt | head -10
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" $F "$FB"
bp 128 "" $F
T=TS_CUDA_BLAS_TUNE=1
# (and the fork with the stream-K rows kernel, gpu-next143's: its wave meets the side's blocks)
bpd 64 "-d 96" $T "$F $T" "$F TS_CUDA_ROWS_SK=1"
stamp "== server"
serve64 "" 30
serve64 "$F" 30
serve64 "$FB" 30
serve64 "$T" 30
stamp "== done"
