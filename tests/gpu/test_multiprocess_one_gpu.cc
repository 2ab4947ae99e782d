// CUDA teams of one process a rank, every rank on GPU 0 (create_cuda_team(id, rank, world_size,
// device): CUDA IPC, bootstrapped over a CPU team, no NCCL): the faults between processes, on the
// GPU, where one GPU is all there is. Each test forks one child per rank before this process
// makes any CUDA call (a process that has initialized CUDA cannot hand it to a forked child);
// even whether there is a GPU is asked in a child. The children report through an anonymous
// shared mapping (what each threw, their outputs) and their exit; each has a hard alarm(), and
// the test kills any child that outlives it, so nothing hangs the suite. The ranks' kernels
// time-slice on the one GPU (separate contexts), so calls stay small.
//
// For one-shot, two-shot and the QK norm:
//   (a) outputs (poisoned before) against the float64 reference and bitwise equal on every rank,
//       world 2 and 4 (not against the CPU backend's bits: the GPU's rsqrtf is not the host's
//       1 / sqrt, so the bits may differ in the norm's last place);
//   (b) a rank killed (SIGKILL) while its peers wait in a call: each survivor's Team::check
//       throws naming it, within the timeout;
//   (c) a rank that never joins creation: the others' create throws naming it;
//   (d) ranks whose calls disagree (hidden, tokens): every rank's check names the peer and field;
//   (e) a rank that rejects its arguments (a null gamma; or kNccl, which this team has not,
//       while its peer's call runs fused): it throws, its peers' check reports the rejection
//       (not a timeout) and their outputs are NaN, and the next call is correct on
//       every rank;
//   (f) a late peer: rank 0 times out alone, then both ranks make a new call: every later call
//       and check on every rank reports the broken team, and rank 1 never completes a call
//       with rank 0's abandoned packets (the abandon mark; fails until that lands).
// And the team itself: no NCCL path, fallback_reason empty, peer memory "cuda ipc", a call the
// workspace cannot carry (or kNccl) refused before any work.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_harness.h"
#include "oneshot_properties.h"
#include "qknorm_properties.h"

