#!/usr/bin/env bash
# For the sixty-second session, any card: on an H200 gpu-next214 (issue 6's server figure,
# then Path::DownCopy and Path::RouterPf against the defaults at tg128 and 16k; ~9 minutes); on
# any other card gpu-next213 (the op test, then the same A/B; ~6 minutes). After it, on the
# same warm H200: gpu-next207.sh's remaining figures (pp2048, bf16), gpu-next208.sh.
#   OPS=.dev/ops tools/gpu/plans/gpu-next212.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
nvidia-smi --query-gpu=name,uuid --format=csv,noheader
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/gpu-next213.sh" "$B"
fi
exec bash "$(dirname "$0")/gpu-next214.sh" "$B"
