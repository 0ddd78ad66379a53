#!/usr/bin/env bash
# For the sixty-second session on an H200 (~9 minutes): issue 6's figure (the server, 64 clients,
# 45 s, the defaults), then Path::DownCopy and Path::RouterPf against the defaults at tg128
# (the default's figure is issue 5's) and at 16k, alternating, with hashes; the op test
# down_copy_exact with time left.
#   OPS=.dev/ops tools/gpu/plans/gpu-next214.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
q8_ready
stamp "== synthesised"
issue6_server
stamp "== tg128"
for r in 1 2; do
  for e in "" "TS_CUDA_DOWN_COPY=1" "TS_CUDA_DOWN_COPY=1 TS_CUDA_ROUTER_PF=1"; do
    young 420 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  done
done
stamp "== tg64 at 16k"
for e in "" "TS_CUDA_DOWN_COPY=1 TS_CUDA_ROUTER_PF=1"; do young 480 && b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash; done
young 500 && { timeout 60 "$OPS" --test-threads 2 down_copy_exact > $O/ops.txt 2>&1; grep -E "FAIL|test result|panicked" $O/ops.txt | head; }
stamp "== done"
