// The CPU backend across processes: teams over one block of shared memory (create_cpu_team(id,
// rank, world_size)). First the property suites on such a team joined from threads (every rank
// with a mapping of its own), then real processes (fork): the thread team's bits, a peer that
// dies, a rank that never joins, a rank 0 that starts late, ranks given different arguments, and
// nothing left behind, even when every rank is killed while the team is being made.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
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

// The team's name in an id (IdFields: the magic, then "tpfuse-<random>"): rank 0's abstract
// socket and the memory's memfd name.
std::string team_name(const CpuTeamId& id) {
  return id.bytes + 16;
}

// Whether rank 0's socket is open: Linux lists abstract names in /proc/net/unix as "@name".
bool socket_listed(const std::string& name) {
  std::ifstream sockets("/proc/net/unix");
  for (std::string line; std::getline(sockets, line);) {
    const size_t at = line.rfind(" @");
    if (at != std::string::npos && line.substr(at + 2) == name) return true;
  }
  return false;
}

// The processes of this host that hold the team's memory, by descriptor or mapping (a memfd
// shows as "/memfd:<name> (deleted)"): once none does, the kernel has freed it.
std::vector<pid_t> memory_holders(const std::string& name) {
  const std::string memfd = "/memfd:" + name + " ";
  std::vector<pid_t> holders;
  std::error_code ignored;
  for (const auto& process : std::filesystem::directory_iterator("/proc", ignored)) {
    const pid_t pid = pid_t(std::strtol(process.path().filename().c_str(), nullptr, 10));
    if (pid <= 0) continue;
    bool holds = false;
    for (const auto& fd : std::filesystem::directory_iterator(process.path() / "fd", ignored)) {
      holds = holds ||
              (std::filesystem::read_symlink(fd.path(), ignored).string() + " ").find(memfd) == 0;
    }
    std::ifstream maps(process.path() / "maps");
    for (std::string line; !holds && std::getline(maps, line);) {
      holds = (line + " ").find(memfd) != std::string::npos;
    }
    if (holds) holders.push_back(pid);
  }
  return holders;
}

// The entries of /dev/shm whose name contains `part`.
std::vector<std::string> shm_entries(const std::string& part) {
  std::vector<std::string> entries;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    const std::string file = entry.path().filename().string();
    if (file.find(part) != std::string::npos) entries.push_back(file);
  }
  return entries;
}

// What a team of this id left behind on the host once its processes are gone: its socket, a
// process holding its memory, a file in /dev/shm; "" if nothing.
std::string left_behind(const CpuTeamId& id) {
  const std::string name = team_name(id);
  std::ostringstream left;
  if (socket_listed(name)) left << "the socket @" << name << "; ";
  for (pid_t pid : memory_holders(name)) left << "the memory, held by process " << pid << "; ";
  for (const std::string& file : shm_entries(name)) left << "/dev/shm/" << file << "; ";
  return left.str();
}

// One rank of a team in this process: the CPU harness's memory, driving only `rank`.
class OneRankHarness : public CpuHarness {
 public:
  OneRankHarness(const Team& team, int world)
      : CpuHarness(one_rank_of(team, world)), rank_(team.rank()) {}
  void run(const std::function<void(int, Stream)>& call) override { call(rank_, Stream{}); }
  void enqueue(const std::function<void(int, Stream)>& call) override { run(call); }

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
      // Rank 0 closes its socket once every rank has joined: the team has no name while it runs.
      if (rank == 0) EXPECT_FALSE(socket_listed(team_name(id)));
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
    EXPECT_EQ(left_behind(id), "") << "the team outlived its processes";
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
  EXPECT_EQ(left_behind(id), "");
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
  EXPECT_EQ(left_behind(id), "");
}

