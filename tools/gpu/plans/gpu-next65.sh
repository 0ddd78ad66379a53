#!/usr/bin/env bash
# Twenty-third session: chained greedy steps (bench's default; `--no-chain` the old loop): each
# decode step is enqueued before the previous pick reaches the host, its token taken on the
# device from the last arg-max (TOKEN_FROM_ARGMAX), so the host's turn between tokens (~30 us a
# token on the trace) overlaps the device's work. Must keep every hash (tg128
# db10d2fd9a926913, 16k efeed109b1480c9a, 64 sequences 33948fa635fb0682).
#   tools/gpu/plans/gpu-next65.sh BIN OPS   (~6 minutes)
set -u
B=$1; OPS=$2
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=90
"$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1 &
stamp "== op tests"
op_log 120 4 ops.txt "chained|" "" chained_argmax_tokens argmax_rows_exact embed_all_types recorded_steps_replay
wait
stamp "== tg128"
for r in 1 2; do
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
  b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash --no-chain
done
stamp "== tg64 at 16k, 64 sequences"
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash --no-chain
for f in "" "--no-chain"; do b "" "$B" bench --backend cuda -m $V -p 0 -n 32 --parallel 64 -r 2 --hash $f; done
stamp "== trace"
trace_tg 12
stamp "== done"
