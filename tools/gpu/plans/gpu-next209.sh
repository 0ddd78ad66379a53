#!/usr/bin/env bash
# For the sixty-first session's last device time (~6 minutes on an H200): gpu-next207's H200 half
# alone (the server, 64 clients for 45 s, then tg128, tg64 at 16k, pp2048 and bf16 tg128 with
# time left). On any other card it stops at once: gpu-next206 already ran on an H100 this
# session, and the figures issues 5 and 6 name are the H200's.
#   OPS=.dev/ops tools/gpu/plans/gpu-next209.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader)"; exit 0
fi
exec bash "$(dirname "$0")/gpu-next207.sh" "$B"
