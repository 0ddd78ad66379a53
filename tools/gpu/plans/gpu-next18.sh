#!/usr/bin/env bash
# The eleventh session's fifth measurement (2026-11-30): the tiled expert copy group-major
# (TS_CUDA_TILE_GM=1: group g of every 16-row tile of a matrix one after the other, so the warps
# on one expert read neighbouring bytes at each step) against tile-major (the default), one binary
# (commit of the switch: "CUDA: the tiled expert copy optionally group-major", reverted after).
# Measured (H200): no change beyond noise: 64 sequences 7,481 / 7,482 against 7,495 / 7,483; 128
# sequences 13,069 against 12,989; 32 sequences 4,321 against 4,275 (-r 1); same hashes. Dropped.
#   tools/gpu/plans/gpu-next18.sh BIN OPS
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 both ways; 282e057fc6ee8e5f at 128.
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
ops_tests 200 1 rows_
ab64 2 "" TS_CUDA_TILE_GM=1
for e in "" TS_CUDA_TILE_GM=1; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 128 -r 1 --hash; done
for e in "" TS_CUDA_TILE_GM=1; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
