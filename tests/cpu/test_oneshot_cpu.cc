// The one-shot protocol and epilogues on the CPU backend: ranks are threads, so the protocol's
// concurrency (slot rotation, drift between ranks, clearing) is exercised for real.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <tuple>

#include "oneshot_properties.h"

namespace tpfuse::testing {
namespace {

// Each property at each world size, for each algorithm forced (the NCCL path's CPU stand-in
// included).
class CpuAlgorithms : public ::testing::TestWithParam<std::tuple<int, Algorithm>> {
 protected:
  CpuAlgorithms() : harness_(std::get<0>(GetParam())) {
    harness_.algorithm = std::get<1>(GetParam());
  }
  uint64_t seed(uint64_t base) const {
    return base + 100 * uint64_t(std::get<1>(GetParam())) + uint64_t(std::get<0>(GetParam()));
  }
  CpuHarness harness_;
};

TEST_P(CpuAlgorithms, MatchesFloat64ReferenceOnRandomCases) {
  check_random_cases(harness_, seed(1000), 40, 37);
}

TEST_P(CpuAlgorithms, RepeatedCallsGiveIdenticalBits) {
  check_repeatable(harness_, seed(2000));
}

TEST_P(CpuAlgorithms, AdversarialPayloads) {
  check_adversarial(harness_, seed(3000));
}

TEST_P(CpuAlgorithms, OnePlusGammaWeight) {
  check_one_plus_gamma(harness_, seed(3500), 12, 37);
}

TEST_P(CpuAlgorithms, Fp8OutputsMatchTheirDefinition) {
  check_fp8_outputs(harness_, seed(3700), 9);
}

TEST_P(CpuAlgorithms, Fp8PowerOfTwoScalesAtTheirEdges) {
  check_fp8_power_of_two_scales(harness_, seed(3750));
}

TEST_P(CpuAlgorithms, MoeFinalizeMatchesItsDefinition) {
  check_moe_finalize(harness_, seed(3800), 6);
}

TEST_P(CpuAlgorithms, Fp8AndMoeCallsReplayedOnFreshInputs) {
  check_graph_replays(harness_, seed(3900));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuAlgorithms,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(Algorithm::kOneShot,
                                                              Algorithm::kTwoShot,
                                                              Algorithm::kNccl)),
                         [](const auto& info) {
                           return std::string(algorithm_name(std::get<1>(info.param))) + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

class CpuOneShot : public ::testing::TestWithParam<int> {};

// One-shot and two-shot alternating at random from call to call (they share the slots).
TEST_P(CpuOneShot, ThousandsOfConsecutiveCalls) {
  CpuHarness harness(GetParam());
  check_consecutive_calls(harness, 4000 + GetParam(), 3000, 16, 64);
}

TEST_P(CpuOneShot, TwoShotGivesOneShotBitsWhateverTheBatch) {
  CpuHarness harness(GetParam());
  check_batch_invariance(harness, 5000 + GetParam());
}

TEST_P(CpuOneShot, OnePlusGammaWeightSameBitsOnEveryAlgorithm) {
  CpuHarness harness(GetParam());
  check_one_plus_gamma(harness, 5500 + GetParam(), 4, 37);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuOneShot, ::testing::Values(1, 2, 3, 4, 5, 8),
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
  spec.algorithm = Algorithm::kOneShot;
  const CaseData over = random_case(rng, spec, 2);
  try {
    runner.run(spec, over);
    FAIL() << "a message one token over the workspace was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("tokens 11"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("at most 10 tokens"), std::string::npos)
        << error.what();
  }
  // Not forced, the same call runs another algorithm that carries it.
  spec.algorithm = Algorithm::kAuto;
  const CaseResult auto_result = runner.run(spec, over);
  EXPECT_NE(auto_result.algorithm, Algorithm::kOneShot);
  expect_correct(spec, over, auto_result);
  // The rejected call used no slot: the team still works.
  spec.algorithm = Algorithm::kOneShot;
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
  // Rank 0 announced the failure: its peers' check and calls say so at once, naming it, and a
  // late peer's call is refused instead of meeting rank 0's abandoned packets.
  for (int r : {1, 2}) {
    try {
      team[r].check();
      ADD_FAILURE() << "rank " << r << "'s check did not report rank 0's failure";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("rank 0 failed the team"), std::string::npos)
          << error.what();
    }
  }
  std::vector<uint16_t> poison(64, 0x5a5a);
  out = poison;
  EXPECT_THROW(allreduce(team[1], input.data(), out.data(), 64, DType::kBFloat16), Error);
  EXPECT_EQ(out, poison) << "a refused call wrote its output";
  // A failed team refuses further calls instead of corrupting them.
  EXPECT_THROW(allreduce(team[0], input.data(), out.data(), 64, DType::kBFloat16), Error);
}

// Which bits each algorithm keeps where the residual cancels the sum (README, Limits): one-shot
// and two-shot round sum + residual once, the NCCL path rounds the sum first. In bf16, 1 + 2^-8
// is halfway between 1 and 1 + 2^-7 and rounds to 1, so with residual -1 the fused paths give
// 2^-8 and the NCCL path 0 in every element: the whole value, not a last bit.
TEST(CpuRounding, TheNcclPathRoundsTheSumBeforeTheResidualAndTheFusedPathsDoNot) {
  constexpr int64_t kHidden = 64;
  std::vector<Team> team = create_cpu_team(2);
  HostTensor gamma(DType::kBFloat16, kHidden), residual(DType::kBFloat16, kHidden);
  std::vector<HostTensor> inputs(2, HostTensor(DType::kBFloat16, kHidden));
  for (size_t i = 0; i < size_t(kHidden); ++i) {
    gamma.set(i, 1.0);
    residual.set(i, -1.0);
    inputs[0].set(i, 1.0);
    inputs[1].set(i, 0.00390625);  // 2^-8
  }
  for (Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl}) {
    std::vector<HostTensor> residual_out(2, poisoned(DType::kBFloat16, kHidden));
    std::vector<HostTensor> norm_out(2, poisoned(DType::kBFloat16, kHidden));
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        AddRmsNormArgs args;
        args.input = inputs[rank].data();
        args.residual = residual.data();
        args.gamma = gamma.data();
        args.residual_out = residual_out[rank].data();
        args.norm_out = norm_out[rank].data();
        args.tokens = 1;
        args.hidden = kHidden;
        args.dtype = DType::kBFloat16;
        args.eps = 1e-6f;
        args.algorithm = algorithm;
        EXPECT_EQ(allreduce_add_rmsnorm(team[rank], args), algorithm);
      });
    }
    for (std::thread& rank : ranks) rank.join();
    const double expected = algorithm == Algorithm::kNccl ? 0.0 : 0.00390625;
    for (int rank = 0; rank < 2; ++rank) {
      for (size_t i = 0; i < size_t(kHidden); ++i) {
        ASSERT_EQ(residual_out[rank].get(i), expected)
            << algorithm_name(algorithm) << ", rank " << rank << ", element " << i;
      }
      EXPECT_EQ(residual_out[rank].bytes, residual_out[0].bytes);
      EXPECT_EQ(norm_out[rank].bytes, norm_out[0].bytes);
    }
    // The norm of a row of zeros is zero; of a constant row x, 1 / sqrt(1 + eps / x^2), in bf16.
    const double x = expected;
    EXPECT_NEAR(norm_out[0].get(0), x == 0.0 ? 0.0 : 1.0 / std::sqrt(1.0 + 1e-6 / (x * x)),
                1.0 / 256)
        << algorithm_name(algorithm);
  }
}

TEST(CpuOneRankTeam, EveryAlgorithmGivesTheLocalEpiloguesBits) {
  CpuHarness harness(1);
  check_one_rank_team_is_local(harness, 6100);
}

TEST(CpuLocalAddRmsNorm, MatchesFloat64Reference) {
  std::mt19937_64 rng(6);
  for (DType dtype : kDTypes) {
    for (int64_t hidden : {8, 136, 3072, 16384}) {
      for (NormWeight weight : {NormWeight::kGamma, NormWeight::kOnePlusGamma}) {
        CaseSpec spec;
        spec.dtype = dtype;
        spec.hidden = hidden;
        spec.tokens = 3;
        spec.norm_weight = weight;
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
        args.norm_weight = weight;
        add_rmsnorm(Backend::kCpu, args);
        expect_correct(spec, data, result);
      }
    }
  }
}

}  // namespace
}  // namespace tpfuse::testing
