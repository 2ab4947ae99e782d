// SYCL teams of one rank per process (create_sycl_team(id, rank, world_size, device)) on Intel's
// OpenCL CPU device (label sycl): every rank a forked process, forked before this process uses
// SYCL at all (the runtime is not fork-safe once started), each with an alarm, so that nothing
// hangs. World 2 (the machine's 2 cores are the device's 2 compute units: at most 2 ranks may
// spin), except the refusal of one rank more. The CPU backend's bits for add + RMSNorm and
// allreduce on a few shapes and dtypes, back-to-back calls across processes, a rank that never
// joins, ranks given other arguments, a rejected call, a killed rank, the refusal (of one rank
// more than the compute units, and of two ranks pinned to one CPU), bad arguments.
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sycl/sycl.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "oneshot_properties.h"
#include "tpfuse/sycl.h"

namespace tpfuse::testing {
namespace {

// Memory every forked rank shares with the test: anonymous, shared, created before the fork.
class SharedArea {
 public:
  explicit SharedArea(size_t bytes) : bytes_(bytes) {
    base_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap of the shared test area failed");
    std::memset(base_, 0, bytes);
  }
  ~SharedArea() { ::munmap(base_, bytes_); }
  char* data() { return static_cast<char*>(base_); }

 private:
  void* base_;
  size_t bytes_;
};

constexpr size_t kMessageBytes = 4096;

// Forks one process per rank, runs rank_main(rank) in each (under an alarm of `limit_seconds`)
// and waits for all of them (killing them if they outlive the limit). What each child threw, or
// "" if it returned, comes back per rank; a child that died by a signal, or recorded a gtest
// failure, is reported as such. Nothing of SYCL runs in this process.
std::vector<std::string> run_processes(int world, const std::function<void(int rank)>& rank_main,
                                       unsigned limit_seconds = 120) {
  SharedArea messages(size_t(world) * kMessageBytes);
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::alarm(limit_seconds);
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
      std::fflush(stderr);
      ::_exit(0);  // no static destructor of the SYCL runtime's
    }
    children.push_back(pid);
  }
  std::vector<std::string> outcomes(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limit_seconds + 5);
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

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

sycl::device cpu_device() {
  return sycl::device(sycl::cpu_selector_v);
}

// What a first child found, once per test process: the CPU device's compute units (0: none, and
// why), after making a one-rank team, which compiles the kernels into the disk cache (minutes,
// cold) so that the ranks of a test do not each compile them while their peers wait.
struct DeviceProbe {
  int compute_units = 0;
  std::string why;
};

const DeviceProbe& probe() {
  static const DeviceProbe found = [] {
    SharedArea area(kMessageBytes);
    const std::vector<std::string> outcomes = run_processes(
        1,
        [&](int) {
          const sycl::device device = cpu_device();
          create_sycl_team(create_cpu_team_id(), 0, 1, device);
          std::snprintf(area.data(), kMessageBytes, "%u",
                        device.get_info<sycl::info::device::max_compute_units>());
        },
        900);
    DeviceProbe probe;
    probe.compute_units = std::atoi(area.data());
    if (probe.compute_units == 0) probe.why = "no SYCL CPU device: " + outcomes[0];
    return probe;
  }();
  return found;
}

// The CPU device, or why there is none (a failure where TPFUSE_SYCL_REQUIRE_DEVICE is set, as
// ctest sets it; a skip by hand without the environment fetch-sycl.sh prints); two ranks need
// two compute units.
#define TPF_REQUIRE_DEVICE(ranks)                                                    \
  do {                                                                               \
    if (probe().compute_units == 0) {                                                \
      if (std::getenv("TPFUSE_SYCL_REQUIRE_DEVICE")) FAIL() << probe().why;          \
      GTEST_SKIP() << probe().why;                                                   \
    }                                                                                \
    if (probe().compute_units < (ranks)) {                                           \
      GTEST_SKIP() << (ranks) << " ranks need " << (ranks) << " compute units, the " \
                   << "device has " << probe().compute_units;                        \
    }                                                                                \
  } while (0)

TeamOptions test_options(double timeout_seconds = 10.0) {
  TeamOptions options;
  options.packet_bytes = 1 << 20;
  options.peer_timeout_seconds = timeout_seconds;
  options.handshake_timeout_seconds = 1.0;
  return options;
}

// One rank of a team, in its own process: every buffer on its device (the other ranks' too,
// which OneShotRunner uploads and downloads but no call of this process uses), calls on its
// own queue.
class ProcessRankHarness : public Harness {
 public:
  ProcessRankHarness(const Team& team, int world) : team_(size_t(world)), rank_(team.rank()) {
    team_[size_t(rank_)] = team;
  }
  ~ProcessRankHarness() override {
    try {
      team_[size_t(rank_)].check();
    } catch (const Error&) {
    }
    for (void* block : blocks_) sycl::free(block, queue());
  }
  std::vector<Team>& team() override { return team_; }
  sycl::queue& queue() { return sycl_queue(team_[size_t(rank_)]); }
  void* allocate(int, size_t bytes) override {
    void* block = sycl::malloc_device(bytes + 64, queue());
    if (block == nullptr) throw Error("sycl::malloc_device of " + std::to_string(bytes) + " bytes");
    blocks_.push_back(block);
    return block;
  }
  void upload(int, void* destination, const void* source, size_t bytes) override {
    queue().memcpy(destination, source, bytes).wait();
  }
  void download(int, void* destination, const void* source, size_t bytes) override {
    queue().memcpy(destination, source, bytes).wait();
  }
  void run(const std::function<void(int, Stream)>& call) override {
    enqueue(call);
    synchronize();
  }
  void enqueue(const std::function<void(int, Stream)>& call) override {
    call(rank_, sycl_stream(queue()));
  }
  void synchronize() override { team_[size_t(rank_)].check(); }

