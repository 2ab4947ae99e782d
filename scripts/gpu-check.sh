#!/usr/bin/env bash
# One call on a GPU machine: build with CMake + Ninja, run the GPU and CPU tests, a
# compute-sanitizer pass, and tpfuse-bench; logs and results go under $OUT.
#
#   OUT=/tmp/out STEPS="build test sanitize bench peers experiments ab profile python e2e cpu" scripts/gpu-check.sh
#   OUT=/tmp/out STEPS=pair scripts/gpu-check.sh     (on two NVLinked GPUs: every pair step)
#
# peers: bench/peers.py (FlashInfer, torch symmetric memory, tpfuse from torch, the local kernels)
# into the bench step's results file; PEERS_ARGS narrows it. python: the torch ops' tests (tests/python, the GPU one included: one process per GPU, the
# passes under CUDA graphs), bench/torch_host_overhead.py and bench/torch_qk_baseline.py. e2e:
# the end-to-end decode benchmark (bench/e2e/decode.py; E2E_ARGS narrows it, E2E_ARGS=--fp8 ... runs
# its FP8 model). profile: Nsight
# Compute on the QK-norm kernels of a one-GPU run (PROFILE_TOKENS, PROFILE_SKIP, PROFILE_LAUNCHES).
# transformers: HF transformers' own models under their own TP, decode step eager / compiled / with the passes (bench/e2e/transformers_decode.py; TRANSFORMERS_ARGS narrows it).
#
# GoogleTest comes from the system, or from .deps/googletest (scripts/fetch-deps.sh copies it
# there for machines without it). NCCL: torch's nvidia/nccl if present (the NCCL the baselines
# were measured with), else the system's. The device copy has no .git: pass the commit in
# TPFUSE_BENCH_COMMIT. TEST_LABEL=cpu|gpu picks the tests (default gpu; CI runs cpu).
# TEST_REGEX narrows the tests (ctest -R). BUILD_TARGETS narrows the build (e.g. tpfuse_torch for a call that runs only Python).
# SANITIZE_TOOLS, SANITIZE_TESTS (oneshot, qknorm, shared_device, nccl_headers), SANITIZE_FILTER (a gtest
# filter in place of the test's own) and SANITIZE_TIMEOUT narrow the sanitizer.
# experiments: EXPERIMENTS (environment settings, one bench run each) and EXPERIMENT_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# NVLink multicast stays off on shared hosts (see README): never remove these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/gpu-out}
STEPS=${STEPS:-"build test sanitize bench"}
# pair: everything that needs two GPUs joined by NVLink, in one call (docs/benchmarks.md says what
# each step measures there): the tests (the NCCL path's headers and faults among them, their log
# kept as pair-faults.log), the sanitizers, tpfuse-bench with the peers, the Python ops and
# benchmarks, e2e and transformers; with AB_BASE set, the A/B over NVLink too.
if [[ " $STEPS " == *" pair "* ]]; then
  STEPS="${STEPS/pair/} build test sanitize bench peers python e2e transformers${AB_BASE:+ ab}"
  PAIR=1
fi
BUILD=build/gpu
mkdir -p "$OUT"
status=0
step() { echo "=== $* ($(date -u +%H:%M:%S))"; }

{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv 2>&1
  nvidia-smi topo -m 2>&1
  nvcc --version | tail -2
} >"$OUT/machine.txt"

nccl_root=$(python3 -c 'import nvidia, os; p = os.path.join(nvidia.__path__[0], "nccl"); print(p if os.path.isdir(p) else "")' 2>/dev/null)

