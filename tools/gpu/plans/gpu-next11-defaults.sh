#!/usr/bin/env bash
# The tenth session's measurements of gpu-next11's defaults (2026-11-30; docs/PERF.md, "Experts in
# 16-row tiles"), one build against its own switches:
#   tools/gpu/plans/gpu-next11-defaults.sh BIN [a|b]     (about 4 and 3 minutes)
# a: the padding-rule x blocks-bound kernel variants (TS_CUDA_DEFINES), the tiled expert copy on
#    and off at 64 sequences, dense rows at 32 and 48 sequences, tg128, pp512.
# b: the CUDA-vs-CPU fixtures, dense rows up to 64 at 64 sequences, the server with the defaults
#    and with all dense products on the rows kernel, bf16 tg128.
# Expect: hash 33948fa635fb0682 at --parallel 64 -n 32 -r 2 (tiled or not; 5610eef2ac0499d9 with
# TS_CUDA_MMQ_ROWS=64), tg128 756941f1d106faec, bf16 tg128 867b15cc0c282528.
set -u
B=$1; PART=${2:-a}
source "$(dirname "$0")/lib.sh"
P="bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash"
if [ "$PART" = a ]; then
  "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
  for d in "MMQ_ROWS_PAD=1 MMQ_ROWS_MINB=5" "MMQ_ROWS_PAD=0 MMQ_ROWS_MINB=5" "MMQ_ROWS_PAD=1 MMQ_ROWS_MINB=4" "MMQ_ROWS_PAD=0 MMQ_ROWS_MINB=4"; do
    echo "## $d"; TS_CUDA_DEFINES="$d" TS_CUDA_MOE_TILED=0 b "" "$B" $P | grep x64
  done
  for e in "" TS_CUDA_MOE_TILED=0; do b "$e" "$B" $P; done
  for e in "" TS_CUDA_MMQ_ROWS=0; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 32 -r 1; done
  for e in "" TS_CUDA_MMQ_ROWS=32; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 16 --parallel 48 -r 1; done
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "" "$B" bench --backend cuda -m $V -p 512 -n 0 -r 3
  exit 0
fi
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
tools/gpu/prefill.sh "$B" none $O/pf fix 2>&1 | grep -E "OK|FAIL|failures" | head -8
wait
b TS_CUDA_MMQ_ROWS=64 "$B" $P
for e in "" TS_CUDA_MMQ_ROWS=128; do
  echo "== server ${e:-default}"
  env $e TS_LOAD_SECONDS=20 tools/gpu/prefill.sh "$B" none $O/pf serve 2>&1 | grep -E "tokens:|TTFT|failures|steps_total|batch_tokens"
done
"$B" synth --preset deepseek-v2-lite --quant bf16 -o /tmp/v2lite-bf16.gguf >/dev/null 2>&1
b "" "$B" bench --backend cuda -m /tmp/v2lite-bf16.gguf -p 0 -n 128 -r 3 --hash
rm -f /tmp/v2lite-bf16.gguf