namespace tpfuse::testing {
namespace {

constexpr int kDevice = 0;
// A child's hard limit (alarm), and how long the test waits for its children beyond it.
constexpr unsigned kChildSeconds = 90;
// How long a survivor may take to report a dead or late peer: its timeout and then some (the
// ranks' kernels share the GPU by time slices).
constexpr double kPeerTimeout = 1.5;
constexpr double kReportSlack = 5.0;

TeamOptions one_gpu_options(double peer_timeout = kPeerTimeout) {
  TeamOptions options;
  options.packet_bytes = 1 << 20;
  options.peer_timeout_seconds = peer_timeout;
  return options;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Memory every forked rank shares with the test: per rank a message (what it threw, or "") and
// a results area, and flags the ranks signal each other with. Anonymous, made before the fork.
class Board {
 public:
  Board(int world, size_t result_bytes)
      : world_(world), result_bytes_(result_bytes), bytes_(kHead + size_t(world) * stride()) {
    base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) throw std::runtime_error("mmap of the shared test area failed");
    std::memset(base_, 0, bytes_);
  }
  ~Board() { ::munmap(base_, bytes_); }
  Board(const Board&) = delete;
  Board& operator=(const Board&) = delete;

  int* flag(int i) { return static_cast<int*>(base_) + i; }
  void raise_flag(int i) { __atomic_fetch_add(flag(i), 1, __ATOMIC_ACQ_REL); }
  // Waits (bounded by the child's alarm) until flag i reaches `value`.
  void wait_flag(int i, int value) {
    while (__atomic_load_n(flag(i), __ATOMIC_ACQUIRE) < value) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  char* message(int rank) { return static_cast<char*>(base_) + kHead + size_t(rank) * stride(); }
  char* results(int rank) { return message(rank) + kMessageBytes; }
  int world() const { return world_; }

 private:
  static constexpr size_t kHead = 4096;  // the flags
  static constexpr size_t kMessageBytes = 4096;
  size_t stride() const { return kMessageBytes + (result_bytes_ + 63) / 64 * 64; }
  int world_;
  size_t result_bytes_;
  size_t bytes_;
  void* base_ = nullptr;
};

// Forks one child per rank, runs rank_main(rank) in each and waits for them all. Per rank: ""
// if it returned with no gtest failure, else what it threw, that an expectation failed (its
// output says which), or the signal that ended it.
std::vector<std::string> run_ranks(Board& board, const std::function<void(int rank)>& rank_main) {
  const int world = board.world();
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::alarm(kChildSeconds);
      std::string outcome;
      try {
        rank_main(rank);
        if (::testing::Test::HasFailure()) {
          outcome = "rank " + std::to_string(rank) + ": an expectation failed (output above)";
        }
      } catch (const std::exception& error) {
        outcome = std::string("rank ") + std::to_string(rank) + " threw: " + error.what();
      }
      std::snprintf(board.message(rank), 4096, "%s", outcome.c_str());
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(0);
    }
    children.push_back(pid);
  }
  std::vector<std::string> outcomes(static_cast<size_t>(world));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kChildSeconds + 10);
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    while (::waitpid(children[size_t(rank)], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (pid_t child : children) ::kill(child, SIGKILL);
        ::waitpid(children[size_t(rank)], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    outcomes[size_t(rank)] = board.message(rank);
    if (WIFSIGNALED(status)) {
      outcomes[size_t(rank)] = "rank " + std::to_string(rank) + " died of signal " +
                               std::to_string(WTERMSIG(status)) +
                               (WTERMSIG(status) == SIGALRM ? " (its alarm: it hung)" : "");
    }
  }
  return outcomes;
}

// One rank of a team whose ranks are processes: the harness's calls drive this rank only, on
// its own stream. The property helpers index every rank, so the other ranks' buffers are made
// here too (small, never used by a call).
class OneProcessHarness : public Harness {
 public:
  OneProcessHarness(const Team& team, int world) : rank_(team.rank()) {
    team_.resize(static_cast<size_t>(world));
    team_[size_t(rank_)] = team;
    check_cuda(cudaSetDevice(kDevice), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  }
  ~OneProcessHarness() override {
    cudaStreamSynchronize(stream_);
    for (void* block : blocks_) cudaFree(block);
    cudaStreamDestroy(stream_);
  }
  std::vector<Team>& team() override { return team_; }
  int rank() const { return rank_; }
  cudaStream_t stream() const { return stream_; }
  void* allocate(int, size_t bytes) override {
    void* pointer = nullptr;
    check_cuda(cudaMalloc(&pointer, bytes == 0 ? 16 : bytes), "cudaMalloc");
    blocks_.push_back(pointer);
    return pointer;
  }
  void upload(int, void* destination, const void* source, size_t bytes) override {
    check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyHostToDevice, stream_),
               "upload");
    check_cuda(cudaStreamSynchronize(stream_), "upload sync");
  }
  void download(int, void* destination, const void* source, size_t bytes) override {
    check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, stream_),
               "download");
    check_cuda(cudaStreamSynchronize(stream_), "download sync");
  }
  void run(const std::function<void(int, Stream)>& call) override {
    enqueue(call);
    synchronize();
  }
  void enqueue(const std::function<void(int, Stream)>& call) override {
    call(rank_, cuda_stream(stream_));
  }
  void synchronize() override {
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    team_[size_t(rank_)].check();
  }

 private:
  int rank_;
  std::vector<Team> team_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> blocks_;
};

// This rank's team on GPU 0.
Team join(const CpuTeamId& id, int rank, int world,
          const TeamOptions& options = one_gpu_options()) {
  check_cuda(cudaSetDevice(kDevice), "cudaSetDevice");
  return create_cuda_team(id, rank, world, kDevice, options);
}

// Every element NaN (the outputs of a call a peer rejected or disagreed with).
bool all_nan(const HostTensor& tensor) {
  for (size_t i = 0; i < tensor.count(); ++i) {
    if (!std::isnan(tensor.get(i))) return false;
  }
  return true;
}

// The row calls of the tests: random shapes, at most 8 tokens (the workspace and the GPU's time
// slices), the algorithm forced.
std::vector<CaseSpec> row_specs(uint64_t seed, Algorithm algorithm, int count) {
  std::mt19937_64 rng(seed);
  std::vector<CaseSpec> specs;
  for (int c = 0; c < count; ++c) {
    CaseSpec spec = random_spec(rng, 8);
    spec.algorithm = algorithm;
    specs.push_back(spec);
  }
  return specs;
}

size_t row_result_bytes(const CaseSpec& spec) {
  return 2 * size_t(spec.tokens * spec.hidden) * dtype_size(spec.dtype);
}

