#!/usr/bin/env bash
# Fortieth session: mmdh_<NT>_<CS> with its activation copy's division replaced by shifts; the
# A/B at 64 sequences, and Nsight's per-instruction stall samples (SASS) of q+kv_a's launch.
#   tools/gpu/plans/gpu-next135.sh BIN 2>&1 | tee $OUT/log.txt | tail -150   (~4 minutes)
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
Q=TS_CUDA_DENSE_Q8H=1
stamp "== 64 sequences -d 96"
bpd 64 "-d 96" "" $Q
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
stamp "== Nsight source: mmdh_8_8"
env $Q TS_CUDA_GRAPHS=0 timeout 200 "$ncu" --kernel-name "regex:mmdh_8_8" --launch-skip 100 --launch-count 1 \
  --set full --import-source yes -o $O/rep "$B" bench --backend cuda -m $V -p 0 -n 4 --parallel 64 -r 1 -d 96 > $O/ncu_run.txt 2>&1
"$ncu" -i $O/rep.ncu-rep --page details --print-details all > $O/details.txt 2>&1
"$ncu" -i $O/rep.ncu-rep --page source --print-source sass --csv > $O/sass.csv 2>&1
grep -E "Duration|Warp Cycles Per Issued|Stall" $O/details.txt | head -40
wc -l $O/sass.csv; head -3 $O/sass.csv | cut -c1-600
rm -f $V $O/rep.ncu-rep
stamp "== done"
