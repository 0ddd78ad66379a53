#!/usr/bin/env bash
# Why the grouped expert products run where they do (eleventh session): Nsight Compute on one
# mmq_q8_rows launch of the 64-sequence step and one mmq_q8_64 expert launch of a 512-token
# prompt: speed of light, occupancy, stall reasons per issued instruction, and the per-SASS
# instruction stall samples (CSV under $OUT).
#   tools/gpu/plans/ncu-rows.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
NCU_PICK=",130" prof '^mmq_q8_rows$' 30 2 rows64 -p 0 -n 4 --parallel 64 -r 1
NCU_PICK=",130" prof '^mmq_q8_64$' 56 8 mmq64pp512 -p 512 -n 0 -r 1
