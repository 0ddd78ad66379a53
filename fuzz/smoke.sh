#!/usr/bin/env bash
# Builds every fuzz target and runs each for a bounded time; fails on any crash, leak, timeout
# or out-of-memory. Usage: fuzz/smoke.sh [seconds per target, default 20] [target ...]
#
# Needs cargo-fuzz (installed here if missing) and a nightly-capable rustc: on a stable
# toolchain RUSTC_BOOTSTRAP=1 enables the sanitizer flags cargo-fuzz passes.
# The tokenizer/chat/server targets need SmolLM2 (fetched into the model cache when absent).
set -euo pipefail
cd "$(dirname "$0")"
secs="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf hf tokenizer chat_template server_request)
export RUSTC_BOOTSTRAP=1

# Tooling that cannot be had (no registry, a toolchain without sanitizer support) is reported
# loudly and skipped; what the targets find (crashes, hangs, OOM) fails the run.
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "smoke: installing cargo-fuzz"
  if ! cargo install cargo-fuzz --locked --version 0.13.2; then
    echo "*** smoke: SKIPPED: cargo-fuzz could not be installed ***"
    exit 0
  fi
fi

t0=$(date +%s)
if ! cargo fuzz build >build.log 2>&1; then
  tail -30 build.log
  if grep -q "error\[E" build.log; then echo "smoke: the fuzz targets do not compile"; exit 1; fi
  echo "*** smoke: SKIPPED: the sanitizer build failed for a tooling reason (log above) ***"
  exit 0
fi
echo "smoke: built in $(( $(date +%s) - t0 )) s"

status=0
for t in "${targets[@]}"; do
  corpus="corpus/$t"
  mkdir -p "$corpus" "artifacts/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  log=$(mktemp)
  # -timeout: one input may take at most 30 s (chat templates burn their fuel slowly under
  # ASan, and CI machines are shared); -rss_limit_mb: a 2 GiB cap turns unbounded allocation into a reported crash.
  if cargo fuzz run "$t" "$corpus" "${seeds[@]}" -- \
      -max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 -max_len=65536 \
      -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
    echo "smoke: $t ok ($execs executions in ${secs} s)"
  else
    echo "smoke: $t FAILED; the end of its log:"
    tail -40 "$log"
    ls "artifacts/$t" || true
    status=1
  fi
  rm -f "$log"
done
exit $status
