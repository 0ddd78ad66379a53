#!/usr/bin/env bash
# Twenty-seventh session, main: (1) why the split MLA decode at depth 16,384 takes ~23 us a
# layer (gpu-next77: issue slots 17% busy, one warp a scheduler; gpu-next78: 8 warps were
# slower): Nsight Compute's warp stall reasons for one launch of mla_split_tc_h (cycles a warp
# spends stalled per issued instruction, by reason). (2) The bf16 decode MoE's down kernels at 4
# blocks an SM (TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=4: 64 registers without spills, where 67
# at 3 blocks put its 1,024 blocks in 2.6 waves); register allocation only, so the hash must hold.
#   tools/gpu/plans/gpu-next79.sh BIN OPS 2>&1 | tee $OUT/log.txt | tail -80   (~4 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1
stamp "== bf16 tg128: down kernels at 4 blocks an SM"
for r in 1 2; do
  for e in "" "TS_CUDA_DEFINES=GQ_DOWN16_MIN_BLOCKS=4"; do b "$e" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash; done
done
rm -f $BF
# (Last: the call may run out of device time here.)
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
stamp "== ncu mla_split_tc_h stalls"
TS_CUDA_GRAPHS=0 timeout 120 "$NCU" --kernel-name "regex:mla_split" --launch-skip 30 --launch-count 1 \
  --section SpeedOfLight --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg" \
  "$B" bench --backend cuda -m $V -p 0 -n 4 -d 16384 -r 1 2>&1 | grep -E "mla_split|Duration|Elapsed|stalled|inst_executed|cycles_active|ERR|rror" | grep -vE " 0$| 0\.0?0?$" | head -60
rm -f $V
stamp "== done"
