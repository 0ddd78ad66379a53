#!/usr/bin/env bash
# Written in the thirteenth session (2026-12-01), NOT yet run: why the f16 prompt products
# (mmf16_256, ~45% of a 512-token prompt) run at 2.5 TB/s and ~200 TFLOPS, under both roofs,
# with every tile shape within 2% of the others. Nsight Compute on two gate/up launches of a
# 512-token prompt (speed of light, occupancy, stall reasons per issued instruction), then the
# per-SASS stall samples of one (CSV under $OUT). The same profiler calls as ncu-rows.sh.
#   tools/gpu/plans/ncu-mmf.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/ncu-lib.sh"
prof '^mmf16_256$' 2 2 mmf256pp512 -p 512 -n 0 -r 1
