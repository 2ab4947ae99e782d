#!/usr/bin/env bash
# The CPU backend under the sanitizers, bounded for CI (2 cores): the C++ suites built with
# AddressSanitizer + UndefinedBehaviorSanitizer, a ThreadSanitizer build of the suites whose ranks
# are threads (the protocol's atomics and the rejected / disagreeing calls), and the libFuzzer
# target over argument validation of both fused ops for FUZZ_SECONDS (default 60). Exits non-zero
# if any of them finds something.
#   bash scripts/sanitize-cpu.sh            # all three
#   STEPS="asan fuzz" bash scripts/sanitize-cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-"asan tsan fuzz"}
# The CPU backend alone: not the SYCL backend either (its runtime's libraries are not built with
# the sanitizers, and its kernels compile at run time, minutes under ASan).
common=(-G Ninja -DTPFUSE_CUDA=OFF -DTPFUSE_SYCL=OFF -DTPFUSE_TORCH=OFF -DTPFUSE_BUILD_BENCH=OFF
  -DCMAKE_BUILD_TYPE=RelWithDebInfo)
status=0

if [[ " $STEPS " == *" asan "* ]]; then
  echo "=== address + undefined (sanitize-cpu +${SECONDS}s)"
  cmake -S . -B build/asan "${common[@]}" -DTPFUSE_SANITIZE=address,undefined >/dev/null
  cmake --build build/asan
  # The heaviest soaks run in the plain build; here every suite, their long cases filtered (the
  # MoE finalize at world 2 and 3 only: its code is the same at every world size; the conversions
  # over every fp32, pure arithmetic on two buffers, in the plain build only), and the random
  # faults (test_fault_random) a smaller run of.
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 TPFUSE_FAULT_CALLS=1500 \
    ctest --test-dir build/asan -L cpu -j 2 --timeout 600 --output-on-failure \
    -E "ThousandsOfConsecutiveCalls|SharedMemory.*world8|MoeFinalize.*world(1|4|5|8)|HostConversionsGiveTheBranchyForms" || status=1
fi

if [[ " $STEPS " == *" tsan "* ]]; then
  echo "=== thread (sanitize-cpu +${SECONDS}s)"
  cmake -S . -B build/tsan "${common[@]}" -DTPFUSE_SANITIZE=thread >/dev/null
  cmake --build build/tsan
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" TPFUSE_FAULT_CALLS=500 \
    ctest --test-dir build/tsan -L cpu -j 2 --timeout 900 --output-on-failure \
    -R "Arguments|FaultRandom|RejectedCallKeepsCallsPaired|DisagreeingRanks|TinyPackets|LatePeer|StandInPath|CpuMisuse.*world(2|3|4)|CpuAlgorithms.*world2|CpuQkNorm.*world2|CpuQkNormArguments|ProcessTeam\.(PeerThatDies|RankThatNever|RanksGiven|BadArguments)|SharedMemoryAlgorithms.*(oneshot|twoshot)_world2|SharedMemoryTeam.*(Misuse|TwoShot|QkNormMatches).*world2" ||
    status=1
fi

if [[ " $STEPS " == *" fuzz "* ]]; then
  echo "=== libFuzzer: argument validation, ${FUZZ_SECONDS:-60} s (sanitize-cpu +${SECONDS}s)"
  CXX=${FUZZ_CXX:-clang++} cmake -S . -B build/fuzz "${common[@]}" -DTPFUSE_BUILD_TESTS=OFF \
    -DTPFUSE_SANITIZE=address,undefined -DTPFUSE_FUZZ=ON >/dev/null
  cmake --build build/fuzz --target fuzz_arguments
  # New inputs go to build/fuzz/corpus; tests/fuzz/regressions holds inputs that once failed.
  mkdir -p build/fuzz/corpus
  build/fuzz/fuzz_arguments -max_total_time="${FUZZ_SECONDS:-60}" -seed="${FUZZ_SEED:-1}" -print_final_stats=1 \
    -artifact_prefix=build/fuzz/ build/fuzz/corpus tests/fuzz/regressions 2>&1 | tail -15 || status=1
fi

exit $status
