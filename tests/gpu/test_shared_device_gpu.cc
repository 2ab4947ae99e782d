// The multi-rank kernels on one GPU: every rank of a team on the same device (a team only tests
// make), so the world-size-2 and -4 kernels, their sends, polls and slot rotation, run where one
// GPU is all there is. All ranks' grids must be resident together, so token counts stay small
// (kBlocksOnDevice in all); peers reach each other through L2 instead of NVLink.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/team/teams.h"
#include "cuda_harness.h"
#include "misuse_properties.h"
#include "oneshot_properties.h"
#include "qknorm_properties.h"

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
  // One allreduce_qk_rmsnorm call whose token 1 is outside the cache: its outputs are NaN on
  // every rank, the others are not, and Team::check reports it once.
  void check_bad_position_call(int world, const std::vector<QkNormArgs>& args,
                               const std::vector<void*>& q_out, int64_t tokens, int64_t q_size) {
    harness_->enqueue([&](int rank, Stream stream) {
      allreduce_qk_rmsnorm(harness_->team()[rank], args[rank], stream);
    });
    for (int r = 0; r < world; ++r) {
      try {
        harness_->team()[r].check();
        ADD_FAILURE() << "rank " << r << ": the bad position was not reported";
      } catch (const Error& error) {
        EXPECT_NE(
            std::string(error.what()).find("positions[1] = 9 is outside [0, max_position = 8)"),
            std::string::npos)
            << error.what();
      }
      EXPECT_NO_THROW(harness_->team()[r].check()) << "reported once";
      std::vector<uint16_t> q(tokens * q_size);
      harness_->download(r, q.data(), q_out[r], q.size() * 2);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < q_size; ++i) {
          const uint16_t bits = q[t * q_size + i];
          const bool nan = (bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0;
          EXPECT_EQ(nan, t == 1) << "rank " << r << " token " << t << " element " << i;
          if (nan != (t == 1)) return;
        }
      }
    }
  }
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

// Every FP8 mode, each fused algorithm forced (a team of ranks on one device has no NCCL path:
// its local kernel is GpuOneRankTeam's).
TEST_P(SharedDevice, Fp8OutputsMatchTheirDefinition) {
  for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    harness_->algorithm = algorithm;
    check_fp8_outputs(*harness_, seed(970) + uint64_t(algorithm), 12);
  }
}

TEST_P(SharedDevice, Fp8PowerOfTwoScalesAtTheirEdges) {
  for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    harness_->algorithm = algorithm;
    check_fp8_power_of_two_scales(*harness_, seed(972) + uint64_t(algorithm));
  }
}

// The MoE finalize, each fused algorithm forced: the kernels' combine gives the host's bits.
TEST_P(SharedDevice, MoeFinalizeMatchesItsDefinition) {
  for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    harness_->algorithm = algorithm;
    check_moe_finalize(*harness_, seed(975) + uint64_t(algorithm), 12);
  }
}

// The same captured in CUDA graphs (one a rank, launched together) and replayed on fresh inputs.
TEST_P(SharedDevice, Fp8AndMoeCallsReplayedFromCudaGraphs) {
  for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    harness_->algorithm = algorithm;
    check_graph_replays(*harness_, seed(980) + uint64_t(algorithm));
  }
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
  const MisuseCounts counts = check_misuse(
      *harness_, seed(1010), 300, std::min<int64_t>(8, max_tokens()),
      [&] { return impl::create_in_process_cuda_team(devices, options, /*shared_devices=*/true); });
  EXPECT_GT(counts.rejected, 10);
  EXPECT_GT(counts.disagreeing, 10);
  std::printf("%d ranks: %d good, %d rejected, %d disagreeing calls\n", GetParam(), counts.good,
              counts.rejected, counts.disagreeing);
}

// A position outside the cos/sin cache (which the host cannot see inside a CUDA graph): that
// token's q and k outputs are NaN on every rank, nothing outside the cache is read, the others
// are untouched, and Team::check names the token, once.
TEST_P(SharedDevice, QkPositionOutsideTheCacheGivesNaNAndIsReported) {
  const int world = GetParam();
  constexpr int64_t kTokens = 3, kQ = 128, kKv = 64, kRow = kQ + 2 * kKv, kMaxPosition = 8;
  std::vector<uint16_t> host_qkv(kTokens * kRow), ones(kQ, 0x3f80);  // bf16 1.0
  for (size_t i = 0; i < host_qkv.size(); ++i) host_qkv[i] = uint16_t(0x3f00 + i % 64);
  std::vector<float> cache(kMaxPosition * 64, 0.5f);
  const int64_t positions[kTokens] = {2, kMaxPosition + 1, 5};
  std::vector<void*> qkv(world), q_out(world), k_out(world);
  std::vector<QkNormArgs> args(world);
  for (int r = 0; r < world; ++r) {
    qkv[r] = harness_->allocate(r, host_qkv.size() * 2);
    q_out[r] = harness_->allocate(r, kTokens * kQ * 2);
    k_out[r] = harness_->allocate(r, kTokens * kKv * 2);
    void* gamma = harness_->allocate(r, kQ * 2);
    void* device_positions = harness_->allocate(r, sizeof(positions));
    void* device_cache = harness_->allocate(r, cache.size() * 4);
    harness_->upload(r, qkv[r], host_qkv.data(), host_qkv.size() * 2);
    harness_->upload(r, gamma, ones.data(), kQ * 2);
    harness_->upload(r, device_positions, positions, sizeof(positions));
    harness_->upload(r, device_cache, cache.data(), cache.size() * 4);
    QkNormArgs& a = args[r];
    a.qkv = qkv[r];
    a.q_out = q_out[r];
    a.k_out = k_out[r];
    a.q_gamma = gamma;
    a.k_gamma = gamma;
    a.tokens = kTokens;
    a.q_size = kQ;
    a.kv_size = kKv;
    a.q_global_size = kQ * world;
    a.k_global_size = kKv * world;
    a.rope = RopeStyle::kNeox;
    a.head_dim = 64;
    a.rotary_dim = 64;
    a.positions = static_cast<const int64_t*>(device_positions);
    a.cos_sin_cache = static_cast<const float*>(device_cache);
    a.max_position = kMaxPosition;
  }
  // Twice: a reported error leaves the record free for the next one.
  const std::vector<uint16_t> zeros(kTokens * kQ, 0);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("call " + std::to_string(round));
    for (int r = 0; r < world; ++r) harness_->upload(r, q_out[r], zeros.data(), zeros.size() * 2);
    check_bad_position_call(world, args, q_out, kTokens, kQ);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SharedDevice, ::testing::Values(2, 4));

}  // namespace
}  // namespace tpfuse::testing
