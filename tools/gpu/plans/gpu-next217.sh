#!/usr/bin/env bash
# For the sixty-third session (~6 minutes), any card: Path::GuCluster (TS_CUDA_GU_CLUSTER=1:
# the one-token gate/up's 32-row units as clusters of 8 one-warp blocks, moe_gateup_sh_q8w, so
# that every SM holds 21-22 warps' work instead of 2 or 3 eight-warp blocks; the same bits).
# The op test, tg128 alternating (two rounds, hashes), tg64 at 16k, then Nsight on the new
# launch's balance (as gpu-next216 measured moe_gateup_sh_q8q's) and a trace.
#   OPS=.dev/ops tools/gpu/plans/gpu-next217.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
ops_tests 100 4 gu_cluster_exact
stamp "== tg128"
for e in "" "TS_CUDA_GU_CLUSTER=1" "" "TS_CUDA_GU_CLUSTER=1"; do
  young 300 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_GU_CLUSTER=1"; do young 380 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
stamp "== Nsight: moe_gateup_sh_q8w's balance"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
young 430 && TS_CUDA_GU_CLUSTER=1 TS_CUDA_GRAPHS=0 timeout 80 "$ncu" --kernel-name "regex:^moe_gateup_sh_q8w\$" --launch-skip 30 --launch-count 1 \
  --metrics gpu__time_duration.sum,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__ctas_launched.min,sm__ctas_launched.max,launch__registers_per_thread,dram__throughput.avg.pct_of_peak_sustained_elapsed \
  "$B" bench --backend cuda -m $V -p 0 -n 8 -r 1 2>&1 | grep -E "q8w|duration|cycles_active|ctas_launched|registers|dram__|rror" | head -12
stamp "== trace"
young 480 && TS_CUDA_GU_CLUSTER=1 trace_tg 8
stamp "== done"
