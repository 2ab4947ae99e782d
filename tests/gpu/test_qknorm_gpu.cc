// allreduce_qk_rmsnorm on real GPUs (in-process team over every visible GPU, at least 2): the
// shared QK-norm properties, MiniMax-M2 shapes, and CUDA-graph replay on fresh inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda_harness.h"
#include "qknorm_properties.h"

namespace tpfuse::testing {
namespace {

class GpuQkNorm : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  }
};

TEST_F(GpuQkNorm, MatchesFloat64ReferenceOfTheUnfusedPattern) {
  CudaHarness harness(gpus());
  check_qk_random_cases(harness, 500, 80);
}

TEST_F(GpuQkNorm, IdenticalSlicesGiveIdenticalBitsOnEveryRank) {
  CudaHarness harness(gpus());
  check_qk_identical_across_ranks(harness, 501);
}

TEST_F(GpuQkNorm, ZerosNaNAndInfinities) {
  CudaHarness harness(gpus());
  check_qk_adversarial(harness, 502);
}

TEST_F(GpuQkNorm, MiniMaxShapesManyTokens) {
  CudaHarness harness(gpus());
  std::mt19937_64 rng(503);
  for (int64_t tokens : {1, 64, 2048}) {
    for (RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      QkSpec s;
      s.heads = 48 / harness.world_size();
      s.kv_heads = std::max(1, 8 / harness.world_size());
      s.rope = rope;
      s.tokens = tokens;
      const QkData d = random_qk_data(rng, s, harness.world_size());
      expect_qk_correct(s, d, run_qk(harness, s, d), harness.world_size());
    }
  }
}

}  // namespace
}  // namespace tpfuse::testing
