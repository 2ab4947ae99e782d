// The multi-rank kernels on one GPU: every rank of a team on the same device (a team only tests
// make), so the world-size-2 and -4 kernels, their sends, polls and slot rotation, run where one
// GPU is all there is. All ranks' grids must be resident together, so token counts stay small
// (kBlocksOnDevice in all); peers reach each other through L2 instead of NVLink.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "cuda_harness.h"
#include "misuse_properties.h"
#include "oneshot_properties.h"
#include "qknorm_properties.h"
#include "team/teams.h"

namespace tpfuse::testing {
namespace {

// Blocks of all ranks together: one per SM of the smallest GPU this runs on, so that they are
// resident at once at any occupancy.
constexpr int64_t kBlocksOnDevice = 128;

class SharedDevice : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
    int multiprocessors = 0;
    cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, 0);
    if (multiprocessors < kBlocksOnDevice) GTEST_SKIP() << "needs " << kBlocksOnDevice << " SMs";
    const std::vector<int> devices(GetParam(), 0);
    harness_ = std::make_unique<CudaHarness>(
        impl::create_in_process_cuda_team(devices, TeamOptions{}, /*shared_devices=*/true),
        devices);
    ASSERT_EQ(harness_->team()[0].fallback_reason(), "");
  }
  int64_t max_tokens() const { return kBlocksOnDevice / GetParam(); }
  uint64_t seed(uint64_t base) const { return base + uint64_t(GetParam()); }
  std::unique_ptr<CudaHarness> harness_;
};

TEST_P(SharedDevice, MatchesFloat64ReferenceOnRandomCases) {
  check_random_cases(*harness_, seed(900), 60, max_tokens());
}

TEST_P(SharedDevice, TwoShotMatchesFloat64ReferenceOnRandomCases) {
  harness_->algorithm = Algorithm::kTwoShot;
  check_random_cases(*harness_, seed(910), 40, max_tokens());
}

TEST_P(SharedDevice, RepeatedCallsGiveIdenticalBits) {
  check_repeatable(*harness_, seed(920));
}

TEST_P(SharedDevice, AdversarialPayloads) {
  check_adversarial(*harness_, seed(930));
}

TEST_P(SharedDevice, BackToBackCallsUnderPdlWithAlternatingScales) {
  check_consecutive_calls(*harness_, seed(940), 1500, 16, max_tokens());
}

TEST_P(SharedDevice, TwoShotGivesOneShotBitsWhateverTheBatch) {
  check_batch_invariance(*harness_, seed(950));
}

TEST_P(SharedDevice, OnePlusGammaWeight) {
  check_one_plus_gamma(*harness_, seed(960), 20, max_tokens());
}

TEST_P(SharedDevice, QkNormMatchesFloat64Reference) {
  check_qk_random_cases(*harness_, seed(970), 40);
}

TEST_P(SharedDevice, QkNormIdenticalBitsOnEveryRankAndAdversarialValues) {
  check_qk_identical_across_ranks(*harness_, seed(980));
  check_qk_adversarial(*harness_, seed(990));
}

TEST_P(SharedDevice, QkNormHalvesGiveTheFusedBits) {
  check_qk_halves_match_fused(*harness_, seed(1000));
}

// Rejected and disagreeing calls at random (tests/common/misuse_properties.h): the kernels' header
// checks, the absent call's drain, the NaN outputs and the error records, on the GPU.
TEST_P(SharedDevice, MisuseReportedWhereItBelongsAndTheNextCallCorrect) {
  const std::vector<int> devices(GetParam(), 0);
  TeamOptions options;
  options.peer_timeout_seconds = 5.0;
  harness_->team() = impl::create_in_process_cuda_team(devices, options, true);
  const MisuseCounts counts =
      check_misuse(*harness_, seed(1010), 300, std::min<int64_t>(8, max_tokens()), [&] {
        return impl::create_in_process_cuda_team(devices, options, /*shared_devices=*/true);
      });
  EXPECT_GT(counts.rejected, 10);
  EXPECT_GT(counts.disagreeing, 10);
  std::printf("%d ranks: %d good, %d rejected, %d disagreeing calls\n", GetParam(), counts.good,
              counts.rejected, counts.disagreeing);
}

INSTANTIATE_TEST_SUITE_P(Ranks, SharedDevice, ::testing::Values(2, 4));

}  // namespace
}  // namespace tpfuse::testing
