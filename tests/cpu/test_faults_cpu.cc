// Faults that once gave a wrong result with no error, each as it was reproduced, on the CPU
// backend (ranks are threads): a rejected call on every path (fused, NCCL stand-in, a team
// without peer stores) keeps the ranks' calls paired; ranks that disagree get NaN in every
// output (or, refused, nothing written); a row wider than a packet is carried, never written past
// the workspace; a late peer is refused instead of meeting an abandoned call. Run under ASan and
// UBSan by scripts/sanitize-cpu.sh.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace tpfuse::testing {
namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Runs fn(rank) on a thread per rank; returns what each threw ("" if nothing).
std::vector<std::string> on_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const Error& error) {
        errors[r] = error.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

bool all_nan(const std::vector<float>& values) {
  for (float v : values) {
    if (!std::isnan(v)) return false;
  }
  return true;
}

struct PathCase {
  const char* name;
  bool peer_stores;
  Algorithm algorithm;
};

class RejectedCallKeepsCallsPaired : public ::testing::TestWithParam<PathCase> {};

// World 2, fp32 allreduce of 8 elements, three calls; rank 1's call 1 passes 7 elements. Once,
// on the NCCL path and on teams without peer stores, rank 0's call 1 returned 103 (rank 1's
// call 2 with its own call 1's) and rank 1's call 2 returned 103 too, with no error.
TEST_P(RejectedCallKeepsCallsPaired, OnEveryPath) {
  TeamOptions options;
  options.peer_stores = GetParam().peer_stores;
  options.peer_timeout_seconds = 20;
  std::vector<Team> team = create_cpu_team(2, options);
  std::vector<std::vector<float>> out(2, std::vector<float>(8));
  std::vector<std::string> errors[3];
  for (int call = 0; call < 3; ++call) {
    errors[call] = on_ranks(2, [&](int r) {
      std::vector<float> input(8, float(100 * (call + 1) * (r + 1) + call));
      std::fill(out[r].begin(), out[r].end(), -1.0f);
      const int64_t count = call == 1 && r == 1 ? 7 : 8;
      allreduce(team[r], input.data(), out[r].data(), count, DType::kFloat32, {},
                GetParam().algorithm);
    });
    const float sum = float(100 * (call + 1) * 3 + 2 * call);
    for (int r = 0; r < 2; ++r) {
      if (call == 1) {
        EXPECT_TRUE(contains(errors[call][r], r == 1 ? "count must be" : "rank 1 rejected"))
            << "rank " << r << ": " << errors[call][r];
        if (r == 0) EXPECT_TRUE(all_nan(out[r])) << "rank 0's outputs of the rejected call";
        if (r == 1) EXPECT_EQ(out[r], std::vector<float>(8, -1.0f)) << "a rejected call wrote";
      } else {
        EXPECT_EQ(errors[call][r], "") << "call " << call << " rank " << r;
        EXPECT_EQ(out[r], std::vector<float>(8, sum)) << "call " << call << " rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, RejectedCallKeepsCallsPaired,
                         ::testing::Values(PathCase{"fused", true, Algorithm::kAuto},
                                           PathCase{"nccl_forced", true, Algorithm::kNccl},
                                           PathCase{"no_peer_stores", false, Algorithm::kAuto}),
                         [](const auto& info) { return std::string(info.param.name); });

// The NCCL path's stand-in carries the whole call's signature: ranks whose calls there disagree
// (here in eps) are told, where they once got each other's sums with no error.
TEST(StandInPath, DisagreeingCallsAreTold) {
  TeamOptions options;
  options.peer_stores = false;
  std::vector<Team> team = create_cpu_team(2, options);
  const std::vector<std::string> errors = on_ranks(2, [&](int r) {
    std::vector<float> input(2 * 16, 1.0f), residual(2 * 16, 0.5f), gamma(16, 1.0f);
    std::vector<float> residual_out(2 * 16), norm_out(2 * 16);
    AddRmsNormArgs a;
    a.input = input.data();
    a.residual = residual.data();
    a.gamma = gamma.data();
    a.residual_out = residual_out.data();
    a.norm_out = norm_out.data();
    a.tokens = 2;
    a.hidden = 16;
    a.dtype = DType::kFloat32;
    a.eps = r == 0 ? 1e-6f : 1e-5f;
    allreduce_add_rmsnorm(team[r], a);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r], "disagree")) << "rank " << r << ": " << errors[r];
  }
}

// Fills an AddRmsNormArgs of `tokens` x `hidden` fp32 over the given buffers.
struct RowBuffers {
  std::vector<float> input, residual, gamma, residual_out, norm_out;
  RowBuffers(int64_t tokens, int64_t hidden, float value)
      : input(size_t(tokens * hidden), value),
        residual(size_t(tokens * hidden), 0.25f),
        gamma(size_t(hidden), 1.0f),
        residual_out(size_t(tokens * hidden), 7.0f),
        norm_out(size_t(tokens * hidden), 7.0f) {}
  AddRmsNormArgs args(int64_t tokens, int64_t hidden, Algorithm algorithm) {
    AddRmsNormArgs a;
    a.input = input.data();
    a.residual = residual.data();
    a.gamma = gamma.data();
    a.residual_out = residual_out.data();
    a.norm_out = norm_out.data();
    a.tokens = tokens;
    a.hidden = hidden;
    a.dtype = DType::kFloat32;
    a.algorithm = algorithm;
    return a;
  }
};

class DisagreeingRanks : public ::testing::TestWithParam<Algorithm> {};

// World 2, fp32, 2 tokens, hidden 16 on rank 0 and 8 on rank 1. Both threw "...that call's
// outputs are NaN..." while rank 1's outputs were all finite and rank 0's half.
TEST_P(DisagreeingRanks, EveryOutputNaNOrNothingWritten) {
  for (int attempt = 0; attempt < 8; ++attempt) {
    std::vector<Team> team = create_cpu_team(2);
    std::vector<RowBuffers> buffers;
    for (int r = 0; r < 2; ++r) buffers.emplace_back(2, r == 0 ? 16 : 8, 1.0f + r);
    const std::vector<std::string> errors = on_ranks(2, [&](int r) {
      allreduce_add_rmsnorm(team[r], buffers[r].args(2, r == 0 ? 16 : 8, GetParam()));
    });
    for (int r = 0; r < 2; ++r) {
      ASSERT_FALSE(errors[r].empty()) << "rank " << r << " returned from a disagreeing call";
      if (contains(errors[r], "wrote nothing")) {
        EXPECT_EQ(buffers[r].norm_out, std::vector<float>(buffers[r].norm_out.size(), 7.0f));
        EXPECT_EQ(buffers[r].residual_out,
                  std::vector<float>(buffers[r].residual_out.size(), 7.0f));
      } else {
        EXPECT_TRUE(contains(errors[r], "outputs are NaN")) << errors[r];
        EXPECT_TRUE(all_nan(buffers[r].norm_out)) << "rank " << r << ": " << errors[r];
        EXPECT_TRUE(all_nan(buffers[r].residual_out)) << "rank " << r << ": " << errors[r];
      }
      EXPECT_THROW(team[r].check(), Error) << "the team is failed on rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, DisagreeingRanks,
                         ::testing::Values(Algorithm::kOneShot, Algorithm::kTwoShot,
                                           Algorithm::kNccl));

// The QK norm's outputs (in place) are NaN too when its ranks disagree.
TEST(DisagreeingRanks, QkNormOutputsNaNOrNothingWritten) {
  std::vector<Team> team = create_cpu_team(2);
  std::vector<std::vector<float>> qkv(2);
  const std::vector<std::string> errors = on_ranks(2, [&](int r) {
    const int64_t q = r == 0 ? 128 : 256, kv = 128;
    qkv[r].assign(size_t(2 * (q + 2 * kv)), 1.0f);
    std::vector<float> q_gamma(size_t(q), 1.0f), k_gamma(size_t(kv), 1.0f);
    QkNormArgs a;
    a.qkv = qkv[r].data();
    a.q_gamma = q_gamma.data();
    a.k_gamma = k_gamma.data();
    a.tokens = 2;
    a.q_size = q;
    a.kv_size = kv;
    a.q_global_size = 2 * q;
    a.k_global_size = 2 * kv;
    a.dtype = DType::kFloat32;
    allreduce_qk_rmsnorm(team[r], a);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(errors[r].empty());
    if (contains(errors[r], "wrote nothing")) continue;
    const int64_t q = r == 0 ? 128 : 256, row = q + 2 * 128;
    for (int64_t t = 0; t < 2; ++t) {
      for (int64_t i = 0; i < q + 128; ++i) {
        ASSERT_TRUE(std::isnan(qkv[r][size_t(t * row + i)])) << "rank " << r << " token " << t;
      }
      for (int64_t i = q + 128; i < row; ++i) {
        ASSERT_EQ(qkv[r][size_t(t * row + i)], 1.0f) << "v is not an output";
      }
    }
  }
}

// World 2, packet_bytes 16, fp32 allreduce of 2048 elements: a row wider than a packet was
// written past the workspace (ASan: heap-buffer-overflow in store_packets). It is now carried in
// pieces of a packet by the NCCL path's stand-in, or refused when a fused path is forced.
TEST(TinyPackets, RowsWiderThanAPacketAreCarriedOrRefused) {
  for (const size_t packet : {size_t(16), size_t(48), size_t(4096)}) {
    TeamOptions options;
    options.packet_bytes = packet;
    std::vector<Team> team = create_cpu_team(2, options);
    std::vector<std::vector<float>> out(2, std::vector<float>(2048, -1.0f));
    std::vector<std::string> errors = on_ranks(2, [&](int r) {
      std::vector<float> input(2048);
      for (size_t i = 0; i < input.size(); ++i) input[i] = float(i % 97) + float(r);
      allreduce(team[r], input.data(), out[r].data(), 2048, DType::kFloat32);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "") << "packet " << packet;
      for (size_t i = 0; i < 2048; ++i) {
        ASSERT_EQ(out[r][i], 2.0f * float(i % 97) + 1.0f) << "packet " << packet << " i " << i;
      }
    }
    // The norm op through the same cut (its sum, then the local epilogue).
    std::vector<RowBuffers> buffers(2, RowBuffers(3, 1024, 2.0f));
    errors = on_ranks(2, [&](int r) {
      allreduce_add_rmsnorm(team[r], buffers[r].args(3, 1024, Algorithm::kAuto));
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "");
      EXPECT_EQ(buffers[r].residual_out, std::vector<float>(3 * 1024, 4.25f));
    }
    EXPECT_EQ(buffers[0].norm_out, buffers[1].norm_out);
    // Forced onto a fused path that cannot carry it: refused before any write, on every rank.
    for (Algorithm forced : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
      std::vector<RowBuffers> more(2, RowBuffers(4, 1024, 1.0f));
      errors = on_ranks(
          2, [&](int r) { allreduce_add_rmsnorm(team[r], more[r].args(4, 1024, forced)); });
      for (int r = 0; r < 2; ++r) {
        EXPECT_TRUE(contains(errors[r], "packet_bytes")) << errors[r];
        EXPECT_EQ(more[r].norm_out, std::vector<float>(4 * 1024, 7.0f));
      }
    }
  }
}

TEST(TeamOptions, CheckedAtCreation) {
  const auto message = [](const TeamOptions& options) {
    try {
      create_cpu_team(2, options);
    } catch (const Error& error) {
      return std::string(error.what());
    }
    return std::string();
  };
  TeamOptions options;
  options.packet_bytes = 8;
  EXPECT_TRUE(contains(message(options), "packet_bytes")) << message(options);
  options.packet_bytes = 24;
  EXPECT_TRUE(contains(message(options), "packet_bytes")) << message(options);
  options = TeamOptions{};
  options.packet_bytes = size_t{1} << 62;
  EXPECT_TRUE(contains(message(options), "packet_bytes")) << message(options);
  options = TeamOptions{};
  options.peer_timeout_seconds = -1;
  EXPECT_TRUE(contains(message(options), "peer_timeout_seconds")) << message(options);
  options.peer_timeout_seconds = std::nan("");
  EXPECT_TRUE(contains(message(options), "peer_timeout_seconds")) << message(options);
  options = TeamOptions{};
  options.handshake_timeout_seconds = -2;
  EXPECT_TRUE(contains(message(options), "handshake_timeout_seconds")) << message(options);
}

// World 2, peer timeout 0.3 s, bf16, 1 token, hidden 1024. Rank 0 makes call 1 alone and times
// out; then both call with new inputs (rank 0: 100, rank 1: 10). Rank 1 once returned 11 (rank
// 0's abandoned packet plus its own) and its check raised nothing.
TEST(LatePeer, IsRefusedNotGivenAnAbandonedCall) {
  for (Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl}) {
    TeamOptions options;
    options.peer_timeout_seconds = 0.3;
    std::vector<Team> team = create_cpu_team(2, options);
    const auto call = [&](int r, float value, std::vector<float>& out) {
      std::vector<float> input(1024, value);
      allreduce(team[r], input.data(), out.data(), 1024, DType::kFloat32, {}, algorithm);
    };
    std::vector<float> alone(1024, -1.0f);
    EXPECT_THROW(call(0, 1.0f, alone), Error);
    std::vector<std::vector<float>> out(2, std::vector<float>(1024, -1.0f));
    const std::vector<std::string> errors =
        on_ranks(2, [&](int r) { call(r, r == 0 ? 100.0f : 10.0f, out[r]); });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(contains(errors[r], "rank 0"))
          << algorithm_name(algorithm) << " rank " << r << ": " << errors[r];
      EXPECT_EQ(out[r], std::vector<float>(1024, -1.0f)) << "rank " << r << " wrote";
      try {
        team[r].check();
        ADD_FAILURE() << "rank " << r << "'s check passed on a failed team";
      } catch (const Error& error) {
        EXPECT_TRUE(contains(error.what(), "rank 0")) << error.what();
      }
    }
  }
}

// A rank that arrives while its peer still waits gets the call's exact result, and the team goes
// on: the mark is only for calls a peer gave up on.
TEST(LatePeer, WithinTheTimeoutIsAnOrdinaryCall) {
  TeamOptions options;
  options.peer_timeout_seconds = 5;
  std::vector<Team> team = create_cpu_team(2, options);
  for (int call = 0; call < 3; ++call) {
    std::vector<std::vector<float>> out(2, std::vector<float>(64));
    const std::vector<std::string> errors = on_ranks(2, [&](int r) {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::vector<float> input(64, float(r + 1));
      allreduce(team[r], input.data(), out[r].data(), 64, DType::kFloat32);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(errors[r], "");
      EXPECT_EQ(out[r], std::vector<float>(64, 3.0f));
      EXPECT_NO_THROW(team[r].check());
    }
  }
}

}  // namespace
}  // namespace tpfuse::testing