// One rank's outputs of a row call into its results area, and every rank's back out of it.
void put(char*& at, const HostTensor& tensor) {
  std::memcpy(at, tensor.data(), tensor.bytes.size());
  at += tensor.bytes.size();
}
HostTensor take(const char*& at, DType dtype, size_t count) {
  HostTensor tensor(dtype, count);
  std::memcpy(tensor.data(), at, tensor.bytes.size());
  at += tensor.bytes.size();
  return tensor;
}

void put_row_result(char*& at, const CaseResult& result, int rank) {
  put(at, result.norm_out[size_t(rank)]);
  put(at, result.residual_out[size_t(rank)]);
}

// Every rank's outputs of the row call whose results start at `at[r]`.
CaseResult take_row_result(std::vector<const char*>& at, const CaseSpec& spec) {
  CaseResult result;
  result.algorithm = spec.algorithm;
  const size_t count = size_t(spec.tokens * spec.hidden);
  for (size_t r = 0; r < at.size(); ++r) {
    result.norm_out.push_back(take(at[r], spec.dtype, count));
    result.residual_out.push_back(take(at[r], spec.dtype, count));
  }
  return result;
}

void expect_all_ranks_returned(const std::vector<std::string>& outcomes) {
  for (size_t r = 0; r < outcomes.size(); ++r) EXPECT_EQ(outcomes[r], "") << "rank " << r;
}

// --- (a) results ---

void check_row_results(Algorithm algorithm, uint64_t seed) {
  for (const int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::vector<CaseSpec> specs = row_specs(seed + uint64_t(world), algorithm, 12);
    std::mt19937_64 rng(seed + 100 + uint64_t(world));
    std::vector<CaseData> data;
    size_t per_rank = 0;
    for (const CaseSpec& spec : specs) {
      data.push_back(random_case(rng, spec, world));
      per_rank += row_result_bytes(spec);
    }
    Board board(world, per_rank);
    const CpuTeamId id = create_cpu_team_id();
    expect_all_ranks_returned(run_ranks(board, [&](int rank) {
      const Team team = join(id, rank, world);
      EXPECT_EQ(team.fallback_reason(), "");
      EXPECT_EQ(team.peer_memory(), "cuda ipc");
      OneProcessHarness harness(team, world);
      OneShotRunner runner(harness);
      char* at = board.results(rank);
      for (size_t c = 0; c < specs.size(); ++c) {
        const CaseResult result = runner.run(specs[c], data[c]);
        if (rank == 0) {
          EXPECT_EQ(result.algorithm, algorithm) << describe(specs[c]);
        }
        put_row_result(at, result, rank);
      }
    }));
    if (::testing::Test::HasFailure()) return;
    std::vector<const char*> at;
    for (int r = 0; r < world; ++r) at.push_back(board.results(r));
    for (size_t c = 0; c < specs.size(); ++c) {
      expect_correct(specs[c], data[c], take_row_result(at, specs[c]));
    }
  }
}

// The QK norm's cases in order, one process per rank of a team on GPU 0: every rank's q and k of
// each case (empty if a rank did not return: the failure is already recorded).
std::vector<QkResult> run_qk_in_processes(int world, const std::vector<QkSpec>& specs,
                                          const std::vector<QkData>& data) {
  size_t per_rank = 0;
  for (const QkSpec& s : specs) {
    per_rank += size_t(s.tokens * (s.q_size() + s.kv_size())) * dtype_size(s.dtype);
  }
  Board board(world, per_rank);
  const CpuTeamId id = create_cpu_team_id();
  expect_all_ranks_returned(run_ranks(board, [&](int rank) {
    OneProcessHarness harness(join(id, rank, world), world);
    harness.algorithm = Algorithm::kOneShot;
    char* at = board.results(rank);
    for (size_t c = 0; c < specs.size(); ++c) {
      const QkResult result = run_qk(harness, specs[c], data[c]);
      put(at, result.q[size_t(rank)]);
      put(at, result.k[size_t(rank)]);
    }
  }));
  if (::testing::Test::HasFailure()) return {};
  std::vector<const char*> at;
  for (int r = 0; r < world; ++r) at.push_back(board.results(r));
  std::vector<QkResult> results(specs.size());
  for (size_t c = 0; c < specs.size(); ++c) {
    const QkSpec& s = specs[c];
    for (int r = 0; r < world; ++r) {
      results[c].q.push_back(take(at[size_t(r)], s.dtype, size_t(s.tokens * s.q_size())));
      results[c].k.push_back(take(at[size_t(r)], s.dtype, size_t(s.tokens * s.kv_size())));
    }
  }
  return results;
}

