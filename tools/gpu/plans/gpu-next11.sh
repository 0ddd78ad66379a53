#!/usr/bin/env bash
# RAN 2026-11-30 (tenth session; docs/PERF.md, "Experts in 16-row tiles"). TS_CUDA_L2PF was removed
# after it (it lost 2.5%); its runs of part c now measure the defaults.
# First GPU run of branch gpu-next11 (written 2026-11-30, ninth session, after gpu-next10 ran;
# NOT RUN ON A GPU):
#  - mmq_q8_rows (grouped, the default for 16-token expert tiles since gpu-next10): activation
#    rows in shared memory at a stride of 8 words mod 32 (was 4: the 4 rows of a half-warp's
#    8-byte fragment loads shared banks two ways), bounded to 5 blocks an SM (91 registers; the
#    build on main has 96, 5 blocks too). Same bits: the --parallel 64 hash stays 33948fa635fb0682.
#  - mmq_q8_rows_d: dense Q8_0 products on the same kernel (split K: each block copies and walks
#    its own groups), for products of up to TS_CUDA_MMQ_ROWS=n tokens (default 0: off). At 64
#    sequences the dense products are 139 mmq_q8_64 launches of 10.9 us (15% of the step) that
#    read ~0.6 GB a step (0.15 ms at 4 TB/s). Other tiles, so other split-K sums: other hashes
#    (ops_vs_cpu mmq_rows_dense_exact checks it bit for bit against mmq_q8_16 on the same tiles).
#  - TS_CUDA_MOE_TILED=1: expert stacks also uploaded in 16-row tiles (each tile group-major, so
#    a warp's group of 16 rows is one contiguous 2,304-byte piece; twice the expert memory), read
#    by mmq_q8_rows. Same bits (moe_rows_exact checks a third backend with it on).
#  - TS_CUDA_L2PF=1: Backend::prefetch_hint (deepseek2 names the next layer's attention weights
#    before each MoE) taken up by an l2_prefetch launch between the decode MoE's gate/up and down
#    products: ~14.6 MB a layer into L2 while the down products stream, for the latency-bound
#    attention GEMVs after (knockout, fourth session: q/kv_a 13.4 us a layer against ~2 at
#    bandwidth). Same bits (ops_vs_cpu l2_prefetch_changes_nothing; tg128 keeps its hash).
#  - TS_CUDA_DOWN_WPR=4: the decode MoE's down products with four warps a row (Q8_0: 2 by
#    default, 15.4 us a layer at 1.7 TB/s in Nsight; bf16: 1, 20.8 us at 2.2 TB/s, 11 dependent
#    batches of loads a warp). Another summation order: other tokens.
#  - tools/gpu/bwprobe.cu: frag16, mmq_q8_rows' own loads, from the row-major layout and from a
#    16-row tiled one (is DRAM locality what holds the kernel at 2.3 TB/s?).
#   tools/gpu/plans/gpu-next11.sh BIN OPS_TEST BASE_BIN [a|b|c]   (about 8, 5 and 7 minutes)
#   BASE_BIN: main's kernels (.dev/n10/turbospark: gpu-next10's last build, main's mmq_q8_rows).
# Expect: ops_vs_cpu 26 pass; tg128 hash 756941f1d106faec with and without TS_CUDA_L2PF; hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 by default and
# with TS_CUDA_MOE_TILED=1 (TS_CUDA_MMQ_ROWS changes the dense split-K sums: another hash).
set -u
B=$1; OPS=$2; M=$3; PART=${4:-a}
source "$(dirname "$0")/lib.sh"
if [ "$PART" = c ]; then
  # Decode: the L2 prefetch of the next layer's attention weights (same tokens) and the down
  # products with four warps a row (another summation order: other tokens).
  [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  echo "== ops_vs_cpu moe with TS_CUDA_DOWN_WPR=4"
  TS_CUDA_DOWN_WPR=4 "$OPS" --test-threads 2 moe 2>&1 | grep -E "FAIL|test result|panicked" | head -6
  wait
  for r in 1 2; do
    for e in "" TS_CUDA_L2PF=1 TS_CUDA_DOWN_WPR=4 "TS_CUDA_L2PF=1 TS_CUDA_DOWN_WPR=4"; do
      b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
    done
  done
  "$B" synth --preset deepseek-v2-lite --quant bf16 -o /tmp/v2lite-bf16.gguf >/dev/null 2>&1
  for e in "" TS_CUDA_L2PF=1 TS_CUDA_DOWN_WPR=4 "TS_CUDA_L2PF=1 TS_CUDA_DOWN_WPR=4"; do
    b "$e" "$B" bench --backend cuda -m /tmp/v2lite-bf16.gguf -p 0 -n 128 -r 3 --hash
  done
  rm -f /tmp/v2lite-bf16.gguf
  exit 0
fi
if [ "$PART" = b ]; then
  [ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
  /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 -std=c++17 -o /tmp/bwprobe tools/gpu/bwprobe.cu && /tmp/bwprobe
  wait
  # Why mmq_q8_rows waits: the stall reasons per issued instruction (a separate call: if a
  # metric name is unknown here, only this line is lost).
  M1=smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  TS_CUDA_GRAPHS=0 "$NCU" --kernel-name regex:mmq_q8_rows --launch-skip 300 --launch-count 1 --metrics $M1 \
    "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 2>&1 | grep -E "stalled|mmq_q8_rows|ERR|rror" | head -12
  TS_CUDA_MMQ_ROWS=64 TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=$O/par64.csv "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 1 2>&1 | grep -E "cuda trace|tg"
  python3 tools/gpu/trace.py $O/par64.csv 8 2>/dev/null | head -14
  # The server's steps average ~78 tokens (64 decoding plus new prompts of 32): the dense
  # products then take two 64-token tiles; on the rows kernel (TS_CUDA_MMQ_ROWS=128) 16-token
  # tiles follow the token count.
  for run in "- $M" "- $B" "TS_CUDA_MMQ_ROWS=128 $B"; do
    set -- $run; e=$1; bin=$2; [ "$e" = - ] && e=""
    echo "== server ${e:-default} $bin"
    env $e TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$bin" "$OPS" $O/pf serve 2>&1 | grep -E "tokens:|TTFT|requests:|failures|steps_total|batch_tokens"
  done
  exit 0
fi
ops_and_model
grep -E "mmq_rows_dense|moe_rows" $O/ops.txt | grep -E "FAIL|ok|exact" | head -6
# (The tiled copy costs a host permutation of the 15 GB of experts at load: ~20 s a run.)
b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
for e in "" TS_CUDA_MOE_TILED=1 TS_CUDA_MMQ_ROWS=64 "TS_CUDA_MOE_TILED=1 TS_CUDA_MMQ_ROWS=64"; do
  b "$e" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
done
b "" "$M" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
for e in "" TS_CUDA_MMQ_ROWS=64; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
