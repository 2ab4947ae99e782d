// Faults at random (issue 40) on the one-GPU multi-process team: CUDA teams of one forked process
// a rank, every rank on GPU 0 (create_cuda_team(id, rank, world_size, device): CUDA IPC,
// bootstrapped over a CPU team id, no NCCL path), world 2-4. The same generator, runner, rules,
// shrinker and TPFUSE_FAULT_* variables as the CPU's run (tests/common/fault_random.h; the rules
// are there), with:
//   - the ranks' buffers on the device: each call's inputs (and its poisoned outputs) are copied
//     to a device arena of the rank, the call queued on the rank's stream, the stream
//     synchronized, Team::check() asked (where a CUDA team reports a peer's rejection, a
//     disagreement or a timeout), then the outputs copied back and judged as the CPU's are;
//   - the ranks meet (a barrier) after every call, so that a rank's check reports its call and
//     never the next one of a faster peer (a disagreement there fails the team for every rank
//     at once); the CPU's ranks, whose calls throw their own errors, run up to a call apart;
//   - the reference: the GPU's own local ops (add_rmsnorm, qk_sum_squares and
//     qk_rmsnorm_from_sums with Backend::kCuda on the exact sums: the inputs are small integers),
//     not the host's, whose norm may differ from the GPU's in the last bit (rsqrtf). They run in
//     a process of their own (forked, as the ranks are, before anything here touches CUDA), which
//     this process asks for each reference over a pipe;
//   - what the team cannot run is never drawn (Limits, one_gpu_limits below): Algorithm::kNccl
//     (no NCCL path: a kNccl draw becomes kAuto, a disagreement over the algorithm changes it to
//     one the team has), teams without peer stores (create_cuda_team(id, ...) requires them), and
//     packets of 64 and 256 bytes (the CPU carries a wider row a packet at a time; this team
//     refuses every call its packets cannot carry, so they would test little but refusals);
//   - the selection table pinned (TPFUSE_ALGORITHM_TABLE, written here, set before any team is
//     made): this process never touches CUDA, so its oracle (a CPU team of the same options,
//     asked what kAuto runs) must read the same table as the ranks' GPU teams; the pinned one
//     has one-shot up to 4 KiB and two-shot above, so that kAuto reaches both;
//   - late peers' timeouts of 1 to 1.75 s (the CPU's are 50 to 80 ms): the ranks' kernels
//     time-slice on one GPU, and a short-timeout team's good calls must not time out.
// The calls stay small (at most 13 tokens, hidden at most 1032) and the bounded run is 2000
// calls (TPFUSE_FAULT_CALLS). Every child (the ranks and the reference process) has an alarm and
// dies with this process; this process kills a rank that outlives its sequence's limit. With no
// GPU (asked in a child) the test reports itself skipped.
//
// Run it on a GPU machine: build/gpu/tests/test_fault_random_gpu (ctest: fault_random_gpu).
#include <cuda_runtime.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cuda_harness.h"
#include "fault_random.h"
#include "tpfuse/cuda.h"

namespace tpfuse::testing::fault_random {
namespace {

constexpr int kDevice = 0;
// Device memory for one call's buffers (the largest call's are well under 1 MiB).
constexpr size_t kArenaBytes = size_t{8} << 20;
// The reference process's hard limit (it also dies with this process, and ends when asked).
constexpr unsigned kReferenceSeconds = 3600;

// What the one-GPU team can run (see the top of this file).
Limits one_gpu_limits() {
  Limits limits;
  limits.peer_stores_optional = false;
  limits.packets = {4096, 16 << 10, 64 << 10, 64 << 10, 256 << 10};
  limits.nccl = false;
  limits.late_timeout = 1.0;
  limits.late_timeout_step = 0.25;
  return limits;
}

// A failed CUDA call of the test's own (not the library's): never a tpfuse::Error, so that the
// runner records it as a broken rank, not as an error the rules allow.
void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
  }
}

