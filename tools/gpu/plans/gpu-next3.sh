#!/usr/bin/env bash
# First GPU run of branch gpu-next3, one device call (~5 minutes): its op tests, then each change
# against its switch in the same binary, interleaved, and the first device-side trace.
#   tools/gpu/plans/gpu-next3.sh BIN OPS_TEST
# All three changes are meant bit-exact: every tg128 hash must be main's (53d74bf0df5d4532 at
# `-p 0 -n 128 -r 3`, 2026-11-30).
#   TS_CUDA_RR=0   router product and routing apart (gemv_f32_split + moe_route_quant)
#   TS_CUDA_DPF=0  no L2 prefetch of the shared-expert down rows
#   TS_CUDA_RA=0   norm_rope_cache and the absorbed query product apart
# and the split MLA decode on the tensor cores (TS_CUDA_MLATC=1; f16 numerics, so its own hash)
# at 16k context, where the SIMT split kernel holds decode to ~316 tok/s.
set -u
B=$1; OPS=$2
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
V=/tmp/v2lite-q8_0.gguf
b() { local e=$1; shift; echo "-- ${e:-default} $*"; env $e "$@" 2>&1 | grep -E "^\| .*(pp|tg)|hash|rror" | sed -E 's/.*\| (pp|tg)/\1/'; }
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
echo "== ops_vs_cpu"
"$OPS" --test-threads 2 > ${OUT:-/tmp}/ops.txt 2>&1
grep -E "FAIL|test result|panicked" ${OUT:-/tmp}/ops.txt | head -20
wait
for r in 1 2; do
  for e in "" TS_CUDA_RR=0 TS_CUDA_DPF=0 TS_CUDA_RA=0 "TS_CUDA_RR=0 TS_CUDA_DPF=0 TS_CUDA_RA=0"; do
    b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
b "TS_CUDA_RR=0 TS_CUDA_DPF=0 TS_CUDA_RA=0" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash
OFF="TS_CUDA_RR=0 TS_CUDA_DPF=0 TS_CUDA_RA=0"
b "$OFF" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b TS_CUDA_MLATC=1 "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1
b TS_CUDA_MLATC=1 "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
# The device-side timeline (first use of TS_CUDA_TRACE): each kernel's share of a token.
TS_CUDA_TRACE=1 TS_CUDA_TRACE_OUT=${OUT:-/tmp}/trace.csv "$B" bench --backend cuda -m $V -p 0 -n 32 -r 1 2>&1 | grep -E "cuda trace|tg"
python3 tools/gpu/trace.py ${OUT:-/tmp}/trace.csv 16 | head -30
