#!/usr/bin/env bash
# Thirty-second session, written after its device time was spent (not yet run):
# - gpu-next102 measured TS_CUDA_DENSE128=1 (64 x 128 tiles for 65-128-token dense products)
#   slower: 80 sequences 8,529 -> 8,379, 96 10,363 -> 10,331, 128 13,916 -> 13,362. Its split
#   K rounded up, so V2-Lite's q made 288 blocks for the 264 places two blocks an SM give: a
#   second wave. The plan now takes the most splits that fit one wave (dense_plan). Measure it
#   again at 80 / 96 / 128.
# - TS_CUDA_DENSE_SKIP=1 (Path::DenseSkip, new): a dense product's partly padded last 64-token
#   tile (80 rows: 16 tokens) skips the padding's fragment loads and products (mmq_q8_64es,
#   mmq_q8_64_jobses; whole tiles as before); the same bits (dense_skip_exact,
#   dense_jobs_exact), so the hashes must hold. At 56, 80 and 96 sequences and in the server.
# - TS_CUDA_ROUTER_SPLIT=1 (Path::RouterSplit, new): decode batches' f32 MoE router on
#   gemv_f32_split (8 tokens a block row) instead of cuBLAS's SGEMM, launched without PDL (the
#   64-row trace hid ~8 us a layer in the norm before the MoE). Other bits (test
#   router_split_exact: each token as when alone); at 64 and 80 sequences.
# - TS_CUDA_MLATC=1 at 64 and 80 sequences: the 64-row trace gives the SIMT split attention
#   (one block a token, short contexts) 20.9 us a layer, 7% of the step.
# - Path::Sum4 and Path::GluEpi are removed (measured slower in gpu-next99): every op test again.
# gpu-next104 then: Nsight and the server.
#   tools/gpu/plans/gpu-next103.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -90   (~8 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== every op test"
op_log 200 4 ops.txt "router_split|dense_skip|dense128: .*tokens=(80|128)|" ""
wait
D="TS_CUDA_DENSE128=1"; K="TS_CUDA_DENSE_SKIP=1"
stamp "== 56, 80, 96, 128 sequences"
for p in 56 80 96; do for e in "" "$K" "$D"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done; done
for e in "" "$D"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 128 -r 2 --hash; done
R="TS_CUDA_ROUTER_SPLIT=1"
stamp "== the router on gemv_f32_split: 64, 80 sequences"
for p in 64 80; do for e in "" "$R" "$R $K"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done; done
stamp "== the batch attention on the tensor-core split kernel (TS_CUDA_MLATC=1): 64, 80 sequences"
for p in 64 80; do b "TS_CUDA_MLATC=1" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel $p -r 2 --hash; done
rm -f $V
stamp "== done"
