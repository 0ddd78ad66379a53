#!/usr/bin/env bash
# For the sixty-second session, any card: on an H200 the figures issues 5 and 6 name
# (gpu-next207: the server, 64 clients for 45 s, then tg128, tg64 at 16k, pp2048 and bf16
# tg128; ~8 minutes); on any other card gpu-next213 (Path::DownCopy and Path::RouterPf against the defaults, ~6
# minutes). After it, on the same warm H200: gpu-next213.sh, then gpu-next208.sh.
#   OPS=.dev/ops tools/gpu/plans/gpu-next212.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/gpu-next213.sh" "$B"
fi
exec bash "$(dirname "$0")/gpu-next207.sh" "$B"
