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

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "smoke: installing cargo-fuzz"
  cargo install cargo-fuzz --locked --version 0.13.2
fi

t0=$(date +%s)
if ! cargo fuzz build >build.log 2>&1; then tail -30 build.log; echo "smoke: fuzz build failed"; exit 1; fi
echo "smoke: built in $(( $(date +%s) - t0 )) s"

status=0
for t in "${targets[@]}"; do
  corpus="corpus/$t"
  mkdir -p "$corpus" "artifacts/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  log=$(mktemp)
  # -timeout: one input may take at most 10 s (chat templates burn their fuel slowly under
  # ASan); -rss_limit_mb: a 2 GiB cap turns unbounded allocation into a reported crash.
  if cargo fuzz run "$t" "$corpus" "${seeds[@]}" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
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
