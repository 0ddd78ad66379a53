#!/usr/bin/env bash
# For the seventy-fourth session (after gpu-next237, where Path::RaOut's clusters of 124 KB
# blocks, one an SM, took 18.95 µs a launch and lost 17%): the same path with W_uv split over
# the cluster (each block 16 rows of v_h, sent to the others; ~68 KB a block, three an SM). On
# an H200 first issue 6's figure (the server, 64 clients, 45 s) and tg128. On any card: op test
# ra_in_mla_out_exact, tg128 default / TS_CUDA_RA_OUT=1 alternating (the hashes must match), a
# trace with it on (~4 minutes on an H100).
#   tools/gpu/plans/gpu-next238.sh .dev/turbospark > $OUT/log.txt 2>&1
# (Ran once, in the seventy-fifth session, from 05ac5fe on an H100: tg128 609.6 / 609.5 against
# 631.8 / 632.0, the same hash; the path was removed, so this plan runs only on that commit's
# binaries. docs/PERF.md, seventy-fifth session.)
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== op test"
op_log 80 2 ops.txt "" "" ra_in_mla_out_exact
h200_first tg128
wait
RA="TS_CUDA_RA_OUT=1"
stamp "== tg128: default / RA_OUT"
for r in 1 2; do
  young 330 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$RA" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== trace (tg32): RA_OUT"
young 400 && (export $RA; trace_tg 9)
stamp "== done"