 private:
  std::vector<Team> team_;
  int rank_;
  std::vector<void*> blocks_;
};

// Bytes of one rank's outputs of one call: norm_out, residual_out, quant_out, scales.
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

// A few shapes and dtypes of add + RMSNorm (with and without a residual, 1 + gamma, an FP8
// output) and of the plain all-reduce, one-shot and two-shot.
std::vector<CaseSpec> bit_specs() {
  std::vector<CaseSpec> specs;
  const auto add = [&](DType dtype, int64_t tokens, int64_t hidden, Algorithm algorithm) {
    CaseSpec spec;
    spec.dtype = dtype;
    spec.tokens = tokens;
    spec.hidden = hidden;
    spec.algorithm = algorithm;
    specs.push_back(spec);
    return &specs.back();
  };
  add(DType::kBFloat16, 3, 3072, Algorithm::kOneShot);
  add(DType::kFloat16, 5, 1024, Algorithm::kTwoShot);
  add(DType::kFloat32, 2, 136, Algorithm::kOneShot)->residual = false;
  add(DType::kBFloat16, 7, 2048, Algorithm::kTwoShot)->norm_weight = NormWeight::kOnePlusGamma;
  add(DType::kBFloat16, 4, 512, Algorithm::kOneShot)->quant = QuantMode::kPerTokenGroup128;
  add(DType::kBFloat16, 33, 3072, Algorithm::kAuto);
  for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    add(DType::kFloat32, 4, 256, algorithm)->plain_allreduce = true;
    add(DType::kBFloat16, 1, 4096, algorithm)->plain_allreduce = true;
    add(DType::kFloat16, 9, 760, algorithm)->plain_allreduce = true;
  }
  for (CaseSpec& spec : specs) {
    if (spec.plain_allreduce || !spec.residual) spec.residual_out = spec.plain_allreduce;
    if (spec.plain_allreduce) spec.residual = false;
  }
  return specs;
}