# The ab step's base build (AB_BASE: a source tree to compare with, e.g. `git archive` of the
# commit before a change, carried as an ignored folder): its tpfuse-bench, same preset options.
# With the build step it starts in the background as soon as this tree is built, so that it
# overlaps the GPU-bound tests and sanitizers.
build_ab_base() {
  # A warm machine keeps build/ab-base; a base tree from `git archive` carries commit times that
  # may be older than its objects, so ninja alone would not see a new base: the folder goes when
  # the tree's contents differ from the ones it was built from.
  local base_hash
  base_hash=$(cd "$AB_BASE" && find . -type f -not -path './build/*' -print0 | sort -z |
    xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
  if [ "$(cat build/ab-base/.tree-hash 2>/dev/null)" != "$base_hash" ]; then
    rm -rf build/ab-base && mkdir -p build/ab-base && echo "$base_hash" >build/ab-base/.tree-hash
  fi
  cmake -S "$AB_BASE" -B build/ab-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPFUSE_CUDA=ON \
    -DTPFUSE_TORCH=OFF -DTPFUSE_BUILD_TESTS=OFF ${nccl_root:+-DNCCL_ROOT=$nccl_root} \
    >"$OUT/ab-build.log" 2>&1 &&
    cmake --build build/ab-base -j 16 --target tpfuse-bench >>"$OUT/ab-build.log" 2>&1 ||
    { echo "AB BASE BUILD FAILED"; tail -20 "$OUT/ab-build.log"; return 1; }
}
# Timed steps wait for a base build still running, so that it shares no cores with them.
wait_ab_base() {
  if [ -n "${ab_build_pid:-}" ]; then
    wait "$ab_build_pid" || { status=1; ab_build_failed=1; }
    ab_build_pid=
  fi
}

if [[ " $STEPS " == *" build "* ]]; then
  step build
  cmake --preset gpu ${nccl_root:+-DNCCL_ROOT=$nccl_root} >"$OUT/build.log" 2>&1 &&
    cmake --build --preset gpu -j 16 ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$OUT/build.log" 2>&1
  rc=$?
  grep -E "error|tpfuse:" "$OUT/build.log" | head -20
  # What the torch ops library takes from the process and what it exports of libstdc++ (none:
  # CMakeLists.txt says why).
  library=$BUILD/python/libtpfuse_torch.so
  if [ -f "$library" ]; then
    echo "libtpfuse_torch.so needs: $(readelf -d "$library" | grep -o 'Shared library: \[[^]]*' |
      sed 's/.*\[//' | tr '\n' ' ')"
    echo "libtpfuse_torch.so exports $(nm -DC --defined-only "$library" | grep -cE 'std::(basic_ostream|basic_ios|ios_base|locale|num_put|codecvt)') libstdc++ stream symbols"
  fi
  [ $rc -eq 0 ] || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
  if [[ " $STEPS " == *" ab "* ]]; then
    AB_BASE=${AB_BASE:?ab needs AB_BASE, a source tree to compare with}
    build_ab_base &
    ab_build_pid=$!
  fi
fi

if [[ " $STEPS " == *" test "* ]]; then
  step test
  # Faults across processes on one GPU (tests/gpu/test_multiprocess_one_gpu.cc) run apart, their
  # whole log kept under $OUT: what each rank's error said is the record of each fault.
  one_gpu=0
  if [ "${TEST_LABEL:-gpu}" = gpu ] && [ -x "$BUILD/tests/test_multiprocess_one_gpu" ] &&
     { [ -z "${TEST_REGEX:-}" ] || echo OneGpuProcesses | grep -qE "$TEST_REGEX"; }; then
    one_gpu=1
  fi
  ctest --test-dir "$BUILD" -L "${TEST_LABEL:-gpu}" ${TEST_REGEX:+-R "$TEST_REGEX"} \
    $([ $one_gpu = 1 ] && echo "-E OneGpuProcesses") --output-on-failure -j 1 --timeout 150 >"$OUT/ctest.log" 2>&1 || status=1
  tail -15 "$OUT/ctest.log"
  grep -E "Failed|\*\*\*" "$OUT/ctest.log" | head -20
  if [ -n "${PAIR:-}" ]; then
    # The faults on every path across GPUs (the NCCL path's call headers: a rejected call's turn,
    # disagreements, NaN outputs), whole log kept.
    timeout 600 "$BUILD/tests/test_oneshot_gpu" \
      --gtest_filter='GpuOneShot.MisuseOnEveryPath*:GpuOneShot.MissingPeer*:GpuOneShot.TeamWithoutPeerStoresUsesNccl:Forced/GpuAlgorithms.*' \
      >"$OUT/pair-faults.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|good, .* rejected" "$OUT/pair-faults.log" | tail -20
  fi
  if [ $one_gpu = 1 ]; then
    timeout 900 "$BUILD/tests/test_multiprocess_one_gpu" >"$OUT/multiprocess_one_gpu.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[       OK|^\[  FAILED" "$OUT/multiprocess_one_gpu.log" | tail -20
  fi
