#!/usr/bin/env bash
# Written in the forty-fifth session, never run: superseded by gpu-next156.sh (forty-sixth session), which runs its tests and measurements with the new switches.
# 1. The op test of Path::CombineNorm (a decode batch's MoE combine held for the next layer's
#    first norm, `add_rms_norm_h_comb`; the same bits as the path off), and the tests whose ops
#    it touches (the MoE with the fork, the attention's output side then the MoE, recorded
#    steps).
# 2. 64 sequences at -d 96 (hash 7a3b5e11379cb707 must stay with every switch): CombineNorm on
#    (TS_CUDA_COMBINE_NORM=1) against off, with the expert prefetch (the default: 32 MB of
#    gate / up from the FFN norm) and without (TS_CUDA_XPF=0); the prefetch from the
#    attention's merge (24 MB, TS_CUDA_XPF_AT=2, +0.76% in gpu-next153 where the FFN norm's
#    gained nothing); the down stack's first experts from the GLU's quantisation
#    (TS_CUDA_XPF_GLU, MB, never run yet). Each setting twice, interleaved.
# 3. 128 sequences (hash 2c61c9f742128756) and the server, with CombineNorm off and on.
# Flip CombineNorm on by default if its test passes and it wins (and update docs/PERF.md's
# forty-fifth section, docs/GPU.md's switch table and ARCHITECTURE.md).
#   tools/gpu/plans/gpu-next155.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
ops_tests 300 2 combine_norm_exact moe_shared_fork norm_q8_batch_exact recorded_steps_replay
CN=TS_CUDA_COMBINE_NORM=1
ab() { bpd 64 "-d 96" "" "$CN" "TS_CUDA_XPF=0" "TS_CUDA_XPF=0 $CN" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2 $CN" \
  "TS_CUDA_XPF_GLU=12 $CN" "TS_CUDA_XPF_GLU=24 $CN"; }
ab
ab
bp 128 "" "$CN"
stamp "== server"
serve64 "" 30 "--row-multiple 4"
serve64 "$CN" 30 "--row-multiple 4"
stamp "== done"
