#!/usr/bin/env bash
# Each decode kernel's share of a real (graphed, overlapped) decode step: tg tok/s with that
# kernel left out (TS_CUDA_SKIP, results wrong on purpose) against the full step. Isolated
# timings (tools/gpu/ktime.sh, TS_CUDA_PROFILE) overstate small kernels that PDL overlaps.
# Usage (on the GPU machine, from the repo root): tools/gpu/knockout.sh BIN [bench args...]
# Default bench args: -p 0 -n 64 -r 2. KERNELS overrides the list (space-separated; a comma
# joins names left out together).
set -u
T=$1; shift
ARGS=${*:--p 0 -n 64 -r 2}
V=${V:-/tmp/v2lite-q8_0.gguf}
export TURBOSPARK_HOME=${TURBOSPARK_HOME:-/tmp/tsh}
[ -f $V ] || "$T" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
KERNELS=${KERNELS:-"none gemv_q8_1 gemv_q8_multi moe_gateup_sh moe_down_sh add_rms_norm norm_rope_cache mla_split mla_combine quant_q8_groups moe_route_warp gemv_f32_split argmax_rows add_rms_norm,norm_rope_cache,mla_combine,quant_q8_groups,moe_route_warp,gemv_f32_split none"}
base=""
for k in $KERNELS; do
  s=$k; [ $k = none ] && s=""
  f=$(TS_CUDA_SKIP=$s "$T" bench --backend cuda -m $V $ARGS 2>/dev/null | grep -E "^\| .*tg" | sed -E 's/.*\| ([0-9.]+) \(.*/\1/')
  [ -z "$base" ] && base=$f
  us=$(python3 -c "b=$base; f=${f:-0}; print(f'{1e6/b - 1e6/f:7.1f}' if f else 'n/a')")
  printf "%-70s %9s tok/s  %s us/token\n" "$k" "$f" "$us"
done
