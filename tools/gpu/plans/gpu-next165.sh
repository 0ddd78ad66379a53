#!/usr/bin/env bash
# Forty-ninth session, for the next device time (an H200 if one comes; else an H100, whose
# figures compare only with each other). ~9 minutes.
# 1. The op tests of the code the forty-ninth session changed (the removed paths' call sites in
#    the attention's output side, the MoE's combine, the q / kv_a product; DN16_EARLY on by
#    default): qkv_joint_batch, norm_q8_batch_exact, fused_mla_attention_out_h16, dense_blas_batch,
#    fused_moe_shared, moe_residual_exact, moe_shared_fork, recorded_steps_replay.
# 2. The server (64 clients, 60 s): the new defaults (24 MB of gate / up from the attention's
#    merge), then the old (TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1). Issue 6 asks 10,000 on the H200
#    (9,601 with the old defaults).
# 3. 64 sequences -d 96 the same two ways; tg128, tg64 at 16k and bf16 tg128 with the defaults
#    (the H200's figures: 709, 546, 520.6; bf16 now with DN16_EARLY).
#   tools/gpu/plans/gpu-next165.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
ops_tests 240 4 qkv_joint_batch norm_q8_batch_exact fused_mla_attention_out_h16 dense_blas_batch \
  fused_moe_shared moe_residual_exact moe_shared_fork recorded_steps_replay
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
OLD="TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1"
stamp "== server"
serve64 "" 60 "--row-multiple 4"
serve64 "$OLD" 60 "--row-multiple 4"
stamp "== 64 sequences"
bpd 64 "-d 96" "" "$OLD" ""
stamp "== one sequence"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
wait
b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
stamp "== done"
