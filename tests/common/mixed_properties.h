// A property across the fused ops: a team's calls of allreduce_qk_rmsnorm and
// allreduce_add_rmsnorm, interleaved at random as a model's layers make them, share one slot
// rotation and one clearing scheme (each call clears what the call before it received, whatever
// op that was, and never a rank's own sender region), so each op must still match its
// float64 reference after any mix. Run by tests/cpu and tests/gpu.
#pragma once

#include <random>

#include "oneshot_properties.h"
#include "qknorm_properties.h"

namespace tpfuse::testing {

inline void check_ops_interleaved(Harness& harness, uint64_t seed, int calls) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  const int world = harness.world_size();
  for (int call = 0; call < calls; ++call) {
    if (rng() % 2 == 0) {
      QkSpec spec = random_qk_spec(rng, world);
      const QkData data = random_qk_data(rng, spec, world);
      expect_qk_correct(spec, data, run_qk(harness, spec, data), world);
    } else {
      CaseSpec spec = random_spec(rng, 64);
      if (rng() % 3 == 0) spec.algorithm = Algorithm::kTwoShot;  // both fused kernels in the mix
      const Algorithm algorithm =
          spec.algorithm == Algorithm::kAuto ? harness.algorithm : spec.algorithm;
      spec.tokens =
          std::min(spec.tokens, harness.team()[0].max_tokens(spec.hidden, spec.dtype, algorithm));
      const CaseData data = random_case(rng, spec, world);
      expect_correct(spec, data, runner.run(spec, data));
    }
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "after " << call << " interleaved calls (seed " << seed << ")";
      return;
    }
  }
}

}  // namespace tpfuse::testing