// A rank's buffers on GPU 0: each block of the host's RankBuffers copied into an arena (outputs
// poisoned as on the host), the calls on a stream of this process.
class GpuMemory : public Memory {
 public:
  GpuMemory() {
    cuda_ok(cudaSetDevice(kDevice), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaMalloc(&arena_, kArenaBytes), "cudaMalloc");
  }
  ~GpuMemory() override {
    // Best effort: a process whose context failed has nothing left to free.
    cudaStreamSynchronize(stream_);
    cudaFree(arena_);
    cudaStreamDestroy(stream_);
  }
  GpuMemory(const GpuMemory&) = delete;
  GpuMemory& operator=(const GpuMemory&) = delete;

  Backend backend() const override { return Backend::kCuda; }
  Stream stream() const override { return cuda_stream(stream_); }

  void upload(const RankBuffers& b) override {
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize before an upload");
    blocks_.clear();
    size_t used = 0;
    for (const auto& block : b.owned) {
      const size_t bytes = block->capacity();
      if (used + bytes > kArenaBytes) {
        throw std::runtime_error("a call's buffers outgrow the test's device arena");
      }
      uint8_t* device = static_cast<uint8_t*>(arena_) + used;
      cuda_ok(cudaMemcpyAsync(device, block->data, bytes, cudaMemcpyHostToDevice, stream_),
              "cudaMemcpyAsync (upload)");
      blocks_.push_back({block->data, bytes, device});
      used += (bytes + 255) / 256 * 256;
    }
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after an upload");
  }

  void* at(const void* p) const override {
    if (p == nullptr) return nullptr;
    const auto* byte = static_cast<const uint8_t*>(p);
    for (const Block& block : blocks_) {
      if (byte >= block.host && byte < block.host + block.bytes) {
        return block.device + (byte - block.host);
      }
    }
    throw std::runtime_error("the test passed a pointer outside the uploaded buffers");
  }

  void finish(const Team& team) override {
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after a call");
    team.check();
  }