TEST(SyclProcesses, GiveTheCpuBackendsBits) {
  TPF_REQUIRE_DEVICE(2);
  const std::vector<CaseSpec> specs = bit_specs();
  std::mt19937_64 rng(4200);
  const uint32_t adversarial[] = {0x80000000u, 0x00008000u, 0x80000001u, 0x00000001u,
                                  0x7f800000u, 0x00800000u, 0x3f800000u, 0x00000000u};
  std::vector<CaseData> data;
  size_t per_rank = 0;
  for (size_t c = 0; c < specs.size(); ++c) {
    data.push_back(random_case(rng, specs[c], 2));
    if (c % 3 == 1) {  // the sentinel's bits and its neighbours in the payload
      for (HostTensor& input : data.back().inputs) {
        for (size_t w = 0; w < input.bytes.size() / 4; w += 1 + rng() % 3) {
          const uint32_t word = adversarial[rng() % std::size(adversarial)];
          std::memcpy(input.bytes.data() + 4 * w, &word, 4);
        }
      }
    }
    per_rank += result_bytes(specs[c]);
  }
  // The CPU backend's results first (its threads end before the fork).
  std::vector<CaseResult> on_cpu;
  {
    CpuHarness cpu(2, test_options());
    OneShotRunner runner(cpu);
    for (size_t c = 0; c < specs.size(); ++c) on_cpu.push_back(runner.run(specs[c], data[c]));
  }
  SharedArea area(per_rank * 2);
  const CpuTeamId id = create_cpu_team_id();
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    const sycl::device device = cpu_device();
    const auto start = std::chrono::steady_clock::now();
    const Team team = create_sycl_team(id, rank, 2, device, test_options());
    std::printf("rank %d: the team made in %.3f s (kernels from the disk cache)\n", rank,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    EXPECT_EQ(team.peer_memory(), "sycl shared memory");
    EXPECT_EQ(team.rank(), rank);
    EXPECT_EQ(team.world_size(), 2);
    ProcessRankHarness harness(team, 2);
    OneShotRunner runner(harness);
    char* at = area.data() + size_t(rank) * per_rank;
    for (size_t c = 0; c < specs.size(); ++c) {
      const CaseResult result = runner.run(specs[c], data[c]);
      put(at, result.norm_out[rank].data(), result.norm_out[rank].bytes.size());
      put(at, result.residual_out[rank].data(), result.residual_out[rank].bytes.size());
      if (specs[c].quant != QuantMode::kNone) {
        put(at, result.quant_out[rank].data(), result.quant_out[rank].size());
        put(at, result.scales[rank].data(), result.scales[rank].size() * 4);
      }
    }
  });
  for (int r = 0; r < 2; ++r) ASSERT_EQ(outcomes[r], "") << "rank " << r;
  const char* at[2] = {area.data(), area.data() + per_rank};
  for (size_t c = 0; c < specs.size(); ++c) {
    const CaseSpec& spec = specs[c];
    SCOPED_TRACE("call " + std::to_string(c) + ": " + describe(spec));
    const size_t count = size_t(spec.tokens * spec.hidden);
    for (int r = 0; r < 2; ++r) {
      HostTensor norm(spec.dtype, count), residual_out(spec.dtype, count);
      take(at[r], norm.data(), norm.bytes.size());
      take(at[r], residual_out.data(), residual_out.bytes.size());
      EXPECT_TRUE(norm.bytes == on_cpu[c].norm_out[r].bytes) << "norm_out (or out) of rank " << r;
      if (OneShotRunner::writes_residual_out(spec)) {
        EXPECT_TRUE(residual_out.bytes == on_cpu[c].residual_out[r].bytes)
            << "residual_out of rank " << r;
      }
      if (spec.quant != QuantMode::kNone) {
        std::vector<uint8_t> quant(OneShotRunner::quant_bytes(spec));
        std::vector<float> scales(OneShotRunner::scale_count(spec));
        take(at[r], quant.data(), quant.size());
        take(at[r], scales.data(), scales.size() * 4);
        EXPECT_TRUE(quant == on_cpu[c].quant_out[r]) << "quant_out of rank " << r;
        EXPECT_EQ(std::memcmp(scales.data(), on_cpu[c].scales[r].data(), scales.size() * 4), 0)
            << "scales of rank " << r;
      }
    }
    // The CPU backend's own result is right (where the inputs are not adversarial).
    if (c % 3 != 1) expect_correct(spec, data[c], on_cpu[c]);
  }
}

