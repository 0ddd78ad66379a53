#!/usr/bin/env bash
# (Replaced by gpu-next237 before it ran.) For the seventy-fourth session: the MoE routers in a persisting L2 window
# (TS_CUDA_L2_ROUTER=1: every layer's f32 router rows, 13.6 MB for V2-Lite, in one allocation
# that the one-token routing launch reads through a persisting access-policy window, so that
# each token's routing finds them in L2 instead of DRAM). On an H200 first issue 6's figure
# (the server, 64 clients, 45 s, the defaults) and tg128. On any card: tg128 off / on,
# alternating (the hashes must match), Nsight's DRAM bytes of the routing launch each way (no
# cache flush between kernels), two traces, and tg64 at 16k each way (~5 minutes on an H100,
# ~8 on an H200).
#   tools/gpu/plans/gpu-next236.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
h200_first tg128
wait
L="TS_CUDA_L2_ROUTER=1"
stamp "== tg128: off / on"
for r in 1 2; do
  young 400 || break
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "$L" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== Nsight: the routing launch's DRAM bytes, off / on"
ncu=$(ncu_path)
for e in "" "$L"; do
  young 440 || break
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
stamp "== traces (tg32): off, on"
young 470 && trace_tg 9
young 490 && (export $L; trace_tg 9)
stamp "== tg64 at 16k: off / on"
young 510 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
young 535 && b "$L" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
