#!/usr/bin/env bash
# Sixty-ninth session: the output head's launch in whole waves. Path::HeadMmh (TS_CUDA_HEAD_MMH=1,
# off) ran V2-Lite's head as 400 tiles of 256 rows at one block an SM, 4 waves on 132 SMs for
# 3.03 waves of work; it now picks tiles of 200 rows there (mmh8_dn200, 512 tiles: 3.88 waves;
# TS_CUDA_HEAD_BN=256 the old tiles). On an H200 first issue 6's figure (the server with the
# defaults) and tg128; on any card the op test head_mmh (both tile sizes), the head launch's
# isolated time under Nsight Compute at each tile size, then 64 sequences at -d 96 alternating
# (defaults, 200-row tiles, 256-row tiles), and with time left the server with the best of them.
# ~5 minutes on an H100 with the file made, ~7 on an H200.
#   OPS=.dev/ops_vs_cpu tools/gpu/plans/gpu-next222.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
q8_bg
if is_h200; then
  wait
  stamp "== synthesised"
  issue6_server
  stamp "== tg128"
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
fi
stamp "== op test"
op_log 120 2 ops.txt "HeadMmh|" "" head_mmh
wait
stamp "== the head launch alone (Nsight Compute, graphs off, 64 sequences)"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for bn in 256 200; do
  if [ -n "$NCU" ]; then
    echo "-- TS_CUDA_HEAD_BN=$bn"
    TS_CUDA_GRAPHS=0 TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_BN=$bn timeout 120 "$NCU" --kernel-name regex:mmh8_dn \
      --launch-skip 4 --launch-count 4 --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw \
      "$B" bench --backend cuda -m $V -p 0 -n 8 --parallel 64 -r 1 -d 96 2>/dev/null \
      | grep -E "mmh8_dn" | awk -F'","' '{print $5, $(NF-1), $NF}' | head -4
  fi
done
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  p64_best ""
  p64_best "TS_CUDA_HEAD_MMH=1"
  p64_best "TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_BN=256"
done
if young 420; then serve_best; fi
stamp "== done"
