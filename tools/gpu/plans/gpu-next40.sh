#!/usr/bin/env bash
# Seventeenth session (2026-12-01): the prompt MoE on wgmma (mmfw_*, sm_90a, TS_CUDA_MMF_W=1),
# the sm_90a build's first run. First its op test (moe_f16_prompt: mmfw against mmfq8, its
# gate-up launch against its three); if that fails, again with LBO and SBO of the B descriptor
# swapped (TS_CUDA_DEFINES=MMFW_SWAP_LS=1). Then pp512 / pp2048 with the f16 copies (default),
# straight from Q8_0 on mma.sync (TS_CUDA_F16=0: mmfq8) and on wgmma, then every op test and
# the decode hashes on the sm_90a build (they must stay 756941f1d106faec and 33948fa635fb0682).
#   tools/gpu/plans/gpu-next40.sh BIN OPS
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== wgmma op test"
SW=""
timeout 240 "$OPS" --test-threads 1 moe_f16_prompt > $O/ops_w.txt 2>&1; RC=$?
grep -E "mmfw|FAIL|test result|panicked|skipped" $O/ops_w.txt | head -16; echo "exit $RC"
if [ $RC != 0 ]; then
  stamp "== again with LBO/SBO swapped"
  TS_CUDA_DEFINES=MMFW_SWAP_LS=1 timeout 200 "$OPS" --test-threads 1 moe_f16_prompt > $O/ops_w2.txt 2>&1; RC2=$?
  grep -E "mmfw|FAIL|test result|panicked" $O/ops_w2.txt | head -12; echo "exit $RC2"
  [ $RC2 = 0 ] && SW="TS_CUDA_DEFINES=MMFW_SWAP_LS=1"
fi
wait
stamp "== prompts"
for e in "" "TS_CUDA_F16=0" "TS_CUDA_F16=0 TS_CUDA_MMF_W=1 $SW"; do
  b "$e" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  b "$e" "$B" bench --backend cuda -m $V -p 2048 -n 0 -r 2
done
stamp "== every op test (sm_90a build)"
timeout 200 "$OPS" --test-threads 4 > $O/ops.txt 2>&1 || echo "ops_vs_cpu: exit $?"
grep -E "FAIL|test result|panicked" $O/ops.txt | head -20
stamp "== decode hashes"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
stamp "== done"
