#!/usr/bin/env bash
# For the sixty-first session's last device time (~4 minutes on an H200): the figures issues 5
# and 6 name that the sixtieth session's defaults can move, trimmed to fit what is left of the
# budget: the server (64 clients, 45 s), tg128, then tg64 at 16k with time left (pp2048 is met;
# bf16 tg128 would need its 31 GB file made first). On any other card it stops at once:
# gpu-next206 already ran on an H100 this session.
#   OPS=.dev/ops tools/gpu/plans/gpu-next209.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  echo "not an H200: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader)"; exit 0
fi
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=150
q8_ready
issue6_server
stamp "== issue 5's figures (Q8_0)"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
young 300 && b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
stamp "== done"