// Calls queued back to back across processes (16 before a wait), one-shot and two-shot
// alternating, widths changing, scales alternating by 2^20 from call to call: every sum exact
// (small integers times a power of two), so any slot mixed up between two calls shows.
TEST(SyclProcesses, BackToBackCallsAcrossProcesses) {
  TPF_REQUIRE_DEVICE(2);
  constexpr int kCalls = 480, kBatch = 16;
  static constexpr int64_t kMostCount = 64 * 136;
  const CpuTeamId id = create_cpu_team_id();
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    const Team team = create_sycl_team(id, rank, 2, cpu_device(), test_options());
    sycl::queue& queue = sycl_queue(team);
    std::vector<float*> in(kBatch), out(kBatch);
    for (int s = 0; s < kBatch; ++s) {
      in[s] = sycl::malloc_shared<float>(kMostCount, queue);
      out[s] = sycl::malloc_shared<float>(kMostCount, queue);
    }
    const auto value = [](int call, int64_t i, int r) {
      const float scale = call % 2 ? 1048576.0f : 1.0f / 1048576.0f;
      return float(int((call * 7 + i * 3 + r * 11) % 64) - 32) * scale;
    };
    const auto count_of = [](int call) {
      return int64_t(8 * (1 + (call * 37) % (kMostCount / 8)));
    };
    int wrong = 0;
    for (int first = 0; first < kCalls; first += kBatch) {
      for (int call = first; call < first + kBatch; ++call) {
        const int s = call - first;
        for (int64_t i = 0; i < count_of(call); ++i) in[s][i] = value(call, i, rank);
        std::fill(out[s], out[s] + count_of(call), -1.0f);
      }
      for (int call = first; call < first + kBatch; ++call) {
        allreduce(team, in[call - first], out[call - first], count_of(call), DType::kFloat32, queue,
                  call % 3 == 0 ? Algorithm::kTwoShot : Algorithm::kOneShot);
      }
      team.check();
      for (int call = first; call < first + kBatch; ++call) {
        for (int64_t i = 0; i < count_of(call); ++i) {
          wrong += out[call - first][i] != value(call, i, 0) + value(call, i, 1);
        }
      }
    }
    EXPECT_EQ(wrong, 0) << "elements of " << kCalls << " calls on rank " << rank;
    for (int s = 0; s < kBatch; ++s) {
      sycl::free(in[s], queue);
      sycl::free(out[s], queue);
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(outcomes[r], "") << "rank " << r;
}

TEST(SyclProcesses, RankThatNeverJoinsIsNamed) {
  TPF_REQUIRE_DEVICE(2);
  const CpuTeamId id = create_cpu_team_id();
  SharedArea waited(sizeof(double));
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    if (rank == 1) return;  // never joins
    const sycl::device device = cpu_device();
    const auto start = std::chrono::steady_clock::now();
    try {
      create_sycl_team(id, rank, 2, device, test_options(1.0));
    } catch (...) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::memcpy(waited.data(), &seconds, sizeof(seconds));
      throw;
    }
  });
  EXPECT_TRUE(contains(outcomes[0], "rank(s) 1 did not join within 2 s")) << outcomes[0];
  EXPECT_EQ(outcomes[1], "");
  double seconds = 0;
  std::memcpy(&seconds, waited.data(), sizeof(seconds));
  // The wait (1 s + the 1 s handshake timeout) after the rank's own setup (kernels from the
  // disk cache, the clock's 50 ms calibration).
  EXPECT_GT(seconds, 2.0);
  EXPECT_LT(seconds, 15.0);
}

TEST(SyclProcesses, RanksGivenDifferentArgumentsAreTold) {
  TPF_REQUIRE_DEVICE(2);
  {
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
      TeamOptions options = test_options(2.0);
      if (rank == 1) options.packet_bytes *= 2;
      create_sycl_team(id, rank, 2, cpu_device(), options);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(contains(outcomes[r], "rank " + std::to_string(r) +
                                            ": the ranks were not given the same options, in "
                                            "options.packet_bytes: 1048576 on rank 0, 2097152 "
                                            "on rank 1"))
          << outcomes[r];
    }
  }
  {
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
      create_sycl_team(id, rank, rank == 1 ? 3 : 2, cpu_device(), test_options(1.0));
    });
    EXPECT_TRUE(contains(outcomes[1], "in world_size: 2 on rank 0, 3 here")) << outcomes[1];
    EXPECT_TRUE(contains(outcomes[0], "rank(s) 1 did not join")) << outcomes[0];
  }
  {
    // peer_stores false on every rank: no NCCL path to run on; the same error on both.
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
      TeamOptions options = test_options(2.0);
      options.peer_stores = false;
      create_sycl_team(id, rank, 2, cpu_device(), options);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(contains(outcomes[r], "options.peer_stores must be true")) << outcomes[r];
    }
  }
}