fi

if [[ " $STEPS " == *" sanitize "* ]]; then
  step sanitize
  oneshot_filter='GpuOneShot.RepeatedCallsGiveIdenticalBits:GpuOneShot.AdversarialPayloads:GpuOneShot.TwoShotGivesOneShotBitsWhateverTheBatch:Forced/GpuAlgorithms.RepeatedCallsGiveIdenticalBits/*:GpuLocalAddRmsNorm.*:GpuOneRankTeam.Fp8OutputsMatchTheirDefinition'
  qk_filter='GpuQkNorm.IdenticalSlicesGiveIdenticalBitsOnEveryRank:GpuQkNorm.ZerosNaNAndInfinities:GpuQkNorm.LocalHalvesGiveTheFusedBits:GpuQkNorm.MiniMaxShapesManyTokens'
  # Several ranks on one GPU: the multi-rank kernels where one GPU is all there is, and the
  # error records (a rejected peer, a bad QK position: the GPU's writes to host-mapped memory).
  shared_filter='Ranks/SharedDevice.RepeatedCallsGiveIdenticalBits/0:Ranks/SharedDevice.QkNormHalvesGiveTheFusedBits/0:Ranks/SharedDevice.AdversarialPayloads/0:Ranks/SharedDevice.MisuseReportedWhereItBelongsAndTheNextCallCorrect/0:Ranks/SharedDevice.QkPositionOutsideTheCacheGivesNaNAndIsReported/0:Ranks/SharedDevice.Fp8OutputsMatchTheirDefinition/0'
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    for test in ${SANITIZE_TESTS:-oneshot qknorm}; do
      filter=$oneshot_filter
      [ $test = qknorm ] && filter=$qk_filter
      [ $test = shared_device ] && filter=$shared_filter
      [ $test = nccl_headers ] && filter='*'
      filter=${SANITIZE_FILTER:-$filter}
      # One log for all runs: the device tool returns at most 8 files.
      log="$OUT/sanitizer.log"
      echo "=== compute-sanitizer --tool $tool test_${test}_gpu" >>"$log"
      # API errors are not kernel errors: NCCL's initialization probes kernels of other
      # architectures and the teams tolerate peer access already being enabled.
      timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 \
        "$BUILD/tests/test_${test}_gpu" --gtest_filter="$filter" >"$OUT/sanitizer-run.log" 2>&1
      rc=$?
      cat "$OUT/sanitizer-run.log" >>"$log"
      rm -f "$OUT/sanitizer-run.log"
      echo "compute-sanitizer $tool $test: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
      [ $rc -eq 0 ] || status=1
    done
  done
fi

if [[ " $STEPS " == *" bench "* ]]; then
  step bench
  wait_ab_base
  # tpfuse-bench never overwrites: a bench.json already in $OUT makes it write bench-1.json, ...;
  # the file it wrote is the one its last line names.
  TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} "$BUILD/bench/tpfuse-bench" --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || status=1
  bench_json=$(sed -n 's/^wrote [0-9]* records to //p' "$OUT/bench.log" | tail -1)
  bench_json=${bench_json:-$OUT/bench.json}
  python3 bench/plot_results.py "$bench_json" >/dev/null 2>&1 || echo "plot failed"
  # The selection table with this machine's measured rows merged in (a new GPU or world size:
  # commit it as data/algorithms.csv with the results, and fix the note's file name to theirs,
  # or rerun bench/selection_table.py with --source). Its warnings (a run that measured less far
  # than the rows it replaces) are printed here as well as logged.
  python3 bench/selection_table.py "$bench_json" --merge data/algorithms.csv \
    >"$OUT/algorithms.csv" 2>"$OUT/selection.log" || echo "selection table failed"
  tee -a "$OUT/bench.log" <"$OUT/selection.log"
  rm -f "$OUT/selection.log"
