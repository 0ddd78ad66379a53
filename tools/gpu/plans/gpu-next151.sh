#!/usr/bin/env bash
# Forty-fourth session, last call (~5 minutes of device time left): the MoE's down launch with
# one row set a warp (`TS_CUDA_ROWS_R_DN=1`: 2,048 blocks of 64 rows, ~3.1 waves of the 660
# block places at 64 sequences, against 1,024 blocks of 128 rows, ~1.55 waves) against the
# default, two rounds at 64 sequences and once at 128; then the prompt-wave bench once.
#   tools/gpu/plans/gpu-next151.sh BIN 2>&1 | tee $OUT/log.txt | tail -30   (~3 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=60
q8_bg
wait
bpd 64 "-d 96" "" TS_CUDA_ROWS_R_DN=1 "" TS_CUDA_ROWS_R_DN=1
bp 128 "" TS_CUDA_ROWS_R_DN=1
stamp "== a prompt wave (64 prompts of 32 tokens, forwards of 1,024)"
bwave ""
stamp "== done"
