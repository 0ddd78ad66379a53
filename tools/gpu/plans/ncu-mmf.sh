#!/usr/bin/env bash
# What the f16 prompt products and the decode-size dense products wait on (fourteenth session):
# Nsight Compute on two mmf16_gu_s4 launches (gate, up and GLU) of a 512-token prompt, and on
# mmq_q8_64's dense launches of the 64-sequence step (q, o, kv_a: 9-15 us each under Nsight for
# 1.5-7 MB, 0.2-0.5 TB/s; the source view of a q launch, grid (48, 1, 6)). CSV under $OUT.
#   tools/gpu/plans/ncu-mmf.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
NCU_PICK=",6" prof '^mmq_q8_64$' 150 6 dense64 -p 0 -n 4 --parallel 64 -r 1
prof '^mmf16_gu_s4$' 2 2 mmfgu-pp512 -p 512 -n 0 -r 1
