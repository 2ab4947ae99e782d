// Misuse at random on the CPU backend (tests/common/misuse_properties.h): 1,500 calls at each
// world size from 2 to 8, one rank at a time rejecting its arguments or disagreeing with its
// peers, every error where it belongs and the next good call correct.
#include <gtest/gtest.h>

#include <string>

#include "misuse_properties.h"

namespace tpfuse::testing {
namespace {

TeamOptions misuse_options() {
  TeamOptions options;
  options.packet_bytes = 64 << 10;     // 16 tokens of the widest row (1032 fp32)
  options.peer_timeout_seconds = 5.0;  // a regression would time out, not hang CI
  return options;
}

class CpuMisuse : public ::testing::TestWithParam<int> {};

TEST_P(CpuMisuse, EveryFaultReportedWhereItBelongsAndTheNextCallCorrect) {
  const int world = GetParam();
  CpuHarness harness(world, misuse_options());
  const MisuseCounts counts = check_misuse(harness, 7000 + uint64_t(world), 1500, 8, [&] {
    return create_cpu_team(world, misuse_options());
  });
  // The draw is fixed by the seed; what it injected, so the test cannot pass vacuously.
  EXPECT_GT(counts.rejected, 100);
  EXPECT_GT(counts.disagreeing, 100);
  EXPECT_GT(counts.good, 1000);
  std::printf("world %d: %d good, %d rejected, %d disagreeing calls\n", world, counts.good,
              counts.rejected, counts.disagreeing);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuMisuse, ::testing::Values(2, 3, 4, 5, 6, 7, 8),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace tpfuse::testing
