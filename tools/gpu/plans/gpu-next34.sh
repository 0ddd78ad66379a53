#!/usr/bin/env bash
# RUN 2026-12-01 (fourteenth session, with TS_CUDA_MMF_GU=1 on every server): 5,910 / 5,907
# without; 5,909 / 5,938 with 64; 5,815 / 5,943 with 64 and wait 4; 5,942 / 5,936 with 32. Noise:
# the load test's clients run in step, so prompts already arrive together. Dropped (the serve
# options no longer exist).
# Written in the thirteenth session (2026-12-01), NOT yet run: prompt tiles for the server
# (serve --prefill-batch N: prompt tokens held back while others decode until N wait, at most
# --prefill-wait steps). A server step of 64 decode rows plus ~12 prompt tokens took 9.8-10.9 ms,
# where the bench's 64-row step takes 8.4 and its 128-row one 9.6: the second, mostly empty row
# tile costs nearly a whole one. The server at 64 clients, 15 s, without and with 64 (wait 8 and
# 4) and 32, twice; aggregate tok/s and TTFT p50/p99 (the price: a prompt starts a few steps
# later). If it wins, make it serve's default. About 5 minutes (after the model's synthesis).
#   tools/gpu/plans/gpu-next34.sh BIN
set -u
B=$1
source "$(dirname "$0")/lib.sh"
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
for r in 1 2; do
  serve64 "" 15
  serve64 "" 15 "--prefill-batch 64"
  serve64 "" 15 "--prefill-batch 64 --prefill-wait 4"
  serve64 "" 15 "--prefill-batch 32"
done