class OneGpuProcesses : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpus_seen_by_a_child() < 1) GTEST_SKIP() << "needs a GPU";
  }
};

TEST_F(OneGpuProcesses, OneShotMatchesFloat64AndIsIdenticalOnEveryRank) {
  check_row_results(Algorithm::kOneShot, 41000);
}

TEST_F(OneGpuProcesses, TwoShotMatchesFloat64AndIsIdenticalOnEveryRank) {
  check_row_results(Algorithm::kTwoShot, 42000);
}

// Each rank's q and k slices differ, so their outputs do: each against float64 (the sums behind
// them are one all-reduce; identical slices give identical bits, the next test).
TEST_F(OneGpuProcesses, QkNormMatchesFloat64OnEveryRank) {
  for (const int world : {2, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::mt19937_64 rng(43000 + uint64_t(world));
    std::vector<QkSpec> specs;
    std::vector<QkData> data;
    for (int c = 0; c < 10; ++c) {
      QkSpec s = random_qk_spec(rng, world);
      s.tokens = std::min<int64_t>(s.tokens, 8);
      data.push_back(random_qk_data(rng, s, world));
      specs.push_back(s);
    }
    const std::vector<QkResult> results = run_qk_in_processes(world, specs, data);
    for (size_t c = 0; c < results.size(); ++c)
      expect_qk_correct(specs[c], data[c], results[c], world);
  }
}

// Every rank given the same q and k slices: the same sums in the same order, so the same bits
// on every rank (the QK norm's across-rank promise, which differing slices cannot show).
TEST_F(OneGpuProcesses, QkNormGivesIdenticalBitsOnEveryRank) {
  const int world = 2;
  std::mt19937_64 rng(44000);
  std::vector<QkSpec> specs;
  std::vector<QkData> data;
  for (const RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox}) {
    QkSpec s = minimax_qk_spec(world, DType::kBFloat16, rope, 5);
    data.push_back(random_qk_data(rng, s, world, /*identical_ranks=*/true));
    specs.push_back(s);
  }
  const std::vector<QkResult> results = run_qk_in_processes(world, specs, data);
  for (size_t c = 0; c < results.size(); ++c) {
    const QkSpec& s = specs[c];
    const QkResult& result = results[c];
    expect_qk_correct(s, data[c], result, world);
    EXPECT_TRUE(result.q[0].bytes == result.q[1].bytes) << describe(s) << ": q differs by rank";
    EXPECT_TRUE(result.k[0].bytes == result.k[1].bytes) << describe(s) << ": k differs by rank";
  }
}