  void download(RankBuffers& b) override {
    if (b.owned.size() != blocks_.size()) {
      throw std::runtime_error("download of buffers other than the uploaded ones");
    }
    for (const Block& block : blocks_) {
      cuda_ok(
          cudaMemcpyAsync(block.host, block.device, block.bytes, cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync (download)");
    }
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize after a download");
  }

 private:
  struct Block {
    uint8_t* host;
    size_t bytes;
    uint8_t* device;
  };
  cudaStream_t stream_ = nullptr;
  void* arena_ = nullptr;
  std::vector<Block> blocks_;
};

// A rank's teams: CUDA teams on GPU 0, one process a rank, over the ids made before the fork.
class OneGpuTeams : public ProcessTeams {
 public:
  using ProcessTeams::ProcessTeams;
  Team make(int index, int rank, const TeamOptions& options) override {
    shared_->barrier.wait(world_);
    return create_cuda_team(shared_->ids()[index], rank, world_, kDevice, options);
  }
  Memory& memory() override { return memory_; }
  void after_call() override { shared_->barrier.wait(world_); }

 private:
  GpuMemory memory_;
};

// All of `bytes` through `io` (::read or ::write) on fd; false at its end or an error.
template <typename Byte, typename Io>
bool transfer(Io io, int fd, Byte* data, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = io(fd, data, bytes);
    if (n <= 0) return false;
    data += n;
    bytes -= size_t(n);
  }
  return true;
}

bool read_all(int fd, void* data, size_t bytes) {
  return transfer(::read, fd, static_cast<char*>(data), bytes);
}

bool write_all(int fd, const void* data, size_t bytes) {
  return transfer(::write, fd, static_cast<const char*>(data), bytes);
}

// The GPU's reference, computed in a forked process of its own (this one never touches CUDA):
// asked a call and a world size over one pipe, it answers every rank's hash over another.
class ReferenceProcess {
 public:
  ReferenceProcess() {
    int requests[2], replies[2];
    if (::pipe(requests) != 0) throw std::runtime_error("pipe failed");
    if (::pipe(replies) != 0) throw std::runtime_error("pipe failed");
    std::fflush(stdout);
    std::fflush(stderr);
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::alarm(kReferenceSeconds);
      ::close(requests[1]);
      ::close(replies[0]);
      serve(requests[0], replies[1]);
      ::_exit(0);
    }
    ::close(requests[0]);
    ::close(replies[1]);
    to_ = requests[1];
    from_ = replies[0];
  }
  ~ReferenceProcess() {
    close_ends();  // it reads the end of its requests and exits
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ReferenceProcess(const ReferenceProcess&) = delete;
  ReferenceProcess& operator=(const ReferenceProcess&) = delete;

  // In a rank forked later: it needs neither end (and must not keep the requests open).
  void close_ends() {
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    to_ = from_ = -1;
  }

  std::vector<uint64_t> ask(const Call& c, int world) {
    uint32_t status = 1;
    if (!write_all(to_, &c, sizeof c) || !write_all(to_, &world, sizeof world) ||
        !read_all(from_, &status, sizeof status)) {
      throw std::runtime_error("the GPU reference process is gone");
    }
    if (status == 0) {
      std::vector<uint64_t> hashes(static_cast<size_t>(world));
      if (!read_all(from_, hashes.data(), hashes.size() * 8)) {
        throw std::runtime_error("the GPU reference process is gone");
      }
      return hashes;
    }
    uint32_t length = 0;
    std::string message;
    if (read_all(from_, &length, sizeof length)) {
      message.resize(length);
      if (!read_all(from_, message.data(), length)) message = "(cut short)";
    }
    throw std::runtime_error("the GPU reference of " + describe(c) + " failed: " + message);
  }

 private:
  static_assert(std::is_trivially_copyable_v<Call>, "a Call goes over a pipe as bytes");

  static void serve(int in, int out) {
    std::unique_ptr<GpuMemory> memory;
    std::string setup_error;
    try {
      memory = std::make_unique<GpuMemory>();
    } catch (const std::exception& error) {
      setup_error = error.what();
    }
    Call c;
    int world = 0;
    while (read_all(in, &c, sizeof c) && read_all(in, &world, sizeof world)) {
      std::string error = setup_error;
      std::vector<uint64_t> hashes;
      if (error.empty()) {
        try {
          hashes = reference_hashes(c, world, *memory);
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      const uint32_t status = error.empty() ? 0 : 1;
      bool written = write_all(out, &status, sizeof status);
      if (error.empty()) {
        written = written && write_all(out, hashes.data(), hashes.size() * 8);
      } else {
        const uint32_t length = uint32_t(error.size());
        written = written && write_all(out, &length, sizeof length) &&
                  write_all(out, error.data(), error.size());
      }
      if (!written) return;
    }
  }

  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

// The selection table of every team of this run, this process's oracle included (see the top of
// this file); the file goes with the object.
class PinnedSelectionTable {
 public:
  PinnedSelectionTable() {
    char path[] = "/tmp/tpfuse-fault-random-gpu-table-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) throw std::runtime_error("mkstemp failed");
    const std::string table =
        "device,world_size,max_bytes,algorithm\n*,*,4096,oneshot\n*,*,inf,twoshot\n";
    const bool written = write_all(fd, table.data(), table.size());
    ::close(fd);
    path_ = path;
    if (!written) throw std::runtime_error("the selection table could not be written");
    ::setenv("TPFUSE_ALGORITHM_TABLE", path, 1);
  }
  ~PinnedSelectionTable() { ::unlink(path_.c_str()); }
  PinnedSelectionTable(const PinnedSelectionTable&) = delete;
  PinnedSelectionTable& operator=(const PinnedSelectionTable&) = delete;

 private:
  std::string path_;
};

TEST(FaultRandomGpu, OneGpuProcessTeams) {
  if (gpus_seen_by_a_child() < 1) GTEST_SKIP() << "needs a GPU";
  // A child that died leaves a pipe without a reader: an error to report, not a signal.
  ::signal(SIGPIPE, SIG_IGN);
  const PinnedSelectionTable table;
  ReferenceProcess reference;
  const FaultBackend backend{
      "processes on one GPU",
      [&](const Sequence& s) {
        return run_processes(s, [&](ProcessShared* shared, int world) {
          ::prctl(PR_SET_PDEATHSIG, SIGKILL);
          reference.close_ends();
          return std::unique_ptr<TeamSource>(std::make_unique<OneGpuTeams>(shared, world));
        });
      },
      [&](const Call& c, int world) { return reference.ask(c, world); }};
  run_faults(backend,
             {2, 4, 2000, "FaultRandomGpu.OneGpuProcessTeams",
              "build/gpu/tests/test_fault_random_gpu", one_gpu_limits()},
             6000000);
}

}  // namespace
}  // namespace tpfuse::testing::fault_random
