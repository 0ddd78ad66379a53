#!/usr/bin/env bash
# Thirty-second session, written after its device time was spent (not yet run). Switches, all
# off until measured:
# - TS_CUDA_DENSE_SKIP=1 (K, Path::DenseSkip): a dense product's partly padded last 64-token
#   tile (80 rows: 16 tokens) skips the padding's fragment loads and products (mmq_q8_64es,
#   mmq_q8_64_jobses; whole tiles as before). The same bits: the hashes must hold.
# - TS_CUDA_ROUTER_SPLIT=1 (R, Path::RouterSplit): decode batches' f32 MoE router on
#   gemv_f32_split (8 tokens a block row) instead of cuBLAS's SGEMM, launched without PDL (the
#   64-row trace hid ~8 us a layer in the norm before the MoE). Other bits.
# - TS_CUDA_GLU_PAIR=1 (G, Path::GluPair): the gate/up pair's second block of each (tile,
#   group) quantises the GLU for the down product (mmq_q8_rows_r2g): no GLU quantisation
#   launch (5.5 us a layer). The same bits.
# - TS_CUDA_DENSE128=1 (D): measured slower in gpu-next102 with a two-wave split K; the split
#   now fits one wave.
# - TS_CUDA_MLATC=1: the batch attention on the tensor-core split kernel (the SIMT one takes
#   20.9 us a 64-row layer in the trace, 7% of the step).
# Path::Sum4 and Path::GluEpi are removed: every op test again (new: dense_skip_exact,
# router_split_exact, moe_rows_exact with GluPair). gpu-next104 then: 56 / 128 sequences,
# Nsight, the server.
#   tools/gpu/plans/gpu-next103.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -90   (~7 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "router_split|dense_skip|GLU in the pair.*n=64 bias=0|" ""
wait
K="TS_CUDA_DENSE_SKIP=1"; R="TS_CUDA_ROUTER_SPLIT=1"; G="TS_CUDA_GLU_PAIR=1"; D="TS_CUDA_DENSE128=1"
stamp "== 64 sequences (hash 6bbd3fa953f72f1b without R)"
bp 64 "" "$R" "$G" "$R $G" "TS_CUDA_MLATC=1"
stamp "== 80 sequences (hash b5b6f4aafbef8aca without R and D)"
bp 80 "" "$K" "$R" "$G" "$K $R $G" "$D"
stamp "== 96 sequences"
bp 96 "" "$K" "$D"
rm -f $V
stamp "== done"
