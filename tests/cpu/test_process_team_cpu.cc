// The CPU backend across processes: teams over a shared-memory segment (create_cpu_team(id,
// rank, world_size)). First the property suites on such a team joined from threads (every rank
// with a mapping of its own), then real processes (fork): the thread team's bits, a peer that
// dies, a rank that never joins, ranks given different arguments, and no segment left behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "misuse_properties.h"
#include "mixed_properties.h"
#include "oneshot_properties.h"
#include "qknorm_properties.h"

namespace tpfuse::testing {
namespace {

TeamOptions small_options(double timeout_seconds = 10.0) {
  TeamOptions options;
  options.packet_bytes = 256 << 10;
  options.peer_timeout_seconds = timeout_seconds;
  return options;
}

// --- the properties, on a shared-memory team whose ranks are threads ---

class SharedMemoryAlgorithms : public ::testing::TestWithParam<std::tuple<int, Algorithm>> {
 protected:
  SharedMemoryAlgorithms()
      : harness_(create_shared_memory_team(std::get<0>(GetParam()), small_options())) {
    harness_.algorithm = std::get<1>(GetParam());
  }
  uint64_t seed(uint64_t base) const {
    return base + 100 * uint64_t(std::get<1>(GetParam())) + uint64_t(std::get<0>(GetParam()));
  }
  CpuHarness harness_;
};

TEST_P(SharedMemoryAlgorithms, MatchesFloat64ReferenceOnRandomCases) {
  check_random_cases(harness_, seed(21000), 25, 37);
}

TEST_P(SharedMemoryAlgorithms, AdversarialPayloads) {
  check_adversarial(harness_, seed(22000));
}

TEST_P(SharedMemoryAlgorithms, Fp8OutputsMatchTheirDefinition) {
  check_fp8_outputs(harness_, seed(23000), 2);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, SharedMemoryAlgorithms,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(Algorithm::kOneShot,
                                                              Algorithm::kTwoShot,
                                                              Algorithm::kNccl)),
                         [](const auto& info) {
                           return std::string(algorithm_name(std::get<1>(info.param))) + "_world" +
                                  std::to_string(std::get<0>(info.param));
                         });

class SharedMemoryTeam : public ::testing::TestWithParam<int> {};

TEST_P(SharedMemoryTeam, ThousandsOfConsecutiveCalls) {
  TeamOptions options = small_options();
  options.packet_bytes = 1 << 20;  // 64 tokens of the widest row (16384 fp32)
  CpuHarness harness(create_shared_memory_team(GetParam(), options));
  check_consecutive_calls(harness, 24000 + GetParam(), 1500, 16, 64);
}

TEST_P(SharedMemoryTeam, TwoShotGivesOneShotBitsWhateverTheBatch) {
  CpuHarness harness(create_shared_memory_team(GetParam(), small_options()));
  check_batch_invariance(harness, 25000 + GetParam());
}

TEST_P(SharedMemoryTeam, QkNormMatchesFloat64Reference) {
  CpuHarness harness(create_shared_memory_team(GetParam(), small_options()));
  check_qk_random_cases(harness, 26000 + GetParam(), 12);
  check_qk_identical_across_ranks(harness, 26500 + GetParam());
}

TEST_P(SharedMemoryTeam, QkNormInterleavedWithAddRmsNorm) {
  CpuHarness harness(create_shared_memory_team(GetParam(), small_options()));
  check_ops_interleaved(harness, 27000 + GetParam(), 60);
}

TEST_P(SharedMemoryTeam, MisuseReportedWhereItBelongsAndTheNextCallCorrect) {
  const int world = GetParam();
  TeamOptions options = small_options(5.0);
  options.packet_bytes = 64 << 10;
  CpuHarness harness(create_shared_memory_team(world, options));
  const MisuseCounts counts = check_misuse(harness, 28000 + uint64_t(world), 400, 8, [&] {
    return create_shared_memory_team(world, options);
  });
  EXPECT_GT(counts.rejected, 20);
  EXPECT_GT(counts.disagreeing, 20);
  EXPECT_GT(counts.good, 250);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, SharedMemoryTeam, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

// --- real processes ---

// Memory every forked rank shares with the test: anonymous, shared, created before the fork.
class SharedArea {
 public:
  explicit SharedArea(size_t bytes) : bytes_(bytes) {
    base_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap of the shared test area failed");
  }
  ~SharedArea() { ::munmap(base_, bytes_); }
  char* data() { return static_cast<char*>(base_); }

 private:
  void* base_;
  size_t bytes_;
};

constexpr size_t kMessageBytes = 2048;

// Forks one process per rank, runs rank_main(rank) in each and waits for all of them (killing
// them if they outlive `limit`). What each child threw, or "" if it returned, comes back per
// rank; a child that died by a signal or recorded a gtest failure is reported as such.
std::vector<std::string> run_processes(int world, const std::function<void(int rank)>& rank_main,
                                       std::chrono::seconds limit = std::chrono::seconds(60)) {
  SharedArea messages(size_t(world) * kMessageBytes);
  std::memset(messages.data(), 0, size_t(world) * kMessageBytes);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      std::string outcome;
      try {
        rank_main(rank);
        if (::testing::Test::HasFailure()) outcome = "a gtest expectation failed in this rank";
      } catch (const std::exception& error) {
        outcome = error.what();
        if (outcome.empty()) outcome = "an exception with no message";
      }
      std::snprintf(messages.data() + size_t(rank) * kMessageBytes, kMessageBytes, "%s",
                    outcome.c_str());
      std::fflush(stdout);
      ::_exit(0);
    }
    children.push_back(pid);
  }
  std::vector<std::string> outcomes(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    while (::waitpid(children[rank], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t child : children) ::kill(child, SIGKILL);
        ::waitpid(children[rank], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    outcomes[rank] = messages.data() + size_t(rank) * kMessageBytes;
    if (WIFSIGNALED(status)) {
      outcomes[rank] = "the process died of signal " + std::to_string(WTERMSIG(status));
    }
  }
  return outcomes;
}

// Whether a shared-memory name of this id is still in /dev/shm.
bool segment_listed(const CpuTeamId& id) {
  const std::string name = id.bytes + 16;  // IdFields: the magic, then "/tpfuse-..."
  return std::filesystem::exists("/dev/shm" + name);
}

// One rank of a team in this process: the CPU harness's memory, driving only `rank`.
class OneRankHarness : public CpuHarness {
 public:
  OneRankHarness(const Team& team, int world)
      : CpuHarness(one_rank_of(team, world)), rank_(team.rank()) {}
  void run(const std::function<void(int, cudaStream_t)>& call) override { call(rank_, nullptr); }
  void enqueue(const std::function<void(int, cudaStream_t)>& call) override { run(call); }

 private:
  static std::vector<Team> one_rank_of(const Team& team, int world) {
    std::vector<Team> ranks(static_cast<size_t>(world));
    ranks[size_t(team.rank())] = team;
    return ranks;
  }
  int rank_;
};

// The calls the process tests make: every algorithm, dtypes, widths, FP8 outputs, the plain
// all-reduce, in-place forms; the same list in every process (a fixed seed).
std::vector<CaseSpec> process_specs(int count) {
  std::mt19937_64 rng(31000);
  std::vector<CaseSpec> specs;
  const Algorithm algorithms[] = {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl,
                                  Algorithm::kAuto};
  const QuantMode quants[] = {QuantMode::kNone, QuantMode::kStatic, QuantMode::kPerToken,
                              QuantMode::kPerTokenGroup128};
  for (int c = 0; c < count; ++c) {
    CaseSpec spec = random_spec(rng, 9);
    spec.hidden = std::min<int64_t>(spec.hidden, 4096);
    spec.algorithm = algorithms[c % 4];
    if (c % 3 == 2 && !spec.plain_allreduce && spec.dtype != DType::kFloat32 &&
        spec.hidden % kQuantGroupSize == 0) {
      spec.quant = quants[1 + (c / 3) % 3];
    }
    specs.push_back(spec);
  }
  return specs;
}

// Bytes of one rank's outputs of one call, as the children write them: norm_out, residual_out,
// quant_out, scales.
size_t result_bytes(const CaseSpec& spec) {
  const size_t row = size_t(spec.tokens * spec.hidden);
  return 2 * row * dtype_size(spec.dtype) + OneShotRunner::quant_bytes(spec) +
         OneShotRunner::scale_count(spec) * 4;
}

void put(char*& at, const void* data, size_t bytes) {
  std::memcpy(at, data, bytes);
  at += bytes;
}
void take(const char*& at, void* data, size_t bytes) {
  std::memcpy(data, at, bytes);
  at += bytes;
}

TEST(ProcessTeam, ProcessesGiveTheFloat64ReferenceAndTheThreadTeamsBits) {
  for (const int world : {2, 4, 8}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::vector<CaseSpec> specs = process_specs(24);
    std::mt19937_64 rng(32000 + world);
    std::vector<CaseData> data;
    size_t per_rank = 0;
    for (const CaseSpec& spec : specs) {
      data.push_back(random_case(rng, spec, world));
      per_rank += result_bytes(spec);
    }
    // The thread team's results first (before any fork: no thread runs while the test forks).
    std::vector<CaseResult> threads;
    {
      CpuHarness harness(world, small_options());
      OneShotRunner runner(harness);
      for (size_t c = 0; c < specs.size(); ++c) threads.push_back(runner.run(specs[c], data[c]));
    }
    SharedArea area(per_rank * size_t(world));
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(world, [&](int rank) {
      OneRankHarness harness(create_cpu_team(id, rank, world, small_options()), world);
      OneShotRunner runner(harness);
      char* at = area.data() + size_t(rank) * per_rank;
      for (size_t c = 0; c < specs.size(); ++c) {
        CaseResult result = runner.run(specs[c], data[c]);
        put(at, result.norm_out[rank].data(), result.norm_out[rank].bytes.size());
        put(at, result.residual_out[rank].data(), result.residual_out[rank].bytes.size());
        if (specs[c].quant != QuantMode::kNone) {
          put(at, result.quant_out[rank].data(), result.quant_out[rank].size());
          put(at, result.scales[rank].data(), result.scales[rank].size() * 4);
        }
      }
    });
    for (int r = 0; r < world; ++r) ASSERT_EQ(outcomes[r], "") << "rank " << r;
    EXPECT_FALSE(segment_listed(id)) << "the team's shared-memory name outlived its creation";
    std::vector<const char*> at(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) at[r] = area.data() + size_t(r) * per_rank;
    for (size_t c = 0; c < specs.size(); ++c) {
      const CaseSpec& spec = specs[c];
      SCOPED_TRACE("call " + std::to_string(c) + ": " + describe(spec));
      const size_t count = size_t(spec.tokens * spec.hidden);
      CaseResult processes;
      for (int r = 0; r < world; ++r) {
        HostTensor norm(spec.dtype, count), residual_out(spec.dtype, count);
        take(at[r], norm.data(), norm.bytes.size());
        take(at[r], residual_out.data(), residual_out.bytes.size());
        EXPECT_TRUE(norm.bytes == threads[c].norm_out[r].bytes) << "norm_out of rank " << r;
        if (OneShotRunner::writes_residual_out(spec)) {
          EXPECT_TRUE(residual_out.bytes == threads[c].residual_out[r].bytes)
              << "residual_out of rank " << r;
        }
        processes.norm_out.push_back(std::move(norm));
        processes.residual_out.push_back(std::move(residual_out));
        if (spec.quant != QuantMode::kNone) {
          std::vector<uint8_t> quant(OneShotRunner::quant_bytes(spec));
          std::vector<float> scales(OneShotRunner::scale_count(spec));
          take(at[r], quant.data(), quant.size());
          take(at[r], scales.data(), scales.size() * 4);
          EXPECT_TRUE(quant == threads[c].quant_out[r]) << "quant_out of rank " << r;
          processes.quant_out.push_back(std::move(quant));
          processes.scales.push_back(std::move(scales));
        }
      }
      expect_correct(spec, data[c], processes);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// One call of 64 bf16 ones; what it threw, or "".
std::string one_call(const Team& team) {
  std::vector<uint16_t> input(64, 0x3f80), out(64);
  try {
    allreduce(team, input.data(), out.data(), 64, DType::kBFloat16);
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ProcessTeam, PeerThatDiesIsReportedAsMissingNamingItsProcess) {
  const CpuTeamId id = create_cpu_team_id();
  SharedArea calls(3 * kMessageBytes);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> outcomes = run_processes(3, [&](int rank) {
    const Team team = create_cpu_team(id, rank, 3, small_options(1.0));
    if (rank == 2) ::_exit(0);  // joins, then dies before its first call
    std::snprintf(calls.data() + rank * kMessageBytes, kMessageBytes, "%s", one_call(team).c_str());
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(outcomes[rank], "");
    const std::string error = calls.data() + rank * kMessageBytes;
    EXPECT_TRUE(contains(error, "timed out waiting for rank 2")) << error;
    EXPECT_TRUE(contains(error, "has exited")) << error;
    // The causes a timeout can have besides a death, a rejection that took no turn among them
    // (in the rank's own timeout; a rank that saw its peer's announcement first names that).
    if (!contains(error, "rank " + std::to_string(1 - rank) + " failed the team")) {
      EXPECT_TRUE(contains(error, "rejected its arguments where it could not take its turn"))
          << error;
    }
  }
  EXPECT_FALSE(segment_listed(id));
}

TEST(ProcessTeam, RankThatNeverJoinsIsNamedAndNothingIsLeftBehind) {
  const CpuTeamId id = create_cpu_team_id();
  const std::vector<std::string> outcomes = run_processes(3, [&](int rank) {
    if (rank == 2) return;  // never joins
    create_cpu_team(id, rank, 3, small_options(0.5));
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(contains(outcomes[rank], "rank(s) 2 did not join within 0.5 s")) << outcomes[rank];
  }
  EXPECT_FALSE(segment_listed(id));
}

TEST(ProcessTeam, RanksGivenDifferentArgumentsAreTold) {
  {
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
      TeamOptions options = small_options(0.5);
      if (rank == 1) options.packet_bytes *= 2;
      create_cpu_team(id, rank, 2, options);
    });
    EXPECT_TRUE(contains(outcomes[1], "in options.packet_bytes: 262144 on rank 0, 524288 here"))
        << outcomes[1];
    EXPECT_TRUE(contains(outcomes[0], "rank(s) 1 did not join")) << outcomes[0];
    EXPECT_FALSE(segment_listed(id));
  }
  {
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(
        3, [&](int rank) { create_cpu_team(id, rank, rank == 2 ? 4 : 3, small_options(0.5)); });
    EXPECT_TRUE(contains(outcomes[2], "in world_size: 3 on rank 0, 4 here")) << outcomes[2];
    EXPECT_TRUE(contains(outcomes[0], "rank(s) 2 did not join")) << outcomes[0];
  }
}

// A rank 0 killed while its team is being made leaves the segment's name behind (nothing ran
// its cleanup); the next id made on the host removes the names whose creator has exited.
TEST(ProcessTeam, ANameLeftByAKilledCreatorIsRemovedByTheNextId) {
  auto* shared = static_cast<CpuTeamId*>(::mmap(nullptr, sizeof(CpuTeamId), PROT_READ | PROT_WRITE,
                                                MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(shared, MAP_FAILED);
  std::memset(shared, 0, sizeof(CpuTeamId));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    *shared = create_cpu_team_id();  // named after this process
    try {
      create_cpu_team(*shared, 0, 2, small_options(60.0));  // waits for a rank 1 that never comes
    } catch (...) {
    }
    ::_exit(0);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!(shared->bytes[0] != 0 && segment_listed(*shared)) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const bool created = segment_listed(*shared);
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  const CpuTeamId left = *shared;
  ::munmap(shared, sizeof(CpuTeamId));
  ASSERT_TRUE(created) << "rank 0 never created its segment";
  EXPECT_TRUE(segment_listed(left))
      << "the killed creator's name is expected to stay until a sweep";
  create_cpu_team_id();
  EXPECT_FALSE(segment_listed(left)) << "the next id did not remove the dead creator's name";
}

TEST(ProcessTeam, WaitingForAMissingRankZeroEnds) {
  const CpuTeamId id = create_cpu_team_id();
  try {
    create_cpu_team(id, 1, 2, small_options(0.3));
    FAIL() << "rank 1 joined a team whose rank 0 never came";
  } catch (const Error& error) {
    EXPECT_TRUE(contains(error.what(), "waited 0.3 s for rank 0 to create the team"))
        << error.what();
  }
}

TEST(ProcessTeam, BadArgumentsAreNamed) {
  const CpuTeamId id = create_cpu_team_id();
  const auto error_of = [](const std::function<void()>& create) -> std::string {
    try {
      create();
    } catch (const Error& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(CpuTeamId{}, 0, 2); }),
                       "id was not made by create_cpu_team_id"));
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(id, 2, 2); }),
                       "rank must be in [0, world_size = 2), got 2"));
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(id, 0, 0); }), "world_size must be in"));
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(id, 0, 17); }), "world_size must be in"));
  TeamOptions bad = small_options();
  bad.packet_bytes = 24;
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(id, 0, 2, bad); }),
                       "options.packet_bytes must be a positive multiple of 16"));
  // A rank that joins twice: one of the two is refused, and the team completes with the other.
  // Rank 2 joins only once the refusal is in, so that both joins of rank 1 find the team still
  // being made (a join after the team is complete finds no segment: its name is gone).
  std::vector<Team> team(4);
  std::string joins[2];
  std::atomic<int> returned{0};
  std::thread first([&] { team[0] = create_cpu_team(id, 0, 3, small_options(10.0)); });
  std::vector<std::thread> rank_one;
  for (int j = 0; j < 2; ++j) {
    rank_one.emplace_back([&, j] {
      joins[j] = error_of([&] { team[1 + j] = create_cpu_team(id, 1, 3, small_options(10.0)); });
      returned.fetch_add(1);
    });
  }
  const auto start = std::chrono::steady_clock::now();
  while (returned.load() == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(8)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::thread last([&] { team[3] = create_cpu_team(id, 2, 3, small_options(10.0)); });
  first.join();
  last.join();
  for (auto& thread : rank_one) thread.join();
  const int refused = joins[0].empty() ? 1 : 0;
  EXPECT_TRUE(joins[1 - refused].empty()) << joins[1 - refused];
  EXPECT_TRUE(contains(joins[refused], "rank 1 has already joined this team")) << joins[refused];
  std::string errors[3];
  const Team* ranks[3] = {&team[0], &team[2 - refused], &team[3]};
  std::vector<std::thread> callers;
  for (int r = 0; r < 3; ++r) callers.emplace_back([&, r] { errors[r] = one_call(*ranks[r]); });
  for (auto& caller : callers) caller.join();
  EXPECT_EQ(errors[0] + errors[1] + errors[2], "");
}

TEST(ProcessTeam, OneRankTeamRunsLocally) {
  const Team team = create_cpu_team(create_cpu_team_id(), 0, 1, small_options());
  EXPECT_EQ(team.peer_memory(), "shared memory");
  EXPECT_EQ(one_call(team), "");
}

}  // namespace
}  // namespace tpfuse::testing