fi
if [[ " $STEPS " == *" peers "* ]]; then
  step peers
  wait_ab_base
  # The peers in the same run (bench/peers.py): FlashInfer's fused kernels, torch's symmetric
  # memory + tpfuse's local kernel, tpfuse from torch, and the local kernels on GPU 0; its
  # records join the bench step's results file (a file of their own without one). FlashInfer
  # comes from the bundle scripts/prepare-flashinfer.sh makes (.peers, carried); without it the
  # run says so and leaves its impls out.
  [ -f .peers/env.sh ] && source .peers/env.sh
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
  export TPFUSE_TORCH_LIBRARY=$PWD/$BUILD/python/libtpfuse_torch.so
  if [ -n "${bench_json:-}" ] && [ -f "$bench_json" ]; then
    peers_out=(--results "$bench_json")
  else
    peers_out=(--out "$OUT/peers.json")
  fi
  TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} timeout ${PEERS_TIMEOUT:-400} \
    python3 bench/peers.py "${peers_out[@]}" ${PEERS_ARGS:-} >"$OUT/peers.txt" 2>"$OUT/peers.log" || status=1
  grep -E "^peers.py|Error" "$OUT/peers.log" | head -10
  cat "$OUT/peers.txt"
  plotted=${bench_json:-$OUT/peers.json}
  [ -f "$plotted" ] && { python3 bench/plot_results.py "$plotted" >/dev/null 2>&1 || echo "plot failed"; }
