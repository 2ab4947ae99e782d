// allreduce_qk_rmsnorm on the CPU backend: the shared QK-norm properties at world sizes 2..8
// (replicated KV heads included), and its argument checks.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "mixed_properties.h"
#include "qknorm_properties.h"
#include "tpfuse/impl/qknorm.h"

namespace tpfuse::testing {
namespace {

class CpuQkNorm : public ::testing::TestWithParam<int> {};

TEST_P(CpuQkNorm, MatchesFloat64ReferenceOfTheUnfusedPattern) {
  CpuHarness harness(GetParam());
  check_qk_random_cases(harness, 100 + GetParam(), 40);
}

// The NCCL path (its CPU stand-in): qk_sum_squares, an all-reduce of the sums, the norm.
TEST_P(CpuQkNorm, NcclPathMatchesFloat64Reference) {
  CpuHarness harness(GetParam());
  harness.algorithm = Algorithm::kNccl;
  check_qk_random_cases(harness, 150 + GetParam(), 20);
  check_qk_adversarial(harness, 160 + GetParam());
}

TEST_P(CpuQkNorm, IdenticalSlicesGiveIdenticalBitsOnEveryRank) {
  CpuHarness harness(GetParam());
  check_qk_identical_across_ranks(harness, 200 + GetParam());
}

TEST_P(CpuQkNorm, ZerosNaNAndInfinities) {
  CpuHarness harness(GetParam());
  check_qk_adversarial(harness, 300 + GetParam());
}

TEST_P(CpuQkNorm, LocalHalvesGiveTheFusedBits) {
  CpuHarness harness(GetParam());
  check_qk_halves_match_fused(harness, 350 + GetParam());
}

TEST_P(CpuQkNorm, UnalignedCosSinCache) {
  CpuHarness harness(GetParam());
  check_qk_unaligned_cache(harness, 390 + GetParam());
}

TEST_P(CpuQkNorm, InterleavedWithAddRmsNormOnOneTeam) {
  CpuHarness harness(GetParam());
  check_ops_interleaved(harness, 380 + GetParam(), 60);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuQkNorm, ::testing::Values(2, 3, 4, 8),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// MiniMax-M2 at TP 2, 4 and 8: 48 query heads and 8 KV heads of 128 over all ranks.
TEST(CpuQkNormMiniMax, ShapesAtTp248) {
  std::mt19937_64 rng(400);
  for (int world : {2, 4, 8}) {
    CpuHarness harness(world);
    QkSpec s;
    s.heads = 48 / world;
    s.kv_heads = 8 / world;
    s.rope = RopeStyle::kNeox;
    s.rotary_dim = 64;
    s.tokens = 3;
    const QkData d = random_qk_data(rng, s, world);
    expect_qk_correct(s, d, run_qk(harness, s, d), world);
  }
}

// The GPU kernel's RoPE in registers takes each neox partner from lane +-(rotary_dim / 2) /
// elements of the same warp, at the same index of the thread's vectors (vector c of a row in
// thread c % threads, index c / threads). Wherever impl::rope_in_registers says yes, that must hold
// for every rotary vector of the row, and no vector may straddle a head or a rotary half.
TEST(QkRopeLayout, RegistersOnlyWhereEveryPartnerIsInTheSameWarp) {
  int registers = 0, shared = 0;
  for (int elements : {4, 8}) {  // fp32; fp16 / bf16
    for (int64_t head_dim : {8, 16, 32, 64, 96, 128, 192, 256, 512}) {
      for (int64_t rotary = 2; rotary <= head_dim; rotary += 2) {
        for (RopeStyle style : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
          for (int64_t heads : {1, 3, 6, 24, 48}) {
            const int64_t width = (heads + 1) * head_dim;  // q heads, then one k head
            for (int vecs : {1, 2, 4}) {
              const bool in_registers =
                  impl::rope_in_registers(style, head_dim, rotary, elements, vecs);
              if (!in_registers) {
                ++shared;
                continue;
              }
              ++registers;
              const int64_t vectors = width / elements;
              const int64_t threads = ((vectors + vecs - 1) / vecs + 31) / 32 * 32;
              const int64_t half = rotary / 2, away = half / elements;
              for (int64_t c = 0; c < vectors; ++c) {
                const int64_t j0 = (c * elements) % head_dim;
                ASSERT_LE(j0 + elements, head_dim) << "a vector straddles two heads";
                if (j0 >= rotary) continue;
                // interleaved: pairs inside the vector, which lies in the rotary part; neox: the
                // vector lies in one rotary half.
                ASSERT_LE(j0 + elements,
                          style == RopeStyle::kInterleaved || j0 >= half ? rotary : half)
                    << "a vector straddles a rotary boundary: head_dim " << head_dim << " rotary "
                    << rotary << " elements " << elements << " style " << int(style);
                if (style == RopeStyle::kInterleaved) continue;
                const int64_t partner = j0 < half ? c + away : c - away;
                ASSERT_EQ(partner * elements / head_dim, c * elements / head_dim);
                ASSERT_EQ(partner / threads, c / threads) << "another index of the thread";
                ASSERT_EQ((partner % threads) / 32, (c % threads) / 32)
                    << "another warp: head_dim " << head_dim << " rotary " << rotary << " elements "
                    << elements << " vecs " << vecs << " c " << c;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(registers, 0);
  EXPECT_GT(shared, 0);
  // MiniMax-M2's layout (head_dim 128, rotary 64, one vector a thread) runs in registers in every
  // dtype; a rotary half that is not whole vectors, a 64-vector rotary part in fp32, and more than
  // two vectors a thread do not.
  EXPECT_TRUE(impl::rope_in_registers(RopeStyle::kNeox, 128, 64, 8, 1));
  EXPECT_TRUE(impl::rope_in_registers(RopeStyle::kNeox, 128, 64, 4, 1));
  EXPECT_TRUE(impl::rope_in_registers(RopeStyle::kInterleaved, 128, 64, 8, 2));
  EXPECT_FALSE(impl::rope_in_registers(RopeStyle::kNeox, 128, 34, 8, 1));
  EXPECT_FALSE(impl::rope_in_registers(RopeStyle::kNeox, 256, 256, 4, 1));
  EXPECT_FALSE(impl::rope_in_registers(RopeStyle::kNeox, 128, 64, 8, 4));
  EXPECT_FALSE(impl::rope_in_registers(RopeStyle::kNone, 128, 64, 8, 1));
}

void expect_error_naming(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming '" << name << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(name), std::string::npos)
        << "message does not name '" << name << "': " << error.what();
  }
}

TEST(CpuQkNormArguments, EachBadArgumentIsNamed) {
  std::vector<Team> team = create_cpu_team(4);
  alignas(16) static uint16_t qkv[4096], q_gamma[1024], k_gamma[1024], out[4096];
  alignas(16) static int64_t positions[4];
  alignas(16) static float cos_sin[1024];
  QkNormArgs good;
  good.qkv = qkv;
  good.q_gamma = q_gamma;
  good.k_gamma = k_gamma;
  good.tokens = 2;
  good.q_size = 256;
  good.kv_size = 128;
  good.q_global_size = 1024;
  good.k_global_size = 512;
  // Rank 0 makes the bad call while ranks 1-3 make good ones: the rejected call takes its turn,
  // so theirs end at once with an error naming rank 0, and the team goes on.
  static uint16_t peer_qkv[4][4096];
  const auto good_call = [&](int rank, std::string* error) {
    QkNormArgs a = good;
    a.qkv = peer_qkv[rank];
    try {
      allreduce_qk_rmsnorm(team[rank], a);
    } catch (const Error& e) {
      *error = e.what();
    }
  };
  const auto rejected = [&](const std::function<void(QkNormArgs&)>& mutate,
                            const std::string& name) {
    QkNormArgs a = good;
    mutate(a);
    std::string errors[4];
    std::vector<std::thread> peers;
    for (int r = 1; r < 4; ++r) peers.emplace_back(good_call, r, &errors[r]);
    expect_error_naming([&] { allreduce_qk_rmsnorm(team[0], a); }, name);
    for (auto& peer : peers) peer.join();
    for (int r = 1; r < 4; ++r) {
      EXPECT_NE(errors[r].find("rank 0 rejected its part of this call"), std::string::npos)
          << "rank " << r << " got: " << errors[r];
    }
    peers.clear();
    for (int r = 0; r < 4; ++r) {
      errors[r].clear();
      peers.emplace_back(good_call, r, &errors[r]);
    }
    for (auto& peer : peers) peer.join();
    for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[r], "") << "the team did not go on";
  };
  rejected([](auto& a) { a.qkv = nullptr; }, "qkv is null");
  rejected([](auto& a) { a.q_gamma = nullptr; }, "q_gamma is null");
  rejected([](auto& a) { a.k_gamma = nullptr; }, "k_gamma is null");
  rejected([](auto& a) { a.q_size = 12; }, "q_size must be a positive multiple of 8");
  rejected([](auto& a) { a.kv_size = 0; }, "kv_size");
  rejected([](auto& a) { a.q_global_size = 128; }, "q_global_size must be >= q_size");
  rejected([](auto& a) { a.k_global_size = 64; }, "k_global_size must be >= kv_size");
  rejected([](auto& a) { a.kv_replicas = 3; }, "kv_replicas must divide the world size 4");
  rejected([](auto& a) { a.q_size = 40000; }, "q_size + kv_size must be at most");
  rejected([](auto& a) { a.q_out = qkv + 8; }, "q_out overlaps qkv");
  rejected(
      [](auto& a) {
        a.q_out = out;
        a.k_out = out + 8;
      },
      "q_out overlaps k_out");
  rejected([](auto& a) { a.qkv = qkv + 1; }, "qkv must be 16-byte aligned");
  // Outputs (or qkv, in place) over a weight or a RoPE input.
  rejected([](auto& a) { a.q_out = q_gamma; }, "q_out overlaps q_gamma");
  rejected(
      [](auto& a) {
        a.q_out = out;
        a.k_out = k_gamma + 64;
      },
      "k_out overlaps k_gamma");
  rejected([](auto& a) { a.q_gamma = qkv + 512; }, "qkv (in place) overlaps q_gamma");
  rejected([](auto& a) { a.rope = RopeStyle(5); }, "rope 5 is not a RopeStyle");
  const auto with_rope = [&](QkNormArgs& a) {
    a.rope = RopeStyle::kNeox;
    a.head_dim = 64;
    a.rotary_dim = 32;
    a.positions = positions;
    a.cos_sin_cache = cos_sin;
    a.max_position = 4;
  };
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.head_dim = 48;
      },
      "head_dim must divide q_size");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.rotary_dim = 33;
      },
      "rotary_dim must be even");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.rotary_dim = 128;
      },
      "rotary_dim must be even");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.positions = nullptr;
      },
      "positions is null");
  // Positions outside the cache: in host memory they are checked before any work.
  positions[1] = 4;
  rejected(with_rope, "positions[1] = 4 is outside [0, max_position = 4)");
  positions[1] = -1;
  rejected(with_rope, "positions[1] = -1 is outside [0, max_position = 4)");
  positions[1] = 0;
  {
    QkNormArgs a = good;
    with_rope(a);
    positions[0] = 7;
    alignas(8) static float sums[4];
    expect_error_naming([&] { qk_rmsnorm_from_sums(Backend::kCpu, a, sums); },
                        "positions[0] = 7 is outside [0, max_position = 4)");
    positions[0] = 0;
  }
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.cos_sin_cache = nullptr;
      },
      "cos_sin_cache is null");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.q_out = out;
        a.k_out = out + 2048;
        a.cos_sin_cache = reinterpret_cast<const float*>(out + 16);
      },
      "q_out overlaps cos_sin_cache");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.positions = reinterpret_cast<const int64_t*>(qkv + 8);
      },
      "qkv (in place) overlaps positions");
  rejected(
      [&](auto& a) {
        with_rope(a);
        a.max_position = 0;
      },
      "max_position");
  rejected([](auto& a) { a.eps = -1; }, "eps");
  float sums[8];
  expect_error_naming([&] { qk_sum_squares(Backend::kCpu, good, true, nullptr); }, "sums is null");
  expect_error_naming([&] { qk_sum_squares(Backend::kCpu, good, true, sums + 1); },
                      "sums must be 8-byte aligned");
  QkNormArgs bad = good;
  bad.q_size = 12;
  expect_error_naming([&] { qk_rmsnorm_from_sums(Backend::kCpu, bad, sums); },
                      "qk_rmsnorm_from_sums: q_size must be a positive multiple of 8");
}

