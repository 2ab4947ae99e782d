// The SYCL backend's QK norm on Intel's OpenCL CPU device (label sycl): the shared QK-norm
// property suites (tests/common/qknorm_properties.h, mixed_properties.h) at world 2, the CPU
// backend's bits, a one-rank team, rejected and disagreeing calls (NaN in every output of every
// rank), positions outside the cache (that token NaN, Team::check names it), and a missing peer.
#include <gtest/gtest.h>

#include <sycl/sycl.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "mixed_properties.h"
#include "qknorm_properties.h"
#include "sycl_harness.h"

namespace tpfuse::testing {
namespace {

class SyclQkNorm : public ::testing::Test {
 protected:
  void SetUp() override {
    TPF_REQUIRE_DEVICE(device);
    TPF_REQUIRE_TWO_COMPUTE_UNITS(device);
    device_ = device;
    harness_ = std::make_unique<SyclHarness>(two_ranks(device));
  }
  std::optional<sycl::device> device_;
  std::unique_ptr<SyclHarness> harness_;
};

TEST_F(SyclQkNorm, MatchesFloat64ReferenceOfTheUnfusedPattern) {
  check_qk_random_cases(*harness_, 2100, 40);
}

TEST_F(SyclQkNorm, IdenticalSlicesGiveIdenticalBitsOnEveryRank) {
  check_qk_identical_across_ranks(*harness_, 2200);
}

TEST_F(SyclQkNorm, ZerosNaNAndInfinities) {
  check_qk_adversarial(*harness_, 2300);
}

// qk_sum_squares and qk_rmsnorm_from_sums on the ranks' queues, the sums added in rank order on
// the host: the fused call's bits.
TEST_F(SyclQkNorm, LocalHalvesGiveTheFusedBits) {
  check_qk_halves_match_fused(*harness_, 2350);
}

TEST_F(SyclQkNorm, UnalignedCosSinCache) {
  check_qk_unaligned_cache(*harness_, 2390);
}

// The QK norm and the row calls (one-shot and two-shot) interleaved on one team: one slot
// rotation, one clearing scheme.
TEST_F(SyclQkNorm, InterleavedWithAddRmsNormOnOneTeam) {
  check_ops_interleaved(*harness_, 2380, 60);
}

// Adversarial words in qkv: the sentinel's bits, -0 beside a nonzero lane, denormals, Inf, NaN,
// huge values (their squares overflow fp32).
void scatter_adversarial_words(std::mt19937_64& rng, QkData& d) {
  const uint32_t adversarial[] = {0x80000000u, 0x00008000u, 0x80000001u, 0x00000001u,
                                  0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f7fffffu,
                                  0x00800000u, 0x3f800000u, 0xbf800000u, 0x00000000u};
  for (HostTensor& qkv : d.qkv) {
    for (size_t w = 0; w < qkv.bytes.size() / 4; w += 1 + rng() % 7) {
      const uint32_t word = adversarial[rng() % std::size(adversarial)];
      std::memcpy(qkv.bytes.data() + 4 * w, &word, 4);
    }
  }
}

// Where the reference defines the bits (the packets' sum in rank order in fp32, one rounding),
// the SYCL backend gives the CPU backend's, RoPE included: random shapes of every dtype, RoPE
// style and replication, half of them with adversarial words; and qk_sum_squares's sums.
TEST_F(SyclQkNorm, GivesTheCpuBackendsBits) {
  CpuHarness cpu(2);
  std::mt19937_64 rng(2400);
  for (int c = 0; c < 40; ++c) {
    const QkSpec s = random_qk_spec(rng, 2);
    QkData d = random_qk_data(rng, s, 2);
    if (c % 2 == 1) scatter_adversarial_words(rng, d);
    const QkResult on_sycl = run_qk(*harness_, s, d);
    const QkResult on_cpu = run_qk(cpu, s, d);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(differing_elements(on_sycl.q[r], on_cpu.q[r]), 0u)
          << describe(s) << ": q of rank " << r << ", case " << c;
      EXPECT_EQ(differing_elements(on_sycl.k[r], on_cpu.k[r]), 0u)
          << describe(s) << ": k of rank " << r << ", case " << c;
    }
    // Rank 0's sums of squares (qk_sum_squares on its queue), bit for bit.
    std::vector<float> cpu_sums(size_t(2 * s.tokens)), sycl_sums(cpu_sums.size());
    const std::vector<QkBuffers> b = upload_qk(*harness_, s, d);
    QkBuffers host{};
    host.qkv = const_cast<void*>(static_cast<const void*>(d.qkv[0].data()));
    host.q_gamma = const_cast<void*>(static_cast<const void*>(d.q_gamma[0].data()));
    host.k_gamma = const_cast<void*>(static_cast<const void*>(d.k_gamma[0].data()));
    host.positions =
        s.rope != RopeStyle::kNone ? const_cast<int64_t*>(d.positions.data()) : nullptr;
    host.cos_sin = s.rope != RopeStyle::kNone ? const_cast<float*>(d.cos_sin.data()) : nullptr;
    qk_sum_squares(Backend::kCpu, qk_args(s, host, d.max_position, 2), c % 3 != 0, cpu_sums.data());
    void* sums = harness_->allocate(0, sycl_sums.size() * 4);
    qk_sum_squares(Backend::kSycl, qk_args(s, b[0], d.max_position, 2), c % 3 != 0,
                   static_cast<float*>(sums), harness_->queue(0));
    harness_->download(0, sycl_sums.data(), sums, sycl_sums.size() * 4);
    for (size_t i = 0; i < cpu_sums.size(); ++i) {  // NaN payloads aside, as above
      const bool both_nan = std::isnan(sycl_sums[i]) && std::isnan(cpu_sums[i]);
      EXPECT_TRUE(both_nan || std::memcmp(&sycl_sums[i], &cpu_sums[i], 4) == 0)
          << describe(s) << ": qk_sum_squares, case " << c << ", sums[" << i
          << "]: " << sycl_sums[i] << " here, " << cpu_sums[i] << " on the CPU backend";
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// A team of one rank runs the fused kernel with itself: the CPU backend's bits (and float64's).
TEST(SyclQkNormOneRank, GivesTheCpuBackendsBits) {
  TPF_REQUIRE_DEVICE(device);
  SyclHarness one(create_sycl_team(std::vector<sycl::device>{device}));
  CpuHarness cpu(1);
  std::mt19937_64 rng(2500);
  for (int c = 0; c < 12; ++c) {
    const QkSpec s = random_qk_spec(rng, 1);
    const QkData d = random_qk_data(rng, s, 1);
    const QkResult on_sycl = run_qk(one, s, d);
    const QkResult on_cpu = run_qk(cpu, s, d);
    expect_qk_correct(s, d, on_sycl, 1);
    EXPECT_EQ(differing_elements(on_sycl.q[0], on_cpu.q[0]), 0u) << describe(s) << ": q";
    EXPECT_EQ(differing_elements(on_sycl.k[0], on_cpu.k[0]), 0u) << describe(s) << ": k";
    if (::testing::Test::HasFailure()) return;
  }
}

// How many elements of a rank's q and k outputs, in its first `tokens` rows, are not NaN.
size_t not_nan(const QkSpec& s, const QkResult& result, int rank, int64_t tokens) {
  size_t count = 0;
  for (int64_t i = 0; i < tokens * s.q_size(); ++i) {
    count += !std::isnan(result.q[size_t(rank)].get(size_t(i)));
  }
  for (int64_t i = 0; i < tokens * s.kv_size(); ++i) {
    count += !std::isnan(result.k[size_t(rank)].get(size_t(i)));
  }
  return count;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// One fused call a rank, `change` applied to each rank's arguments (the rank's number given),
// through the sycl::queue form; what each rank's call or its Team::check threw.
std::vector<std::string> run_qk_changed(SyclHarness& harness, const QkSpec& s, const QkData& d,
                                        const std::vector<QkBuffers>& b,
                                        const std::function<void(int, QkNormArgs&)>& change) {
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    QkNormArgs args = qk_args(s, b[size_t(r)], d.max_position, 2);
    change(r, args);
    try {
      allreduce_qk_rmsnorm(harness.team()[size_t(r)], args, harness.queue(r));
    } catch (const Error& error) {
      errors[size_t(r)] = error.what();
    }
  }
  for (int r = 0; r < 2; ++r) {
    if (!errors[size_t(r)].empty()) continue;
    try {
      harness.team()[size_t(r)].check();
    } catch (const Error& error) {
      errors[size_t(r)] = error.what();
    }
  }
  return errors;
}

// A rank that rejects its arguments takes its turn: its peer's outputs are NaN, every element,
// its error names the rejecting rank, and the team goes on (the next call is correct). Ranks
// that disagree (eps, tokens, dtype, the RoPE style, the width) fail the team: every output of
// either rank is NaN, every element, and each names the other. Whatever the case, the headers
// are checked before any packet is used.
TEST_F(SyclQkNorm, RejectedAndDisagreeingCallsGiveNaNInEveryOutput) {
  TeamOptions options;
  options.peer_timeout_seconds = 30.0;
  harness_ = std::make_unique<SyclHarness>(two_ranks(*device_, options));
  std::mt19937_64 rng(2600);
  struct Fault {
    const char* what;
    bool rejects;  // else a disagreement
    std::function<void(QkNormArgs&)> apply;
  };
  const std::vector<Fault> faults = {
      {"qkv is null", true, [](QkNormArgs& a) { a.qkv = nullptr; }},
      {"algorithm twoshot is not offered", true,
       [](QkNormArgs& a) { a.algorithm = Algorithm::kTwoShot; }},
      {"eps must be finite", true, [](QkNormArgs& a) { a.eps = -1.0f; }},
      {"eps", false, [](QkNormArgs& a) { a.eps *= 2.0f; }},
      {"tokens", false, [](QkNormArgs& a) { a.tokens -= 1; }},
      {"dtype", false,
       [](QkNormArgs& a) {
         a.dtype = a.dtype == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
       }},
      {"width", false, [](QkNormArgs& a) { a.q_global_size *= 2; }},
      {"rope", false,
       [](QkNormArgs& a) {
         a.rope = a.rope == RopeStyle::kNeox ? RopeStyle::kInterleaved : RopeStyle::kNeox;
       }},
  };
  for (size_t f = 0; f < faults.size() * 2; ++f) {
    const Fault& fault = faults[f % faults.size()];
    const int faulty = int(f / faults.size());
    QkSpec s;
    s.tokens = 3 + int64_t(f % 4);
    s.heads = 4;
    s.kv_heads = 2;
    s.rope = f % 2 ? RopeStyle::kNeox : RopeStyle::kInterleaved;
    s.in_place = f % 3 == 0;
    const QkData d = random_qk_data(rng, s, 2);
    const std::vector<QkBuffers> b = upload_qk(*harness_, s, d);
    const std::string what = std::string(fault.what) + ", rank " + std::to_string(faulty) +
                             (s.in_place ? ", in place" : "");
    const std::vector<std::string> errors =
        run_qk_changed(*harness_, s, d, b, [&](int rank, QkNormArgs& a) {
          if (rank == faulty) fault.apply(a);
        });
    const QkResult result = download_qk(*harness_, s, d, b);
    const int peer = 1 - faulty;
    if (fault.rejects) {
      EXPECT_TRUE(contains(errors[size_t(faulty)], fault.what))
          << what << ": got " << errors[size_t(faulty)];
      EXPECT_TRUE(contains(errors[size_t(peer)], "rank " + std::to_string(faulty) + " rejected"))
          << what << ": rank " << peer << " got " << errors[size_t(peer)];
      EXPECT_EQ(not_nan(s, result, peer, s.tokens), 0u)
          << what << ": rank " << peer << "'s outputs";
      // The team goes on: the next call matches float64 on both ranks.
      const QkData next = random_qk_data(rng, s, 2);
      expect_qk_correct(s, next, run_qk(*harness_, s, next), 2);
    } else {
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(contains(errors[size_t(r)], "rank " + std::to_string(1 - r)))
            << what << ": rank " << r << " got " << errors[size_t(r)];
        EXPECT_TRUE(contains(errors[size_t(r)], "disagrees with this rank's") ||
                    contains(errors[size_t(r)], "failed the team"))
            << what << ": rank " << r << " got " << errors[size_t(r)];
        // The rows of the rank's own call (the faulty rank's may be fewer; another dtype's NaN
        // reads as NaN in this one).
        const int64_t tokens =
            r == faulty && std::string(fault.what) == "tokens" ? s.tokens - 1 : s.tokens;
        EXPECT_EQ(not_nan(s, result, r, tokens), 0u) << what << ": rank " << r << "'s outputs";
      }
      harness_ = std::make_unique<SyclHarness>(two_ranks(*device_, options));
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// A QK norm on one rank while its peer makes an add + RMSNorm: the QK rank's outputs are NaN,
// and both name the other.
TEST_F(SyclQkNorm, ARowCallBesideAQkCallIsADisagreement) {
  QkSpec s;
  s.tokens = 2;
  s.heads = 2;
  s.kv_heads = 1;
  std::mt19937_64 rng(2650);
  const QkData d = random_qk_data(rng, s, 2);
  const std::vector<QkBuffers> b = upload_qk(*harness_, s, d);
  std::vector<std::string> errors(2);
  try {
    allreduce_qk_rmsnorm(harness_->team()[0], qk_args(s, b[0], d.max_position, 2),
                         harness_->queue(0));
  } catch (const Error& error) {
    errors[0] = error.what();
  }
  AddRmsNormArgs rows;
  rows.input = b[1].qkv;
  rows.gamma = b[1].q_gamma;
  rows.norm_out = b[1].q_out;
  rows.tokens = 2;
  rows.hidden = 128;
  rows.algorithm = Algorithm::kOneShot;
  try {
    allreduce_add_rmsnorm(harness_->team()[1], rows, harness_->queue(1));
  } catch (const Error& error) {
    errors[1] = error.what();
  }
  for (int r = 0; r < 2; ++r) {
    try {
      harness_->team()[size_t(r)].check();
    } catch (const Error& error) {
      if (errors[size_t(r)].empty()) errors[size_t(r)] = error.what();
    }
  }
  EXPECT_TRUE(contains(errors[0], "rank 1")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 0")) << errors[1];
  const QkResult result = download_qk(*harness_, s, d, b);
  EXPECT_EQ(not_nan(s, result, 0, s.tokens), 0u) << "the QK rank's outputs";
}

// Positions outside [0, max_position), checked on the device: that token's q and k are NaN on
// every rank, every other token has the bits of the call without it, nothing is read outside
// the cache, and Team::check names the token once. The local pass (qk_rmsnorm_from_sums) makes
// the token NaN too.
TEST_F(SyclQkNorm, APositionOutsideTheCacheMakesItsTokenNaNAndIsReported) {
  std::mt19937_64 rng(2700);
  for (const RopeStyle rope : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
    QkSpec s;
    s.tokens = 5;
    s.heads = 6;
    s.kv_heads = 2;
    s.rope = rope;
    const QkData d = random_qk_data(rng, s, 2);
    const QkResult good = run_qk(*harness_, s, d);
    for (const auto& [bad_token, bad_position] :
         std::vector<std::pair<int64_t, int64_t>>{{1, d.max_position}, {3, -1}, {4, 1 << 30}}) {
      const std::string trace = describe(s) + ", positions[" + std::to_string(bad_token) +
                                "] = " + std::to_string(bad_position);
      QkData bad = d;
      bad.positions[size_t(bad_token)] = bad_position;
      const std::vector<QkBuffers> b = upload_qk(*harness_, s, bad);
      const std::string expected =
          "positions[" + std::to_string(bad_token) + "] = " + std::to_string(bad_position) +
          " is outside [0, max_position = " + std::to_string(d.max_position) + ")";
      const std::vector<std::string> errors =
          run_qk_changed(*harness_, s, bad, b, [](int, QkNormArgs&) {});
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(contains(errors[size_t(r)], expected))
            << trace << ": rank " << r << " got '" << errors[size_t(r)] << "'";
        EXPECT_NO_THROW(harness_->team()[size_t(r)].check()) << trace << ": reported once";
      }
      const QkResult result = download_qk(*harness_, s, bad, b);
      const auto expect_rows = [&](const HostTensor& got, const HostTensor& want, int64_t width,
                                   const std::string& what) {
        const size_t row_bytes = size_t(width) * dtype_size(s.dtype);
        for (int64_t t = 0; t < s.tokens; ++t) {
          if (t == bad_token) {
            for (int64_t e = 0; e < width; ++e) {
              ASSERT_TRUE(std::isnan(got.get(size_t(t * width + e))))
                  << trace << ": " << what << " token " << t << " element " << e;
            }
          } else {
            ASSERT_EQ(std::memcmp(got.bytes.data() + t * row_bytes,
                                  want.bytes.data() + t * row_bytes, row_bytes),
                      0)
                << trace << ": " << what << " token " << t;
          }
        }
      };
      for (int r = 0; r < 2; ++r) {
        expect_rows(result.q[size_t(r)], good.q[size_t(r)], s.q_size(),
                    "q of rank " + std::to_string(r));
        expect_rows(result.k[size_t(r)], good.k[size_t(r)], s.kv_size(),
                    "k of rank " + std::to_string(r));
      }
      // The team goes on.
      expect_qk_correct(s, d, run_qk(*harness_, s, d), 2);
      // The local pass: the token NaN, no error (no team to report to).
      const std::vector<float> ones(size_t(2 * s.tokens), 1.0f);
      void* sums = harness_->allocate(0, ones.size() * 4);
      harness_->upload(0, sums, ones.data(), ones.size() * 4);
      const std::vector<QkBuffers> local = upload_qk(*harness_, s, bad);
      qk_rmsnorm_from_sums(Backend::kSycl, qk_args(s, local[0], d.max_position, 2),
                           static_cast<const float*>(sums), harness_->queue(0));
      harness_->queue(0).wait();
      HostTensor q(s.dtype, size_t(s.tokens * s.q_size()));
      harness_->download(0, q.data(), local[0].q_out, q.bytes.size());
      for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t e = 0; e < s.q_size(); ++e) {
          ASSERT_EQ(std::isnan(q.get(size_t(t * s.q_size() + e))), t == bad_token)
              << trace << ": qk_rmsnorm_from_sums, token " << t << " element " << e;
        }
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// A peer that never makes its call: the wait for its header ends at about the timeout, the
// error names it, and every output is NaN.
TEST(SyclQkNormFaults, AMissingPeerTimesOutWithEveryOutputNaN) {
  TPF_REQUIRE_DEVICE(device);
  TPF_REQUIRE_TWO_COMPUTE_UNITS(device);
  TeamOptions options;
  options.peer_timeout_seconds = 0.5;
  SyclHarness harness(two_ranks(device, options));
  QkSpec s;
  s.tokens = 4;
  s.heads = 2;
  s.kv_heads = 1;
  s.rope = RopeStyle::kNeox;
  std::mt19937_64 rng(2800);
  const QkData d = random_qk_data(rng, s, 2);
  const std::vector<QkBuffers> b = upload_qk(harness, s, d);
  const auto start = std::chrono::steady_clock::now();
  allreduce_qk_rmsnorm(harness.team()[0], qk_args(s, b[0], d.max_position, 2), harness.queue(0));
  try {
    harness.team()[0].check();
    FAIL() << "rank 0's call returned although rank 1 never called";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("timed out waiting for rank 1"), std::string::npos)
        << error.what();
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GT(waited, 0.45);
  EXPECT_LT(waited, 5.0);
  HostTensor q(s.dtype, size_t(s.tokens * s.q_size())), k(s.dtype, size_t(s.tokens * s.kv_size()));
  harness.download(0, q.data(), b[0].q_out, q.bytes.size());
  harness.download(0, k.data(), b[0].k_out, k.bytes.size());
  for (size_t i = 0; i < q.count(); ++i) ASSERT_TRUE(std::isnan(q.get(i))) << "q element " << i;
  for (size_t i = 0; i < k.count(); ++i) ASSERT_TRUE(std::isnan(k.get(i))) << "k element " << i;
}

}  // namespace
}  // namespace tpfuse::testing
