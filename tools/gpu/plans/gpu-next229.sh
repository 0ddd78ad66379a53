#!/usr/bin/env bash
# For a session after the seventy-first (it replaces gpu-next227's H200 steps): on an H200,
# issue 6's figure (the server, 64 clients, 45 s, the defaults) then tg128 (issue 5's), ~4
# minutes; on any other card the one op test the seventy-first session's full `ops_vs_cpu` run
# on an H100 did not reach in its 150 s (`pre_routed_moe_exact`), at most 120 s.
#   tools/gpu/plans/gpu-next229.sh .dev/turbospark > $OUT/log.txt 2>&1
set -u
B=$1
OPS=${OPS:-.dev/ops_vs_cpu}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=100
if ! is_h200; then
  stamp "== not an H200: the op test pre_routed_moe_exact"
  op_log 120 2 ops.txt "" "" pre_routed_moe_exact
  exit 0
fi
q8_bg
h200_first tg128
stamp "== done"
