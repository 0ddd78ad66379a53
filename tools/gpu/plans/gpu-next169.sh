#!/usr/bin/env bash
# Fifty-first session, for an H200 (else an H100, whose figures compare only with each other).
# ~9 minutes with the two syntheses.
# 1. gpu-next165's figures with the defaults (the forty-ninth session's expert prefetch from the
#    attention's merge, 24 MB): the server (64 clients, 45 s) against the old prefetch
#    (TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1), 64 sequences -d 96 the same two ways, tg128, tg64 at
#    16k, bf16 tg128. The H200's last figures: server 9,601, 64 sequences 9,926, tg128 709, 16k
#    546, bf16 520.6.
# 2. Why the server's 64-row step is ~1.7% slower than the bench's at the same depths (fiftieth
#    session): the experts a 64-row step reaches and its 16-token tiles, in the bench (-d 32)
#    and in the server (graphs off, TS_CUDA_MOE_COUNTS=1; the averages over the steps of 384
#    routed pairs).
#   tools/gpu/plans/gpu-next169.sh BIN 2>&1 | tee $OUT/log.txt | tail -60
set -u
B=$1
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=200
stamp "== synth"
q8_ready
"$B" synth --preset deepseek-v2-lite --quant bf16 -o $BF >/dev/null 2>&1 &
OLD="TS_CUDA_XPF=32 TS_CUDA_XPF_AT=1"
stamp "== server"
serve64 "" 45 "--row-multiple 4"
serve64 "$OLD" 45 "--row-multiple 4"
stamp "== 64 sequences"
bpd 64 "-d 96" "" "$OLD" ""
stamp "== one sequence"
b "" "$B" bench --backend cuda -m $V -p 0 -n 128 -r 3 --hash
b "" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 16384 -r 1 --hash
wait
b "" "$B" bench --backend cuda -m $BF -p 0 -n 128 -r 3 --hash
# The averages of the 64-row steps' MoE counts (lines of 384 routed pairs): experts reached,
# 16-pair tiles, the busiest expert's pairs.
counts() { grep "moe counts: 384 pairs" | sed -E 's/.* over ([0-9]+) of.*16-pair tiles ([0-9]+), largest \[([0-9]+).*/\1 \2 \3/' |
  awk '{e+=$1; t+=$2; m+=$3; n++} END {if (n) printf "steps %d: experts %.2f, 16-pair tiles %.2f, busiest %.2f\n", n, e/n, t/n, m/n}'; }
stamp "== MoE counts, bench -d 32 -n 64"
TS_CUDA_GRAPHS=0 TS_CUDA_MOE_COUNTS=1 timeout 200 "$B" bench --backend cuda -m $V -p 0 -n 64 --parallel 64 -r 1 -d 32 2>&1 | counts
stamp "== MoE counts, server 30 s"
TS_CUDA_GRAPHS=0 TS_CUDA_MOE_COUNTS=1 "$B" serve --backend cuda -m $V --max-seqs 64 --max-queue 256 -c 1024 --port 8089 --row-multiple 4 > $O/serve_counts.log 2>&1 &
sp=$!
for i in $(seq 1 150); do curl -sf http://127.0.0.1:8089/health >/dev/null && break; sleep 1; done
timeout 100 "$B" loadtest --url http://127.0.0.1:8089 --clients 64 --duration 30 --max-tokens 128 --prompt-ids 32 --temperature 0 | grep -E "^tokens:"
kill -INT $sp; (sleep 20; kill -9 $sp 2>/dev/null) & wait $sp 2>/dev/null
counts < $O/serve_counts.log
rm -f $O/serve_counts.log
stamp "== done"
