#!/usr/bin/env bash
# For the seventy-fourth session: two switches of one-token decode.
# `TS_CUDA_RA_OUT=1` (Path::RaOut): the rope, cache write and absorbed query of a short-context
# token done inside the output launch (mla_out_q8_ra, clusters of a head's 8 blocks), one
# dependent launch a layer fewer, the same bits. `TS_CUDA_L2_ROUTER=1`: the MoE routers in a
# persisting L2 window. On an H200 first issue 6's figure (the server, 64 clients, 45 s, the
# defaults) and tg128. On any card: op test ra_in_mla_out_exact (and the two it builds on),
# tg128 default / RA_OUT / L2_ROUTER alternating (the hashes must match), Nsight's DRAM bytes of
# the routing launch each way of L2_ROUTER, and traces (~6 minutes on an H100, ~9 on an H200).
#   tools/gpu/plans/gpu-next237.sh .dev/turbospark > $OUT/log.txt 2>&1
# (Ran once, from fe45030, on an H100: RA_OUT lost 17% in that form and L2_ROUTER gained
# nothing, and was removed, so this plan's L2_ROUTER runs only on commit 10038ce's binaries.
# docs/PERF.md, seventy-fourth session.)
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
stamp "== op tests"
op_log 100 3 ops.txt "" "" ra_in_mla_out_exact fused_mla_rope_absorb short_attention_in_mla_out
h200_first tg128
wait
RA="TS_CUDA_RA_OUT=1"
L="TS_CUDA_L2_ROUTER=1"
stamp "== tg128: default / RA_OUT / L2_ROUTER"
for r in 1 2; do
  young 380 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$RA" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$L" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== traces (tg32): default, RA_OUT"
young 420 && trace_tg 9
young 440 && (export $RA; trace_tg 9)
stamp "== Nsight: the routing launch's DRAM bytes, L2_ROUTER off / on"
ncu=$(ncu_path)
for e in "" "$L"; do
  young 480 || break
  [ -n "$ncu" ] || { echo "ncu not found"; break; }
  echo "-- ${e:-default}"
  env $e TS_CUDA_GRAPHS=0 timeout 60 "$ncu" --cache-control none --kernel-name add_rms_norm_parts_router_route \
    --launch-skip 300 --launch-count 6 --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
    --csv --page raw "$B" bench --backend cuda -m $V -p 0 -n 24 -r 1 2>/dev/null > $O/ncu.csv
  python3 - $O/ncu.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
h = next((r for r in rows if r and r[0] == "ID"), None)
for r in rows:
    if h and len(r) == len(h) and r[0].isdigit():
        d = dict(zip(h, r))
        print("ns", d.get("gpu__time_duration.sum"), "dram bytes", d.get("dram__bytes_read.sum"), "L2 hit %", d.get("lts__t_sector_hit_rate.pct"))
PY
done
stamp "== done"
