#!/usr/bin/env bash
# tpfuse-bench's SYCL mode as a user meets it (ctest gives it the CPU device's environment): what
# it refuses, and a short run on the CPU device that prints every op it measures beside the CPU
# backend's and writes them all.
# usage: bench_sycl.sh PATH/TO/tpfuse-bench
set -uo pipefail
bench=$1
failures=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

"$bench" --backend sycl --processes >"$out/stdout" 2>"$out/stderr"
status=$?
{ [[ $status -eq 2 ]] && grep -qF -- "--processes: the SYCL mode's ranks" "$out/stderr"; } ||
  fail "--backend sycl --processes exited $status: $(head -2 "$out/stderr")"

# More ranks than the CPU device's compute units (one a core): the team's refusal, named, never
# a hang (where that is within the 16 ranks the bench takes).
units=$(nproc)
if [[ $units -lt 16 ]]; then
  timeout 120 "$bench" --backend sycl --world $((units + 1)) --hidden 3072 --tokens 1 \
    --replays 1 --ops-per-graph 1 --out "$out/refused.json" >"$out/refused" 2>"$out/refused.stderr"
  status=$?
  { [[ $status -eq 1 ]] && grep -qF "compute units" "$out/refused.stderr"; } ||
    fail "--world $((units + 1)) exited $status: $(head -3 "$out/refused.stderr")"
fi

if ! timeout 600 "$bench" --backend sycl --hidden 3072 --tokens 1,2 --replays 1 --ops-per-graph 1 \
  --out "$out/run.json" >"$out/run" 2>"$out/run.stderr"; then
  fail "the SYCL run failed: $(cat "$out/run.stderr")"
fi
for wanted in "SYCL mode: 2 ranks on" "CPU-device figures" \
  "hidden 3072, bf16, world 2 (sycl (CPU device))" "oneshot_sycl" "twoshot_sycl" \
  "oneshot_sycl_host" "sycl_local" "fp8_static_sycl" "fp8_token_sycl" "fp8_group128_sycl" \
  "tpfuse_cpu" "cpu_local" "tpfuse_fused_sycl" "tpfuse_fused_rope_sycl"; do
  grep -qF -- "$wanted" "$out/run" || fail "the SYCL run's output does not show '$wanted'"
done
grep -qF '"impl": "tpfuse_oneshot_sycl_host"' "$out/run.json" ||
  fail "the JSON has no host-cost record"
grep -qF '"backend": "sycl (CPU device)"' "$out/run.json" || fail "the JSON names no SYCL backend"

if [[ $failures -ne 0 ]]; then
  cat "$out/run" 2>/dev/null | head -20
  echo "$failures failure(s)"
  exit 1
fi
echo "tpfuse-bench SYCL mode: every check passed"