fi
if [[ " $STEPS " == *" experiments "* ]]; then
  step experiments
  wait_ab_base
  # Timing experiments: tpfuse-bench once per entry of EXPERIMENTS, each an environment setting
  # the library reads (e.g. "TPFUSE_DISABLE_PDL=1"; "base" for none), same binary, back to
  # back, EXPERIMENT_ARGS narrowing the run; logs and JSON per entry in experiments.tgz.
  mkdir -p "$OUT/experiments"
  for setting in ${EXPERIMENTS:-base}; do
    name=${setting//=/-}
    name=${name//,/_}
    assignment=()
    # An entry may set several variables, comma-separated (A=1,B=2).
    [ "$setting" = base ] || IFS=, read -ra assignment <<<"$setting"
    env "${assignment[@]}" TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} \
      "$BUILD/bench/tpfuse-bench" --out "$OUT/experiments/$name.json" ${EXPERIMENT_ARGS:-} \
      >"$OUT/experiments/$name.log" 2>&1 || status=1
    echo "$setting:"
    grep -E "^(qk norm|hidden)" "$OUT/experiments/$name.log" | sed 's/^/  /'
  done
  (cd "$OUT" && tar czf experiments.tgz --remove-files experiments)
fi
if [[ " $STEPS " == *" ab "* ]]; then
  step ab
  # Same-machine A/B of this tree against AB_BASE (build_ab_base above): the two tpfuse-bench
  # run alternately AB_ROUNDS times with AB_ARGS; scripts/ab_compare.py prints each op's median
  # over the rounds and the ratio.
  AB_BASE=${AB_BASE:?ab needs AB_BASE, a source tree to compare with}
  if [ -n "${ab_build_pid:-}" ]; then
    wait_ab_base
  elif [ -z "${ab_build_failed:-}" ]; then
    build_ab_base || status=1
  fi
  # AB_SETS: several configurations, ';'-separated, each an A/B of its own with AB_ARGS (e.g.
  # AB_SETS="--world 1;--shared-device --world 2;--shared-device --world 4"): ab-compare-N.txt.
  IFS=';' read -r -a ab_sets <<<"${AB_SETS:-}"
  [ ${#ab_sets[@]} -eq 0 ] && ab_sets=("")
  for set_index in "${!ab_sets[@]}"; do
    ab_dir="$OUT/ab/set$set_index"
    mkdir -p "$ab_dir"
    echo "A/B set $set_index: ${AB_ARGS:-} ${ab_sets[$set_index]}" | tee "$ab_dir/args.txt"
    # The order alternates by round (base new, new base, ...): the side run second in every round
    # measured ~0.5% slower on unchanged kernels
    # (cdd3d3d:bench/studies/h200-20261204-d5e887c-slot-clear, docs/notebook.md).
    for round in $(seq 1 ${AB_ROUNDS:-2}); do
      order="base new"
      [ $((round % 2)) -eq 0 ] && order="new base"
      for side in $order; do
        binary=$BUILD/bench/tpfuse-bench
        [ $side = base ] && binary=build/ab-base/bench/tpfuse-bench
        # shellcheck disable=SC2086  # the arguments are lists
        TPFUSE_BENCH_COMMIT=$side "$binary" --out "$ab_dir/$side-$round.json" ${AB_ARGS:-} \
          ${ab_sets[$set_index]} >"$ab_dir/$side-$round.log" 2>&1 || status=1
      done
    done
    compare="$OUT/ab-compare.txt"
    [ ${#ab_sets[@]} -gt 1 ] && compare="$OUT/ab-compare-$set_index.txt"
    {
      cat "$ab_dir/args.txt"
      python3 scripts/ab_compare.py --base "$ab_dir"/base-*.json --new "$ab_dir"/new-*.json
    } | tee "$compare"
  done
  (cd "$OUT" && tar czf ab.tgz --remove-files ab)
fi
if [[ " $STEPS " == *" profile "* ]]; then
  step profile
  wait_ab_base
  # Nsight Compute on the QK-norm kernels of a one-GPU run (a team of one: no peer, so ncu's
  # kernel replay cannot stall on another GPU), with and without RoPE: duration, issue rate and
  # the dominant stall (the CLI prints no per-reason table: for that, export a report with
  # --export and open it in Nsight Compute). Clocks are left alone (--clock-control none).
  # PROFILE_KERNEL (a regex; default the QK kernel) and PROFILE_HIDDEN pick another kernel, e.g.
  # PROFILE_KERNEL=local_epilogue_kernel PROFILE_HIDDEN=3072 PROFILE_TOKENS=512.
  # PROFILE_NCU_ARGS replaces the sections (e.g. "--page raw --metrics regex:..." for the stall
  # reasons as numbers).
  kernel=${PROFILE_KERNEL:-qk_rmsnorm_kernel}
  ncu_args=${PROFILE_NCU_ARGS:-"--section LaunchStats --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy"}
  # PROFILE_SKIP skips that many matching launches first: the QK sweep runs the one-rank shape
  # before MiniMax-M2's TP-2 slice, every token count in order.
  # shellcheck disable=SC2086  # ncu_args is a list of arguments
  timeout 240 ncu --clock-control none --kernel-name "regex:$kernel" \
    --launch-skip ${PROFILE_SKIP:-0} --launch-count ${PROFILE_LAUNCHES:-12} $ncu_args \
    "$BUILD/bench/tpfuse-bench" --world 1 --backend cuda --hidden ${PROFILE_HIDDEN:-6144} \
    --tokens ${PROFILE_TOKENS:-1,2} --ops-per-graph 1 --replays 1 --out "$OUT/profile-bench.json" \
    >"$OUT/ncu-profile.txt" 2>&1
  echo "ncu: exit $? ($(grep -c "$kernel" "$OUT/ncu-profile.txt") kernel lines)"
  rm -f "$OUT/profile-bench.json"
fi
if [[ " $STEPS " == *" python "* ]]; then
  step python
  export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/$BUILD/python/libtpfuse_torch.so
  # One module per interpreter, with faulthandler: a crash names its test and its stack.
  # PYTHON_TESTS narrows the modules (CI runs the CPU ones on every commit).
  for name in ${PYTHON_TESTS:-$(cd tests/python && ls test_*.py | sed 's/\.py$//')}; do
    (cd tests/python && timeout 400 python3 -X faulthandler -m unittest -v "$name") \
      >>"$OUT/python.log" 2>&1
    rc=$?
    echo "python $name: exit $rc"
    [ $rc -eq 0 ] || status=1
    # A crash (signal) gets a native backtrace: the module again under a debugger (the GPU
    # image has cuda-gdb, which debugs host code too, and no gdb).
    debugger=$(command -v gdb || command -v cuda-gdb)
    if [ $rc -gt 128 ] && [ $rc -ne 137 ] && [ -n "$debugger" ]; then
      (cd tests/python && timeout 180 "$debugger" -q -batch -ex "set pagination off" -ex run \
        -ex "bt 40" --args python3 -m unittest "$name") >>"$OUT/python-backtrace.log" 2>&1
      echo "python $name: backtrace in python-backtrace.log"
      grep -E "^#[0-9]+ " "$OUT/python-backtrace.log" | head -25
    fi
  done
  # The torch-side benchmarks (PYTHON_BENCHES=0 leaves them out: a tests-only call). Both need
  # two GPUs: with fewer the step says so instead of counting their refusal as a failure.
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "${PYTHON_BENCHES:-1}" = 1 ] && [ "$gpus" -lt 2 ]; then
    echo "python benches (torch_host_overhead, torch_qk_baseline): need two GPUs, found $gpus: left out"
  elif [ "${PYTHON_BENCHES:-1}" = 1 ]; then
    timeout 200 python3 bench/torch_host_overhead.py --out "$OUT/host_overhead.json" 2>&1 |
      tee -a "$OUT/python.log" || status=1
    # The QK norm from torch: the torch-eager unfused pattern against the fused op.
    timeout 200 python3 bench/torch_qk_baseline.py --out "$OUT/torch_qk.json" 2>&1 |
      tee -a "$OUT/python.log" || status=1
  fi
fi
if [[ " $STEPS " == *" e2e "* ]]; then
  step e2e
  wait_ab_base
  # The end-to-end decode benchmark (bench/e2e/decode.py), one process per GPU; E2E_ARGS narrows
  # it (batches, contexts, layer counts, modes) to fit a call.
  export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/$BUILD/python/libtpfuse_torch.so
  TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} timeout ${E2E_TIMEOUT:-400} \
    python3 bench/e2e/decode.py --out "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" |
    grep -v -i warn | tail -45 || status=1
  # decode.py never overwrites either: the file is the one its "wrote" line names.
  e2e_json=$(sed -n 's/^wrote //p' "$OUT/e2e.log" | tail -1)
  python3 bench/e2e/plot.py "${e2e_json:-$OUT/e2e.json}" >/dev/null 2>&1 || echo "e2e plot failed"
fi
if [[ " $STEPS " == *" transformers "* ]]; then
  step transformers
  wait_ab_base
  # transformers' Llama, Qwen3 and MiniMax-M2 under their own tensor-parallel plans, one process
  # per GPU: the decode step eager, compiled, and compiled with tpfuse's passes (every site of
  # the decode graph must be rewritten). TRANSFORMERS_ARGS narrows it (models, batches, shapes).
  export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/$BUILD/python/libtpfuse_torch.so
  TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} timeout ${TRANSFORMERS_TIMEOUT:-540} \
    python3 bench/e2e/transformers_decode.py --out "$OUT/transformers.json" ${TRANSFORMERS_ARGS:-} \
    2>&1 | tee "$OUT/transformers.log" | grep -v -i warn | tail -30 || status=1
fi
if [[ " $STEPS " == *" cpu "* ]]; then
  step cpu
  wait_ab_base
  # The CPU backend across processes on this host's cores (bench/cpu_processes.py: tpfuse's
  # shared-memory team against gloo's all-reduce + the local add + RMSNorm; CPU_ARGS narrows it),
  # and tpfuse-bench --processes in CPU mode.
  export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/$BUILD/python/libtpfuse_torch.so
  TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} timeout ${CPU_TIMEOUT:-300} \
    python3 bench/cpu_processes.py --world 2,4,8 --out "$OUT/cpu-processes.json" ${CPU_ARGS:-} \
    2>&1 | tee "$OUT/cpu-processes.log" | grep -v -i warn | tail -40 || status=1
  # CPU_BENCH=0 leaves tpfuse-bench's CPU run out (a call that needs only the comparison).
  if [ "${CPU_BENCH:-1}" = 1 ]; then
    TPFUSE_BENCH_COMMIT=${TPFUSE_BENCH_COMMIT:-unknown} timeout 200 "$BUILD/bench/tpfuse-bench" \
      --backend cpu --processes --world 4 --hidden 3072,7168 --out "$OUT/cpu-bench-x4.json" \
      >"$OUT/cpu-bench.log" 2>&1 || status=1
  fi
fi
# The device tool returns at most 8 files: the logs travel as one archive.
(cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null)
step "done" "status $status"
exit $status
