// Multi-process teams on real GPUs: one process per GPU, launched by this test itself. Run
// without TPFUSE_MP_RANK, the binary is the launcher: it makes the NCCL ids, starts one copy of
// itself per GPU (at most 8) with the rank in its environment, and fails if any rank fails or
// the whole run exceeds its deadline (a hang is a failure, never a stuck ctest). Each rank runs
// the same tests in the same order; results are compared across ranks through NCCL.
//
// Covered: the creation handshake over NCCL windows and over CUDA IPC, numerics against float64
// and bitwise equality across ranks for one-shot, two-shot and the NCCL path, one-shot == two-shot
// bits (batch invariance), CUDA-graph replay on fresh inputs, checked mode (a rank that skips a
// call is reported by the others within 1 s), the forced fallback and a failed handshake, a team
// from a unique id, and the QK norm's fused kernel against its NCCL path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "oneshot_properties.h"
#include "qknorm_properties.h"
#include "tpfuse/cuda.h"

extern char** environ;

namespace tpfuse::testing {
namespace {

#define CHECK_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call
#define CHECK_NCCL(call) ASSERT_EQ((call), ncclSuccess) << #call

std::string to_hex(const UniqueId& id) {
  std::string hex;
  char byte[3];
  for (char c : id.bytes) {
    std::snprintf(byte, sizeof(byte), "%02x", static_cast<unsigned char>(c));
    hex += byte;
  }
  return hex;
}

UniqueId from_hex(const std::string& hex) {
  UniqueId id{};
  for (size_t i = 0; i < sizeof(id.bytes) && 2 * i + 1 < hex.size(); ++i) {
    id.bytes[i] = char(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  }
  return id;
}

// This process's rank, its NCCL communicator (made by the test, so it can gather results), and
// the default team over it.
struct World {
  int rank = 0;
  int size = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  Team team;
  UniqueId second_id{};
};

World& world() {
  static World instance;
  return instance;
}

// Device memory freed at scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&pointer_, bytes == 0 ? 16 : bytes), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(pointer_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return pointer_; }
  void upload(const HostTensor& tensor) {
    EXPECT_EQ(cudaMemcpy(pointer_, tensor.data(), tensor.bytes.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }

 private:
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
};

// Every rank's copy of a device tensor of `count` elements (an NCCL all-gather).
std::vector<HostTensor> gather(const void* device, DType dtype, size_t count) {
  World& w = world();
  const size_t bytes = count * dtype_size(dtype);
  DeviceBuffer all(bytes * size_t(w.size));
  EXPECT_EQ(ncclAllGather(device, all.get(), bytes, ncclUint8, w.comm, w.stream), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  std::vector<HostTensor> out;
  for (int r = 0; r < w.size; ++r) {
    HostTensor tensor(dtype, count);
    EXPECT_EQ(cudaMemcpy(tensor.data(), static_cast<char*>(all.get()) + bytes * r, bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    out.push_back(std::move(tensor));
  }
  return out;
}

// One allreduce_add_rmsnorm on every rank (each process its own), outputs poisoned first;
// returns every rank's outputs and what ran.
CaseResult run_case(const Team& team, const CaseSpec& spec, const CaseData& data) {
  World& w = world();
  const size_t count = size_t(spec.tokens * spec.hidden);
  const size_t bytes = count * dtype_size(spec.dtype);
  DeviceBuffer input(bytes), residual(bytes), gamma(size_t(spec.hidden) * 4), residual_out(bytes),
      norm_out(bytes);
  input.upload(data.inputs[w.rank]);
  residual.upload(data.residuals[w.rank]);
  gamma.upload(data.gamma);
  const HostTensor poison = poisoned(spec.dtype, count);
  residual_out.upload(poison);
  norm_out.upload(poison);
  AddRmsNormArgs args;
  args.input = input.get();
  args.residual = spec.residual ? residual.get() : nullptr;
  args.gamma = gamma.get();
  args.residual_out = residual_out.get();
  args.norm_out = norm_out.get();
  args.tokens = spec.tokens;
  args.hidden = spec.hidden;
  args.dtype = spec.dtype;
  args.eps = spec.eps;
  args.algorithm = spec.algorithm;
  CaseResult result;
  result.algorithm = allreduce_add_rmsnorm(team, args, w.stream);
  EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  team.check();
  result.norm_out = gather(norm_out.get(), spec.dtype, count);
  result.residual_out = gather(residual_out.get(), spec.dtype, count);
  return result;
}

void check_random(const Team& team, Algorithm algorithm, uint64_t seed, int cases) {
  std::mt19937_64 rng(seed);  // the same seed on every rank: the same cases and data
  for (int c = 0; c < cases; ++c) {
    CaseSpec spec = random_spec(rng, 300);
    spec.plain_allreduce = false;
    spec.norm_in_place = spec.residual_in_place = false;
    spec.residual_out = true;
    spec.algorithm = algorithm;
    if (algorithm != Algorithm::kNccl) {
      spec.tokens = std::min(spec.tokens, team.max_tokens(spec.hidden, spec.dtype, algorithm));
    }
    const CaseData data = random_case(rng, spec, world().size);
    const CaseResult result = run_case(team, spec, data);
    EXPECT_EQ(result.algorithm, algorithm);
    expect_correct(spec, data, result);
  }
}

TEST(MultiProcess, HandshakeProvesPeerStoresOverNcclWindows) {
  EXPECT_EQ(world().team.fallback_reason(), "");
  EXPECT_EQ(world().team.peer_memory(), "nccl window");
  EXPECT_EQ(world().team.world_size(), world().size);
  EXPECT_EQ(world().team.rank(), world().rank);
}

TEST(MultiProcess, OneShotMatchesFloat64AndIsIdenticalOnEveryRank) {
  check_random(world().team, Algorithm::kOneShot, 1, 30);
}

TEST(MultiProcess, TwoShotMatchesFloat64AndIsIdenticalOnEveryRank) {
  check_random(world().team, Algorithm::kTwoShot, 2, 30);
}

TEST(MultiProcess, NcclPathMatchesFloat64) {
  check_random(world().team, Algorithm::kNccl, 3, 15);
}

TEST(MultiProcess, TwoShotGivesOneShotBits) {
  std::mt19937_64 rng(4);
  for (int64_t tokens : {1, 7, 64, 513}) {
    CaseSpec spec;
    spec.tokens = tokens;
    const CaseData data = random_case(rng, spec, world().size);
    spec.algorithm = Algorithm::kOneShot;
    const CaseResult one = run_case(world().team, spec, data);
    spec.algorithm = Algorithm::kTwoShot;
    const CaseResult two = run_case(world().team, spec, data);
    for (int r = 0; r < world().size; ++r) {
      EXPECT_TRUE(one.norm_out[r].bytes == two.norm_out[r].bytes) << "tokens " << tokens;
      EXPECT_TRUE(one.residual_out[r].bytes == two.residual_out[r].bytes) << "tokens " << tokens;
    }
  }
}

// Two calls (one-shot 5 tokens, two-shot 300) captured in one graph, replayed on fresh inputs.
TEST(MultiProcess, CudaGraphReplaysOnFreshInputs) {
  World& w = world();
  std::mt19937_64 rng(5);
  CaseSpec a, b;
  a.tokens = 5;
  a.algorithm = Algorithm::kOneShot;
  b.tokens = 300;
  b.algorithm = Algorithm::kTwoShot;
  const size_t bytes_a = size_t(a.tokens * a.hidden) * 2, bytes_b = size_t(b.tokens * b.hidden) * 2;
  DeviceBuffer in_a(bytes_a), res_a(bytes_a), rout_a(bytes_a), nout_a(bytes_a);
  DeviceBuffer in_b(bytes_b), res_b(bytes_b), rout_b(bytes_b), nout_b(bytes_b);
  DeviceBuffer gamma(3072 * 2);
  CaseData data_a = random_case(rng, a, w.size);
  gamma.upload(data_a.gamma);
  const auto args_for = [&](const CaseSpec& spec, DeviceBuffer& in, DeviceBuffer& res,
                            DeviceBuffer& rout, DeviceBuffer& nout) {
    AddRmsNormArgs args;
    args.input = in.get();
    args.residual = res.get();
    args.gamma = gamma.get();
    args.residual_out = rout.get();
    args.norm_out = nout.get();
    args.tokens = spec.tokens;
    args.hidden = spec.hidden;
    args.algorithm = spec.algorithm;
    return args;
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(w.stream, cudaStreamCaptureModeThreadLocal));
  allreduce_add_rmsnorm(w.team, args_for(a, in_a, res_a, rout_a, nout_a), w.stream);
  allreduce_add_rmsnorm(w.team, args_for(b, in_b, res_b, rout_b, nout_b), w.stream);
  CHECK_CUDA(cudaStreamEndCapture(w.stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 100; ++replay) {
    CaseData da = random_case(rng, a, w.size, replay % 2 ? 1000.0 : 1.0);
    CaseData db = random_case(rng, b, w.size, replay % 2 ? 1.0 : 1000.0);
    da.gamma = db.gamma = data_a.gamma;
    in_a.upload(da.inputs[w.rank]);
    res_a.upload(da.residuals[w.rank]);
    in_b.upload(db.inputs[w.rank]);
    res_b.upload(db.residuals[w.rank]);
    const HostTensor poison_a = poisoned(a.dtype, bytes_a / 2),
                     poison_b = poisoned(b.dtype, bytes_b / 2);
    nout_a.upload(poison_a);
    nout_b.upload(poison_b);
    CHECK_CUDA(cudaGraphLaunch(exec, w.stream));
    CHECK_CUDA(cudaStreamSynchronize(w.stream));
    CaseResult ra, rb;
    ra.norm_out = gather(nout_a.get(), a.dtype, bytes_a / 2);
    ra.residual_out = gather(rout_a.get(), a.dtype, bytes_a / 2);
    rb.norm_out = gather(nout_b.get(), b.dtype, bytes_b / 2);
    rb.residual_out = gather(rout_b.get(), b.dtype, bytes_b / 2);
    expect_correct(a, da, ra);
    expect_correct(b, db, rb);
    if (::testing::Test::HasFailure()) break;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// Checked mode: rank 1 skips one call; every other rank reports it within 1 s.
TEST(MultiProcess, ARankThatSkipsACallIsReportedWithinOneSecond) {
  World& w = world();
  TeamOptions options;
  options.peer_timeout_seconds = 0.25;
  {
    const Team team = create_nccl_team(w.comm, options);
    DeviceBuffer input(4096), out(4096);
    if (w.rank != 1) {
      const auto start = std::chrono::steady_clock::now();
      allreduce(team, input.get(), out.get(), 1024, DType::kBFloat16, w.stream);
      try {
        team.check();
        ADD_FAILURE() << "rank " << w.rank << " finished although rank 1 never called";
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what()).find("rank 1"), std::string::npos) << error.what();
      }
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_LT(seconds, 1.0) << "the missing rank was reported after " << seconds << " s";
    }
    // Ranks meet again through NCCL before the team (and its window) is destroyed together.
    EXPECT_EQ(ncclAllReduce(input.get(), input.get(), 1, ncclFloat, ncclSum, w.comm, w.stream),
              ncclSuccess);
    EXPECT_EQ(cudaStreamSynchronize(w.stream), cudaSuccess);
  }
}

TEST(MultiProcess, CudaIpcPeerMemory) {
  TeamOptions options;
  options.peer_memory = PeerMemory::kCudaIpc;
  const Team team = create_nccl_team(world().comm, options);
  EXPECT_EQ(team.fallback_reason(), "");
  EXPECT_EQ(team.peer_memory(), "cuda ipc");
  check_random(team, Algorithm::kOneShot, 6, 10);
  check_random(team, Algorithm::kTwoShot, 7, 10);
}

TEST(MultiProcess, TeamWithoutPeerStoresRunsNccl) {
  TeamOptions options;
  options.peer_stores = false;
  const Team team = create_nccl_team(world().comm, options);
  EXPECT_NE(team.fallback_reason().find("peer_stores is false"), std::string::npos);
  check_random(team, Algorithm::kNccl, 8, 5);
  EXPECT_EQ(team.choose(1, 3072, DType::kBFloat16), Algorithm::kNccl);
}

// Rank 1's handshake store into rank 0 is dropped (as if its P2P writes never arrived): every
// rank falls back to NCCL and says why.
TEST(MultiProcess, FailedHandshakeFallsBackOnEveryRank) {
  TeamOptions options;
  options.handshake_timeout_seconds = 0.5;
  setenv("TPFUSE_TEST_HANDSHAKE_DROP", "1>0", 1);
  const Team team = create_nccl_team(world().comm, options);
  unsetenv("TPFUSE_TEST_HANDSHAKE_DROP");
  EXPECT_NE(team.fallback_reason().find("rank 0 did not see rank 1's store"), std::string::npos)
      << team.fallback_reason();
  EXPECT_EQ(team.choose(1, 3072, DType::kBFloat16), Algorithm::kNccl);
  check_random(team, Algorithm::kNccl, 9, 5);
}

TEST(MultiProcess, TeamFromAUniqueId) {
  World& w = world();
  const Team team = create_nccl_team(w.second_id, w.rank, w.size, w.rank);
  EXPECT_EQ(team.fallback_reason(), "");
  check_random(team, Algorithm::kOneShot, 10, 5);
}

// At MiniMax-M2's TP-2 shapes the fused QK kernel and its NCCL path agree bit for bit (two
// fp32 sums add the same in either order), and every rank holds the same bits.
TEST(MultiProcess, QkNormFusedEqualsItsNcclPath) {
  World& w = world();
  std::mt19937_64 rng(11);
  for (RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox}) {
    QkSpec s;
    s.tokens = 33;
    s.heads = 48 / w.size;
    s.kv_heads = std::max(1, 8 / w.size);
    s.kv_replicas = std::max(1, w.size / 8);
    s.rope = rope;
    const QkData d = random_qk_data(rng, s, w.size);
    const size_t element = dtype_size(s.dtype);
    std::vector<HostTensor> outputs;
    for (Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kNccl}) {
      DeviceBuffer qkv(size_t(s.tokens * s.row()) * element);
      DeviceBuffer q_out(size_t(s.tokens * s.q_size()) * element);
      DeviceBuffer k_out(size_t(s.tokens * s.kv_size()) * element);
      DeviceBuffer q_gamma(size_t(s.q_size()) * element), k_gamma(size_t(s.kv_size()) * element);
      DeviceBuffer positions(size_t(s.tokens) * 8), cos_sin(d.cos_sin.size() * 4 + 16);
      qkv.upload(d.qkv[w.rank]);
      q_gamma.upload(d.q_gamma[w.rank]);
      k_gamma.upload(d.k_gamma[w.rank]);
      CHECK_CUDA(cudaMemcpy(positions.get(), d.positions.data(), d.positions.size() * 8,
                            cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(cos_sin.get(), d.cos_sin.data(), d.cos_sin.size() * 4,
                            cudaMemcpyHostToDevice));
      QkBuffers b{};
      b.qkv = qkv.get();
      b.q_out = q_out.get();
      b.k_out = k_out.get();
      b.q_gamma = q_gamma.get();
      b.k_gamma = k_gamma.get();
      b.positions = positions.get();
      b.cos_sin = cos_sin.get();
      QkNormArgs args = qk_args(s, b, d.max_position, w.size);
      args.algorithm = algorithm;
      EXPECT_EQ(allreduce_qk_rmsnorm(w.team, args, w.stream), algorithm);
      CHECK_CUDA(cudaStreamSynchronize(w.stream));
      QkResult result;
      result.q = gather(q_out.get(), s.dtype, size_t(s.tokens * s.q_size()));
      result.k = gather(k_out.get(), s.dtype, size_t(s.tokens * s.kv_size()));
      expect_qk_correct(s, d, result, w.size);
      outputs.push_back(result.q[w.rank]);
      outputs.push_back(result.k[w.rank]);
    }
    EXPECT_TRUE(outputs[0].bytes == outputs[2].bytes) << "q: fused and NCCL path differ";
    EXPECT_TRUE(outputs[1].bytes == outputs[3].bytes) << "k: fused and NCCL path differ";
  }
}

// The launcher: one process per GPU, a deadline for all of them.
int launch(int argc, char** argv) {
  const int gpus = std::min(cuda_device_count(), 8);
  if (gpus < 2) {
    std::printf("[  SKIPPED ] multi-process tests need 2 GPUs, found %d\n", gpus);
    return 0;
  }
  const std::string id = to_hex(create_unique_id());
  const std::string second = to_hex(create_unique_id());
  std::vector<pid_t> children;
  for (int rank = 0; rank < gpus; ++rank) {
    std::vector<std::string> variables = {"TPFUSE_MP_RANK=" + std::to_string(rank),
                                          "TPFUSE_MP_WORLD=" + std::to_string(gpus),
                                          "TPFUSE_MP_ID=" + id, "TPFUSE_MP_ID2=" + second};
    std::vector<char*> env;
    for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
    for (std::string& v : variables) env.push_back(v.data());
    env.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, env.data()) != 0) {
      std::perror("posix_spawn");
      return 1;
    }
    children.push_back(pid);
  }
  const char* deadline_env = std::getenv("TPFUSE_MP_DEADLINE_SECONDS");
  const double deadline_seconds = deadline_env != nullptr ? std::atof(deadline_env) : 400.0;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(int64_t(deadline_seconds * 1000));
  int failures = 0;
  size_t done = 0;
  std::vector<bool> finished(children.size(), false);
  while (done < children.size()) {
    for (size_t i = 0; i < children.size(); ++i) {
      if (finished[i]) continue;
      int status = 0;
      if (waitpid(children[i], &status, WNOHANG) == children[i]) {
        finished[i] = true;
        ++done;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
          std::fprintf(stderr, "rank %zu failed (status %d)\n", i, status);
          ++failures;
        }
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "multi-process tests passed their %.0f s deadline: killing the ranks\n",
                   deadline_seconds);
      for (size_t i = 0; i < children.size(); ++i) {
        if (!finished[i]) kill(children[i], SIGKILL);
      }
      for (size_t i = 0; i < children.size(); ++i) {
        if (!finished[i]) waitpid(children[i], nullptr, 0);
      }
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  (void)argc;
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tpfuse::testing

int main(int argc, char** argv) {
  using namespace tpfuse;
  using namespace tpfuse::testing;
  const char* rank = std::getenv("TPFUSE_MP_RANK");
  if (rank == nullptr) return launch(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  World& w = world();
  w.rank = std::atoi(rank);
  w.size = std::atoi(std::getenv("TPFUSE_MP_WORLD"));
  if (cudaSetDevice(w.rank) != cudaSuccess) return 2;
  const UniqueId id = from_hex(std::getenv("TPFUSE_MP_ID"));
  w.second_id = from_hex(std::getenv("TPFUSE_MP_ID2"));
  ncclUniqueId nccl_id;
  std::memcpy(nccl_id.internal, id.bytes, sizeof(id.bytes));
  if (ncclCommInitRank(&w.comm, w.size, nccl_id, w.rank) != ncclSuccess) return 3;
  if (cudaStreamCreateWithFlags(&w.stream, cudaStreamNonBlocking) != cudaSuccess) return 4;
  int result = 1;
  try {
    w.team = create_nccl_team(w.comm);
    result = RUN_ALL_TESTS();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "rank %d: %s\n", w.rank, error.what());
  }
  w.team = Team();
  ncclCommDestroy(w.comm);
  return result;
}