// No NCCL path: nothing falls back, kNccl is refused, and a call the workspace cannot carry is
// refused on every rank before any work (no turn taken: the next call is correct).
TEST_F(OneGpuProcesses, TeamHasNoNcclPathAndRefusesWhatTheWorkspaceCannotCarry) {
  const int world = 2;
  CaseSpec spec;
  spec.tokens = 4;
  spec.algorithm = Algorithm::kOneShot;
  std::mt19937_64 rng(45000);
  const CaseData data = random_case(rng, spec, world);
  Board board(world, row_result_bytes(spec));
  const CpuTeamId id = create_cpu_team_id();
  expect_all_ranks_returned(run_ranks(board, [&](int rank) {
    const Team team = join(id, rank, world);
    EXPECT_EQ(team.fallback_reason(), "");
    EXPECT_EQ(team.peer_memory(), "cuda ipc");
    EXPECT_EQ(team.device(), kDevice);
    EXPECT_EQ(team.max_tokens(3072, DType::kBFloat16, Algorithm::kNccl), 0);
    const int64_t most = team.max_tokens(3072, DType::kBFloat16, Algorithm::kAuto);
    EXPECT_GT(most, 0);
    EXPECT_LT(most, int64_t(1) << 20);
    try {
      team.choose(most + 1, 3072, DType::kBFloat16);
      ADD_FAILURE() << "a message past the workspace was accepted";
    } catch (const Error& error) {
      EXPECT_TRUE(contains(error.what(), "packet capacity")) << error.what();
    }
    try {
      team.choose(1, 3072, DType::kBFloat16, Algorithm::kNccl);
      ADD_FAILURE() << "kNccl was accepted by a team without NCCL";
    } catch (const Error& error) {
      EXPECT_TRUE(contains(error.what(), "needs NCCL")) << error.what();
    }
    OneProcessHarness harness(team, world);
    // Too many tokens for the workspace: refused before any work, on every rank alike.
    CaseSpec large = spec;
    large.tokens = most + 1;
    large.algorithm = Algorithm::kAuto;
    const size_t bytes = size_t(large.tokens * large.hidden) * 2;
    void* input = harness.allocate(rank, bytes);
    void* output = harness.allocate(rank, bytes);
    void* gamma = harness.allocate(rank, size_t(large.hidden) * 2);
    AddRmsNormArgs args;
    args.input = input;
    args.gamma = gamma;
    args.norm_out = output;
    args.tokens = large.tokens;
    args.hidden = large.hidden;
    try {
      allreduce_add_rmsnorm(team, args, harness.stream());
      ADD_FAILURE() << "a call past the workspace ran";
    } catch (const Error& error) {
      EXPECT_TRUE(contains(error.what(), "packet capacity")) << error.what();
    }
    EXPECT_NO_THROW(harness.synchronize());
    OneShotRunner runner(harness);
    char* at = board.results(rank);
    put_row_result(at, runner.run(spec, data), rank);
  }));
  std::vector<const char*> at = {board.results(0), board.results(1)};
  expect_correct(spec, data, take_row_result(at, spec));
}

// --- (b) a rank killed mid-call ---

// The call a fault test makes: one of the three ops, small.
enum class Op { kOneShot, kTwoShot, kQkNorm };

const char* op_name(Op op) {
  switch (op) {
    case Op::kOneShot:
      return "one-shot";
    case Op::kTwoShot:
      return "two-shot";
    case Op::kQkNorm:
      return "QK norm";
  }
  return "?";
}

// Buffers and arguments of one call of `op` on this rank (inputs random, outputs poisoned).
struct FaultCall {
  FaultCall(OneProcessHarness& harness, Op op, int world, int64_t tokens, int64_t hidden,
            uint64_t seed)
      : harness_(harness), op_(op) {
    std::mt19937_64 rng(seed);
    const int rank = harness.rank();
    if (op == Op::kQkNorm) {
      qk_ = minimax_qk_spec(world, DType::kBFloat16, RopeStyle::kNone, tokens);
      qk_data_ = random_qk_data(rng, qk_, world);
      qk_buffers_ = upload_qk(harness, qk_, qk_data_);
      qk_args_ = qk_args(qk_, qk_buffers_[size_t(rank)], qk_data_.max_position, world);
      qk_args_.algorithm = Algorithm::kOneShot;
      return;
    }
    spec_.tokens = tokens;
    spec_.hidden = hidden;
    spec_.algorithm = op == Op::kOneShot ? Algorithm::kOneShot : Algorithm::kTwoShot;
    data_ = random_case(rng, spec_, world);
    const size_t count = size_t(tokens * hidden), bytes = count * 2;
    const HostTensor poison = poisoned(DType::kBFloat16, count);
    input_ = harness.allocate(rank, bytes);
    residual_ = harness.allocate(rank, bytes);
    gamma_ = harness.allocate(rank, size_t(hidden) * 2);
    residual_out_ = harness.allocate(rank, bytes);
    norm_out_ = harness.allocate(rank, bytes);
    harness.upload(rank, input_, data_.inputs[size_t(rank)].data(), bytes);
    harness.upload(rank, residual_, data_.residuals[size_t(rank)].data(), bytes);
    harness.upload(rank, gamma_, data_.gamma.data(), size_t(hidden) * 2);
    harness.upload(rank, residual_out_, poison.data(), bytes);
    harness.upload(rank, norm_out_, poison.data(), bytes);
    args_.input = input_;
    args_.residual = residual_;
    args_.gamma = gamma_;
    args_.residual_out = residual_out_;
    args_.norm_out = norm_out_;
    args_.tokens = tokens;
    args_.hidden = hidden;
    args_.algorithm = spec_.algorithm;
  }
  // How a rank's call is rejected: a null gamma, or Algorithm::kNccl (the team has no NCCL).
  enum class Reject { kNone, kNullGamma, kAsksNccl };
  // Queues the call (or, rejected, the same call made wrong, which throws).
  void queue(Reject reject = Reject::kNone) {
    const Team& team = harness_.team()[size_t(harness_.rank())];
    if (op_ == Op::kQkNorm) {
      QkNormArgs args = qk_args_;
      if (reject == Reject::kNullGamma) args.q_gamma = nullptr;
      if (reject == Reject::kAsksNccl) args.algorithm = Algorithm::kNccl;
      allreduce_qk_rmsnorm(team, args, harness_.stream());
    } else {
      AddRmsNormArgs args = args_;
      if (reject == Reject::kNullGamma) args.gamma = nullptr;
      if (reject == Reject::kAsksNccl) args.algorithm = Algorithm::kNccl;
      allreduce_add_rmsnorm(team, args, harness_.stream());
    }
  }
  // This rank's main output (norm_out, or q).
  HostTensor output() {
    if (op_ == Op::kQkNorm) {
      return download_qk(harness_, qk_, qk_data_, qk_buffers_).q[size_t(harness_.rank())];
    }
    HostTensor out(DType::kBFloat16, size_t(spec_.tokens * spec_.hidden));
    harness_.download(harness_.rank(), out.data(), norm_out_, out.bytes.size());
    return out;
  }
  const CaseSpec& spec() const { return spec_; }
  const CaseData& data() const { return data_; }

