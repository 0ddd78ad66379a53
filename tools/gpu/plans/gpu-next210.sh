#!/usr/bin/env bash
# For the sixty-second session (~8 minutes on an H200): the figures issues 5 and 6 name, with the
# sixtieth session's defaults (gpu-next207: the server, 64 clients for 45 s, then tg128, tg64 at
# 16k, pp2048 and bf16 tg128). On any other card it stops at once: gpu-next206's checks ran on an
# H100 in the sixty-first session, and nothing else waits for a card. After it, on the same warm
# H200: gpu-next208.sh (MMQ_GU_PF 128 / 192 / 256 at 64 sequences, then the server again).
#   OPS=.dev/ops tools/gpu/plans/gpu-next210.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader)"; exit 0
fi
exec bash "$(dirname "$0")/gpu-next207.sh" "$B"