// Ranks whose QK-norm calls disagree (or one rank making another op) are told the peer and the
// field, and the team is failed; no rank waits out the timeout.
TEST(CpuQkNormDisagreement, EveryRankNamesThePeerAndTheField) {
  struct Case {
    const char* field;
    std::function<void(QkNormArgs&)> change;
  };
  const std::vector<Case> cases = {
      {"tokens: 2 here, 1 on rank 1", [](QkNormArgs& a) { a.tokens = 1; }},
      {"the width (hidden, or q_global_size): 512 here, 1024 on rank 1",
       [](QkNormArgs& a) { a.q_global_size = 1024; }},
      {"eps or the MoE top-k (or, for the QK norm, k_global_size",
       [](QkNormArgs& a) { a.k_global_size = 512; }},
      {"dtype: bfloat16 here, float16 on rank 1", [](QkNormArgs& a) { a.dtype = DType::kFloat16; }},
  };
  alignas(16) static uint16_t qkv[2][4096], gamma[1024];
  for (const Case& c : cases) {
    TeamOptions options;
    options.peer_timeout_seconds = 30.0;
    std::vector<Team> team = create_cpu_team(2, options);
    QkNormArgs args[2];
    for (int r = 0; r < 2; ++r) {
      args[r].qkv = qkv[r];
      args[r].q_gamma = gamma;
      args[r].k_gamma = gamma;
      args[r].tokens = 2;
      args[r].q_size = 256;
      args[r].kv_size = 128;
      args[r].q_global_size = 512;
      args[r].k_global_size = 256;
    }
    c.change(args[1]);
    std::string errors[2];
    std::thread peer([&] {
      try {
        allreduce_qk_rmsnorm(team[1], args[1]);
      } catch (const Error& error) {
        errors[1] = error.what();
      }
    });
    try {
      allreduce_qk_rmsnorm(team[0], args[0]);
    } catch (const Error& error) {
      errors[0] = error.what();
    }
    peer.join();
    EXPECT_NE(
        errors[0].find(std::string("rank 1's call disagrees with this rank's, in ") + c.field),
        std::string::npos)
        << errors[0];
    EXPECT_NE(errors[1].find("rank 0's call disagrees with this rank's"), std::string::npos)
        << errors[1];
  }
  // Rank 1 makes an add + RMSNorm while rank 0 makes the QK norm.
  std::vector<Team> team = create_cpu_team(2);
  QkNormArgs qk;
  qk.qkv = qkv[0];
  qk.q_gamma = gamma;
  qk.k_gamma = gamma;
  qk.tokens = 2;
  qk.q_size = 256;
  qk.kv_size = 128;
  qk.q_global_size = 512;
  qk.k_global_size = 256;
  AddRmsNormArgs rows;
  rows.input = qkv[1];
  rows.gamma = gamma;
  rows.norm_out = qkv[1] + 2048;
  rows.tokens = 2;
  rows.hidden = 256;
  std::string errors[2];
  std::thread peer([&] {
    try {
      allreduce_add_rmsnorm(team[1], rows);
    } catch (const Error& error) {
      errors[1] = error.what();
    }
  });
  try {
    allreduce_qk_rmsnorm(team[0], qk);
  } catch (const Error& error) {
    errors[0] = error.what();
  }
  peer.join();
  EXPECT_NE(errors[0].find("the op / algorithm: fused QK norm here, one-shot all-reduce"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 0's call disagrees"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace tpfuse::testing
