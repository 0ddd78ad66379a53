#!/usr/bin/env bash
# Sixty-ninth session: the output head's launch in whole waves. Path::HeadMmh (TS_CUDA_HEAD_MMH=1,
# off) ran V2-Lite's head as 400 tiles of 256 rows at one block an SM, 4 waves on 132 SMs for
# 3.03 waves of work; it now picks tiles of 200 rows there (mmh8_dn200, 512 tiles: 3.88 waves;
# TS_CUDA_HEAD_BN=256 the old tiles); and with TS_CUDA_DEFINES=MMH_HELP=1 the idle second
# multiplying warpgroup of a tile of <= 64 pairs turns rows into f16 too (7 warps, not 3). On an
# H200 first issue 6's figure (the server with the defaults) and tg128; on any card the op
# tests head_mmh (both tile sizes) and moe_f16_prompt (mmh8_*), each without and with
# MMH_HELP, the head launch's isolated time under Nsight Compute (tile sizes x MMH_HELP), then
# 64 sequences at -d 96 alternating, and with time left the server with the best of them.
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
stamp "== op tests"
op_log 100 2 ops.txt "HeadMmh|" "" head_mmh moe_f16_prompt
stamp "== op tests, MMH_HELP=1"
op_log 100 2 ops-help.txt "HeadMmh|" "TS_CUDA_DEFINES=MMH_HELP=1" head_mmh moe_f16_prompt
wait
stamp "== the head launch alone (Nsight Compute, graphs off, 64 sequences)"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for e in "TS_CUDA_HEAD_BN=256" "TS_CUDA_HEAD_BN=200" "TS_CUDA_HEAD_BN=200 TS_CUDA_DEFINES=MMH_HELP=1"; do
  if [ -n "$NCU" ] && young 330; then
    echo "-- $e"
    env $e TS_CUDA_GRAPHS=0 TS_CUDA_HEAD_MMH=1 timeout 100 "$NCU" --kernel-name regex:mmh8_dn \
      --launch-count 100 --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size --csv --page raw \
      "$B" bench --backend cuda -m $V -p 0 -n 6 --parallel 64 -r 1 -d 96 2>/dev/null > $O/ncu.csv
    # (the header's metric columns, then the last three launches: the decode steps' heads)
    grep -m1 '"ID"' $O/ncu.csv | tr ',' '\n' | tail -3 | tr '\n' ' '; echo
    grep -E "mmh8_dn" $O/ncu.csv | awk -F'","' '{print $5, $(NF-2), $(NF-1), $NF}' | tail -3
  fi
done
stamp "== 64 sequences, -d 96"
for r in 1 2; do
  [ $r = 2 ] && ! young 450 && break
  p64_best ""
  p64_best "TS_CUDA_HEAD_MMH=1"
  p64_best "TS_CUDA_HEAD_MMH=1 TS_CUDA_DEFINES=MMH_HELP=1"
  p64_best "TS_CUDA_HEAD_MMH=1 TS_CUDA_HEAD_BN=256"
done
if young 420; then serve_best; fi
stamp "== done"