// A rank that gives up marks the memory abandoned: a rank still waiting with a longer timeout
// sees the mark and throws too, naming the rank that did not join.
TEST(ProcessTeam, ARankGivingUpEndsTheWaitOfTheOthers) {
  const CpuTeamId id = create_cpu_team_id();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> outcomes = run_processes(3, [&](int rank) {
    if (rank == 2) return;  // never joins
    create_cpu_team(id, rank, 3, small_options(rank == 0 ? 60.0 : 0.5));
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_TRUE(contains(outcomes[1], "rank(s) 2 did not join within 0.5 s")) << outcomes[1];
  EXPECT_TRUE(contains(outcomes[0], "another rank gave up waiting; rank(s) 2 did not join"))
      << outcomes[0];
  EXPECT_EQ(left_behind(id), "");
}

// Rank 1 connects to rank 0's socket until rank 0 listens: a rank 0 that starts late is waited
// for, up to the deadline.
TEST(ProcessTeam, RankZeroStartingLongAfterRankOneStillMakesTheTeam) {
  const CpuTeamId id = create_cpu_team_id();
  SharedArea calls(2 * kMessageBytes);
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const Team team = create_cpu_team(id, rank, 2, small_options(10.0));
    std::snprintf(calls.data() + rank * kMessageBytes, kMessageBytes, "%s", one_call(team).c_str());
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(outcomes[rank], "") << "rank " << rank;
    EXPECT_STREQ(calls.data() + rank * kMessageBytes, "") << "rank " << rank;
  }
  EXPECT_EQ(left_behind(id), "");
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
    EXPECT_EQ(left_behind(id), "");
  }
  {
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(
        3, [&](int rank) { create_cpu_team(id, rank, rank == 2 ? 4 : 3, small_options(0.5)); });
    EXPECT_TRUE(contains(outcomes[2], "in world_size: 3 on rank 0, 4 here")) << outcomes[2];
    EXPECT_TRUE(contains(outcomes[0], "rank(s) 2 did not join")) << outcomes[0];
  }
}

// Every rank killed while the team is being made (rank 0 waiting for a rank that never comes,
// with the memory in its hands and in those of the ranks that joined): nothing ran a cleanup,
// and still nothing is left, no file in /dev/shm, no socket, no process holding the memory (the
// test process never holds it: it forks the ranks and makes only the id). The kernel frees what
// no process holds.
TEST(ProcessTeam, EveryRankKilledWhileTheTeamIsMadeLeavesNothing) {
  for (const int joining : {1, 2}) {  // world 2: rank 0 alone; world 3: ranks 0 and 1
    const int world = joining + 1;
    SCOPED_TRACE("world " + std::to_string(world) + ", ranks below " + std::to_string(joining) +
                 " killed, rank " + std::to_string(joining) + " never joins");
    const CpuTeamId id = create_cpu_team_id();
    const std::string name = team_name(id);
    std::fflush(stdout);
    std::fflush(stderr);
    std::vector<pid_t> children;
    for (int rank = 0; rank < joining; ++rank) {
      const pid_t child = ::fork();
      ASSERT_GE(child, 0);
      if (child == 0) {
        try {
          create_cpu_team(id, rank, world, small_options(60.0));  // waits for the missing rank
        } catch (...) {
        }
        ::_exit(0);
      }
      children.push_back(child);
    }
    // Wait until every joining rank maps the memory and rank 0 listens.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::vector<pid_t> holders;
    bool listening = false;
    while (std::chrono::steady_clock::now() < deadline) {
      holders = memory_holders(name);
      listening = socket_listed(name);
      if (listening && holders.size() >= children.size()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (pid_t child : children) ::kill(child, SIGKILL);
    for (pid_t child : children) {
      int status = 0;
      ::waitpid(child, &status, 0);
      EXPECT_TRUE(WIFSIGNALED(status)) << "process " << child << " ended before it was killed";
    }
    ASSERT_TRUE(listening) << "rank 0 never listened on @" << name;
    std::sort(holders.begin(), holders.end());
    std::vector<pid_t> expected = children;
    std::sort(expected.begin(), expected.end());
    ASSERT_EQ(holders, expected) << "the ranks, and only they, hold the memory while they wait";
    EXPECT_EQ(left_behind(id), "");
    for (pid_t child : children) {
      EXPECT_TRUE(shm_entries("tpfuse-" + std::to_string(child) + "-").empty())
          << "a /dev/shm file of process " << child;
    }
  }
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
                       "options.packet_bytes must be a multiple of 16"));
  // A rank that joins twice: one of the two is refused, and the team completes with the other.
  // Rank 2 joins only once the refusal is in, so that both joins of rank 1 find the team still
  // being made (a join after the team is complete finds no socket: rank 0 has closed it).
  std::vector<Team> team(4);
  std::string joins[2];
  std::atomic<int> returned{0};
  std::thread first([&] { team[0] = create_cpu_team(id, 0, 3, small_options(10.0)); });
  // A second rank 0 of the id finds the first one's socket: an id makes one team.
  const auto listening = std::chrono::steady_clock::now();
  while (!socket_listed(team_name(id)) &&
         std::chrono::steady_clock::now() - listening < std::chrono::seconds(8)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(contains(error_of([&] { create_cpu_team(id, 0, 3, small_options(10.0)); }),
                       "an id makes one team"));
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