 private:
  OneProcessHarness& harness_;
  Op op_;
  CaseSpec spec_;
  CaseData data_;
  void *input_ = nullptr, *residual_ = nullptr, *gamma_ = nullptr, *residual_out_ = nullptr,
       *norm_out_ = nullptr;
  AddRmsNormArgs args_;
  QkSpec qk_;
  QkData qk_data_;
  std::vector<QkBuffers> qk_buffers_;
  QkNormArgs qk_args_;
};

// What Team::check threw after this rank's queued work, or "" (and how long it took).
std::string check_error(OneProcessHarness& harness, double* seconds = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    harness.synchronize();
  } catch (const Error& e) {
    error = e.what();
  }
  if (seconds != nullptr) *seconds = seconds_since(start);
  return error;
}

TEST_F(OneGpuProcesses, ARankKilledMidCallIsReportedByEverySurvivorInTime) {
  struct Case {
    int world;
    Op op;
  };
  for (const Case& c : {Case{2, Op::kOneShot}, Case{2, Op::kTwoShot}, Case{2, Op::kQkNorm},
                        Case{4, Op::kOneShot}}) {
    SCOPED_TRACE(std::string(op_name(c.op)) + ", world " + std::to_string(c.world));
    const int victim = c.world - 1;
    Board board(c.world, 0);
    const CpuTeamId id = create_cpu_team_id();
    const std::vector<std::string> outcomes = run_ranks(board, [&](int rank) {
      OneProcessHarness harness(join(id, rank, c.world), c.world);
      FaultCall call(harness, c.op, c.world, 4, 3072, 46000);
      if (rank == victim) {
        // Dies once every survivor's call is queued and has had time to reach its wait.
        board.wait_flag(0, c.world - 1);
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ::kill(::getpid(), SIGKILL);
      }
      call.queue();
      board.raise_flag(0);
      double seconds = 0;
      const std::string error = check_error(harness, &seconds);
      EXPECT_TRUE(contains(error, "waiting for rank " + std::to_string(victim)))
          << "rank " << rank << ": " << error;
      EXPECT_TRUE(contains(error, "has exited")) << "rank " << rank << ": " << error;
      EXPECT_LT(seconds, kPeerTimeout + kReportSlack) << "rank " << rank;
      // The team stays failed.
      EXPECT_NE(check_error(harness), "") << "rank " << rank;
    });
    for (int r = 0; r < c.world; ++r) {
      if (r == victim) {
        EXPECT_TRUE(contains(outcomes[size_t(r)], "signal 9")) << outcomes[size_t(r)];
      } else {
        EXPECT_EQ(outcomes[size_t(r)], "") << "rank " << r;
      }
    }
  }
}

// --- (c) a rank that never joins ---

