// The one-shot protocol and epilogues on the CPU backend: ranks are threads, so the protocol's
// concurrency (slot rotation, drift between ranks, clearing) is exercised for real.
#include <gtest/gtest.h>

#include <chrono>

#include "oneshot_properties.h"

namespace tpfuse::testing {
namespace {

class CpuOneShot : public ::testing::TestWithParam<int> {};

TEST_P(CpuOneShot, MatchesFloat64ReferenceOnRandomCases) {
  CpuHarness harness(GetParam());
  check_random_cases(harness, 1000 + GetParam(), 60, 37);
}

TEST_P(CpuOneShot, RepeatedCallsGiveIdenticalBits) {
  CpuHarness harness(GetParam());
  check_repeatable(harness, 2000 + GetParam());
}

TEST_P(CpuOneShot, AdversarialPayloads) {
  CpuHarness harness(GetParam());
  check_adversarial(harness, 3000 + GetParam());
}

TEST_P(CpuOneShot, ThousandsOfConsecutiveCalls) {
  CpuHarness harness(GetParam());
  check_consecutive_calls(harness, 4000 + GetParam(), 3000, 16, 64);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuOneShot, ::testing::Values(2, 3, 4, 5, 8),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(CpuOneShotLimits, LargestMessageTheWorkspaceHoldsAndOneTokenMore) {
  TeamOptions options;
  options.packet_bytes = 64 * 1024;
  CpuHarness harness(2, options);
  const int64_t max_tokens = harness.team()[0].max_tokens(3072, DType::kBFloat16);
  ASSERT_EQ(max_tokens, 10);
  std::mt19937_64 rng(5);
  OneShotRunner runner(harness);
  CaseSpec spec;
  spec.tokens = max_tokens;
  const CaseData data = random_case(rng, spec, 2);
  expect_correct(spec, data, runner.run(spec, data));
  spec.tokens = max_tokens + 1;
  const CaseData over = random_case(rng, spec, 2);
  try {
    runner.run(spec, over);
    FAIL() << "a message one token over the workspace was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("tokens 11"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("at most 10 tokens"), std::string::npos)
        << error.what();
  }
  // The rejected call used no slot: the team still works.
  spec.tokens = 3;
  const CaseData after = random_case(rng, spec, 2);
  expect_correct(spec, after, runner.run(spec, after));
}

TEST(CpuOneShotLimits, MissingPeerIsReportedNotWaitedFor) {
  TeamOptions options;
  options.peer_timeout_seconds = 0.2;
  std::vector<Team> team = create_cpu_team(3, options);
  std::vector<uint16_t> input(64, 0x3f80), out(64);
  const auto start = std::chrono::steady_clock::now();
  try {
    allreduce(team[0], input.data(), out.data(), 64, DType::kBFloat16);
    FAIL() << "rank 0 returned although ranks 1 and 2 never called";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("rank 1"), std::string::npos) << error.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_THROW(team[0].check(), Error);
  EXPECT_NO_THROW(team[1].check());
  // A failed team refuses further calls instead of corrupting them.
  EXPECT_THROW(allreduce(team[0], input.data(), out.data(), 64, DType::kBFloat16), Error);
}

TEST(CpuLocalAddRmsNorm, MatchesFloat64Reference) {
  std::mt19937_64 rng(6);
  for (DType dtype : kDTypes) {
    for (int64_t hidden : {8, 136, 3072, 16384}) {
      CaseSpec spec;
      spec.dtype = dtype;
      spec.hidden = hidden;
      spec.tokens = 3;
      const CaseData data = random_case(rng, spec, 1);
      CaseResult result;
      result.norm_out.push_back(poisoned(dtype, size_t(3 * hidden)));
      result.residual_out.push_back(poisoned(dtype, size_t(3 * hidden)));
      AddRmsNormArgs args;
      args.input = data.inputs[0].data();
      args.residual = data.residuals[0].data();
      args.gamma = data.gamma.data();
      args.residual_out = result.residual_out[0].data();
      args.norm_out = result.norm_out[0].data();
      args.tokens = spec.tokens;
      args.hidden = hidden;
      args.dtype = dtype;
      args.eps = spec.eps;
      add_rmsnorm(Backend::kCpu, args);
      expect_correct(spec, data, result);
    }
  }
}

}  // namespace
}  // namespace tpfuse::testing
