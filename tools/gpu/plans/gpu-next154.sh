#!/usr/bin/env bash
# Forty-fifth session, third call (slimmed to ~4.5 minutes after refusals). The op test of the
# new Path::CombineNorm (a decode batch's MoE combine in the next layer's first norm,
# `add_rms_norm_h_comb`; the same bits). Then at 64 sequences (hash 7a3b5e11379cb707 must stay):
# both new defaults off, both on, the expert prefetch alone (32 MB from the FFN norm), and the
# prefetch from the attention's merge instead (24 MB, TS_CUDA_XPF_AT=2); the server on the
# defaults.
#   tools/gpu/plans/gpu-next154.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_bg
wait
OFF="TS_CUDA_XPF=0 TS_CUDA_COMBINE_NORM=0"
# (in order of need: a call cut short by the device budget still returns what ran)
bpd 64 "-d 96" "$OFF" ""
stamp "== server"
serve64 "" 30 "--row-multiple 4"
ops_tests 150 2 combine_norm_exact
bpd 64 "-d 96" "TS_CUDA_COMBINE_NORM=0" "TS_CUDA_XPF=24 TS_CUDA_XPF_AT=2" "$OFF" ""
stamp "== done"