TEST_F(OneGpuProcesses, ARankThatNeverJoinsIsNamedByTheOthers) {
  const int world = 3;
  Board board(world, 0);
  const CpuTeamId id = create_cpu_team_id();
  TeamOptions options = one_gpu_options(1.0);
  options.handshake_timeout_seconds = 1.0;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::string> outcomes = run_ranks(board, [&](int rank) {
    if (rank == 2) return;  // never joins
    join(id, rank, world, options);
    ADD_FAILURE() << "rank " << rank << " made a team without rank 2";
  });
  EXPECT_LT(seconds_since(start), 30.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(outcomes[size_t(r)], "create_cuda_team")) << outcomes[size_t(r)];
    EXPECT_TRUE(contains(outcomes[size_t(r)], "rank(s) 2 did not join")) << outcomes[size_t(r)];
  }
  EXPECT_EQ(outcomes[2], "");
}

// --- (d) ranks whose calls disagree ---

TEST_F(OneGpuProcesses, RanksWhoseCallsDisagreeAreToldThePeerAndTheField) {
  const int world = 2;
  struct Case {
    Op op;
    int64_t tokens[2];
    int64_t hidden[2];
    const char* field;
  };
  const Case cases[] = {
      {Op::kOneShot, {4, 4}, {3072, 2048}, "the width (hidden"},
      {Op::kTwoShot, {4, 6}, {3072, 3072}, "tokens: "},
      {Op::kQkNorm, {4, 5}, {0, 0}, "tokens: "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(op_name(c.op));
    Board board(world, 0);
    const CpuTeamId id = create_cpu_team_id();
    expect_all_ranks_returned(run_ranks(board, [&](int rank) {
      OneProcessHarness harness(join(id, rank, world), world);
      FaultCall call(harness, c.op, world, c.tokens[rank], c.hidden[rank], 47000);
      call.queue();
      const std::string error = check_error(harness);
      const int peer = 1 - rank;
      // Its own diagnosis (the peer and the field), or the peer's, announced by its mark (the
      // peer saw the disagreement first and failed the team on every rank).
      const bool own = contains(error, "rank " + std::to_string(peer) + "'s call disagrees");
      const bool announced = contains(error, "rank " + std::to_string(peer) + " failed the team") &&
                             contains(error, "disagreed with rank " + std::to_string(rank));
      EXPECT_TRUE(own || announced) << "rank " << rank << ": " << error;
      if (own) EXPECT_TRUE(contains(error, c.field)) << "rank " << rank << ": " << error;
      EXPECT_NE(check_error(harness), "") << "rank " << rank << ": the team stays failed";
    }));
  }
}

// --- (e) a rejected call, then a correct one ---

TEST_F(OneGpuProcesses, ARejectedCallIsReportedAndTheNextCallIsCorrect) {
  const int world = 2;
  using Reject = FaultCall::Reject;
  const Op ops[] = {Op::kOneShot, Op::kTwoShot, Op::kQkNorm, Op::kOneShot, Op::kQkNorm};
  const Reject rejects[] = {Reject::kNullGamma, Reject::kNullGamma, Reject::kNullGamma,
                            Reject::kAsksNccl, Reject::kAsksNccl};
  const size_t cases = std::size(ops);
  CaseSpec next;
  next.tokens = 3;
  std::vector<CaseSpec> specs;
  std::vector<CaseData> data;
  std::mt19937_64 rng(48000);
  for (const Op op : ops) {
    next.algorithm = op == Op::kTwoShot ? Algorithm::kTwoShot : Algorithm::kOneShot;
    specs.push_back(next);
    data.push_back(random_case(rng, next, world));
  }
  size_t per_rank = 0;
  for (const CaseSpec& spec : specs) per_rank += row_result_bytes(spec);
  Board board(world, per_rank);
  const CpuTeamId id = create_cpu_team_id();
  expect_all_ranks_returned(run_ranks(board, [&](int rank) {
    OneProcessHarness harness(join(id, rank, world), world);
    OneShotRunner runner(harness);
    char* at = board.results(rank);
    for (size_t i = 0; i < cases; ++i) {
      const bool asks_nccl = rejects[i] == Reject::kAsksNccl;
      SCOPED_TRACE(std::string(op_name(ops[i])) + (asks_nccl ? ", kNccl" : ", null gamma"));
      FaultCall call(harness, ops[i], world, 4, 3072, 48100 + i);
      if (rank == 1) {
        try {
          call.queue(rejects[i]);
          ADD_FAILURE() << "the rejected call was accepted";
        } catch (const Error& error) {
          EXPECT_TRUE(contains(error.what(), asks_nccl ? "needs NCCL" : "gamma")) << error.what();
        }
        EXPECT_EQ(check_error(harness), "");
      } else {
        call.queue();
        // Told by the rejected call's turn (a timeout's error names no rejection).
        const std::string error = check_error(harness);
        EXPECT_TRUE(contains(error, "rank 1 rejected its part of a call")) << error;
        EXPECT_TRUE(all_nan(call.output())) << "rank 0's outputs of the rejected call";
        EXPECT_EQ(check_error(harness), "") << "the rejection is reported once";
      }
      // The next call: a row call (QK rows after the QK rejection too), correct everywhere.
      put_row_result(at, runner.run(specs[i], data[i]), rank);
    }
  }));
  std::vector<const char*> at = {board.results(0), board.results(1)};
  for (size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(op_name(ops[i]));
    expect_correct(specs[i], data[i], take_row_result(at, specs[i]));
  }
}

// --- (f) a late peer ---

// Rank 0 makes a call alone and times out; then rank 1 arrives and both make a new call. The
// team is broken after a timeout: every later call and check on every rank says so, and rank 1
// must get an error, never a result that mixes rank 0's abandoned packets (its first call's,
// still in rank 1's slot) with its own.
TEST_F(OneGpuProcesses, LatePeerGetsAnErrorNotAbandonedData) {
  const int world = 2;
  CaseSpec spec;
  spec.tokens = 4;
  spec.algorithm = Algorithm::kOneShot;
  std::mt19937_64 rng(49000);
  const CaseData abandoned = random_case(rng, spec, world);
  CaseData fresh = random_case(rng, spec, world);
  fresh.residuals = abandoned.residuals;
  fresh.gamma = abandoned.gamma;
  // What rank 1 would compute from rank 0's abandoned packet and its own fresh one.
  CaseData mixed = fresh;
  mixed.inputs[0] = abandoned.inputs[0];
  Board board(world, row_result_bytes(spec));
  const CpuTeamId id = create_cpu_team_id();
  expect_all_ranks_returned(run_ranks(board, [&](int rank) {
    OneProcessHarness harness(join(id, rank, world, one_gpu_options(1.0)), world);
    OneShotRunner runner(harness);
    if (rank == 0) {
      try {
        runner.run(spec, abandoned);
        ADD_FAILURE() << "rank 0's lone call did not time out";
      } catch (const Error& error) {
        EXPECT_TRUE(contains(error.what(), "waiting for rank 1")) << error.what();
      }
      board.raise_flag(0);
      // The new call, made by both ranks: the team is broken.
      try {
        runner.run(spec, fresh);
        ADD_FAILURE() << "rank 0: a call after the timeout succeeded";
      } catch (const Error& error) {
        SUCCEED() << error.what();
      }
      EXPECT_NE(check_error(harness), "") << "rank 0: check() after the timeout";
      return;
    }
    board.wait_flag(0, 1);  // late: after rank 0 gave up
    try {
      const CaseResult result = runner.run(spec, fresh);
      char* at = board.results(rank);
      put_row_result(at, result, rank);
      ADD_FAILURE() << "rank 1's call after rank 0's timeout succeeded (see the outputs' check)";
    } catch (const Error& error) {
      SUCCEED() << error.what();
    }
    EXPECT_NE(check_error(harness), "") << "rank 1: check() after its peer's timeout";
  }));
  // Had rank 1 completed a call, say what its outputs hold: abandoned data mixed with its own?
  const char* at = board.results(1);
  const HostTensor norm_out = take(at, spec.dtype, size_t(spec.tokens * spec.hidden));
  const bool written = !std::all_of(norm_out.bytes.begin(), norm_out.bytes.end(),
                                    [](uint8_t byte) { return byte == 0; });
  if (written) {
    const Reference reference =
        reference_add_rmsnorm(mixed.inputs, &mixed.residuals[0], mixed.gamma, spec.tokens,
                              spec.hidden, spec.eps, spec.norm_weight);
    double worst = 0;
    for (size_t i = 0; i < reference.norm_out.size(); ++i) {
      worst = std::max(worst, std::fabs(norm_out.get(i) - reference.norm_out[i]));
    }
    ADD_FAILURE() << "rank 1 completed a call after its peer's timeout; its norm_out is within "
                  << worst << " of rank 0's abandoned input + rank 1's fresh one";
  }
}

}  // namespace
}  // namespace tpfuse::testing