// A rank whose own setup fails (here its workspace, which RLIMIT_FSIZE keeps from being sized:
// EFBIG) still joins and tells its peers: every rank throws naming it, with its message, at once.
TEST(SyclProcesses, ARankWhoseSetupFailsIsNamedOnEveryRank) {
  TPF_REQUIRE_DEVICE(2);
  const CpuTeamId id = create_cpu_team_id();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    if (rank == 1) {
      // SIGXFSZ blocked, not ignored: the runtime's compiler (LLVM) installs a handler of its own
      // for it, which prints a crash banner. Blocked, it stays pending; the call fails (EFBIG).
      sigset_t file_size;
      sigemptyset(&file_size);
      sigaddset(&file_size, SIGXFSZ);
      ::pthread_sigmask(SIG_BLOCK, &file_size, nullptr);
      const rlimit limit{1 << 20, 1 << 20};  // below the 6 MiB workspace
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) throw Error("setrlimit");
    }
    create_sycl_team(id, rank, 2, cpu_device(), test_options(30.0));
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  std::printf("rank 0 was told: %s\n", outcomes[0].c_str());
  EXPECT_TRUE(contains(outcomes[0], "rank 0: rank 1's setup failed: ")) << outcomes[0];
  EXPECT_TRUE(contains(outcomes[1], "rank 1: setup failed: ")) << outcomes[1];
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(outcomes[r], "bytes of shared memory for the workspace")) << outcomes[r];
    EXPECT_TRUE(contains(outcomes[r], "File too large")) << outcomes[r];
  }
}

// Rank 0 rejects its arguments (a count that is not a multiple of kHiddenMultiple): it takes its
// turn without data, so rank 1's call ends at once (NaN outputs, an error naming rank 0's
// rejection), and the team goes on: the next call is right on both ranks.
TEST(SyclProcesses, ARejectedCallIsReportedToItsPeer) {
  TPF_REQUIRE_DEVICE(2);
  const CpuTeamId id = create_cpu_team_id();
  SharedArea messages(2 * kMessageBytes);
  constexpr int64_t kCount = 256;
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    const Team team = create_sycl_team(id, rank, 2, cpu_device(), test_options(60.0));
    sycl::queue& queue = sycl_queue(team);
    float* in = sycl::malloc_shared<float>(kCount + 8, queue);
    float* out = sycl::malloc_shared<float>(kCount + 8, queue);
    std::fill(in, in + kCount + 8, 1.0f);
    std::fill(out, out + kCount + 8, -7.0f);
    std::string error;
    const auto start = std::chrono::steady_clock::now();
    try {
      if (rank == 0) {
        allreduce(team, in, out, kCount + 1, DType::kFloat32, queue);
      } else {
        allreduce(team, in, out, kCount, DType::kFloat32, queue);
      }
      team.check();
    } catch (const Error& e) {
      error = e.what();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rank == 0) {
      EXPECT_TRUE(contains(error, "count must be a positive multiple of 8, got 257")) << error;
      for (int64_t i = 0; i < kCount + 8; ++i) ASSERT_EQ(out[i], -7.0f) << "rank 0 wrote " << i;
    } else {
      EXPECT_TRUE(contains(error, "rank 0 rejected its part")) << error;
      EXPECT_LT(seconds, 20.0) << "rank 1 waited toward its timeout instead of being told";
      for (int64_t i = 0; i < kCount; ++i) ASSERT_TRUE(std::isnan(out[i])) << "element " << i;
    }
    std::snprintf(messages.data() + rank * kMessageBytes, kMessageBytes, "%s", error.c_str());
    allreduce(team, in, out, kCount, DType::kFloat32, queue);
    team.check();
    for (int64_t i = 0; i < kCount; ++i) ASSERT_EQ(out[i], 2.0f) << "the next call, element " << i;
    sycl::free(in, queue);
    sycl::free(out, queue);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r], "") << "rank " << r;
    std::printf("rank %d was told: %s\n", r, messages.data() + r * kMessageBytes);
  }
}

