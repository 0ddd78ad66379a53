#!/usr/bin/env bash
# Greedy decoding of the synthetic V2-Lite on CUDA and on the CPU, both with f32 activations
# (TS_CUDA_EXACT=1 / --exact), so the comparison is of arithmetic, not of 8-bit rounding.
# Usage (GPU machine): tools/gpu/greedy_exact.sh BIN [N]
set -u
T=${1:-.dev/turbospark}; N=${2:-32}; V=/tmp/v2lite-q8_0.gguf; O=/tmp/greedy; mkdir -p $O
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
[ -f $V ] || "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V
P=1,100,2000,30000,4,5,6,7
TS_CUDA_EXACT=1 "$T" run --backend cuda -m $V --tokens $P -n $N --temp 0 -c 512 > $O/cuda.json 2>$O/log.txt
"$T" run --backend cpu --exact -m $V --tokens $P -n $N --temp 0 -c 512 > $O/cpu.json 2>>$O/log.txt
tail -4 $O/log.txt
if cmp -s $O/cuda.json $O/cpu.json; then echo "greedy $N tokens (f32 activations): CUDA == CPU"; r=0; else echo "greedy $N tokens: DIFFER"; r=1; fi
cat $O/cuda.json $O/cpu.json
TS_CUDA_EXACT=1 "$T" logits --backend cuda -m $V --tokens $P -c 512 -o $O/cuda.npy 2>>$O/log.txt
"$T" logits --backend cpu --exact -m $V --tokens $P -c 512 -o $O/cpu.npy 2>>$O/log.txt
python3 "$(dirname "$0")/compare_npy.py" $O/cpu.npy $O/cuda.npy --tol 1e-3 --label "v2-lite q8_0 logits, CUDA (f32 act) vs CPU (exact)" || r=1
exit $r
