#!/usr/bin/env bash
# tpfuse-bench as a user meets it: bad arguments are refused with a message naming the flag (exit
# 2, before any work), and a short CPU run prints every op it measured, the QK norm by its shape.
# usage: bench_cli.sh PATH/TO/tpfuse-bench
set -uo pipefail
bench=$1
failures=0
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# expect_refusal "what the message must say" args...: exit status 2 and the message on stderr.
expect_refusal() {
  local wanted=$1
  shift
  "$bench" "$@" >"$out/stdout" 2>"$out/stderr"
  local status=$?
  if [[ $status -ne 2 ]] || ! grep -qF -- "$wanted" "$out/stderr"; then
    echo "FAIL: tpfuse-bench $* exited $status; stderr did not say '$wanted':"
    head -3 "$out/stderr"
    failures=$((failures + 1))
  fi
}

expect_refusal "--tokens has an empty item in '1,,2'" --tokens 1,,2
expect_refusal "--tokens expects a comma-separated list of integers, got '1,'" --tokens 1,
expect_refusal "--tokens expects an integer >= 1, got 'x'" --tokens x
expect_refusal "--tokens 100000: the CPU mode measures at most 4096 tokens" --backend cpu \
  --tokens 100000
expect_refusal "--world must be at most 16" --world 17
expect_refusal "--hidden 100: widths must be multiples of" --hidden 100
expect_refusal "unknown option '--bogus'" --bogus

# The help states the limits the errors enforce.
"$bench" --help >"$out/help"
for wanted in "ranks, 1..16" "at most 32768 on GPUs and 4096 on the CPU"; do
  grep -qF -- "$wanted" "$out/help" || {
    echo "FAIL: --help does not say '$wanted'"
    failures=$((failures + 1))
  }
done

# A short run prints every op it measures, and writes them all.
if ! "$bench" --backend cpu --hidden 3072 --tokens 1,2 --replays 1 --ops-per-graph 1 \
  --out "$out/run.json" >"$out/run" 2>"$out/run.stderr"; then
  echo "FAIL: the CPU run failed:"
  cat "$out/run.stderr"
  failures=$((failures + 1))
fi
for wanted in "hidden 3072, bf16, world 2 (cpu)" "tpfuse_cpu" "tpfuse_twoshot_cpu" "cpu_local" \
  "fp8_static_cpu" "fp8_token_cpu" "fp8_group128_cpu" \
  "allreduce_qk_rmsnorm, MiniMax-M2 q 3072 + k 512 per rank (48 / 8 heads of 128, world 2)" \
  "tpfuse_fused_rope_cpu"; do
  grep -qF -- "$wanted" "$out/run" || {
    echo "FAIL: the CPU run's table does not show '$wanted':"
    cat "$out/run"
    failures=$((failures + 1))
  }
done
grep -qF '"shape": "MiniMax-M2 q 3072' "$out/run.json" || {
  echo "FAIL: the QK records in the JSON carry no shape"
  failures=$((failures + 1))
}

# --processes on the CPU: one process a rank over shared memory, the same table.
if ! "$bench" --backend cpu --processes --world 3 --hidden 3072 --tokens 1,2 --replays 1 \
  --ops-per-graph 1 --out "$out/processes.json" >"$out/processes" 2>"$out/processes.stderr"; then
  echo "FAIL: the CPU --processes run failed:"
  cat "$out/processes.stderr"
  failures=$((failures + 1))
fi
for wanted in "one process a rank over shared memory" "hidden 3072, bf16, world 3 (cpu)" \
  "tpfuse_cpu" "fp8_group128_cpu" "tpfuse_fused_rope_cpu"; do
  grep -qF -- "$wanted" "$out/processes" || {
    echo "FAIL: the CPU --processes run's output does not show '$wanted':"
    cat "$out/processes"
    failures=$((failures + 1))
  }
done

if [[ $failures -ne 0 ]]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "tpfuse-bench command line: every check passed"
