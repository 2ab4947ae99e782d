// Faults at random (issue 40) on the CPU backend: long seeded sequences of valid calls, rejected
// calls, calls that disagree, late peers past a short timeout, teams without peer stores and
// tiny packets, on CPU teams of threads (world 2-8) and of forked processes (world 2-4). The
// generator, the runner, the verifier (the rules every call must follow), the shrinker and the
// environment variables that re-run one sequence are shared with the GPU's run
// (tests/gpu/test_fault_random_gpu.cc) and described in tests/common/fault_random.h. The reference
// here is the CPU's local ops, bit for bit.
#include "fault_random.h"

namespace tpfuse::testing::fault_random {
namespace {

TEST(FaultRandom, ThreadTeams) {
  const FaultBackend threads{"threads", run_threads, cpu_reference};
  run_faults(threads,
             {2, 8, 7000, "FaultRandom.ThreadTeams", "build/dev/tests/test_fault_random", Limits{}},
             4000000);
}

TEST(FaultRandom, ProcessTeams) {
  const FaultBackend processes{"processes", [](const Sequence& s) { return run_processes(s); },
                               cpu_reference};
  run_faults(
      processes,
      {2, 4, 3000, "FaultRandom.ProcessTeams", "build/dev/tests/test_fault_random", Limits{}},
      5000000);
}

}  // namespace
}  // namespace tpfuse::testing::fault_random
