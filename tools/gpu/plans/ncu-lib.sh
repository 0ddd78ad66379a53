# Sourced by the Nsight plans (ncu-rows.sh, ncu-mmf.sh) after lib.sh.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -f $V ] || "$B" synth --preset deepseek-v2-lite --quant q8_0 -o $V >/dev/null 2>&1
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,l1tex__t_bytes.sum'
# `prof RE SKIP COUNT LABEL BENCH_ARGS...`: Nsight Compute on COUNT launches of the kernels named
# by RE after SKIP, under `bench BENCH_ARGS`; the per-launch metrics and top stall reasons, then
# the per-SASS source counters of one of them: the first whose grid contains $NCU_PICK (",130"
# say), else the first.
prof() {
  local re=$1 skip=$2 cnt=$3 lab=$4; shift 4
  echo "== $lab"
  TS_CUDA_GRAPHS=0 timeout 240 "$NCU" --kernel-name "regex:$re" --launch-skip $skip --launch-count $cnt --metrics "$M" --csv --page raw \
    "$B" bench --backend cuda -m $V "$@" 2>/dev/null > $O/$lab.csv
  local pick
  pick=$(python3 - "$O/$lab.csv" <<'PY'
import csv, os, sys
rows = list(csv.reader(open(sys.argv[1])))
hi = next((i for i, r in enumerate(rows) if 'Kernel Name' in r), None)
if hi is None:
    print(open(sys.argv[1]).read()[-1500:], file=sys.stderr); print(0); sys.exit()
h, u = rows[hi], rows[hi + 1]
pick = None
for n, d in enumerate(rows[hi + 2:]):
    g = d[h.index('Grid Size')] if 'Grid Size' in h else ''
    st, other = [], []
    for k, un, v in zip(h, u, d):
        if 'issue_stalled' in k:
            try: st.append((float(v), k.replace('smsp__average_warps_issue_stalled_', '').replace('_per_issue_active.ratio', '')))
            except ValueError: pass
        elif k.startswith(('smsp__inst', 'smsp__issue', 'dram__', 'gpu__', 'sm__', 'lts__', 'l1tex__')):
            other.append(f'{k.split("__")[1][:28]}={v}{un}')
    print(f'[{n}] grid {g}: ' + ' '.join(other), file=sys.stderr)
    print('   stalls/issue: ' + ', '.join(f'{nm} {v:.2f}' for v, nm in sorted(st, reverse=True)[:9]), file=sys.stderr)
    want = os.environ.get('NCU_PICK', '')
    if pick is None and want in g.replace(' ', ''):
        pick = n
print(pick if pick is not None else 0)
PY
)
  echo "  source view of launch $pick of these"
  TS_CUDA_GRAPHS=0 timeout 200 "$NCU" --kernel-name "regex:$re" --launch-skip $((skip + pick)) --launch-count 1 --section SourceCounters \
    --page source --print-source sass --csv "$B" bench --backend cuda -m $V "$@" 2>/dev/null > $O/$lab-sass.csv
  echo "  sass lines: $(wc -l < $O/$lab-sass.csv)"
}
