#!/usr/bin/env bash
# Written at the end of the fortieth session (device time spent), for the next one. Two switches,
# both written and compiled, neither yet run on a GPU:
# - `TS_CUDA_HEAD_BLAS=0` (Path::HeadBlas off): a decode batch's output head back on the int8
#   tiles, which read its 223 MB of Q8_0 against the f16 copy's 419 MB on cuBLAS (~60 us of a
#   ~6.8 ms 64-row step at 3.3 TB/s, if they stream it as fast). Other logits bits: the hash may
#   change.
# - `TS_CUDA_BLAS_FORK=1` (Path::BlasFork): kv_a's cuBLAS product on a second stream beside q's
#   (a fork and a join in the step's graph); cuBLAS's q and kv_a took 10.0 + 8.5 us one after
#   the other (Nsight, gpu-next134). The same bits: the hash must not move.
# 1. dense_blas_batch (the fork against one stream, bit for bit, eager and in recorded steps)
#    and recorded_steps_replay. 2. 64 sequences at -d 96 (twice each), 128 sequences. 3. The
#    server with each.
#   tools/gpu/plans/gpu-next139.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
H=TS_CUDA_HEAD_BLAS=0
F=TS_CUDA_BLAS_FORK=1
ops_tests 150 2 dense_blas_batch recorded_steps_replay
grep -E "forked|BlasFork" $O/ops.txt | head -5
stamp "== 64 sequences -d 96, 128 sequences"
bpd 64 "-d 96" "" $H $F "" $H $F
bp 128 "" $H $F
stamp "== server"
serve64 "" 30
serve64 "$H" 30
serve64 "$F" 30
rm -f $V
stamp "== done"