// Rank 1 is killed while its call waits for rank 0's (its packets may or may not be in): rank
// 0's call that waits for a packet rank 1 never sent ends within its timeout (2 s), naming rank
// 1 and its exited process; rank 0's next call is refused at once.
TEST(SyclProcesses, AKilledRankIsReportedWithinTheTimeout) {
  TPF_REQUIRE_DEVICE(2);
  const CpuTeamId id = create_cpu_team_id();
  SharedArea report(kMessageBytes + sizeof(double) + sizeof(int));
  constexpr int64_t kCount = 512;
  constexpr double kTimeout = 2.0;
  const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
    const Team team = create_sycl_team(id, rank, 2, cpu_device(), test_options(kTimeout));
    sycl::queue& queue = sycl_queue(team);
    float* in = sycl::malloc_shared<float>(kCount, queue);
    float* out = sycl::malloc_shared<float>(kCount, queue);
    std::fill(in, in + kCount, 1.0f);
    allreduce(team, in, out, kCount, DType::kFloat32, queue);
    team.check();
    ASSERT_EQ(out[0], 2.0f);
    if (rank == 1) {
      allreduce(team, in, out, kCount, DType::kFloat32, queue);  // waits for rank 0's packets
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ::raise(SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // rank 1 has died by now
    std::string error;
    double seconds = 0;
    int call = 2;
    for (; call <= 3 && error.empty(); ++call) {
      const auto start = std::chrono::steady_clock::now();
      try {
        allreduce(team, in, out, kCount, DType::kFloat32, queue);
        team.check();
      } catch (const Error& e) {
        error = e.what();
      }
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::snprintf(report.data(), kMessageBytes, "%s", error.c_str());
    std::memcpy(report.data() + kMessageBytes, &seconds, sizeof(seconds));
    const int failed_call = call - 1;
    std::memcpy(report.data() + kMessageBytes + sizeof(double), &failed_call, sizeof(int));
    // A failed team refuses every later call before any work.
    EXPECT_THROW(allreduce(team, in, out, kCount, DType::kFloat32, queue), Error);
  });
  EXPECT_EQ(outcomes[0], "");
  EXPECT_EQ(outcomes[1], "the process died of signal 9");
  const std::string error = report.data();
  double seconds = 0;
  int call = 0;
  std::memcpy(&seconds, report.data() + kMessageBytes, sizeof(seconds));
  std::memcpy(&call, report.data() + kMessageBytes + sizeof(double), sizeof(int));
  EXPECT_TRUE(contains(error, "timed out waiting for rank 1")) << error;
  EXPECT_TRUE(contains(error, "has exited")) << error;
  EXPECT_GT(seconds, kTimeout * 0.9) << error;
  EXPECT_LT(seconds, kTimeout + 5.0) << error;
  std::printf("rank 0's call %d reported rank 1 after %.2f s (timeout %.1f s)\n", call, seconds,
              kTimeout);
}

// One rank more than the device's compute units, each rank a process (one rank each, which
// alone would fit): the refusal counts the ranks of every process on the device, and every rank
// says the same, at once (no kernel of theirs spins).
TEST(SyclProcesses, MoreRanksThanComputeUnitsAreRefusedAcrossProcesses) {
  TPF_REQUIRE_DEVICE(1);
  const int units = probe().compute_units;
  if (units + 1 > kMaxWorldSize) GTEST_SKIP() << units << " compute units";
  const int world = units + 1;
  const CpuTeamId id = create_cpu_team_id();
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> outcomes = run_processes(
      world, [&](int rank) { create_sycl_team(id, rank, world, cpu_device(), test_options()); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  std::string ranks;
  for (int r = 0; r < world; ++r) ranks += (r > 0 ? ", " : "") + std::to_string(r);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(contains(outcomes[r], std::to_string(world) + " ranks (" + ranks + ") on device '"))
        << outcomes[r];
    EXPECT_TRUE(contains(outcomes[r], "which has " + std::to_string(units) +
                                          " compute units, counted over the team's processes"))
        << outcomes[r];
  }
}

// The CPU device's compute units are its process's CPUs (sched_getaffinity): two ranks pinned
// to one CPU share one compute unit and are refused; pinned to two CPUs, they are not (and run).
TEST(SyclProcesses, RanksPinnedToOneCpuAreRefusedAndToTwoAreNot) {
  TPF_REQUIRE_DEVICE(2);
  cpu_set_t allowed;
  ASSERT_EQ(::sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  ASSERT_EQ(cpus.size(), 2u);
  for (const bool one_cpu : {true, false}) {
    SCOPED_TRACE(one_cpu
                     ? "both ranks on CPU " + std::to_string(cpus[0])
                     : "on CPUs " + std::to_string(cpus[0]) + " and " + std::to_string(cpus[1]));
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_processes(2, [&](int rank) {
      cpu_set_t pinned;
      CPU_ZERO(&pinned);
      CPU_SET(cpus[one_cpu ? 0 : size_t(rank)], &pinned);
      if (::sched_setaffinity(0, sizeof(pinned), &pinned) != 0) throw Error("sched_setaffinity");
      const sycl::device device = cpu_device();
      EXPECT_EQ(device.get_info<sycl::info::device::max_compute_units>(), 1u);
      const Team team = create_sycl_team(id, rank, 2, device, test_options());
      sycl::queue& queue = sycl_queue(team);
      float* data = sycl::malloc_shared<float>(64, queue);
      std::fill(data, data + 64, 1.5f);
      allreduce(team, data, data, 64, DType::kFloat32, queue);
      team.check();
      EXPECT_EQ(data[0], 3.0f);
      sycl::free(data, queue);
    });
    for (int r = 0; r < 2; ++r) {
      if (one_cpu) {
        EXPECT_TRUE(contains(outcomes[r], "2 ranks (0, 1) on device '")) << outcomes[r];
        EXPECT_TRUE(contains(outcomes[r], "which has 1 compute units")) << outcomes[r];
      } else {
        EXPECT_EQ(outcomes[r], "") << "rank " << r;
      }
    }
  }
}

TEST(SyclProcesses, BadArgumentsAreNamed) {
  TPF_REQUIRE_DEVICE(1);
  SharedArea messages(4 * kMessageBytes);
  const std::vector<std::string> outcomes = run_processes(1, [&](int) {
    const sycl::device device = cpu_device();
    const CpuTeamId id = create_cpu_team_id();
    const auto error_of = [&](const std::function<void()>& create) -> std::string {
      try {
        create();
      } catch (const Error& error) {
        return error.what();
      }
      return "";
    };
    TeamOptions bad = test_options();
    bad.packet_bytes = 24;
    const std::string errors[4] = {
        error_of([&] { create_sycl_team(id, 2, 2, device); }),
        error_of([&] { create_sycl_team(id, 0, 0, device); }),
        error_of([&] { create_sycl_team(id, 0, 2, device, bad); }),
        error_of([&] { create_sycl_team(CpuTeamId{}, 0, 1, device); }),
    };
    for (int e = 0; e < 4; ++e) {
      std::snprintf(messages.data() + e * kMessageBytes, kMessageBytes, "%s", errors[e].c_str());
    }
    // A one-rank team runs the local kernel on its queue.
    const Team one = create_sycl_team(create_cpu_team_id(), 0, 1, device);
    EXPECT_EQ(one.peer_memory(), "sycl shared memory");
    sycl::queue& queue = sycl_queue(one);
    float* data = sycl::malloc_shared<float>(64, queue);
    std::fill(data, data + 64, 3.0f);
    allreduce(one, data, data, 64, DType::kFloat32, queue);
    one.check();
    EXPECT_EQ(data[63], 3.0f);
    sycl::free(data, queue);
  });
  EXPECT_EQ(outcomes[0], "");
  const char* expected[4] = {"rank must be in [0, world_size = 2), got 2", "world_size must be in",
                             "options.packet_bytes must be a multiple of 16",
                             "id was not made by create_cpu_team_id"};
  for (int e = 0; e < 4; ++e) {
    const std::string error = messages.data() + e * kMessageBytes;
    EXPECT_TRUE(contains(error, expected[e])) << error;
  }
}

}  // namespace
}  // namespace tpfuse::testing
