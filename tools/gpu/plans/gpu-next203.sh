#!/usr/bin/env bash
# For the sixtieth session (~4 minutes with the file made), any card: whether Path::HalfParts
# (TS_CUDA_HALF_PARTS=1; measured +1.9% at 16k, +2.3% at 4k on an H100 by gpu-next202) can be the
# default: how far its logits move.
#  0. On an H200, issue 6's server figure first.
#  1. mla_out_half_parts with --nocapture (its measured error against the f32 rows);
#  2. teacher-forced logits of 1,024 random tokens, one token a step with the tensor-core split
#     from position 1 (TS_CUDA_MLA_LONG=1), HALF_PARTS off and on, the SIMT split
#     (TS_CUDA_MLA_LONG=0), and the CPU's default mode: each against the CPU, and on against off
#     (tools/gpu/logit_drift.py);
#  3. tg64 at 8k, off against on.
#   OPS=.dev/ops tools/gpu/plans/gpu-next203.sh .dev/turbospark 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
OPS=${OPS:-.dev/ops}
source "$(dirname "$0")/lib.sh"
export TS_RUN_LIMIT=120
HP="TS_CUDA_HALF_PARTS=1"
D=$(dirname "$0")/..
op_log 150 2 ops.txt "partial rows|" "" mla_out_half_parts
q8_ready
issue6_server
stamp "== logits of 1,024 tokens"
P=$(python3 -c "import random; random.seed(11); print(','.join(str(random.randrange(102400)) for _ in range(1024)))")
L=/tmp/lg; mkdir -p $L
for e in "TS_CUDA_MLA_LONG=1" "TS_CUDA_MLA_LONG=1 $HP" "TS_CUDA_MLA_LONG=0"; do
  t=$(echo "$e" | tr ' =' '__')
  env $e timeout 150 "$B" logits --backend cuda -b 1 -c 2048 -m $V --tokens $P -o $L/$t.npy 2>>$O/lg.txt || echo "$e: exit $?"
done
stamp "cuda done"
timeout 240 "$B" logits --backend cpu -c 2048 -m $V --tokens $P -o $L/cpu.npy 2>>$O/lg.txt || echo "cpu: exit $?"
stamp "cpu done"
python3 $D/logit_drift.py $L/cpu.npy $L/*MLA*.npy --label "vs cpu:"
python3 $D/logit_drift.py $L/TS_CUDA_MLA_LONG_1.npy $L/TS_CUDA_MLA_LONG_1_TS_CUDA_HALF_PARTS_1.npy $L/TS_CUDA_MLA_LONG_0.npy --label "vs tc split, f32 rows:"
stamp "== tg64 at 8k"
for e in "" "$HP"; do b "$e" "$B" bench --backend cuda -m $V -p 0 -n 64 -d 8192 -r 1 --hash; done
stamp "== done"
